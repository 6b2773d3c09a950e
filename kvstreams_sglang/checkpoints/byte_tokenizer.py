"""A byte-level tokenizer with Qwen's chat specials, built offline for tests and demos.

Every UTF-8 string encodes losslessly (one token per byte, no merges), so tests can reason about
token counts exactly, and the chat format matches Qwen's, so code written against the tiny model
runs unchanged against a real Qwen checkpoint.

With a ``corpus``, byte-level BPE merges are learnt on it (Qwen's own tokenizer is byte-level
BPE): ids 0..255 stay the bytes and 256..258 the specials, merged tokens follow. Text still
encodes losslessly, but a word like `` west`` is one token, so a small model trained from
scratch reads and copies words instead of byte sequences, on 3-4x shorter streams.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)  # ids 256, 257, 258

QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def byte_symbols() -> list[str]:
    """The 256 printable stand-ins for bytes used by byte-level BPE (GPT-2's mapping), so that
    symbol ``i`` of the returned list stands for byte value ``i``."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    symbol_of_byte = {b: chr(b) for b in printable}
    next_free = 256
    for b in range(256):
        if b not in symbol_of_byte:
            symbol_of_byte[b] = chr(next_free)
            next_free += 1
    return [symbol_of_byte[b] for b in range(256)]


def learn_merges(corpus: Iterable[str], vocab_size: int) -> list[tuple[str, str]]:
    """Byte-level BPE merges learnt on ``corpus``, at most ``vocab_size`` - 259 of them."""
    n = vocab_size - 256 - len(SPECIAL_TOKENS)
    if n < 0:
        raise ValueError(f"vocab_size {vocab_size} is below the {256 + len(SPECIAL_TOKENS)} bytes and specials")
    if n == 0:
        return []
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(vocab_size=256 + n, min_frequency=2, show_progress=False,
                                  initial_alphabet=byte_symbols())
    backend.train_from_iterator(corpus, trainer)
    return [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
            for m in json.loads(backend.to_str())["model"]["merges"]]


def build_byte_tokenizer(path: str | Path | None = None, *, corpus: Iterable[str] | None = None,
                         vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """Build the byte tokenizer (token id == byte value, specials at 256..258; with ``corpus``,
    BPE merges learnt on it up to ``vocab_size`` tokens); save it as a Hugging Face tokenizer
    directory when ``path`` is given."""
    vocab = {symbol: byte for byte, symbol in enumerate(byte_symbols())}
    merges = learn_merges(corpus, vocab_size) if corpus is not None else []
    vocab.update({token: 256 + i for i, token in enumerate(SPECIAL_TOKENS)})
    next_id = len(vocab)
    for a, b in merges:  # a merged token's id follows the specials, in merge order
        if a + b not in vocab:
            vocab[a + b] = next_id
            next_id += 1
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START],
        clean_up_tokenization_spaces=False,
        model_max_length=32768,
    )
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    if path is not None:
        tokenizer.save_pretrained(str(path))
    return tokenizer
