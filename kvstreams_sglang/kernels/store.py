"""Store kernel: quantise new K/V rows and scatter them into the KV4 cache.

One program per (block of ``BLOCK_T`` tokens, KV head). Keys are rotated in-register
(two half-width dots with the Hadamard matrix's column halves, producing directly the
two halves that split-half packing wants), then every row gets INT4 codes in the token's
slot and, when ``side_slots[i] >= 0``, an INT8 copy in its side slot. Reference:
``kv4.reference.store_reference``. On a CUDA device ``kv4_store`` runs the CUDA kernel of ``store_cuda.cu``
instead where it supports the shapes (v7); this Triton kernel is the fallback and the CPU-tested path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kv4.cache import KV4LayerCache
from .quantize import device_hadamard, int4_codes, int8_codes, rotate_halves


@triton.jit(do_not_specialize=("N",))  # the batch's tokens: one compile for any (Triton specialises 1, 16k)
def _store_kernel(
    K, V, stride_kt, stride_kh, stride_vt, stride_vh,
    Slots, SideSlots, Hmat,
    KCodes, KMeta, VCodes, VMeta, KSide, KSideScale, VSide, VSideScale,
    stride_cs, stride_ch, stride_ms, stride_mh, stride_ss, stride_sh, stride_scs, stride_sch,
    N,
    HALF: tl.constexpr, BLOCK_T: tl.constexpr, ROTATE: tl.constexpr, ROT_PREC: tl.constexpr,
):
    h = tl.program_id(1)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < N
    d = tl.arange(0, HALF)
    row = tmask[:, None]

    k_lo = tl.load(K + t[:, None] * stride_kt + h * stride_kh + d[None, :], mask=row, other=0.0).to(tl.float32)
    k_hi = tl.load(K + t[:, None] * stride_kt + h * stride_kh + HALF + d[None, :], mask=row, other=0.0)
    k_hi = k_hi.to(tl.float32)
    if ROTATE:
        k_lo, k_hi = rotate_halves(k_lo, k_hi, Hmat, HALF, ROT_PREC)
    v_lo = tl.load(V + t[:, None] * stride_vt + h * stride_vh + d[None, :], mask=row, other=0.0).to(tl.float32)
    v_hi = tl.load(V + t[:, None] * stride_vt + h * stride_vh + HALF + d[None, :], mask=row, other=0.0)
    v_hi = v_hi.to(tl.float32)

    slot = tl.load(Slots + t, mask=tmask, other=0).to(tl.int64)
    kc, ks, ko = int4_codes(k_lo, k_hi)
    vc, vs, vo = int4_codes(v_lo, v_hi)
    tl.store(KCodes + slot[:, None] * stride_cs + h * stride_ch + d[None, :], kc, mask=row)
    tl.store(VCodes + slot[:, None] * stride_cs + h * stride_ch + d[None, :], vc, mask=row)
    meta = slot * stride_ms + h * stride_mh
    tl.store(KMeta + meta, ks, mask=tmask)
    tl.store(KMeta + meta + 1, ko, mask=tmask)
    tl.store(VMeta + meta, vs, mask=tmask)
    tl.store(VMeta + meta + 1, vo, mask=tmask)

    side = tl.load(SideSlots + t, mask=tmask, other=-1).to(tl.int64)
    smask = tmask & (side >= 0)
    if tl.max(smask.to(tl.int32), 0) > 0:  # most blocks hold no protected position: skip the INT8 codes
        srow = smask[:, None]
        side = tl.where(smask, side, 0)
        k8_lo, k8_hi, k8s = int8_codes(k_lo, k_hi)
        v8_lo, v8_hi, v8s = int8_codes(v_lo, v_hi)
        base = side[:, None] * stride_ss + h * stride_sh + d[None, :]
        tl.store(KSide + base, k8_lo, mask=srow)
        tl.store(KSide + base + HALF, k8_hi, mask=srow)
        tl.store(VSide + base, v8_lo, mask=srow)
        tl.store(VSide + base + HALF, v8_hi, mask=srow)
        tl.store(KSideScale + side * stride_scs + h * stride_sch, k8s, mask=smask)
        tl.store(VSideScale + side * stride_scs + h * stride_sch, v8s, mask=smask)


def kv4_store(cache: KV4LayerCache, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
              side_slots: torch.Tensor | None = None, *, rotate: bool = True, block_t: int = 64,
              rot_prec: str = "tf32x3", backend: str = "auto") -> None:
    """Quantise ``k, v [N, Hkv, D]`` (post-RoPE) into ``slots [N]``; rows whose
    ``side_slots`` entry is ``>= 0`` also get INT8 copies there.

    ``backend``: ``"auto"`` the CUDA kernel (store_cuda.py) where it supports the shapes and compiled, else Triton;
    ``"triton"`` always Triton (``block_t``, ``rot_prec`` apply to it only); ``"cuda"`` the CUDA kernel or an error."""
    if backend not in ("auto", "triton", "cuda"):
        raise ValueError(f"kv4_store: backend must be 'auto', 'triton' or 'cuda', got {backend!r}")
    n, hkv, d = k.shape
    if v.shape != k.shape or hkv != cache.num_kv_heads or d != cache.head_dim:
        raise ValueError(f"kv4_store: k {tuple(k.shape)} / v {tuple(v.shape)} do not match the cache "
                         f"(Hkv={cache.num_kv_heads}, D={cache.head_dim})")
    if n == 0:
        return
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    if side_slots is None:
        side_slots = torch.full((n,), -1, dtype=torch.int64, device=k.device)
    if backend != "triton":
        from . import store_cuda

        fn = store_cuda.kernel(hkv, k.dtype, k.device) if store_cuda.supported(cache, k, v, slots, side_slots) else None
        if fn is not None:
            store_cuda.store(fn, cache, k, v, slots, side_slots, rotate)
            return
        if backend == "cuda":
            raise RuntimeError(f"kv4_store: the CUDA kernel is unavailable here ({store_cuda.KERNEL.errors})")
    hmat = device_hadamard(d, k.device)
    c = cache
    _store_kernel[(triton.cdiv(n, block_t), hkv)](
        k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        slots, side_slots, hmat,
        c.k_codes, c.k_meta, c.v_codes, c.v_meta, c.k_side, c.k_side_scale, c.v_side, c.v_side_scale,
        c.k_codes.stride(0), c.k_codes.stride(1), c.k_meta.stride(0), c.k_meta.stride(1),
        c.k_side.stride(0), c.k_side.stride(1), c.k_side_scale.stride(0), c.k_side_scale.stride(1),
        n, HALF=d // 2, BLOCK_T=block_t, ROTATE=rotate, ROT_PREC=rot_prec,
    )
