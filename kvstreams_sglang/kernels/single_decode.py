"""One-sequence KV4 decode: quantise a full-precision K/V history and attend to it.

The convenience entry point for tests and studies (FlashInfer's
``single_decode_with_kv_cache`` shape): it builds a private cache, stores the history
with positions split into the INT8 region (``sink`` first and ``recent`` last positions)
and the INT4 region (the rest), and runs the mixed attention through the Triton kernels
(``impl="triton"``) or the torch reference (``impl="torch"``).
"""

from __future__ import annotations

from typing import Literal

import torch

from ..kv4.cache import KV4LayerCache
from ..kv4.reference import decode_reference, store_reference
from ..kv4.regions import split_regions
from .decode import kv4_decode, plan_decode
from .store import kv4_store


def single_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sink: int = 16, recent: int = 128,
                  rotate: bool = True, sm_scale: float | None = None,
                  impl: Literal["triton", "torch"] = "triton") -> torch.Tensor:
    """``q [Hq, D]``, ``k, v [L, Hkv, D]`` (post-RoPE) -> ``out [Hq, D]`` (fp32)."""
    if q.dim() != 2 or k.dim() != 3 or k.shape != v.shape or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"single_decode: expected q [Hq, D], k/v [L, Hkv, D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[0] % k.shape[1]:
        raise ValueError(f"single_decode: Hq={q.shape[0]} is not a multiple of Hkv={k.shape[1]}")
    if impl not in ("triton", "torch"):
        raise ValueError(f"single_decode: impl must be 'triton' or 'torch', got {impl!r}")
    length, hkv, d = k.shape
    dev = q.device
    int4_pos, int8_pos = split_regions(length, sink=sink, recent=recent)
    cache = KV4LayerCache.empty(length, max(1, int8_pos.numel()), hkv, d, device=dev)
    slots = torch.arange(length, device=dev)
    side_slots = torch.full((length,), -1, dtype=torch.int64, device=dev)
    side_slots[int8_pos.to(dev)] = torch.arange(int8_pos.numel(), device=dev)
    kv_indptr = torch.tensor([0, int4_pos.numel()], dtype=torch.int32, device=dev)
    side_indptr = torch.tensor([0, int8_pos.numel()], dtype=torch.int32, device=dev)
    kv_indices = int4_pos.to(device=dev, dtype=torch.int32)
    side_indices = torch.arange(int8_pos.numel(), device=dev, dtype=torch.int32)
    q = q[None]
    if impl == "torch":
        store_reference(cache, k, v, slots, side_slots, rotate=rotate)
        out, _ = decode_reference(q, cache, kv_indptr, kv_indices, side_indptr, side_indices,
                                  sm_scale=sm_scale, rotate=rotate)
    else:
        kv4_store(cache, k, v, slots, side_slots, rotate=rotate)
        plan = plan_decode(kv_indptr, kv_indices, side_indptr, side_indices, num_kv_heads=hkv)
        out = kv4_decode(q.float() if q.dtype == torch.float64 else q, cache, plan, sm_scale=sm_scale,
                         rotate=rotate)
    return out[0].float()
