"""Test helpers (scripted episodes). Production code never imports this package; the offline
model builders it used to hold live in ``kvstreams_sglang.checkpoints`` (re-exported here for tests)."""

from kvstreams_sglang.checkpoints import build_byte_tokenizer, build_tiny_model

__all__ = ["build_byte_tokenizer", "build_tiny_model"]
