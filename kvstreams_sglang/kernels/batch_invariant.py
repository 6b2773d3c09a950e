"""Batch-invariant matmul: a row's result does not depend on how many other rows share the call.

Why: the sampler computes a token's hidden states in a decode step of a few rows, the trainer in
one forward of the whole stream. cuBLAS picks a different kernel (tile shape, split-K, GEMV) for
each problem size, so the same row is summed in a different order, rounds differently to bf16,
and the difference compounds over the layers: on the GPU this, not attention, is most of the bf16
train/infer logprob gap (bench/results/trainer_parity_probe_h200.json: switching attention to
fp32, or cuBLAS's reduced-precision split-K off, leaves it unchanged).

``batch_invariant()`` replaces ``aten::mm`` and ``aten::addmm`` for one device type with a Triton
matmul of one fixed configuration (tile sizes, K order, no split-K): every output row is a
function of its input row and the weight only. Dtypes other than bf16/fp16 (the fp32 LM head)
go to the original kernel. Autograd is untouched: backward's matmuls run through the same
override. The kernel is the same on CPU under Triton's interpreter (tests register it for
``"CPU"``).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import triton
import triton.language as tl

# One configuration for every shape: invariance needs the K loop and the MMA instruction
# sequence to be the same whatever M is.
BLOCK_M, BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES = 64, 64, 64, 4, 3
SUPPORTED = (torch.bfloat16, torch.float16)
ROW_BLOCK = 1024


@triton.jit
def invariant_dot(a, b, EMULATE: tl.constexpr):
    """``a [M, K] @ b [K, N]`` in fp32. On the GPU the MMA gives every output element the same
    summation whatever its row; under Triton's interpreter ``tl.dot`` is numpy's BLAS, whose edge
    kernels sum some rows in another order (and which mis-multiplies bf16), so there the product is
    a broadcast multiply and a per-row reduction in fp32."""
    if EMULATE:
        return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], 1)
    else:
        return tl.dot(a, b)


@triton.jit(do_not_specialize=("M",))  # the batch's tokens: one compile for any (Triton specialises 1, 16k)
def _matmul_kernel(A, B, C, Bias, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                   HAS_BIAS: tl.constexpr, EMULATE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        a = tl.load(A + rm[:, None] * stride_am + kk[None, :] * stride_ak, mask=(rm[:, None] < M) & (kk[None, :] < K),
                    other=0.0)
        b = tl.load(B + kk[:, None] * stride_bk + rn[None, :] * stride_bn, mask=(kk[:, None] < K) & (rn[None, :] < N),
                    other=0.0)
        acc += invariant_dot(a, b, EMULATE)
    if HAS_BIAS:
        acc += tl.load(Bias + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(C + rm[:, None] * stride_cm + rn[None, :] * stride_cn, acc.to(C.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _row_mean_kernel(X, Y, N, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.float32)
    for n0 in range(0, N, BLOCK):
        n = n0 + tl.arange(0, BLOCK)
        acc += tl.load(X + row * stride_x + n, mask=n < N, other=0.0).to(tl.float32)
    tl.store(Y + row, (tl.sum(acc, 0) / N).to(Y.dtype.element_ty))


def row_mean(x: torch.Tensor) -> torch.Tensor:
    """Mean over the last dim of a last-dim-contiguous ``x``, one program per row in a fixed order:
    the reduction the RMSNorms run, whose torch kernel otherwise changes its split with the row count."""
    if x.stride(-1) != 1:
        raise ValueError("row_mean: the last dim must be contiguous")
    rows = x.reshape(-1, x.shape[-1])
    out = torch.empty(rows.shape[0], dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        with launch_guard():
            _row_mean_kernel[(rows.shape[0],)](rows, out, rows.shape[1], rows.stride(0), BLOCK=ROW_BLOCK)
    return out.view(x.shape[:-1])


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a [M, K] @ b [K, N] (+ bias [N])`` in fp32 accumulation, rounded once to ``a``'s dtype."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul: shapes {tuple(a.shape)} @ {tuple(b.shape)} do not chain")
    if a.dtype != b.dtype or a.dtype not in SUPPORTED:
        raise ValueError(f"matmul: needs two bf16/fp16 operands, got {a.dtype} and {b.dtype}")
    m, k = a.shape
    n = b.shape[1]
    c = torch.empty(m, n, dtype=a.dtype, device=a.device)
    if m == 0 or n == 0:
        return c
    if k == 0:
        return c.zero_() if bias is None else c.copy_(bias.expand(m, n))
    if bias is not None:
        bias = bias.contiguous()
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    with launch_guard():
        _matmul_kernel[grid](a, b, c, bias if bias is not None else c, m, n, k, a.stride(0), a.stride(1),
                             b.stride(0), b.stride(1), c.stride(0), c.stride(1), HAS_BIAS=bias is not None,
                             EMULATE=interpreted(), BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K, num_warps=NUM_WARPS,
                             num_stages=NUM_STAGES)
    return c


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_interpreter_lock = threading.Lock()


def launch_guard() -> contextlib.AbstractContextManager:
    """Triton's interpreter keeps the running grid in global state: two threads launching at once (the
    engine's and the trainer's forward in the async loop on CPU) corrupt each other. Compiled launches
    need no lock."""
    return _interpreter_lock if interpreted() else contextlib.nullcontext()


class _Override:
    """The registered ``aten`` kernels for one device type, reference-counted across nested uses."""

    def __init__(self, device_type: str):
        self.device_type, self.users, self.lib = device_type, 0, None
        self.original = {}

    def _mm(self, keyset, a, b):
        if a.dtype in SUPPORTED and b.dtype == a.dtype:
            return matmul(a, b)
        return self.original["mm"].call_boxed(keyset, a, b)

    def _addmm(self, keyset, bias, a, b, *, beta=1, alpha=1):
        if a.dtype in SUPPORTED and b.dtype == a.dtype and bias.dtype == a.dtype and beta == 1 and alpha == 1 \
                and bias.dim() == 1:
            return matmul(a, b, bias)
        return self.original["addmm"].call_boxed(keyset, bias, a, b, beta=beta, alpha=alpha)

    def _mean(self, keyset, x, dim, keepdim=False, *, dtype=None):
        if x.dtype == torch.float32 and dtype in (None, torch.float32) and x.dim() > 0 and dim is not None \
                and len(dim) == 1 and dim[0] % x.dim() == x.dim() - 1 and x.stride(-1) == 1 and x.shape[-1] > 0:
            out = row_mean(x)
            return out[..., None] if keepdim else out
        return self.original["mean.dim"].call_boxed(keyset, x, dim, keepdim, dtype=dtype)

    def acquire(self):
        if self.users == 0:
            ops = {"mm": self._mm, "addmm": self._addmm, "mean.dim": self._mean}
            self.original = {name: torch.library.get_kernel(f"aten::{name}", self.device_type) for name in ops}
            lib = torch.library.Library("aten", "IMPL")
            for name, fn in ops.items():
                lib.impl(name, fn, self.device_type, with_keyset=True)
            self.lib = lib
        self.users += 1

    def release(self):
        self.users -= 1
        if self.users == 0:
            self.lib._destroy()
            self.lib = None


_overrides: dict[str, _Override] = {}
_lock = threading.Lock()


@contextmanager
def batch_invariant(enabled: bool = True, *, device_type: str = "CUDA") -> Iterator[None]:
    """Within the block, bf16/fp16 ``mm``/``addmm`` on ``device_type`` run the batch-invariant
    kernel (process-wide: other threads' matmuls on that device too). ``enabled=False`` is a no-op,
    so call sites can pass a config flag."""
    if not enabled:
        yield
        return
    with _lock:
        override = _overrides.setdefault(device_type, _Override(device_type))
        override.acquire()
    try:
        yield
    finally:
        with _lock:
            override.release()
