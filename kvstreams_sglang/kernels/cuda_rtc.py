"""Run-time CUDA C for the KV4 kernels: NVRTC compiles a ``.cu`` file to a cubin for the device's architecture,
libcuda loads and launches it on PyTorch's current stream. Plain ctypes over ``libnvrtc`` and ``libcuda``: no build
step, no extra package. Shared by ``decode_cuda.py`` and ``store_cuda.py``; any failure there (library missing,
compile error) makes the caller fall back to its Triton kernel. Compiling needs only NVRTC, so CI (no GPU) builds
every kernel variant for sm_90 and checks ptxas's register and spill report.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
from typing import NamedTuple

import torch

_LIBS: dict = {}


def _load_lib(names, patterns):
    """A library by path (``patterns``, first match; its directory's ``*-builtins`` libraries are loaded first,
    globally: NVRTC opens ``libnvrtc-builtins`` by name) or else by soname (``names``)."""
    for pat in patterns:
        for path in sorted(glob.glob(pat), reverse=True):
            if "builtins" in path or "alt" in os.path.basename(path):
                continue
            try:
                for dep in glob.glob(os.path.join(os.path.dirname(path), "*-builtins.so*")):
                    if "alt" not in os.path.basename(dep):
                        ctypes.CDLL(dep, mode=ctypes.RTLD_GLOBAL)
                return ctypes.CDLL(path)
            except OSError:
                pass
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            pass
    raise OSError(f"none of {names} found")


def nvrtc():
    """``libnvrtc``, loaded once (a pip ``nvidia-cuda-nvrtc`` wheel on ``sys.path`` or the CUDA toolkit's): enough
    to compile, also on a machine without a GPU (``tests/test_cuda_sources.py``)."""
    if "nvrtc" not in _LIBS:
        roots = [os.path.join(p, "nvidia") for p in sys.path if os.path.isdir(os.path.join(p, "nvidia"))]
        pats = [os.path.join(r, "*", "lib", "libnvrtc.so*") for r in roots]
        pats += [os.path.join(r, "*", "*", "lib", "libnvrtc.so*") for r in roots]
        pats += ["/usr/local/cuda/lib64/libnvrtc.so*", "/usr/local/cuda*/targets/*/lib/libnvrtc.so*"]
        _LIBS["nvrtc"] = _load_lib(["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"], pats)
    return _LIBS["nvrtc"]


def libs():
    """``(libnvrtc, libcuda)``, loaded once."""
    if "libs" not in _LIBS:
        cuda = _load_lib(["libcuda.so.1", "libcuda.so"], [])
        cuda.cuLaunchKernel.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                                        ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p,
                                        ctypes.c_void_p, ctypes.c_void_p]
        _LIBS["libs"] = (nvrtc(), cuda)
    return _LIBS["libs"]


def _log(lib, prog) -> str:
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    return log.value.decode(errors="replace")


def compile_cubin(src_path: str, arch: tuple[int, int], defines: dict, *, with_log: bool = False):
    """NVRTC: ``src_path`` with ``-D`` ``defines`` -> cubin for compute capability ``arch`` (a device's
    ``torch.cuda.get_device_capability``). ``with_log``: also ptxas's resource report (registers, spills) as
    ``(cubin, log)``."""
    lib = nvrtc()
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), open(src_path, "rb").read(),
                              os.path.basename(src_path).encode(), 0, None, None):
        raise RuntimeError("nvrtcCreateProgram failed")
    opts = [f"--gpu-architecture=sm_{arch[0]}{arch[1]}".encode(), b"--std=c++17",
            f"--include-path={os.path.dirname(os.path.abspath(src_path))}".encode()]  # kv4_ptx.cuh
    opts += [b"--ptxas-options=-v"] if with_log else []
    opts += [f"-D{k}={v}".encode() for k, v in defines.items()]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    try:
        if lib.nvrtcCompileProgram(prog, len(opts), arr):
            raise RuntimeError(f"NVRTC: {_log(lib, prog)[:2000]}")
        size = ctypes.c_size_t()
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, cubin)
        return (cubin.raw, _log(lib, prog)) if with_log else cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def load_function(cubin: bytes, name: bytes, device: torch.device, smem: int = 0):
    """Load ``cubin`` into ``device``'s primary context -> ``(CUfunction, CUmodule)``; ``smem`` above 48 KiB raises
    the function's dynamic shared-memory limit."""
    _, cuda = libs()
    torch.cuda.current_device()  # the primary context is current on this thread
    with torch.cuda.device(device):
        torch.zeros(1, device=device)
        mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
        if cuda.cuModuleLoadData(ctypes.byref(mod), cubin):
            raise RuntimeError("cuModuleLoadData failed")
        if cuda.cuModuleGetFunction(ctypes.byref(fn), mod, name):
            raise RuntimeError("cuModuleGetFunction failed")
        if smem > 48 * 1024 and cuda.cuFuncSetAttribute(fn, 8, ctypes.c_int(smem)):  # MAX_DYNAMIC_SHARED_SIZE_BYTES
            raise RuntimeError("cuFuncSetAttribute failed")
    return fn, mod


def pack_params(vals):
    """``void*[]`` of pointers to the ctypes values ``vals`` (cuLaunchKernel's kernelParams)."""
    return (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in vals])


def launch(fn, grid, block, smem: int, stream: int, params) -> None:
    """``cuLaunchKernel`` with packed ``params``; raises on a nonzero CUresult."""
    rc = libs()[1].cuLaunchKernel(fn, *grid, *block, smem, stream, params, None)
    if rc:
        raise RuntimeError(f"cuLaunchKernel failed: CUresult {rc}")


class LoadedFunction(NamedTuple):
    function: ctypes.c_void_p  # CUfunction
    module: ctypes.c_void_p  # its CUmodule, kept referenced while the function is in use


class RuntimeKernel:
    """One ``__global__`` function of a ``.cu`` file, compiled by NVRTC and loaded on first use per (device,
    defines): the kernel handle owns its compile cache, as a ``triton.jit`` function owns its own, so every caller
    of one specialisation (each decode workspace, every ``kv4_store``) shares one loaded module instead of
    compiling again. A failure is kept (``errors``) and not retried: the callers fall back to their Triton kernel."""

    def __init__(self, src_path: str, name: bytes):
        self.src_path, self.name = src_path, name
        self.errors: list[str] = []
        self._loaded: dict[tuple, LoadedFunction | None] = {}

    def build(self, arch: tuple[int, int], defines: dict, *, with_log: bool = False):
        """The cubin for compute capability ``arch`` (no GPU needed; ``with_log``: also ptxas's report)."""
        return compile_cubin(self.src_path, arch, defines, with_log=with_log)

    def load(self, device: torch.device, defines: dict, smem: int = 0) -> LoadedFunction | None:
        """The function compiled with ``defines`` for ``device``'s architecture, loaded there (``smem``: its
        dynamic shared memory), or None where NVRTC / libcuda are missing or the compilation failed."""
        key = (str(device), tuple(sorted(defines.items())), smem)
        if key not in self._loaded:
            try:
                cubin = self.build(torch.cuda.get_device_capability(device), defines)
                self._loaded[key] = LoadedFunction(*load_function(cubin, self.name, device, smem))
            except Exception as e:  # the caller falls back to its Triton kernel
                self._loaded[key] = None
                self.errors.append(f"{type(e).__name__}: {e}")
        return self._loaded[key]
