"""Shared builders for KV4 kernel tests: a cache filled through the reference store."""

from __future__ import annotations

import torch

from kvstreams_sglang.kv4 import KV4LayerCache, side_slot, split_regions
from kvstreams_sglang.kv4.reference import store_reference


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def filled_cache(lengths, *, hkv=2, d=128, sink=16, recent=128, seed=0, shuffle=True, rotate=True, device="cpu"):
    """Requests of the given lengths stored at shuffled slots; returns the cache, the
    CSR metadata of both regions, and the raw K/V per request."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    perm = torch.randperm(total + 7, generator=g)[:total] if shuffle else torch.arange(total)
    cache = KV4LayerCache.empty(total + 7, len(lengths) * (sink + recent), hkv, d)
    kv_ptr, side_ptr, kv_idx, side_idx, raw = [0], [0], [], [], []
    start = 0
    for row, length in enumerate(lengths):
        k = torch.randn(length, hkv, d, generator=g) * 2
        v = torch.randn(length, hkv, d, generator=g)
        slots = perm[start:start + length]
        start += length
        int4_pos, int8_pos = split_regions(length, sink=sink, recent=recent)
        side = torch.full((length,), -1, dtype=torch.int64)
        for p in int8_pos.tolist():
            side[p] = side_slot(row, p, sink=sink, recent=recent)
        store_reference(cache, k, v, slots, side, rotate=rotate)
        kv_idx.append(slots[int4_pos])
        side_idx.append(side[int8_pos])
        kv_ptr.append(kv_ptr[-1] + int4_pos.numel())
        side_ptr.append(side_ptr[-1] + int8_pos.numel())
        raw.append((k, v))
    meta = dict(
        kv_indptr=torch.tensor(kv_ptr, dtype=torch.int32),
        kv_indices=torch.cat(kv_idx).to(torch.int32),
        side_indptr=torch.tensor(side_ptr, dtype=torch.int32),
        side_indices=torch.cat(side_idx).to(torch.int32),
    )
    cache = KV4LayerCache(**{name: t.to(device) for name, t in vars(cache).items()})
    meta = {name: t.to(device) for name, t in meta.items()}
    return cache, meta, [(k.to(device), v.to(device)) for k, v in raw]
