"""HF tokenizer (tokenizer.json via `tokenizers`), chat template, incremental detokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream


class Tokenizer:
    """The model directory's tokenizer; loads without `transformers` so the front end starts fast."""

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"model directory {str(model_dir)!r} has no tokenizer.json")
        self._tok = HFTokenizer.from_file(str(path))
        cfg_path = model_dir / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.chat_template: str | None = self.config.get("chat_template")
        self.eos_token = _token_str(self.config.get("eos_token"))
        self.bos_token = _token_str(self.config.get("bos_token"))
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template (tokenizer_config.json "
                             "chat_template); use /v1/completions")
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise ValueError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except TemplateError as err:
            raise ValueError(f"chat template failed: {err}") from None


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<|endoftext|>", ...}
        return value.get("content")
    return value


class IncrementalDetokenizer:
    """Text of a growing token list, emitted in pieces that never split a character.

    Decoding token by token breaks multi-byte characters that span tokens, and decoding the whole
    list every step is quadratic. `tokenizers`' DecodeStream keeps the short window vLLM's
    detokenizer keeps (decode the tokens since the last emitted piece, hold back text ending in
    U+FFFD, an incomplete character) in Rust, and remembers the window's text instead of decoding
    it again each step: 2.4-2.6 µs per token here against 5.4-5.8 for the same window in Python.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer._tok
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.text = ""

    def push(self, new_token_ids: list[int]) -> str:
        """Add tokens; return the text they completed."""
        start = len(self.text)
        for token in new_token_ids:
            piece = self._stream.step(self._tok, token)
            if piece:
                self.text += piece
        return self.text[start:]
