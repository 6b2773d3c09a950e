"""The KV4 decode step as one CUDA kernel (``decode_cuda.cu``), compiled at run time by NVRTC.

GPU only: the Triton kernel (``decode._decode_kernel``) stays the reference implementation, the CPU-tested path and
the fallback. One launch per layer and step does it all: the INT4 splits, the INT8 side region (each split CTA
takes a share) and the merge (the CTA that finishes last). Everything here is plain ctypes over ``libnvrtc``
(compile to a cubin for the device's architecture) and ``libcuda`` (module load, launch on PyTorch's current
stream), through ``cuda_rtc``: no build step, no extra package. Any failure to find or compile makes ``kernel``
return None, and the caller falls back to the Triton kernel.

What ships is one kernel with its v7 options (bench/NOTES.md v5-v7); ``CudaDecodeVariant`` holds the few
compile-time options a benchmark still compares (ring depth, CTA shape). The measured-and-dropped options of v5-v8
(unfused launch, v5 producers, early ring fill, one-pass merge, side-region CTAs, two warp groups, ablations) are
gone from the source: bench/NOTES.md keeps their numbers.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import cuda_rtc

_SRC = os.path.join(os.path.dirname(__file__), "decode_cuda.cu")
KERNEL = cuda_rtc.RuntimeKernel(_SRC, b"kv4_int4_splits")  # the kernel handle: its compile cache and errors
QTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
TILE = 32  # INT4 slots per tile: per-request split sizes are rounded up to it (decode_cuda.cu)


@dataclass(frozen=True)
class CudaDecodeVariant:
    """Compile-time options of ``decode_cuda.cu``. The default is the shipped kernel (v7: 128x8k 0.328 ms = 3.00x
    FlashInfer BF16 on the H200): CTAs of 8 KV heads (one warp each), 2 CTAs per SM at 128 registers, a 2-stage
    bulk-copy ring. ``defines`` resolves it for a device: the ring needs sm_90 and 4, 8, 16 or 32 warps per CTA;
    elsewhere (A100, 2 or 3 KV heads, ...) the kernel prefetches the next tile into registers."""

    warps: int = 8  # KV heads (one warp each) per CTA; 0: all of them. Must divide the KV heads, else all
    min_blocks: int = 2  # __launch_bounds__ minimum CTAs per SM (2 x 8 warps: 128 registers, no spills)
    pipe: int = 2  # bulk-copy ring stages (>= 2); 0: next tile prefetched into registers (3: measured slower)

    def defines(self, hkv: int, arch: tuple[int, int]) -> dict:
        """The ``-D`` defines of this variant for ``hkv`` KV heads on compute capability ``arch``."""
        warps = self.warps if self.warps and hkv % self.warps == 0 else hkv
        ring = self.pipe >= 2 and tuple(arch) >= (9, 0) and warps >= 4 and 32 % warps == 0
        # at most 16 warps per SM: ptxas then keeps 128 registers (12 KV heads in one CTA: 1 CTA per SM, not 2)
        min_blocks = max(1, min(self.min_blocks, 16 // warps))
        return dict(MIN_BLOCKS=min_blocks, WARPS=warps, PIPE=self.pipe if ring else 0)


def shared_bytes(defines: dict) -> int:
    """Dynamic shared memory of a kernel built with ``defines`` (decode_cuda.cu: the ring's PIPE stages of 32 rows
    of K / V codes and meta, then one 8-byte mbarrier per stage; without a ring, 512 bytes of query codes per
    warp)."""
    warps, pipe = defines["WARPS"], defines["PIPE"]
    if pipe:
        return pipe * (2 * TILE * (warps * 64 + 16) + 2 * TILE * warps * 4) + 8 * pipe
    return warps * 512


class CudaDecodeKernel(NamedTuple):
    """A loaded decode kernel: what a launch needs besides its arguments."""

    function: ctypes.c_void_p  # CUfunction (``KERNEL`` keeps its module loaded)
    shared_bytes: int  # dynamic shared memory per CTA
    warps: int  # KV heads per CTA: the grid is (HKV / warps, splits, batch), the CTA 32 x warps threads


def build(hkv: int, q_dtype: torch.dtype, arch: tuple[int, int], defines: dict, *, with_log: bool = False):
    """NVRTC: the cubin for ``defines`` (``CudaDecodeVariant.defines``) on ``arch`` (no GPU needed; with ``with_log``
    also ptxas's report)."""
    return KERNEL.build(arch, dict(HKV=hkv, QTYPE=QTYPES[q_dtype]) | defines, with_log=with_log)


def kernel(hkv: int, q_dtype: torch.dtype, device: torch.device,
           variant: CudaDecodeVariant = CudaDecodeVariant()) -> CudaDecodeKernel | None:
    """The loaded kernel of ``variant`` for ``hkv`` KV heads and ``q_dtype`` queries on ``device``, or None where
    NVRTC/libcuda are missing or compilation failed (``KERNEL.errors``; never retried)."""
    defines = variant.defines(hkv, torch.cuda.get_device_capability(device))
    smem = shared_bytes(defines)
    loaded = KERNEL.load(device, dict(HKV=hkv, QTYPE=QTYPES[q_dtype]) | defines, smem)
    return None if loaded is None else CudaDecodeKernel(loaded.function, smem, defines["WARPS"])


def supported(q: torch.Tensor, hkv: int, group: int, d: int, kv_indices: torch.Tensor) -> bool:
    """Shapes the CUDA kernel is written for (the launcher also needs 16-byte aligned pointers)."""
    return (q.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1" and q.dtype in QTYPES and d == 128
            and group == 4 and 1 <= hkv <= 16 and kv_indices.dtype == torch.int32
            and torch.cuda.get_device_capability(q.device) >= (8, 0))


class CachePointers(NamedTuple):
    """A layer cache's tensors as the kernels read them (device addresses; meta as 32-bit words)."""

    k_codes: int
    k_meta: int
    v_codes: int
    v_meta: int
    k_side: int
    k_side_scale: int
    v_side: int
    v_side_scale: int


class StepPointers(NamedTuple):
    """What one plan binds for every layer: its index lists, the workspace's buffers, the split layout."""

    kv_indptr: int
    kv_indices: int
    side_indptr: int
    side_indices: int
    part_out: int  # [B, Hq, splits, 128] fp32
    part_lse: int  # [B, Hq, splits] fp32
    counters: int  # [B * Hkv] int32 tickets, zero between launches
    splits: int
    chunk: int  # INT4 slots per split; <= 0: each request's own (computed in the kernel)
    batch: int


class Launcher:
    """One layer's launch with its arguments packed once (ctypes packing is most of the host cost of a small
    launch): per call only the query, output and LSE pointers change, per plan (``bind``) the index lists, the
    workspace buffers and the split layout. Owned by the decode workspace that made it."""

    # kernel parameter order (decode_cuda.cu kv4_int4_splits)
    _Q, _INDPTR, _INDICES, _PART_OUT, _PART_LSE, _SIDE_INDPTR, _SIDE_INDICES = 0, 1, 2, 7, 8, 9, 10
    _COUNTER, _OUT, _LSE, _CHUNK, _PARTS = 15, 16, 17, 18, 19

    def __init__(self, fn: CudaDecodeKernel, hkv: int, cache: CachePointers, sm_scale_log2: float, magic: int,
                 rotate: bool):
        self.fn, self.hkv = fn, hkv
        ptrs = (0, 0, 0, cache.k_codes, cache.k_meta, cache.v_codes, cache.v_meta, 0, 0, 0, 0, cache.k_side,
                cache.k_side_scale, cache.v_side, cache.v_side_scale, 0, 0, 0)
        self.vals = [ctypes.c_uint64(p) for p in ptrs] + [ctypes.c_int(0), ctypes.c_int(0),
                                                          ctypes.c_float(sm_scale_log2), ctypes.c_uint(magic),
                                                          ctypes.c_int(int(rotate))]
        self.params = cuda_rtc.pack_params(self.vals)
        self.grid = (hkv // fn.warps, 0, 0)
        self.step: StepPointers | None = None

    def bind(self, step: StepPointers) -> None:
        """Point the launch at a plan's lists and buffers (a no-op when already bound to them)."""
        if step == self.step:
            return
        v = self.vals
        v[self._INDPTR].value, v[self._INDICES].value = step.kv_indptr, step.kv_indices
        v[self._SIDE_INDPTR].value, v[self._SIDE_INDICES].value = step.side_indptr, step.side_indices
        v[self._PART_OUT].value, v[self._PART_LSE].value = step.part_out, step.part_lse
        v[self._COUNTER].value = step.counters
        v[self._CHUNK].value, v[self._PARTS].value = step.chunk, step.splits
        self.grid = (self.hkv // self.fn.warps, step.splits, step.batch)
        self.step = step

    def __call__(self, q_ptr: int, out_ptr: int, lse_ptr: int, stream: int) -> None:
        v = self.vals
        v[self._Q].value, v[self._OUT].value, v[self._LSE].value = q_ptr, out_ptr, lse_ptr
        cuda_rtc.launch(self.fn.function, self.grid, (32 * self.fn.warps, 1, 1), self.fn.shared_bytes, stream,
                        self.params)
