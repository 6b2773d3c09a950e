"""A byte-level tokenizer with Qwen's chat specials, built offline for tests and demos.

Every UTF-8 string encodes losslessly (one token per byte, no merges), so tests can reason about
token counts exactly, and the chat format matches Qwen's, so code written against the tiny model
runs unchanged against a real Qwen checkpoint.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
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


def build_byte_tokenizer(path: str | Path | None = None) -> PreTrainedTokenizerFast:
    """Build the byte tokenizer (token id == byte value, specials at 256..258); save it as a
    Hugging Face tokenizer directory when ``path`` is given."""
    vocab = {symbol: byte for byte, symbol in enumerate(byte_symbols())}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
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
