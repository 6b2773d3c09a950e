"""Triton kernels of the KV4-RL cache (page size 1): store, decode, extend.

Each file holds one kernel family and its launcher; the torch reference of every kernel
is in ``kvstreams_sglang.kv4.reference``. Without a CUDA device the kernels run under
Triton's interpreter (``TRITON_INTERPRET=1``, set here before any kernel is defined), so
the same code is tested on CPU at small sizes.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from .bf16_decode import bf16_decode
from .decode import DecodePlan, KV4DecodeWorkspace, TritonDecodeVariant, kv4_decode, plan_decode
from .decode_cuda import CudaDecodeVariant
from .extend import kv4_extend
from .quantize import kv4_quantize_query
from .single_decode import single_decode
from .store import kv4_store

__all__ = ["CudaDecodeVariant", "DecodePlan", "KV4DecodeWorkspace", "TritonDecodeVariant", "bf16_decode", "kv4_decode",
           "kv4_extend", "kv4_quantize_query", "kv4_store", "plan_decode", "single_decode"]
