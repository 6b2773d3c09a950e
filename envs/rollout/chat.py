"""Chat rendering of an episode as token pieces, with the model's own chat template.

An episode is the first message (system prompt + first observation + the assistant
header), then turns: the assistant message the model samples (ending in its end-of-turn
token), and the environment message answering it (the newline the template puts after
``<|im_end|>``, the user message, the next assistant header). Pieces are computed as
the *difference* between template renderings, so any template (Qwen3, Llama, ...)
renders exactly as it would render the whole conversation.
"""

from __future__ import annotations

PLACEHOLDER = "\x00PLACEHOLDER\x00"


class ChatRenderer:
    """Token pieces of an episode. First message: system + first user message. Turn:
    assistant header, the sampled message and its end-of-turn token, the separator the
    template puts after it, and the user message answering it."""

    def __init__(self, tokenizer, system_prompt: str):
        self.tok = tokenizer
        self.system_prompt = system_prompt
        self.eos_ids = sorted({i for i in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>"))
                               if isinstance(i, int) and i >= 0})
        base = [{"role": "system", "content": system_prompt}, {"role": "user", "content": PLACEHOLDER},
                {"role": "assistant", "content": PLACEHOLDER}]
        prefix = self._render(base, gen=False)
        with_user = self._render(base + [{"role": "user", "content": PLACEHOLDER}], gen=False)
        with_header = self._render(base + [{"role": "user", "content": PLACEHOLDER}], gen=True)
        if not (with_user.startswith(prefix) and with_header.startswith(with_user)):
            raise ValueError("chat template renders a conversation differently from its prefix; cannot "
                             "render turns incrementally")
        tail = prefix[prefix.rindex(PLACEHOLDER) + len(PLACEHOLDER):]  # "<|im_end|>\n" for Qwen
        self._eos_text = tokenizer.convert_ids_to_tokens(self.eos_ids[0]) if self.eos_ids else ""
        self._after_eos = tail.split(self._eos_text, 1)[1] if self._eos_text and self._eos_text in tail else tail
        self._user_block = with_user[len(prefix):]
        self._header = with_header[len(with_user):]

    def _render(self, messages, *, gen: bool) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def first_message(self, observation: str) -> list[int]:
        """System prompt and first observation (the assistant header comes with the turn)."""
        return self.encode(self._render([{"role": "system", "content": self.system_prompt},
                                         {"role": "user", "content": observation}], gen=False))

    def assistant_header(self) -> list[int]:
        return self.encode(self._header)

    def after_assistant(self, *, closed: bool) -> list[int]:
        """What follows a sampled message: its end-of-turn token when the model did not write
        it (``closed=False``, stopped by the length cap), then the template's separator."""
        return self.encode(("" if closed else self._eos_text) + self._after_eos)

    def user_message(self, text: str) -> list[int]:
        return self.encode(self._user_block.replace(PLACEHOLDER, text))

    def action_text(self, token_ids: list[int]) -> str:
        return self.tok.decode([t for t in token_ids if t not in self.eos_ids], skip_special_tokens=True).strip()
