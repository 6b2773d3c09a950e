"""The KV4 store as a CUDA kernel (``store_cuda.cu``), compiled at run time by NVRTC (``cuda_rtc.py``).

GPU only: the Triton kernel (``store._store_kernel``) stays the reference implementation and the CPU-tested path.
``kv4_store`` takes this kernel on a CUDA device for the shapes it is written for (head dim 128, fp32/bf16/fp16
K and V with 16-byte aligned rows, contiguous cache tensors, int32/int64 slot ids); anything else, or a failure to
find NVRTC or to compile, falls back to Triton.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import NamedTuple

import torch

from ..kv4.cache import KV4LayerCache
from . import cuda_rtc

_SRC = os.path.join(os.path.dirname(__file__), "store_cuda.cu")
KERNEL = cuda_rtc.RuntimeKernel(_SRC, b"kv4_store")  # the kernel handle: its compile cache and errors
QTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
WARPS = 1  # store_cuda.cu: warps per CTA (default), 16 token-head vectors per warp


class StoreKernel(NamedTuple):
    function: ctypes.c_void_p  # CUfunction (loaded by ``KERNEL``, which keeps its module)
    warps: int  # per CTA
    args: _Args  # its launch arguments, filled in place per launch


class _Args:
    """``kv4_store``'s kernel parameters as persistent ctypes values and their ``void*[]``, packed once: a launch
    sets the values (cuLaunchKernel copies them, also into a graph being captured). Packing ~24 ctypes values
    per call cost more host time than the launch itself, once per layer of every step."""

    LAYOUT = ([ctypes.c_uint64] * 2 + [ctypes.c_longlong] * 4 + [ctypes.c_uint64] * 2 + [ctypes.c_int] * 2
              + [ctypes.c_uint64] * 8 + [ctypes.c_int] * 2)

    def __init__(self):
        self.vals = [t() for t in self.LAYOUT]
        self.params = cuda_rtc.pack_params(self.vals)

    def set(self, values) -> None:
        for slot, v in zip(self.vals, values, strict=True):
            slot.value = v


def build(arch: tuple[int, int], defines: dict, *, with_log: bool = False):
    """NVRTC: the cubin for compute capability ``arch`` (no GPU needed; ``with_log``: also ptxas's report)."""
    return KERNEL.build(arch, defines, with_log=with_log)


def kernel(hkv: int, dtype: torch.dtype, device: torch.device, opts: dict | None = None) -> StoreKernel | None:
    """The loaded kernel for ``hkv`` KV heads and input ``dtype``, or None where NVRTC/libcuda are missing or the
    compilation failed (then never retried; the error is kept in ``KERNEL.errors``). ``opts``: store_cuda.cu
    defines (bench variants: WARPS, MIN_BLOCKS, LDHINT)."""
    defines = dict(HKV=hkv, QTYPE=QTYPES[dtype], WARPS=WARPS) | dict(opts or {})
    key = (str(device), tuple(sorted(defines.items())))
    if key not in _KERNELS:
        loaded = KERNEL.load(device, defines)
        _KERNELS[key] = None if loaded is None else StoreKernel(loaded.function, defines["WARPS"], _Args())
    return _KERNELS[key]


_KERNELS: dict = {}


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _rows_ok(x: torch.Tensor) -> bool:
    """16-byte aligned vectors of contiguous elements."""
    step = 16 // x.element_size()
    return (x.stride(2) == 1 and x.stride(0) % step == 0 and x.stride(1) % step == 0
            and x.data_ptr() % 16 == 0)


def supported(cache: KV4LayerCache, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
              side_slots: torch.Tensor) -> bool:
    """Shapes and layouts the CUDA kernel is written for."""
    if not (k.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1"):
        return False
    n, hkv, d = k.shape
    cache_tensors = (cache.k_codes, cache.k_meta, cache.v_codes, cache.v_meta, cache.k_side, cache.k_side_scale,
                     cache.v_side, cache.v_side_scale)
    return (d == 128 and k.dtype in QTYPES and v.dtype == k.dtype and _rows_ok(k) and _rows_ok(v)
            and all(t.is_contiguous() and t.device == k.device for t in cache_tensors)
            and slots.dtype in (torch.int32, torch.int64) and side_slots.dtype in (torch.int32, torch.int64)
            and slots.is_contiguous() and side_slots.is_contiguous()
            and n * hkv < 2 ** 31 and _capability(k.device) >= (8, 0))


def store(fn: StoreKernel, cache: KV4LayerCache, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
          side_slots: torch.Tensor, rotate: bool) -> None:
    """Launch the loaded kernel ``fn`` (``kernel``'s answer) on the current stream (arguments as ``kv4_store``'s,
    checked by ``supported``). No host synchronisation and a grid fixed by ``k``'s shape: a CUDA graph can
    capture it (after a first, eager call has compiled the kernel)."""
    n, hkv, _ = k.shape
    nvec = n * hkv
    c = cache
    fn.args.set((k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                 slots.data_ptr(), side_slots.data_ptr(), int(slots.dtype == torch.int64),
                 int(side_slots.dtype == torch.int64),
                 c.k_codes.data_ptr(), c.k_meta.data_ptr(), c.v_codes.data_ptr(), c.v_meta.data_ptr(),
                 c.k_side.data_ptr(), c.k_side_scale.data_ptr(), c.v_side.data_ptr(), c.v_side_scale.data_ptr(),
                 nvec, int(rotate)))
    blocks = (nvec + 16 * fn.warps - 1) // (16 * fn.warps)
    stream = torch.cuda.current_stream(k.device).cuda_stream  # the capturing stream under a CUDA graph
    cuda_rtc.launch(fn.function, (blocks, 1, 1), (32 * fn.warps, 1, 1), 0, stream, fn.args.params)
