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


def variant(hkv: int, arch: tuple[int, int], min_blocks: int = 2, warps: int = 0, pipe: int = 0, tma: int = 0,
            fuse: int = 0, issue: int = 0, early: int = 0, merge: int = 0, side: int = 0, ablate: int = 0,
            wgroups: int = 1, wside: int = 0) -> dict:
    """The kernel's compile-time options as it will build them for compute capability ``arch``: options the
    variant cannot take are switched off (``kernel`` documents them)."""
    warps = warps if warps and hkv % warps == 0 else hkv
    if tma and (pipe < 2 or warps < 4 or tuple(arch) < (9, 0)):
        tma, pipe = 0, 0  # bulk copies need sm_90, 16-byte meta rows (4 heads) and 2+ stages: register prefetch
    issue = issue if tma else 0
    early = early if tma else 0
    merge = merge if fuse else 0
    side = side if fuse else 0
    if wgroups > 1 and not (tma and fuse and issue and not early and not side and 32 % warps == 0):
        wgroups = 1
    wside = wside if wgroups == 2 else 0
    if wgroups > 1:
        min_blocks = 1  # 2 x 8 warps x 128 registers fill the SM's register file
    return dict(MIN_BLOCKS=min_blocks, WARPS=warps, PIPE=pipe, TMA=tma, FUSE=fuse, ISSUE=issue, EARLY=early,
                MERGE=merge, SIDE_CTAS=side, ABLATE=ablate, WGROUPS=wgroups, WSIDE=wside)


def shared_bytes(v: dict) -> int:
    """Dynamic shared memory of a ``variant``."""
    warps, pipe = v["WARPS"], v["PIPE"]
    if v["TMA"]:  # decode_cuda.cu: PIPE stages of STAGE_T bytes, then one 8-byte mbarrier per stage
        rows = 32 if v["WSIDE"] else 32 * v["WGROUPS"]  # slots per stage (WSIDE: warp group 0's alone)
        smem = pipe * (2 * rows * (warps * 64 + 16) + 2 * rows * warps * 4) + 8 * pipe
        if v["EARLY"]:  # QSM_OFF: the query codes (WARP_SMEM per warp) after the ring, 16-byte aligned
            smem = (smem + 15) // 16 * 16 + warps * 512
        return smem
    return warps * (pipe * STAGE_BYTES if pipe else 512)


def build(hkv: int, q_dtype: torch.dtype, arch: tuple[int, int], v: dict, *, with_log: bool = False):
    """NVRTC: the cubin of ``variant`` ``v`` for ``arch`` (no GPU needed; with ``with_log`` also ptxas's report)."""
    return cuda_rtc.compile_cubin(_SRC, arch, dict(HKV=hkv, QTYPE=QTYPES[q_dtype]) | v, with_log=with_log)


def kernel(hkv: int, q_dtype: torch.dtype, device: torch.device, min_blocks: int = 2, warps: int = 0, pipe: int = 0,
           tma: int = 0, fuse: int = 0, issue: int = 0, early: int = 0, merge: int = 0, side: int = 0,
           ablate: int = 0, wgroups: int = 1, wside: int = 0):
    """The loaded kernel (CTAs of ``warps`` KV heads, all by default), or None where NVRTC/libcuda are missing or
    compilation failed (then never retried). ``fuse``: side region and merge in the same launch; ``issue``: the
    bulk-copy producers' variant (decode_cuda.cu ISSUE); ``early``: the ring filled at kernel start (EARLY, v7);
    ``merge``: the one-pass merge (MERGE, v7); ``side``: CTAs per request for the side region alone (SIDE_CTAS, v7;
    fused only; 0: a share per split CTA); ``wgroups``: warps per KV head (WGROUPS, v8: 2 makes CTAs of 2 x warps
    warps, one per SM, each warp group with its own tiles, side share and part; fused bulk-copy ring with the v6
    producers only, else 1); ``wside``: with 2 warp groups, group 0 streams the INT4 region alone and group 1 takes
    the split's side share beside it (WSIDE, v8: warp specialisation); ``ablate``: bench attribution only, parts of
    the work left out (ABLATE: wrong results).
    Returns (function, module, shared bytes, warps, fuse, side CTAs per request, warp groups)."""
    v = variant(hkv, torch.cuda.get_device_capability(device), min_blocks, warps, pipe, tma, fuse, issue, early,
                merge, side, ablate, wgroups, wside)
    key = (str(device), hkv, q_dtype, *v.values())
    if key not in _STATE:
        try:
            smem = shared_bytes(v)
            fn, mod = cuda_rtc.load_function(build(hkv, q_dtype, torch.cuda.get_device_capability(device), v),
                                             b"kv4_int4_splits", device, smem)
            _STATE[key] = (fn, mod, smem, v["WARPS"], v["FUSE"], v["SIDE_CTAS"], v["WGROUPS"])
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
        partial states per query row (the fused kernel: the splits x warp groups + side CTAs; unfused: the splits +
        the Triton side region's)."""
        self.fn, warps, self.smem = fn[0], fn[3], fn[2]
        self.dims = (hkv // warps, grid[0], grid[1], 32 * warps * fn[6], 1, 1)
        self.vals = [ctypes.c_uint64(p) for p in ptrs] + [ctypes.c_int(chunk), ctypes.c_int(parts),
                                                          ctypes.c_float(sm_scale_log2), ctypes.c_uint(magic),
                                                          ctypes.c_int(int(rotate))]
        self.params = cuda_rtc.pack_params(self.vals)

    def __call__(self, q_ptr: int, stream: int, out_ptr: int = 0, lse_ptr: int = 0) -> None:
        self.vals[0].value = q_ptr
        self.vals[16].value = out_ptr
        self.vals[17].value = lse_ptr
        cuda_rtc.launch(self.fn, self.dims[:3], self.dims[3:], self.smem, stream, self.params)
