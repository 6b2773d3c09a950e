"""Per-vector INT4 and INT8 codes: the two storage formats of the KV4-RL cache.

A *vector* is one token-head row of ``head_dim`` (128) elements; every scale is computed
online from that row alone, so nothing needs calibration and a row can be written the
moment its token is computed.

INT4 (bulk of the cache): asymmetric affine ``x ~ scale * c + offset`` with codes
``c in 0..15``, fp16 scale and offset: ``(128*4 + 2*16) / 128 = 4.25`` bits per element.
Codes are packed two per byte in *split-half* order: byte ``j`` holds element ``j`` in its
low nibble and element ``j + D/2`` in its high nibble. A kernel then unpacks a tile with
one mask and one shift into the two contiguous halves of the vector, and the QK dot
becomes two half-width dots instead of an interleave.

INT8 (sink and recent positions): symmetric ``x ~ scale * c`` with ``c in -127..127`` and
an fp16 scale.

Codes are computed from the *fp16-rounded* scale and offset, so dequantisation uses
exactly the numbers the codes were fitted to; rounding is ``floor(v + 0.5)`` here and in
every kernel, so a kernel and this reference produce the same codes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT4_MAX = 15
INT8_MAX = 127


@dataclass(frozen=True)
class Int4Tensor:
    """INT4 codes of ``[..., D]`` vectors: ``codes [..., D/2] uint8``, ``scale, offset [...] fp16``."""

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.codes.shape[:-1], 2 * self.codes.shape[-1]))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.offset))

    @property
    def bits_per_element(self) -> float:
        return 8 * self.nbytes / self.shape.numel()

    def unpack_codes(self) -> torch.Tensor:
        """Codes as ``[..., D]`` uint8 in element order."""
        return torch.cat((self.codes & 0xF, self.codes >> 4), dim=-1)


@dataclass(frozen=True)
class Int8Tensor:
    """INT8 codes of ``[..., D]`` vectors: ``codes [..., D] int8``, ``scale [...] fp16``."""

    codes: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale))

    @property
    def bits_per_element(self) -> float:
        return 8 * self.nbytes / self.shape.numel()


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """``[..., D]`` codes in 0..15 -> ``[..., D/2]`` bytes, split-half order."""
    d = codes.shape[-1]
    if d % 2:
        raise ValueError(f"pack_int4: last dimension must be even, got {d}")
    codes = codes.to(torch.uint8)
    return codes[..., : d // 2] | (codes[..., d // 2 :] << 4)


def quantize_int4(x: torch.Tensor) -> Int4Tensor:
    """Asymmetric per-vector INT4 over the last dimension (min/max fitted online)."""
    xf = x.to(_compute_dtype(x))
    lo, hi = xf.amin(dim=-1), xf.amax(dim=-1)
    scale = ((hi - lo) / INT4_MAX).to(torch.float16)
    # A constant vector has zero range: any nonzero scale then gives all-zero codes.
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    offset = lo.to(torch.float16)
    c = torch.floor((xf - offset.to(xf.dtype)[..., None]) / scale.to(xf.dtype)[..., None] + 0.5)
    codes = c.clamp(0, INT4_MAX).to(torch.uint8)
    return Int4Tensor(pack_int4(codes), scale, offset)


def dequantize_int4(t: Int4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return t.unpack_codes().to(dtype) * t.scale.to(dtype)[..., None] + t.offset.to(dtype)[..., None]


def quantize_int8(x: torch.Tensor) -> Int8Tensor:
    """Symmetric per-vector INT8 over the last dimension."""
    xf = x.to(_compute_dtype(x))
    scale = (xf.abs().amax(dim=-1) / INT8_MAX).to(torch.float16)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    c = torch.floor(xf / scale.to(xf.dtype)[..., None] + 0.5)
    return Int8Tensor(c.clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale)


def dequantize_int8(t: Int8Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return t.codes.to(dtype) * t.scale.to(dtype)[..., None]
