"""Checkpoints built offline: a byte-level (or BPE) tokenizer and small random Qwen3 models.

No pretrained weights can be downloaded where this project is tested, so tests, demos and
benchmarks build their models here from a config (``build_tiny_model``); real checkpoints load
from a local path everywhere a model path is taken. Depends on nothing else of the project.
"""

from .byte_tokenizer import build_byte_tokenizer
from .tiny_model import QWEN3_4B, ModelShape, build_tiny_model

__all__ = ["QWEN3_4B", "ModelShape", "build_byte_tokenizer", "build_tiny_model"]
