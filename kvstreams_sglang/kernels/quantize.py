"""In-register quantisers shared by the KV4 kernels, and the query-preparation kernel.

Vectors are handled as two halves ``[rows, D/2]`` (the split-half order of the INT4
packing), so rotation, INT4 and INT8 codes never need to interleave a tile. Rounding is
``floor(v + 0.5)`` with IEEE division, as in ``kv4.quant``, so kernels and the torch
reference produce the same codes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kv4.hadamard import hadamard_matrix
from ..kv4.quant import Int8Tensor

_HMAT: dict = {}


def device_hadamard(d: int, device) -> torch.Tensor:
    """fp32 Hadamard matrix on ``device``, made once (``hadamard_matrix`` copies it host-to-device per call)."""
    key = (d, str(device))
    if key not in _HMAT:
        _HMAT[key] = hadamard_matrix(d, device=device)
    return _HMAT[key]


@triton.jit
def rotate_halves(x_lo, x_hi, Hmat, HALF: tl.constexpr, PREC: tl.constexpr):
    """``[x_lo, x_hi] @ H`` with ``H = [[H00, H01], [H10, H11]]``: each output half is two dots.
    ``PREC="tf32x3"`` runs them on the tensor cores (three tf32 passes, ~fp32 accuracy) instead of
    fp32 FMAs; the store kernel uses it (an ieee rotation made it compute bound)."""
    e = tl.arange(0, HALF)
    d = tl.arange(0, HALF)
    h00 = tl.load(Hmat + e[:, None] * (2 * HALF) + d[None, :])
    h01 = tl.load(Hmat + e[:, None] * (2 * HALF) + HALF + d[None, :])
    h10 = tl.load(Hmat + (HALF + e[:, None]) * (2 * HALF) + d[None, :])
    h11 = tl.load(Hmat + (HALF + e[:, None]) * (2 * HALF) + HALF + d[None, :])
    r_lo = tl.dot(x_lo, h00, input_precision=PREC) + tl.dot(x_hi, h10, input_precision=PREC)
    r_hi = tl.dot(x_lo, h01, input_precision=PREC) + tl.dot(x_hi, h11, input_precision=PREC)
    return r_lo, r_hi


@triton.jit
def rotate_halves_sylvester(x_lo, x_hi, Hmat, HALF: tl.constexpr, PREC: tl.constexpr):
    """``rotate_halves`` for the Sylvester Hadamard matrix, whose blocks are ``H00 = H01 = H10 = -H11``:
    ``[x_lo + x_hi, x_lo - x_hi] @ H00``, one 64x64 block instead of four (a quarter of the matrix
    loads and registers, half the FMAs; the decode kernel rotates its own query rows with it). ``PREC``
    as in ``rotate_halves``, no default: Triton's compiler (not its interpreter) rejects a string default."""
    e = tl.arange(0, HALF)
    d = tl.arange(0, HALF)
    h00 = tl.load(Hmat + e[:, None] * (2 * HALF) + d[None, :])
    r_lo = tl.dot(x_lo + x_hi, h00, input_precision=PREC)
    r_hi = tl.dot(x_lo - x_hi, h00, input_precision=PREC)
    return r_lo, r_hi


@triton.jit
def int4_codes(x_lo, x_hi):
    """Per-row asymmetric INT4 of a vector given as two halves ``[T, D/2]``."""
    lo = tl.minimum(tl.min(x_lo, 1), tl.min(x_hi, 1))
    hi = tl.maximum(tl.max(x_lo, 1), tl.max(x_hi, 1))
    scale = ((hi - lo) / 15.0).to(tl.float16)
    scale = tl.where(scale == 0, 1.0, scale.to(tl.float32)).to(tl.float16)
    offset = lo.to(tl.float16)
    s32, o32 = scale.to(tl.float32)[:, None], offset.to(tl.float32)[:, None]
    c_lo = tl.clamp(tl.floor(tl.math.div_rn(x_lo - o32, s32) + 0.5), 0.0, 15.0).to(tl.uint8)
    c_hi = tl.clamp(tl.floor(tl.math.div_rn(x_hi - o32, s32) + 0.5), 0.0, 15.0).to(tl.uint8)
    return c_lo | (c_hi << 4), scale, offset


@triton.jit
def int8_codes(x_lo, x_hi):
    """Per-row symmetric INT8 of a vector given as two halves ``[T, D/2]``."""
    amax = tl.maximum(tl.max(tl.abs(x_lo), 1), tl.max(tl.abs(x_hi), 1))
    scale = (amax / 127.0).to(tl.float16)
    scale = tl.where(scale == 0, 1.0, scale.to(tl.float32)).to(tl.float16)
    s32 = scale.to(tl.float32)[:, None]
    c_lo = tl.clamp(tl.floor(tl.math.div_rn(x_lo, s32) + 0.5), -127.0, 127.0).to(tl.int8)
    c_hi = tl.clamp(tl.floor(tl.math.div_rn(x_hi, s32) + 0.5), -127.0, 127.0).to(tl.int8)
    return c_lo, c_hi, scale


@triton.jit(do_not_specialize=("R",))  # tokens x heads: one compile for any batch (Triton specialises 1 and 16k)
def _query_kernel(Q, stride_qt, stride_qh, H, Hmat, Codes, Scale, R, HALF: tl.constexpr, BLOCK_R: tl.constexpr,
                  ROTATE: tl.constexpr):
    # row r is head r % H of token r // H: a [T, H, D] view is read in place (SGLang's q is a slice of one
    # projection, whose token stride is not H * D: flattening it would copy every layer)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < R
    d = tl.arange(0, HALF)
    src = (r // H).to(tl.int64) * stride_qt + (r % H) * stride_qh
    x_lo = tl.load(Q + src[:, None] + d[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
    x_hi = tl.load(Q + src[:, None] + HALF + d[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
    if ROTATE:  # one 64x64 block (Sylvester) per program: the four-block form made this kernel L2 bound; on the
        # tensor cores in three tf32 passes (~fp32), as the store's rotation (an IEEE one made the store 1.8x slower)
        x_lo, x_hi = rotate_halves_sylvester(x_lo, x_hi, Hmat, HALF, "tf32x3")
    c_lo, c_hi, scale = int8_codes(x_lo, x_hi)
    tl.store(Codes + r[:, None] * (2 * HALF) + d[None, :], c_lo, mask=rmask[:, None])
    tl.store(Codes + r[:, None] * (2 * HALF) + HALF + d[None, :], c_hi, mask=rmask[:, None])
    tl.store(Scale + r, scale, mask=rmask)


def kv4_quantize_query(q: torch.Tensor, *, rotate: bool = True, block_r: int = 64) -> Int8Tensor:
    """Rotate and INT8-quantise queries ``[..., D]`` in one launch (``reference.quantize_query``). An extend step
    prepares tokens x heads rows per layer (64k for 2k new tokens of a 32-head model): 64 rows a program load
    the rotation block a quarter as often as 16 did (H200 rollouts, 16 rows and four blocks: 0.14 ms per layer)."""
    d = q.shape[-1]
    if q.dim() == 3 and q.stride(-1) == 1:  # [T, H, D]: read in place, whatever the token stride
        src, stride_t, stride_h, heads = q, q.stride(0), q.stride(1), q.shape[1]
    else:
        src = q.reshape(-1, d)
        src = src if src.stride(-1) == 1 else src.contiguous()
        stride_t, stride_h, heads = src.stride(0), 0, 1
    rows = q.numel() // d
    codes = torch.empty(rows, d, dtype=torch.int8, device=q.device)
    scale = torch.empty(rows, dtype=torch.float16, device=q.device)
    if rows:
        _query_kernel[(triton.cdiv(rows, block_r),)](
            src, stride_t, stride_h, heads, device_hadamard(d, q.device), codes, scale, rows,
            HALF=d // 2, BLOCK_R=block_r, ROTATE=rotate)
    return Int8Tensor(codes.view(q.shape), scale.view(q.shape[:-1]))
