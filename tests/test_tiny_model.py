"""The tiny offline Qwen3 checkpoint behaves like a real Hugging Face Qwen3 directory."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvstreams_sglang.testing import build_tiny_model

TEXTS = [
    "",
    "hello world",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n",
    "naïve café, straße, Ωμέγα, 中文字符",
    "emoji 🙂🚀👩‍👩‍👧 and flags 🇫🇷",
    "looks special but is not: <|im_start >",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trips_utf8_text_one_token_per_byte(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == list(text.encode("utf-8"))  # token id == byte value
    assert tokenizer.decode(ids) == text


def test_chat_specials_are_single_tokens_with_fixed_ids(tokenizer):
    specials = {"<|endoftext|>": 256, "<|im_start|>": 257, "<|im_end|>": 258}
    for token, expected_id in specials.items():
        assert tokenizer.encode(token, add_special_tokens=False) == [expected_id]
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"


def test_chat_template_renders_qwen_format(tokenizer):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Go north."},
    ]
    expected = "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nGo north.<|im_end|>\n"
    assert tokenizer.apply_chat_template(messages, tokenize=False) == expected
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == expected + "<|im_start|>assistant\n"


def test_model_loads_as_qwen3_with_configured_shapes(tiny_model_path, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    config = model.config
    assert config.model_type == "qwen3"
    assert config.num_hidden_layers == 2
    assert config.num_attention_heads == 4
    assert config.num_key_value_heads == 2
    assert config.head_dim == 128
    assert config.vocab_size >= len(tokenizer) and config.vocab_size % 64 == 0
    assert config.eos_token_id == tokenizer.eos_token_id
    assert config.pad_token_id == tokenizer.pad_token_id
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (2 * 128, config.hidden_size)


def test_forward_gives_finite_logits_over_the_vocab(tiny_model_path, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    input_ids = torch.tensor([tokenizer.encode("The cat sat.", add_special_tokens=False)])
    with torch.no_grad():
        logits = model(input_ids).logits
    assert logits.shape == (1, input_ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()


def test_same_seed_gives_identical_weights_and_other_seed_differs(tmp_path):
    first = load_file(build_tiny_model(tmp_path / "a", seed=7) / "model.safetensors")
    again = load_file(build_tiny_model(tmp_path / "b", seed=7) / "model.safetensors")
    other = load_file(build_tiny_model(tmp_path / "c", seed=8) / "model.safetensors")
    assert first.keys() == again.keys() == other.keys()
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_unknown_vocab_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="vocab"):
        build_tiny_model(tmp_path, vocab="qwen")
    with pytest.raises(ValueError, match="corpus"):
        build_tiny_model(tmp_path, vocab="bpe")


def test_bpe_vocab_learnt_on_a_corpus_round_trips_and_keeps_byte_and_special_ids(tmp_path):
    corpus = ["There is an exit to the west. go west", "head north, then take the coin from the floor"] * 20
    path = build_tiny_model(tmp_path, vocab="bpe", corpus=corpus, vocab_size=320)
    tok = AutoTokenizer.from_pretrained(path)
    assert 259 < len(tok) <= 320  # as many merges as the corpus supports (pairs seen twice), up to the size
    assert tok.convert_ids_to_tokens([256, 257, 258]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert tok.encode("<|im_end|>", add_special_tokens=False) == [258]
    for text in TEXTS + corpus[:2]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text  # lossless, also on text the merges never saw
    assert tok.encode("\x07", add_special_tokens=False) == [7]  # an unmerged byte is its own id
    assert len(tok.encode("go west", add_special_tokens=False)) <= 3  # vs 7 bytes
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.vocab_size >= len(tok)
