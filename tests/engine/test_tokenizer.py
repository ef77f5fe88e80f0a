"""Incremental detokenizer and chat template."""

from __future__ import annotations

import random

import pytest

from splitserve.engine.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = ["def f(x):\n    return x ** 2  # square", "naïve café — 日本語のテキスト 🚀🎉 ok",
         "tabs\tand\nnewlines\r\n", "ünïcödé " * 5]


@pytest.fixture(scope="module")
def tok(llama_fp32):
    return Tokenizer(llama_fp32)


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_matches_full_decode(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    for chunking in (1, 2, 3):
        detok = IncrementalDetokenizer(tok)
        pieces = [detok.push(ids[i : i + chunking]) for i in range(0, len(ids), chunking)]
        assert "".join(pieces) == text
        assert not any("\ufffd" in p for p in pieces)


def test_random_tokens_never_lose_text(tok):
    rng = random.Random(0)
    ids = [rng.randrange(tok.vocab_size - 3) for _ in range(200)]
    detok = IncrementalDetokenizer(tok)
    text = "".join(detok.push([t]) for t in ids)
    full = tok.decode(ids)
    assert full.startswith(text) and len(full) - len(text) <= 4  # only a trailing partial char


def test_chat_template(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
