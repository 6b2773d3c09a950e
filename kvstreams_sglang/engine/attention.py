"""Attention over KV streams, plugged into Hugging Face models as a registered attention
function (no model code is rewritten).

HF computes q/k/v projections, norms and RoPE (at the explicit ``position_ids`` we pass,
i.e. stream positions), then calls ``ALL_ATTENTION_FUNCTIONS["kvstreams"]`` with the new
tokens' ``query [1, Hq, N, D]``, ``key/value [1, Hkv, N, D]``. The function finds the
step's ``ForwardBatch`` and the storage backend in its kwargs, writes the new KV into the
pool and attends over each stream's kept slots. Two backends:

- ``FullPrecisionBackend``: pool in the model dtype, gather + SDPA (exact reference path).
- ``KV4Backend``: KV4-RL storage through the Triton kernels (store / extend / decode) on
  the GPU; on the CPU through their torch references (``kv4.reference``: the same
  arithmetic), since Triton's interpreter runs a kernel program by program, thousands of
  times slower. The kernels stay tested under the interpreter against those references.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from ..kernels import KV4DecodeWorkspace, TritonDecodeVariant, bf16_decode, plan_decode
from ..kernels.attend import kv4_attention_step
from ..kernels.stream_attention import stream_attention
from ..streams import FullPrecisionPool, KV4Pool, SlotTable
from ..streams.pool import SideCopy
from .batch import ForwardBatch, StepItem, build_full_precision_batch, build_invariant_batch, build_kv4_batch

ATTENTION_NAME = "kvstreams"


class FullPrecisionBackend:
    """``invariant``: every step through the batch-invariant stream attention, the kernel the
    trainer replays with (``kernels.stream_attention``), instead of gather + SDPA / paged decode."""

    def __init__(self, pool: FullPrecisionPool, *, invariant: bool = False, gqa_group: int = 1):
        self.pool, self.invariant, self.gqa_group = pool, invariant, gqa_group

    def prepare(self, items: list[StepItem], mode, table: SlotTable, device) -> ForwardBatch:
        if self.invariant:
            return build_invariant_batch(items, mode, table, device, gqa_group=self.gqa_group)
        fb = build_full_precision_batch(items, mode, table, device)
        if mode == "decode" and torch.device(device).type == "cuda":
            # Paged Triton decode on the GPU; the gather + SDPA path stays the CPU reference.
            empty = torch.zeros_like(fb.kv_indptr)
            fb.decode_plan = plan_decode(fb.kv_indptr, fb.kv_indices, empty, empty[:0],
                                         num_kv_heads=self.pool.k[0].shape[1], cuda_variant=None,
                                         triton_variant=TritonDecodeVariant(block_n=64, num_stages=2))
        return fb

    def save_overwritten(self, fb: ForwardBatch) -> None:
        """Nothing: a step writes only into its new tokens' slots, which were free."""
        return None

    def restore_overwritten(self, saved: None) -> None:
        pass

    def forward(self, layer: int, q, k, v, fb: ForwardBatch, scaling: float) -> torch.Tensor:
        # q [N, Hq, D], k/v [N, Hkv, D] -> out [N, Hq, D]
        kp, vp = self.pool.k[layer], self.pool.v[layer]
        kp[fb.out_slots] = k.to(kp.dtype)
        vp[fb.out_slots] = v.to(vp.dtype)
        if fb.invariant_plan is not None:
            return stream_attention(q, kp, vp, fb.invariant_plan, sm_scale=scaling)
        if fb.decode_plan is not None:
            return bf16_decode(q, kp, vp, fb.decode_plan, sm_scale=scaling)
        keys = kp[fb.kv_gather].transpose(1, 2)  # [B, Hkv, L, D]
        vals = vp[fb.kv_gather].transpose(1, 2)
        qs = q[fb.q_gather].transpose(1, 2)  # [B, Hq, M, D]
        out = F.scaled_dot_product_attention(qs, keys.to(q.dtype), vals.to(q.dtype), attn_mask=fb.attn_mask,
                                             scale=scaling, enable_gqa=True)
        return out.transpose(1, 2)[fb.q_valid]  # [N, Hq, D]


class KV4Backend:
    """``impl``: ``"triton"`` (the kernels), ``"torch"`` (their references) or ``"auto"``:
    the kernels on CUDA, the references elsewhere. The backend owns the decode kernels'
    workspace (made at the first kernel decode step, on that step's device). ``invariant``: the kernels'
    batch-invariant plans (a stream's logprobs do not depend on the streams it is batched with; the SGLang server's
    ``--kv4rl-batch-invariant`` runs the same)."""

    def __init__(self, pool: KV4Pool, impl: Literal["auto", "triton", "torch"] = "auto", *, num_q_heads: int,
                 max_streams: int = 1, invariant: bool = False):
        if impl not in ("auto", "triton", "torch"):
            raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")
        self.pool, self.impl, self.invariant = pool, impl, invariant
        self.num_q_heads, self.max_streams = num_q_heads, max_streams
        self.decode_workspace: KV4DecodeWorkspace | None = None

    def _triton(self, device) -> bool:
        return self.impl == "triton" or (self.impl == "auto" and torch.device(device).type == "cuda")

    def prepare(self, items: list[StepItem], mode, table: SlotTable, device) -> ForwardBatch:
        fb = build_kv4_batch(items, mode, table, self.pool, device)
        if mode == "decode" and self._triton(device):
            if self.decode_workspace is None:
                cache = self.pool.layers[0]
                self.decode_workspace = KV4DecodeWorkspace(self.max_streams, self.num_q_heads, cache.num_kv_heads,
                                                           cache.head_dim, device=device, invariant=self.invariant)
            fb.decode_plan = self.decode_workspace.plan(**fb.kv4)
        return fb

    def save_overwritten(self, fb: ForwardBatch) -> SideCopy:
        """The INT8 side entries the step's new tokens will write: a recent token's ring slot still
        holds the copy of the position ``recent`` before it, needed if the step is undone."""
        return self.pool.save_side(fb.side_slots)

    def restore_overwritten(self, saved: SideCopy) -> None:
        self.pool.restore_side(saved)

    def forward(self, layer: int, q, k, v, fb: ForwardBatch, scaling: float) -> torch.Tensor:
        # q [N, Hq, D], k/v [N, Hkv, D] -> out [N, Hq, D]
        return kv4_attention_step(self.pool.layers[layer], q, k, v, mode=fb.mode, qo_indptr=fb.qo_indptr,
                                  out_slots=fb.out_slots, side_slots=fb.side_slots, kv4=fb.kv4, sm_scale=scaling,
                                  use_triton=self._triton(q.device), decode_plan=fb.decode_plan,
                                  decode_workspace=self.decode_workspace, max_new_tokens=fb.max_new_tokens,
                                  invariant=self.invariant)


def kvstreams_attention(module, query, key, value, attention_mask, scaling=None, kv_batch=None, kv_backend=None,
                        **kwargs):
    """HF attention-interface entry point: ``query [1, Hq, N, D]`` -> ``[1, N, Hq, D]``."""
    if kv_batch is None or kv_backend is None:
        raise RuntimeError("the 'kvstreams' attention needs kv_batch/kv_backend kwargs: run the model through "
                           "kvstreams_sglang.engine, not directly")
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = kv_backend.forward(module.layer_idx, q, k, v, kv_batch, scale)
    return out.to(query.dtype)[None], None


def register() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, kvstreams_attention)
    return ATTENTION_NAME
