"""The KV4-RL cache format: INT4 bulk storage, INT8 side cache, Hadamard-rotated keys.

Public API (tests and outside tools rely on these names): ``hadamard``,
``quantize_int4``/``dequantize_int4`` (``Int4Tensor``), ``quantize_int8``/``dequantize_int8``
(``Int8Tensor``); the per-layer layout is ``KV4LayerCache`` and the
region rule ``protected_mask``. The one-sequence decode over this format is
``kvstreams_sglang.kernels.single_decode`` (kernels sit a layer above the format).
"""

from .cache import KV4LayerCache, int4_bytes_per_vector, int8_bytes_per_vector, side_slot, side_width
from .hadamard import hadamard, hadamard_matrix
from .quant import Int4Tensor, Int8Tensor, dequantize_int4, dequantize_int8, quantize_int4, quantize_int8
from .regions import protected_mask, split_regions

__all__ = [
    "Int4Tensor", "Int8Tensor", "KV4LayerCache", "dequantize_int4", "dequantize_int8", "hadamard",
    "hadamard_matrix", "int4_bytes_per_vector", "int8_bytes_per_vector", "protected_mask", "quantize_int4",
    "quantize_int8", "side_slot", "side_width", "split_regions",
]
