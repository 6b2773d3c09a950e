"""Offline fixtures: a byte-level tokenizer and a tiny random Qwen3 checkpoint for tests and demos."""

from kvstreams_sglang.testing.byte_tokenizer import build_byte_tokenizer
from kvstreams_sglang.testing.tiny_model import build_tiny_model

__all__ = ["build_byte_tokenizer", "build_tiny_model"]
