"""Orthonormal Walsh-Hadamard rotation of the last dimension.

KV4-RL stores keys in a Hadamard-rotated basis: the rotation spreads a few outlier
channels over all 128 channels, so the per-vector INT4 range is set by typical values
rather than by one spike. Queries get the same rotation, and since ``H`` is orthonormal
and symmetric, ``(qH)(kH)^T = q k^T``: attention scores are unchanged.
"""

from __future__ import annotations

import functools
import math

import torch


def _check_power_of_two(n: int) -> None:
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard: last dimension must be a power of two, got {n}")


@functools.lru_cache(maxsize=16)
def _hadamard_matrix_f64(n: int) -> torch.Tensor:
    """Sylvester construction ``H_{2n} = [[H, H], [H, -H]]``, scaled by ``1/sqrt(n)``."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def hadamard_matrix(n: int, *, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """The normalised Sylvester Hadamard matrix ``[n, n]`` (symmetric, ``H @ H = I``)."""
    _check_power_of_two(n)
    return _hadamard_matrix_f64(n).to(dtype=dtype, device=device)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Rotate the last dimension of ``x`` by the normalised Hadamard matrix.

    One GEMM with the matrix in ``x``'s dtype (as the kernels do it; one pass beats
    log2(n) butterfly passes of small ops), so a float64 input is rotated to float64
    precision.
    """
    n = x.shape[-1]
    _check_power_of_two(n)
    return x @ hadamard_matrix(n, dtype=x.dtype, device=x.device)
