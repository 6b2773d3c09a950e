"""RMSNorm rounded as Hugging Face's Qwen3 ``RMSNorm.forward`` rounds it, in one kernel.

HF (the trainer's and the built-in engine's model) normalises in fp32, rounds the normalised row to the model
dtype, then multiplies by the weight in that dtype (a second rounding); a residual is added first in the model
dtype. SGLang's fused kernels multiply the weight in fp32 and round once, and normalise the fp32 residual sum:
each a last bit, which ``--kv4rl``'s INT4 codes turn into whole code steps (``sglang_ext.hf_numerics``). HF's code
run as is costs about eight small kernels a norm (cast, square, mean, add, rsqrt, multiply, cast, multiply) and
four norms a layer; this kernel does one row per program with the same roundings, in the same order: the bf16
residual add, the fp32 square and sum, times ``1/N`` as torch's mean does, ``+ eps``, ``rsqrt``, the rounding of
the normalised value, the weight product rounded. Only the order of the row's fp32 sum can differ from torch's
reduction (a last fp32 bit of the variance, rarely a bf16 step of an output).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl


@triton.jit
def _rounded(x32, dtype: tl.constexpr, BF16: tl.constexpr):
    """fp32 -> ``dtype`` rounded to nearest even, as torch rounds. For bf16 the rounding is done on the bits: Triton's
    interpreter truncates an fp32 -> bf16 cast (the CPU tests run it), the GPU rounds; the rounded value then casts
    exactly on both."""
    if BF16:
        bits = x32.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True).to(dtype)
    return x32.to(dtype)


@triton.jit
def _hf_rms_norm_kernel(X, R, W, OUT, SUM, stride_x, stride_r, stride_o, stride_s, N, inv_n, eps,
                        HAS_RESIDUAL: tl.constexpr, BF16: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:  # HF: ``hidden_states = residual + hidden_states`` in the model dtype
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
        x = _rounded(r.to(tl.float32) + x.to(tl.float32), SUM.dtype.element_ty, BF16)
        tl.store(SUM + row * stride_s + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    variance = tl.sum(x32 * x32, axis=0) * inv_n  # torch's mean: the sum times 1/N
    normed = _rounded(x32 * tl.math.rsqrt(variance + eps), OUT.dtype.element_ty, BF16)
    w = tl.load(W + cols, mask=mask, other=0.0)
    out = _rounded(w.to(tl.float32) * normed.to(tl.float32), OUT.dtype.element_ty, BF16)  # HF: weight * normed
    tl.store(OUT + row * stride_o + cols, out, mask=mask)


def mean_factor(rows: int, n: int) -> float:
    """The fp32 factor torch's CUDA mean multiplies the sum by: ``float(outputs) / numel`` in fp32 (``1/N`` rounded,
    unless ``rows * n`` is past 2^24)."""
    return float(np.float32(rows) / np.float32(rows * n))


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The kernel's case: the weight in the input's dtype (HF's product then rounds to it) and a last dim that is
    contiguous; anything else runs HF's code."""
    return x.dtype == weight.dtype and x.shape[-1] == weight.numel() and x.stride(-1) == 1 and weight.is_contiguous()


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``weight * rms_normalise(x)`` over the last dim, as HF rounds it; with ``residual``: ``(norm(residual + x),
    residual + x)``, the sum rounded to the dtype first. New tensors; the inputs are not written."""
    if not supported(x, weight):
        raise ValueError(f"hf_rms_norm: input {x.dtype} {tuple(x.shape)} (last stride {x.stride(-1)}) and weight "
                         f"{weight.dtype} {tuple(weight.shape)}: the weight must have the input's dtype and last dim")
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if residual is not None:
        res = residual.reshape(-1, n)
        if res.shape != rows.shape or res.dtype != x.dtype or res.stride(-1) != 1:
            raise ValueError(f"hf_rms_norm: residual {res.dtype} {tuple(residual.shape)} for input {x.dtype} "
                             f"{tuple(x.shape)}")
        total = torch.empty_like(out)
    else:
        res = total = rows  # unread and unwritten
    if rows.shape[0]:
        inv_n = mean_factor(rows.shape[0], n)
        _hf_rms_norm_kernel[(rows.shape[0],)](rows, res, weight, out, total, rows.stride(0), res.stride(0),
                                              out.stride(0), total.stride(0), n, inv_n, eps,
                                              HAS_RESIDUAL=residual is not None, BF16=x.dtype == torch.bfloat16,
                                              BLOCK=triton.next_power_of_2(n))
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), total.view(x.shape)
