"""A tiny randomly initialised Qwen3 checkpoint, written to disk in the Hugging Face layout.

Tests and demos need a real model directory (config, safetensors weights, tokenizer, chat
template) that loads through the same code paths as a production Qwen3 checkpoint, but builds
offline in well under a second. ``head_dim`` defaults to 128 because that is what the KV4 kernels
are written for (Qwen3's head size), even though ``hidden_size`` is tiny.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

from kvstreams_sglang.checkpoints.byte_tokenizer import ENDOFTEXT, IM_END, build_byte_tokenizer

VOCAB_MULTIPLE = 64  # embedding rows padded like real checkpoints; ids past the tokenizer are never produced


def build_tiny_model(
    path: str | Path,
    *,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 128,
    vocab: str = "bytes",
    corpus: Iterable[str] | None = None,
    vocab_size: int = 1024,
    seed: int = 0,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 32768,
    rope_theta: float = 1e6,
    dtype: torch.dtype = torch.float32,
    vocab_rows: int | None = None,
    device: str | torch.device = "cpu",
    keep_tokenizer: bool = False,
) -> Path:
    """Write a random Qwen3ForCausalLM plus byte tokenizer to ``path`` and return it.

    ``vocab``: ``"bytes"`` (one token per byte) or ``"bpe"`` (byte-level BPE merges learnt on
    ``corpus``, ``vocab_size`` tokens). Weights depend only on ``seed`` and the shapes; the
    caller's global RNG state is left untouched. ``vocab_rows``: embedding rows (default: the
    tokenizer's size rounded up to 64; a real model's count, e.g. 151936, for benchmarks that must
    pay its LM head; ids past the tokenizer are then never text). ``device``: where the weights
    are initialised (a GPU builds a 4B-parameter model in seconds). ``keep_tokenizer``: the
    tokenizer already in ``path`` is the model's (learnt on another machine, whose records in its
    ids come with it); nothing is learnt and its files are left as they are.
    """
    if vocab not in ("bytes", "bpe"):
        raise ValueError(f"unsupported vocab {vocab!r}; offline: 'bytes' or 'bpe' (learnt on a corpus)")
    if keep_tokenizer and corpus is not None:
        raise ValueError("keep_tokenizer: the tokenizer in path is kept, there is no corpus to learn one on")
    if not keep_tokenizer and (vocab == "bpe") != (corpus is not None):
        raise ValueError("vocab='bpe' needs a corpus to learn its merges on, and only it takes one")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)

    if keep_tokenizer:
        from transformers import PreTrainedTokenizerFast

        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"keep_tokenizer: {path} has no tokenizer.json")
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path))
    elif corpus is not None:
        tokenizer = build_byte_tokenizer(path, corpus=corpus, vocab_size=vocab_size)
    else:
        tokenizer = build_byte_tokenizer(path)
    vocab_size = vocab_rows or -(-len(tokenizer) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    if vocab_size < len(tokenizer):
        raise ValueError(f"vocab_rows={vocab_rows} is smaller than the tokenizer ({len(tokenizer)} tokens)")
    # Qwen convention: <|endoftext|> doubles as bos and pad; chat turns end with <|im_end|>.
    endoftext_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    im_end_id = tokenizer.convert_tokens_to_ids(IM_END)

    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 3 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        rope_theta=rope_theta,
        tie_word_embeddings=True,
        bos_token_id=endoftext_id,
        eos_token_id=im_end_id,
        pad_token_id=endoftext_id,
        dtype=dtype,
    )
    device = torch.device(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        with device:
            model = Qwen3ForCausalLM(config).to(dtype)
    model.generation_config = GenerationConfig(
        bos_token_id=endoftext_id,
        eos_token_id=im_end_id,
        pad_token_id=endoftext_id,
        max_new_tokens=64,
    )
    model.save_pretrained(path)
    del model
    return path


@dataclass(frozen=True)
class ModelShape:
    """A Qwen3 architecture's sizes, as ``build_tiny_model`` takes them."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_rows: int
    max_position_embeddings: int = 40960

    def kwargs(self) -> dict:
        return dict(num_layers=self.num_layers, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                    num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                    vocab_rows=self.vocab_rows, max_position_embeddings=self.max_position_embeddings)

    def kv_bytes_per_token(self, bytes_per_element: float = 2.0) -> float:
        """K and V of one token over all layers (bf16: 2 bytes per element)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_element


# The benchmarks' model: Qwen3-4B's shape (36 layers, GQA 32/8, head_dim 128, 151936 embedding rows).
QWEN3_4B = ModelShape(num_layers=36, hidden_size=2560, intermediate_size=9728, num_heads=32, num_kv_heads=8,
                      head_dim=128, vocab_rows=151936)
