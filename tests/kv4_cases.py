"""Shared builders for KV4 kernel tests: a cache filled through the reference store."""

from __future__ import annotations

import torch

from kvstreams_sglang.kv4 import KV4LayerCache, side_slot, side_width, split_regions
from kvstreams_sglang.kv4.reference import store_reference


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def filled_cache(lengths, *, hkv=2, d=128, sink=16, recent=128, seed=0, shuffle=True, rotate=True, device="cpu",
                 spare_slots=0):
    """Requests of the given lengths stored at shuffled slots; returns the cache, the
    CSR metadata of both regions, and the raw K/V per request. The cache's last ``spare_slots`` slots hold no
    request (room for an extend's new tokens)."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    perm = torch.randperm(total + 7, generator=g)[:total] if shuffle else torch.arange(total)
    cache = KV4LayerCache.empty(total + 7 + spare_slots, len(lengths) * side_width(sink, recent), hkv, d)
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


def tie_free_query(shape, *, seed: int, dtype=torch.float32, device="cpu", margin: float = 1e-4) -> torch.Tensor:
    """A seeded random query whose INT8 codes do not depend on the summation order of its Hadamard rotation: in
    float64, every rotated value lies at least ``margin`` code units from a rounding boundary and every row's
    fp16 scale at least 1e-6 (relative) from an fp16 rounding boundary. The kernels rotate in fp32, each in its
    own order (measured over 21M values: the CUDA kernel's butterflies <= 3e-5 code units off, a 64-term fp32 dot
    <= 9e-5), the float64 reference exactly; a value within that of a boundary rounds to the next code in one of
    them, and one such flip moves a long request's LSE by ~1e-3: a rounding tie, not what a kernel test checks.
    Rows (query heads) are quantised independently, so a row that fails is drawn again."""
    from kvstreams_sglang.kv4.hadamard import hadamard

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*shape, generator=g).to(dtype).reshape(-1, shape[-1])
    for _ in range(100):
        x = hadamard(q.double())
        amax = x.abs().amax(-1)
        scale = (amax / 127).half()
        r = x / scale.double()[:, None]
        bad = ((r - torch.floor(r)) - 0.5).abs().amin(-1) <= margin
        bad |= (amax * (1 - 1e-6) / 127).half() != scale
        bad |= (amax * (1 + 1e-6) / 127).half() != scale
        if not bad.any():
            return q.reshape(shape).to(device)
        q[bad] = torch.randn(int(bad.sum()), shape[-1], generator=g).to(dtype)
    raise RuntimeError(f"tie_free_query: no query of shape {shape} found for seed {seed}")
