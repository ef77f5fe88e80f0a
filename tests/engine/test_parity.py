"""Greedy output of LLM.generate equals HF transformers greedy generate, token for token (fp32)."""

from __future__ import annotations

import random

import pytest
import torch
from testutil import assert_all_blocks_free, tiny_model_dir

from splitserve import LLM, SamplingParams

PROMPT_LENS = [1, 2, 5, 15, 16, 17, 33, 64, 100, 160, 255, 301, 340]
MAX_TOKENS = [24, 3, 17, 8, 30, 1, 12, 20, 5, 16, 9, 14, 6]


def make_prompts(vocab: int, seed: int = 0, prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    return [(prefix or []) + [rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENS]


_HF_CACHE: dict[tuple, list[int]] = {}


def hf_greedy(model_dir: str, prompt: list[int], max_tokens: int) -> list[int]:
    key = (model_dir, tuple(prompt), max_tokens)
    if key not in _HF_CACHE:
        model = _hf_model(model_dir)
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
        _HF_CACHE[key] = out[0, len(prompt):].tolist()
    return _HF_CACHE[key]


_MODELS: dict[str, object] = {}


def _hf_model(model_dir: str):
    if model_dir not in _MODELS:
        from transformers import AutoModelForCausalLM

        _MODELS[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return _MODELS[model_dir]


def check_parity(llm: LLM, model_dir: str, prompts: list[list[int]]) -> None:
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS[i % len(MAX_TOKENS)],
                             ignore_eos=True) for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out, sp in zip(prompts, outs, params, strict=True):
        got = out.outputs[0].token_ids
        assert len(got) == sp.max_tokens
        assert got == hf_greedy(model_dir, prompt, sp.max_tokens), f"prompt len {len(prompt)}"
    assert_all_blocks_free(llm.stats())


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_parity_with_hf(arch):
    model_dir = tiny_model_dir(arch, "float32")
    llm = LLM(model=model_dir, kv_cache_memory="32MiB", max_model_len=512)
    check_parity(llm, model_dir, make_prompts(llm.engine.arch.vocab_size))


def test_parity_llama3_rope_scaling():
    model_dir = tiny_model_dir("llama", "float32", rope_scaling="llama3")
    llm = LLM(model=model_dir, kv_cache_memory="32MiB", max_model_len=512)
    check_parity(llm, model_dir, make_prompts(llm.engine.arch.vocab_size, seed=3))


def test_parity_with_prefix_caching_and_shared_prefixes(llama_fp32):
    llm = LLM(model=llama_fp32, kv_cache_memory="32MiB", max_model_len=512,
              enable_prefix_caching=True)
    vocab = llm.engine.arch.vocab_size
    shared = [random.Random(9).randrange(3, vocab) for _ in range(70)]
    prompts = make_prompts(vocab, seed=1, prefix=shared)[:-2]  # keep within max_model_len
    check_parity(llm, llama_fp32, prompts[:6])  # first round fills the cache
    queries_before = llm.stats()["prefix_cache_hits"]
    check_parity(llm, llama_fp32, prompts)  # every prompt hits the shared prefix
    assert llm.stats()["prefix_cache_hits"] - queries_before >= 64 * len(prompts)


def test_parity_with_chunked_prefill(llama_fp32):
    llm = LLM(model=llama_fp32, kv_cache_memory="32MiB", max_model_len=512,
              max_num_batched_tokens=40, enable_prefix_caching=False)
    check_parity(llm, llama_fp32, make_prompts(llm.engine.arch.vocab_size))


def test_parity_under_preemption(llama_fp32):
    # 24 blocks x 16 = 384 tokens for 13 sequences of up to 364 tokens: preemption is certain.
    llm = LLM(model=llama_fp32, num_blocks=24, max_model_len=384, max_num_batched_tokens=256)
    check_parity(llm, llama_fp32, make_prompts(llm.engine.arch.vocab_size, seed=2)[:-1]
                 + [[5] * 300])
    assert llm.stats()["num_preemptions"] > 0
