"""SGLang's token-to-KV pool, storing KV4-RL bytes instead of the model dtype.

A subclass of ``MHATokenToKVPool`` so every allocator, session and capacity path of SGLang
treats it as the MHA pool it replaces; only the bytes differ. Per layer a ``KV4LayerCache``
(INT4 codes + fp16 scale/offset per token-head, plus the INT8 side cache with ``sink +
recent`` side slots per row of ``req_to_token``: ``num_rows`` counts SGLang's reserved row 0
too, so every row index the backend can see has its own), and one int32 per slot: the logical
(RoPE) position the token was computed at. Under KV-streams a row is compacted on eviction, so
a row index no longer says a token's position, and the INT8/INT4 region rule needs it.
"""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from ..kv4.cache import KV4LayerCache, side_width
from ..streams.pool import KV4Pool, kv4_layers


class KV4TokenToKVPool(MHATokenToKVPool):
    def __init__(self, *args, sink: int, recent: int, num_rows: int, forward_stream=None, **kwargs):
        self.sink, self.recent, self.num_rows = sink, recent, num_rows
        self.forward_stream = forward_stream  # the model runner's: side-row copies run in order with the forwards
        super().__init__(*args, **kwargs)
        if self.head_dim != self.v_head_dim or self.head_dim % 2:
            raise ValueError(f"kv4rl needs equal, even K/V head dims, got {self.head_dim} and {self.v_head_dim}")

    def _create_buffers(self):
        # slot 0 stays the padding slot SGLang writes dummy tokens to, as in the parent
        slots = self.size + self.page_size
        side = max(1, self.num_rows * side_width(self.sink, self.recent))  # a side row per req_to_token row, row 0 too
        self.layers, self.side = kv4_layers(self.layer_num, slots, side, self.head_num, self.head_dim, self.device)
        self.slot_positions = torch.zeros(slots, dtype=torch.int32, device=self.device)
        # SGLang reads these for its copy kernels and disaggregation; the bf16 views do not exist
        self.k_buffer, self.v_buffer = [], []
        self.k_data_ptrs = self.v_data_ptrs = self.data_ptrs = torch.zeros(0, dtype=torch.uint64)
        self.data_strides = torch.zeros(0, dtype=torch.int64)
        self._kv_buffer_descs = []  # PD transfer / post-capture backing descriptors: none

    def _clear_buffers(self):
        del self.layers, self.side

    def get_kv_size_bytes(self):
        k = sum(c.k_codes.nbytes + c.k_meta.nbytes + c.k_side.nbytes + c.k_side_scale.nbytes for c in self.layers)
        v = sum(c.v_codes.nbytes + c.v_meta.nbytes + c.v_side.nbytes + c.v_side_scale.nbytes for c in self.layers)
        return k + self.slot_positions.nbytes, v

    def layer_cache(self, layer_id: int) -> KV4LayerCache:
        return self.layers[layer_id - self.start_layer]

    def _unsupported(self, *args, **kwargs):
        raise NotImplementedError("the kv4rl pool stores INT4/INT8 codes: there is no model-dtype K/V buffer "
                                  "(the kv4rl attention backend reads the codes directly)")

    get_key_buffer = get_value_buffer = get_kv_buffer = set_kv_buffer = _unsupported
    get_cpu_copy = load_cpu_copy = move_kv_cache = _unsupported

    @staticmethod
    def cell_size_per_token(num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """Bytes per token slot: the INT4 region (4.25 bits/element, K and V) + its position."""
        return KV4Pool.bytes_per_token(num_layers, num_kv_heads, head_dim) + 4

    @staticmethod
    def side_bytes(num_rows: int, num_layers: int, num_kv_heads: int, head_dim: int, *, sink: int,
                   recent: int) -> int:
        """The INT8 side cache: ``side_width(sink, recent)`` slots per request row. SGLang's ``ReqToTokenPool`` of
        size ``num_rows`` hands out rows ``1..num_rows`` (row 0 is its padding row), so row indices reach
        ``num_rows``."""
        return ((num_rows + 1) * side_width(sink, recent)
                * KV4Pool.side_bytes_per_token(num_layers, num_kv_heads, head_dim))
