"""Sampling parameters, seeds and stop conditions through the real engine (tiny model)."""

from __future__ import annotations

import msgspec
import pytest
import torch
from testutil import assert_all_blocks_free

from splitserve import LLM, SamplingParams
from splitserve.engine.request import EngineCoreRequest, Request
from splitserve.engine.sampler import Sampler, _filter_top_k_top_p

PROMPTS = ["def main():", "import os", "class Foo(object):", "for i in range(10):",
           "# comment", "x = 1"]


@pytest.fixture(scope="module")
def llm(llama_fp32):
    return LLM(model=llama_fp32, kv_cache_memory="32MiB", max_model_len=512)


def _req(params: SamplingParams, output: list[int] | None = None) -> Request:
    r = Request(EngineCoreRequest(request_id="r", prompt_token_ids=[3, 4, 5],
                                  sampling_params=params), frozenset({0}))
    for t in output or []:
        r.append_output_token(t)
    return r


def test_seeded_sampling_same_alone_and_in_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True)] * 5
    batch = llm.generate(PROMPTS, [seeded] + others, use_tqdm=False)
    assert batch[0].outputs[0].token_ids == alone
    again = llm.generate(PROMPTS[::-1], others + [seeded], use_tqdm=False)
    assert again[-1].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=24,
                                ignore_eos=True)
    assert llm.generate(PROMPTS[0], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone
    assert_all_blocks_free(llm.stats())


def test_n_choices_are_seed_plus_j_requests(llm):
    """`n` (vLLM's shape): one RequestOutput per prompt with n outputs, index j; choice j is the
    request with `seed + j`, compared in the same batch composition (same numerics)."""
    params = SamplingParams(temperature=1.0, seed=70, max_tokens=8, ignore_eos=True)
    explicit = llm.generate(
        [p for p in PROMPTS[:2] for _ in range(3)],
        [msgspec.structs.replace(params, seed=70 + j) for _ in range(2) for j in range(3)],
        use_tqdm=False,
    )
    outs = llm.generate(PROMPTS[:2], msgspec.structs.replace(params, n=3), use_tqdm=False)
    assert len(outs) == 2
    for i, out in enumerate(outs):
        assert [c.index for c in out.outputs] == [0, 1, 2]
        assert [c.token_ids for c in out.outputs] == [
            explicit[i * 3 + j].outputs[0].token_ids for j in range(3)]
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) == 3
    with pytest.raises(ValueError, match="n > 1 cannot be combined"):
        llm.generate({"prompt_token_ids": [5, 6, 7], "num_prior_output_tokens": 1},
                     SamplingParams(n=2), use_tqdm=False)
    assert_all_blocks_free(llm.stats())


def test_top_k_1_is_greedy(llm):
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    topk1 = llm.generate(PROMPTS, SamplingParams(temperature=1.5, top_k=1, max_tokens=12),
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in topk1]


def test_top_k_top_p_min_p_filters():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]] * 3)
    reqs = [_req(SamplingParams(top_k=2)), _req(SamplingParams(top_p=0.5)),
            _req(SamplingParams(min_p=0.3))]
    out = _filter_top_k_top_p(logits, reqs)
    kept = (out > float("-inf")).tolist()
    assert kept[0] == [True, True, False, False, False]
    assert kept[1] == [True, False, False, False, False]  # p(top1) ≈ 0.64 ≥ 0.5
    assert kept[2] == [True, True, False, False, False]  # e^-1 ≈ 0.37 ≥ 0.3, e^-2 < 0.3


def test_penalties_and_min_tokens_mask():
    sampler = Sampler(vocab_size=6)
    logits = torch.tensor([[1.0, 5.0, 4.9, -1.0, 0.0, 0.0]])
    rep = _req(SamplingParams(temperature=0, repetition_penalty=2.0), output=[1])
    assert sampler(logits.clone(), [rep])[0] == [2]  # 5.0/2 < 4.9
    freq = _req(SamplingParams(temperature=0, frequency_penalty=0.2), output=[1])
    assert sampler(logits.clone(), [freq])[0] == [2]
    min_tok = _req(SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[2]), output=[])
    min_tok.eos_token_ids = frozenset({1})
    assert sampler(logits.clone(), [min_tok])[0] == [0]  # eos (1) and stop token (2) are banned


def test_logit_bias_and_allowed_token_ids():
    sampler = Sampler(vocab_size=6)
    logits = torch.tensor([[1.0, 5.0, 4.9, -1.0, 0.0, 0.0]])
    forced = _req(SamplingParams(temperature=0, logit_bias={3: 100.0}))
    assert sampler(logits.clone(), [forced])[0] == [3]
    banned = _req(SamplingParams(temperature=0, logit_bias={1: -100.0}))
    assert sampler(logits.clone(), [banned])[0] == [2]
    allowed = _req(SamplingParams(temperature=0, allowed_token_ids=[0, 3]))
    assert sampler(logits.clone(), [allowed])[0] == [0]
    both = _req(SamplingParams(temperature=0, allowed_token_ids=[0, 3], logit_bias={3: 2.5}))
    assert sampler(logits.clone(), [both])[0] == [3]  # -1 + 2.5 > 1
    sampled = _req(SamplingParams(temperature=2.0, allowed_token_ids=[4, 5]))
    assert all(sampler(logits.clone(), [sampled])[0][0] in (4, 5) for _ in range(20))
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 101.0})
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])


def test_logit_bias_reaches_the_engine(llm):
    params = SamplingParams(temperature=0.7, seed=5, max_tokens=8, ignore_eos=True,
                            allowed_token_ids=[11, 12, 13], logit_bias={13: -100.0})
    out = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0].token_ids
    assert len(out) == 8 and set(out) <= {11, 12}
    with pytest.raises(ValueError, match="out of range"):
        llm.generate(PROMPTS[0], SamplingParams(logit_bias={10**7: 1.0}), use_tqdm=False)
    assert_all_blocks_free(llm.stats())


def test_logprobs_are_raw_and_sorted(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4, logprobs=3),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 4
    for token, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.sampled.token_id == token
        assert [t.token_id for t in lp.top][0] == token  # greedy: the top-1 is the sample
        values = [t.logprob for t in lp.top]
        assert values == sorted(values, reverse=True) and values[0] <= 0
    assert out.cumulative_logprob < 0


def test_stop_token_ids_max_tokens_and_eos(llm):
    base = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=10,
                                                   ignore_eos=True), use_tqdm=False)[0]
    tokens = base.outputs[0].token_ids
    assert base.outputs[0].finish_reason == "length" and len(tokens) == 10
    stop_at = tokens[4]
    stopped = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=10,
                                                      stop_token_ids=[stop_at]),
                           use_tqdm=False)[0].outputs[0]
    first = tokens.index(stop_at)
    assert stopped.token_ids == tokens[: first + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_at
    # min_tokens keeps generating past a stop token until it is reached
    later = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=10,
                                                    min_tokens=first + 2,
                                                    stop_token_ids=[stop_at]), use_tqdm=False)
    assert len(later[0].outputs[0].token_ids) > first + 1
    assert_all_blocks_free(llm.stats())


def test_eos_ends_generation_unless_ignored(llm):
    eos = llm.tokenizer.eos_token_id
    prompt = {"prompt_token_ids": [5, 6, 7]}
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=50,
                                                ignore_eos=True), use_tqdm=False)[0]
    forced = SamplingParams(temperature=0, max_tokens=50, stop_token_ids=[])
    # Make the greedy continuation's 3rd token count as EOS by asking for it as the EOS id.
    llm.engine.eos_token_ids = frozenset({plain.outputs[0].token_ids[2]})
    try:
        out = llm.generate(prompt, forced, use_tqdm=False)[0].outputs[0]
    finally:
        llm.engine.eos_token_ids = frozenset({eos})
    assert out.finish_reason == "stop" and out.token_ids == plain.outputs[0].token_ids[:3]


def test_stop_strings_truncate_text(llm):
    full = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=20,
                                                   ignore_eos=True), use_tqdm=False)[0]
    text = full.outputs[0].text
    stop = text[5:8]
    assert stop and stop in text
    out = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=20, stop=[stop],
                                                  ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.text == text[: text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=20, stop=[stop],
                                                   include_stop_str_in_output=True,
                                                   ignore_eos=True), use_tqdm=False)[0]
    assert kept.outputs[0].text == text[: text.index(stop) + len(stop)]
    assert_all_blocks_free(llm.stats())
