"""The ``kv4rl`` attention backend: SGLang's ``AttentionBackend`` over ``KV4TokenToKVPool``.

``init_forward_metadata`` builds, once per step, what every layer reads (FlashInfer's plan
pattern): each request's row of ``req_to_token`` with the logical positions of its tokens,
split into the INT4 and INT8 region lists by the rule of ``kv4.regions``, and where the new
tokens' INT8 copies go. The layers then run ``kernels.attend.kv4_attention_step``, the same step
as the built-in engine: the Triton kernels on CUDA, their torch references elsewhere. The
backend writes the KV itself (quantise + scatter), so ``save_kv_cache=False`` is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from ..kernels import KV4DecodeWorkspace
from ..kernels.attend import kv4_attention_step
from ..kv4.regions import new_side_slots, region_lists
from .pool import KV4TokenToKVPool

BACKEND_NAME = "kv4rl"


@dataclass
class KV4StepMetadata:
    mode: str  # "extend" | "decode"
    qo_indptr: torch.Tensor
    out_slots: torch.Tensor
    side_slots: torch.Tensor
    kv4: dict
    decode_plan: object | None


class KV4RLAttnBackend(AttentionBackend):
    def __init__(self, model_runner):
        super().__init__()
        pool = model_runner.token_to_kv_pool
        if not isinstance(pool, KV4TokenToKVPool):
            raise RuntimeError("the kv4rl attention backend needs the kv4rl KV pool: launch with --kv4rl "
                               f"(got {type(pool).__name__})")
        self.pool = pool
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.device = torch.device(model_runner.device)
        self.use_triton = self.device.type == "cuda"
        self.forward_metadata: KV4StepMetadata | None = None
        self.decode_workspace = None  # the decode kernels' partial outputs, tickets, launch arguments
        if self.use_triton:
            from sglang.srt.layers.dp_attention import get_attention_tp_size

            self.decode_workspace = KV4DecodeWorkspace(
                model_runner.req_to_token_pool.size, model_runner.model_config.num_attention_heads
                // get_attention_tp_size(), pool.head_num, pool.head_dim, device=self.device)

    def init_forward_metadata(self, forward_batch):
        fm = forward_batch.forward_mode
        if fm.is_idle():
            self.forward_metadata = None
            return
        decode = fm.is_decode()
        if not decode and fm.name != "EXTEND":
            raise NotImplementedError(f"kv4rl: forward mode {fm.name} is not supported (extend and decode only: no "
                                      "mixed chunks, no speculative decoding, no split prefill)")
        dev = self.device
        rows = forward_batch.req_pool_indices.long()
        seq_lens = forward_batch.seq_lens.long()
        num_new = torch.ones_like(seq_lens) if decode else forward_batch.extend_seq_lens.long()
        prefix = seq_lens - num_new
        qo = torch.zeros(rows.numel() + 1, dtype=torch.int32, device=dev)
        qo[1:] = torch.cumsum(num_new, 0)
        out_slots = forward_batch.out_cache_loc.long()
        p_new = forward_batch.positions.long()
        sink, recent = self.pool.sink, self.pool.recent
        # every slot remembers the position its token was computed at (rows get compacted)
        self.pool.slot_positions[out_slots] = p_new.to(torch.int32)

        width = int(seq_lens.max())
        col = torch.arange(width, device=dev)[None]
        slots = self.req_to_token[rows, :width]
        positions = self.pool.slot_positions[slots.long()].long()
        first_new = p_new[qo[:-1].long()]
        end_after = p_new[qo[1:].long() - 1] + 1
        stream_of = torch.repeat_interleave(torch.arange(rows.numel(), device=dev), num_new)
        side_slots = new_side_slots(rows[stream_of], p_new, end_after[stream_of], sink=sink, recent=recent)
        if decode:  # the new token is stored first and attends to itself
            valid, end = col < seq_lens[:, None], end_after
        else:  # new tokens attend to each other in full precision, the prefix through KV4
            valid, end = col < prefix[:, None], first_new
        kv4 = region_lists(rows, slots, positions, valid, end, sink=sink, recent=recent)
        plan = None
        if decode and self.use_triton:
            plan = self.decode_workspace.plan(**kv4)
        self.forward_metadata = KV4StepMetadata("decode" if decode else "extend", qo, out_slots, side_slots, kv4,
                                                plan)

    def _forward(self, q, k, v, layer, save_kv_cache):
        if not save_kv_cache:
            raise NotImplementedError("kv4rl writes the KV it attends to: save_kv_cache=False is not supported")
        if layer.qk_head_dim != layer.v_head_dim or layer.is_cross_attention:
            raise NotImplementedError("kv4rl supports self-attention with equal K/V head dims")
        md = self.forward_metadata
        n = q.shape[0]
        q_ = q.reshape(n, layer.tp_q_head_num, layer.qk_head_dim)
        k_ = k.reshape(n, layer.tp_k_head_num, layer.qk_head_dim)
        v_ = v.reshape(n, layer.tp_v_head_num, layer.v_head_dim)
        out = kv4_attention_step(self.pool.layer_cache(layer.layer_id), q_, k_, v_, mode=md.mode,
                                 qo_indptr=md.qo_indptr, out_slots=md.out_slots, side_slots=md.side_slots,
                                 kv4=md.kv4, sm_scale=layer.scaling, use_triton=self.use_triton,
                                 decode_plan=md.decode_plan, decode_workspace=self.decode_workspace)
        return out.reshape(n, layer.tp_q_head_num * layer.v_head_dim).to(q.dtype)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._forward(q, k, v, layer, save_kv_cache)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._forward(q, k, v, layer, save_kv_cache)

    def support_triton(self):
        return self.use_triton
