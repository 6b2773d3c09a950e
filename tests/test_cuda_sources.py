"""The CUDA kernels (``decode_cuda.cu``, ``store_cuda.cu``) compile for the H200 (sm_90) through NVRTC on any
machine, GPU or not, and ptxas's resource report holds: every launch variant the GPU tests run builds, and the
variants that run by default fit their register budget with no spills (a spill in the INT4 loop costs the decode
its bandwidth). NVRTC comes from the ``nvidia-cuda-nvrtc`` wheel (the ``cuda-compile`` extra) or a CUDA toolkit."""

import dataclasses
import re

import pytest
import torch
from test_kernels_decode import CUDA_VARIANTS

from kvstreams_sglang.kernels import cuda_rtc, decode_cuda, plan_decode, store_cuda
from kvstreams_sglang.kernels.decode import cuda_options

H200 = (9, 0)

try:
    cuda_rtc.nvrtc()
    HAVE_NVRTC = True
except OSError:
    HAVE_NVRTC = False
pytestmark = pytest.mark.skipif(not HAVE_NVRTC, reason="NVRTC not found (pip install -e .[cuda-compile])")


def resources(log: str) -> tuple[int, int, int]:
    """ptxas -v: (registers, spill store bytes, spill load bytes) of the one kernel in ``log``."""
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert regs and spills, log
    return int(regs.group(1)), int(spills.group(1)), int(spills.group(2))


def _plan(hkv: int, splits, overrides: dict):
    n = 1000
    plan = plan_decode(torch.tensor([0, n], dtype=torch.int32), torch.zeros(n, dtype=torch.int32),
                       torch.tensor([0, 144], dtype=torch.int32), torch.zeros(144, dtype=torch.int32),
                       num_kv_heads=hkv, cuda_int4=1, cuda_splits=splits)
    return dataclasses.replace(plan, **overrides)


def _decode_variants():
    """Each distinct compile-time variant of the GPU tests' launch variants (bf16, fp16 and fp32 queries)."""
    seen = {}
    for _, hkv, splits, dtype, overrides in CUDA_VARIANTS:
        v = decode_cuda.variant(hkv, H200, **cuda_options(_plan(hkv, splits, overrides)))
        name = f"hkv{hkv}-{str(dtype)[6:]}-" + ",".join(f"{k}={n}" for k, n in v.items() if n)
        seen.setdefault(name, pytest.param(hkv, dtype, v, id=name))
    return list(seen.values())


@pytest.mark.parametrize("hkv,dtype,v", _decode_variants())
def test_decode_kernel_variant_compiles_for_sm90(hkv, dtype, v):
    cubin, log = decode_cuda.build(hkv, dtype, H200, v, with_log=True)
    assert cubin[:4] == b"\x7fELF"
    regs, spill_st, spill_ld = resources(log)
    warps_per_sm = v["MIN_BLOCKS"] * v["WARPS"] * v["WGROUPS"]
    assert regs * 32 * warps_per_sm <= 65536, (regs, v)  # __launch_bounds__ held: min CTAs per SM resident


def test_default_decode_kernel_has_no_spills():
    """The variant the plan picks by default (bf16 and fp16 queries, 8 KV heads: Qwen3's GQA) keeps 2 CTAs of
    8 warps per SM at 128 registers with nothing spilled (bench/NOTES.md v6: 128 registers, no spills)."""
    for dtype in (torch.bfloat16, torch.float16):
        v = decode_cuda.variant(8, H200, **cuda_options(_plan(8, None, {})))
        assert (v["TMA"], v["FUSE"], v["WGROUPS"]) == (1, 1, 1), v
        regs, spill_st, spill_ld = resources(decode_cuda.build(8, dtype, H200, v, with_log=True)[1])
        assert regs <= 128 and spill_st == 0 and spill_ld == 0, (dtype, regs, spill_st, spill_ld)


@pytest.mark.parametrize("hkv,dtype", [(8, torch.bfloat16), (8, torch.float16), (2, torch.float32),
                                       (3, torch.bfloat16)])
def test_store_kernel_compiles_for_sm90_without_spills(hkv, dtype):
    defines = dict(HKV=hkv, QTYPE=store_cuda.QTYPES[dtype], WARPS=store_cuda.WARPS)
    cubin, log = store_cuda.build(H200, defines, with_log=True)
    assert cubin[:4] == b"\x7fELF"
    _, spill_st, spill_ld = resources(log)
    assert spill_st == 0 and spill_ld == 0, log


def test_compile_error_is_reported():
    """A broken variant raises with NVRTC's log (the launchers then fall back to Triton and keep the message)."""
    with pytest.raises(RuntimeError, match="NVRTC.*WGROUPS"):
        decode_cuda.build(8, torch.bfloat16, H200, dict(decode_cuda.variant(8, H200), WGROUPS=2, TMA=0))
