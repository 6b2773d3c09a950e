"""The INT4 region of the KV4 decode as a CUDA kernel (``decode_cuda.cu``), compiled at run time by NVRTC.

GPU only: the Triton kernel (``decode._decode_kernel``) stays the reference implementation and the CPU-tested
path. ``kv4_decode`` takes this kernel when the plan selects it and it compiled. Fused (``fuse``, the default
since v6): one launch does it all, the INT4 splits, the INT8 side region (each split CTA takes a share) and the
merge (the CTA that finishes last); unfused (v5), it does the INT4 splits and the Triton kernel follows in its
``SIDE_MERGE`` mode (INT8 side region + merge of all parts). Everything here is
plain ctypes over ``libnvrtc`` (compile to a cubin for the device's architecture) and ``libcuda`` (module load,
launch on PyTorch's current stream; shared with the store kernel in ``cuda_rtc.py``): no build step, no extra
package. Any failure to find or compile makes
``available()`` false, and the caller falls back to the Triton kernel.
"""

from __future__ import annotations

import ctypes
import os

import torch

from . import cuda_rtc

_SRC = os.path.join(os.path.dirname(__file__), "decode_cuda.cu")
_STATE: dict = {}
STAGE_BYTES = 4608  # decode_cuda.cu: one warp's tile in the cp.async ring
QTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _compile(hkv: int, qtype: int, device: torch.device, min_blocks: int, warps: int, pipe: int, tma: int,
             fuse: int = 0, issue: int = 0, early: int = 0, merge: int = 0, side: int = 0, ablate: int = 0):
    """cubin for ``device``'s architecture -> loaded CUfunction (per device, HKV, query dtype, occupancy)."""
    defines = dict(HKV=hkv, QTYPE=qtype, MIN_BLOCKS=min_blocks, WARPS=warps, PIPE=pipe, TMA=tma, FUSE=fuse,
                   ISSUE=issue, EARLY=early, MERGE=merge, SIDE_CTAS=side,
                   ABLATE=ablate)
    cubin = cuda_rtc.compile_cubin(_SRC, device, defines)
    if tma:  # decode_cuda.cu: PIPE stages of STAGE_T bytes, then one 8-byte mbarrier per stage
        smem = pipe * (2 * 32 * (warps * 64 + 16) + 2 * 32 * warps * 4) + 8 * pipe
        if early:  # QSM_OFF: the query codes (WARP_SMEM per warp) after the ring, 16-byte aligned
            smem = (smem + 15) // 16 * 16 + warps * 512
    else:
        smem = warps * (pipe * STAGE_BYTES if pipe else 512)
    fn, mod = cuda_rtc.load_function(cubin, b"kv4_int4_splits", device, smem)
    return fn, mod, smem


def kernel(hkv: int, q_dtype: torch.dtype, device: torch.device, min_blocks: int = 2, warps: int = 0, pipe: int = 0,
           tma: int = 0, fuse: int = 0, issue: int = 0, early: int = 0, merge: int = 0, side: int = 0,
           ablate: int = 0):
    """The loaded kernel (CTAs of ``warps`` KV heads, all by default), or None where NVRTC/libcuda are missing or
    compilation failed (then never retried). ``fuse``: side region and merge in the same launch; ``issue``: the
    bulk-copy producers' variant (decode_cuda.cu ISSUE); ``early``: the ring filled at kernel start (EARLY, v7);
    ``merge``: the one-pass merge (MERGE, v7); ``side``: CTAs per request for the side region alone (SIDE_CTAS, v7;
    fused only; 0: a share per split CTA);
    ``ablate``: bench attribution only, parts of the work left out (ABLATE: wrong results).
    Returns (function, module, shared bytes, warps, fuse, side CTAs per request)."""
    warps = warps if warps and hkv % warps == 0 else hkv
    if tma and (pipe < 2 or warps < 4 or torch.cuda.get_device_capability(device) < (9, 0)):
        tma, pipe = 0, 0  # bulk copies need sm_90, 16-byte meta rows (4 heads) and 2+ stages: register prefetch
    issue = issue if tma else 0
    early = early if tma else 0
    merge = merge if fuse else 0
    side = side if fuse else 0
    key = (str(device), hkv, q_dtype, min_blocks, warps, pipe, tma, fuse, issue, early, merge, side, ablate)
    if key not in _STATE:
        try:
            _STATE[key] = (*_compile(hkv, QTYPES[q_dtype], device, min_blocks, warps, pipe, tma, fuse, issue, early,
                                     merge, side, ablate), warps, fuse, side)
        except Exception as e:  # fall back to the Triton kernel
            _STATE[key] = None
            _STATE.setdefault("errors", []).append(f"{type(e).__name__}: {e}")
    return _STATE[key]


def supported(q: torch.Tensor, hkv: int, group: int, d: int, kv_indices: torch.Tensor) -> bool:
    """Shapes the CUDA kernel is written for (the launcher also needs 16-byte aligned pointers)."""
    return (q.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1" and q.dtype in QTYPES and d == 128
            and group == 4 and 1 <= hkv <= 16 and kv_indices.dtype == torch.int32
            and torch.cuda.get_device_capability(q.device) >= (8, 0))


class Launcher:
    """One layer's CUDA launch with its arguments packed once: only the query, output and LSE pointers and the
    stream change per call (ctypes argument packing is most of the host cost of a small launch)."""

    def __init__(self, fn, grid, hkv: int, ptrs, chunk: int, parts: int, sm_scale_log2: float, magic: int,
                 rotate: bool):
        """``ptrs``: Q, KvIndptr, KvIndices, KCodes, KMeta32, VCodes, VMeta32, PartOut, PartLse, SideIndptr,
        SideIndices, KSide, KSideScale, VSide, VSideScale, Counter, Out, LseOut (device addresses; the side and
        merge ones are read by the fused kernel only). ``grid``: (splits + side CTAs, requests). ``parts``: the
        partial states per query row (the fused kernel: the splits + side CTAs; unfused: the splits + the Triton
        side region's)."""
        self.fn, warps, self.smem = fn[0], fn[3], fn[2]
        self.dims = (hkv // warps, grid[0], grid[1], 32 * warps, 1, 1)
        self.vals = [ctypes.c_uint64(p) for p in ptrs] + [ctypes.c_int(chunk), ctypes.c_int(parts),
                                                          ctypes.c_float(sm_scale_log2), ctypes.c_uint(magic),
                                                          ctypes.c_int(int(rotate))]
        self.params = cuda_rtc.pack_params(self.vals)

    def __call__(self, q_ptr: int, stream: int, out_ptr: int = 0, lse_ptr: int = 0) -> None:
        self.vals[0].value = q_ptr
        self.vals[16].value = out_ptr
        self.vals[17].value = lse_ptr
        cuda_rtc.launch(self.fn, self.dims[:3], self.dims[3:], self.smem, stream, self.params)
