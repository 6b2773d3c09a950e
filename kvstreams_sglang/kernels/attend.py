"""One attention layer's KV4-RL step, shared by the built-in engine and the SGLang backend.

Decode stores the new token first (a token sees its own quantised KV) and attends to
everything; extend attends to the prefix as cached *before* the step plus the new tokens
in full precision, then stores them. ``use_triton`` picks the kernels (GPU) or their torch
references (CPU: Triton's interpreter runs a kernel program by program, thousands of times
slower; the kernels stay tested under it against the same references).
"""

from __future__ import annotations

from typing import Literal

import torch

from ..kv4.cache import KV4LayerCache
from ..kv4.reference import decode_reference, extend_reference, store_reference
from .decode import DecodePlan, KV4DecodeWorkspace, kv4_decode
from .extend import INVARIANT_TILE, kv4_extend
from .store import kv4_store


def kv4_attention_step(cache: KV4LayerCache, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                       mode: Literal["extend", "decode"], qo_indptr: torch.Tensor, out_slots: torch.Tensor,
                       side_slots: torch.Tensor, kv4: dict, sm_scale: float, use_triton: bool,
                       decode_plan: DecodePlan | None = None,
                       decode_workspace: KV4DecodeWorkspace | None = None,
                       max_new_tokens: int | None = None, out: torch.Tensor | None = None,
                       invariant: bool = False) -> torch.Tensor:
    """``q [N, Hq, D]``, ``k/v [N, Hkv, D]`` of the step's new tokens -> ``[N, Hq, D]``.

    ``kv4``: the region lists (``kv4.regions.region_lists``); ``decode_plan``: the kernels'
    plan of the step (``KV4DecodeWorkspace.plan``), needed for a kernel decode, run in the
    caller's ``decode_workspace`` (a throwaway one if None). ``max_new_tokens``: the step's longest
    run of new tokens, known on the host (extend): without it the kernel's grid needs a device sync,
    once per layer. ``out``: extend writes its result there when it fits (``kv4_extend``'s ``out``), e.g. SGLang's
    preallocated attention output. ``invariant``: extend unsplit at one tile (``extend.INVARIANT_TILE``), so a
    request's output depends on its own tokens and lists alone, not on the batch (a decode is as invariant as its
    plan: ``KV4DecodeWorkspace(invariant=True)``)."""
    if not use_triton:
        if mode == "decode":
            store_reference(cache, k, v, out_slots, side_slots)
            return decode_reference(q, cache, **kv4, sm_scale=sm_scale)[0].to(q.dtype)
        out = extend_reference(q, k, v, qo_indptr, cache, **kv4, sm_scale=sm_scale)
        store_reference(cache, k, v, out_slots, side_slots)
        return out.to(q.dtype)
    if mode == "decode":
        kv4_store(cache, k, v, out_slots, side_slots)
        return kv4_decode(q, cache, decode_plan, workspace=decode_workspace, sm_scale=sm_scale)
    result = kv4_extend(q, k, v, qo_indptr, cache, **kv4, sm_scale=sm_scale, max_new_tokens=max_new_tokens,
                        out=out if out is not None and out.dtype == q.dtype and out.stride(-1) == 1 else None,
                        **(dict(tile=INVARIANT_TILE, splits=1) if invariant else {}))
    kv4_store(cache, k, v, out_slots, side_slots)
    return result
