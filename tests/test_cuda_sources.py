"""The CUDA kernels (``decode_cuda.cu``, ``store_cuda.cu``) compile for the H200 (sm_90) through NVRTC on any
machine, GPU or not, and ptxas's resource report holds: every launch variant the GPU tests run builds, and the
variants that run by default fit their register budget with no spills (a spill in the INT4 loop costs the decode
its bandwidth). NVRTC comes from the ``nvidia-cuda-nvrtc`` wheel (the ``cuda-compile`` extra) or a CUDA toolkit."""

import re

import pytest
import torch
from test_kernels_decode import CUDA_VARIANTS

from kvstreams_sglang.kernels import CudaDecodeVariant, cuda_rtc, decode_cuda, store_cuda

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


def _decode_variants():
    """Each distinct compile-time variant of the GPU tests' launch variants (bf16, fp16 and fp32 queries), and the
    shipped kernel for the KV head counts the CUDA path takes."""
    seen = {}
    cases = [(hkv, dtype, variant) for _, hkv, _, dtype, variant in CUDA_VARIANTS]
    cases += [(hkv, torch.bfloat16, CudaDecodeVariant()) for hkv in (1, 4, 6, 16)]
    for hkv, dtype, variant in cases:
        v = variant.defines(hkv, H200)
        name = f"hkv{hkv}-{str(dtype)[6:]}-" + ",".join(f"{k}={n}" for k, n in v.items())
        seen.setdefault(name, pytest.param(hkv, dtype, v, id=name))
    return list(seen.values())


@pytest.mark.parametrize("hkv,dtype,v", _decode_variants())
def test_decode_kernel_variant_compiles_for_sm90(hkv, dtype, v):
    cubin, log = decode_cuda.build(hkv, dtype, H200, v, with_log=True)
    assert cubin[:4] == b"\x7fELF"
    regs, spill_st, spill_ld = resources(log)
    warps_per_sm = v["MIN_BLOCKS"] * v["WARPS"]
    assert regs * 32 * warps_per_sm <= 65536, (regs, v)  # __launch_bounds__ held: min CTAs per SM resident


def test_default_decode_kernel_has_no_spills():
    """The shipped kernel (bf16 and fp16 queries, 8 KV heads: Qwen3's GQA) keeps 2 CTAs of 8 warps per SM at 128
    registers with nothing spilled (bench/NOTES.md v6: 128 registers, no spills), with its 2-stage bulk-copy ring;
    fp32 queries (the tests' dtype) likewise."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        v = CudaDecodeVariant().defines(8, H200)
        assert v == dict(MIN_BLOCKS=2, WARPS=8, PIPE=2), v
        regs, spill_st, spill_ld = resources(decode_cuda.build(8, dtype, H200, v, with_log=True)[1])
        assert regs <= 128 and spill_st == 0 and spill_ld == 0, (dtype, regs, spill_st, spill_ld)


def test_variant_resolution_per_device_and_head_count():
    """The bulk-copy ring only where it is written for (sm_90, 4/8/16/32 warps per CTA: a stage's 32 rows split
    evenly over the warps); elsewhere the register-prefetch kernel. 12 KV heads took the ring before and would have
    waited forever on a stage 8 rows short."""
    assert CudaDecodeVariant().defines(8, (8, 0)) == dict(MIN_BLOCKS=2, WARPS=8, PIPE=0)  # A100
    assert CudaDecodeVariant().defines(2, H200) == dict(MIN_BLOCKS=2, WARPS=2, PIPE=0)
    assert CudaDecodeVariant().defines(12, H200) == dict(MIN_BLOCKS=1, WARPS=12, PIPE=0)
    assert CudaDecodeVariant().defines(16, H200) == dict(MIN_BLOCKS=2, WARPS=8, PIPE=2)
    assert CudaDecodeVariant(pipe=0).defines(8, H200)["PIPE"] == 0


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
    with pytest.raises(RuntimeError, match="NVRTC.*bulk-copy ring"):
        decode_cuda.build(8, torch.bfloat16, H200, dict(MIN_BLOCKS=2, WARPS=3, PIPE=2))
