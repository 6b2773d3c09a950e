"""Inference side of kvstreams: the KV4 INT4 cache format, its Triton kernels, KV streams
(in-place eviction), the SGLang integration and a small built-in engine.

Kept import-light on purpose: importing the package must not pull in Triton kernels or SGLang.
"""

__version__ = "0.1.0"
