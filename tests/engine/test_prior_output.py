"""Prior output (`num_prior_output_tokens`): a request whose last prompt tokens were generated
elsewhere continues exactly as the colocated run that generated them.

This is what a decode instance does with the t0 of a prefill instance; here both halves run on
one offline engine: "colocated" generates everything, "P" only t0 (max_tokens 1), "D" the rest
from prompt + [t0] with `num_prior_output_tokens: 1`, and the client's text is t0's deliverable
part (`deliverable_text_len`, what the router sends at once) followed by D's text.
"""

from __future__ import annotations

import msgspec
import pytest
import torch
from testutil import assert_all_blocks_free

from splitserve import LLM, SamplingParams
from splitserve.engine.output_processor import OutputProcessor, RequestOutput
from splitserve.engine.protocol import deliverable_text_len
from splitserve.engine.request import EngineCoreOutput, EngineCoreRequest, Request
from splitserve.engine.sampler import Sampler
from splitserve.engine.tokenizer import Tokenizer

PROMPT = "import os\nimport sys\n"
PENALTIES = {"presence_penalty": 1.5, "frequency_penalty": 0.7, "repetition_penalty": 1.4}


@pytest.fixture(scope="module")
def llm(llama_fp32):
    return LLM(model=llama_fp32, kv_cache_memory="32MiB", max_model_len=512, num_threads=1)


# ---------------------------------------------------------------------------- without a model
def test_deliverable_text_len_holds_only_a_possible_stop_start():
    assert deliverable_text_len(" old", [], False) == 4
    assert deliverable_text_len(" old", ["ld t"], False) == 2  # "ld" may begin "ld t"
    assert deliverable_text_len(" old", ["d t", "old!"], False) == 1  # the longest one: "old"
    assert deliverable_text_len(" old", [" old!"], False) == 0
    assert deliverable_text_len(" old", ["ld t"], True) == 4  # kept in the output anyway
    assert deliverable_text_len(" old", ["zz"], False) == 4
    assert deliverable_text_len("", ["ab"], False) == 0


def _request(ids: list[int], params: SamplingParams, num_prior: int = 0) -> Request:
    core = EngineCoreRequest(
        request_id="r",
        prompt_token_ids=ids,
        sampling_params=params,
        num_prior_output_tokens=num_prior,
    )
    return Request(core, frozenset({0}))


def test_request_with_prior_output_is_the_colocated_state():
    params = SamplingParams(
        temperature=0.8, seed=3, min_tokens=3, max_tokens=3, stop_token_ids=[5], **PENALTIES
    )
    colocated = _request([7, 8, 9], params)
    colocated.append_output_token(11)
    resumed = _request([7, 8, 9, 11], params, num_prior=1)
    for attr in ("prompt_token_ids", "output_token_ids", "all_token_ids", "num_tokens"):
        assert getattr(resumed, attr) == getattr(colocated, attr), attr
    sampler = Sampler(vocab_size=16)
    logits = torch.randn(1, 16, generator=torch.Generator().manual_seed(0))
    logits[0, 11] = logits[0, 5] = 10.0  # t0 and the stop token would win unpenalized/unmasked
    a = sampler._apply_penalties(logits.clone(), [colocated])
    b = sampler._apply_penalties(logits.clone(), [resumed])
    assert torch.equal(a, b)
    assert sampler(logits.clone(), [colocated]) == sampler(logits.clone(), [resumed])
    # What D did before: t0 as a prompt token. Presence/frequency spare it: the logits differ.
    as_prompt = _request([7, 8, 9, 11], msgspec.structs.replace(params, max_tokens=2, min_tokens=2))
    assert not torch.equal(sampler._apply_penalties(logits.clone(), [as_prompt]), a)
    # max_tokens counts t0: two more tokens (3 output tokens) and the request is done.
    for r in (colocated, resumed):
        r.append_output_token(12)
        assert not r.check_stop(512)
        r.append_output_token(13)
        assert r.check_stop(512) and r.status.finish_reason == "length"


@pytest.mark.parametrize(("num_prior", "max_tokens"), [(3, 8), (4, 8), (2, 2), (-1, 8)])
def test_bad_prior_output_is_refused(llm, num_prior, max_tokens):
    with pytest.raises(ValueError, match="num_prior_output_tokens"):
        _request([1, 2, 3], SamplingParams(max_tokens=max_tokens), num_prior)
    prompts = [
        {"prompt_token_ids": [4, 5, 6]},
        {"prompt_token_ids": [1, 2, 3], "num_prior_output_tokens": num_prior},
    ]
    with pytest.raises(ValueError, match="num_prior_output_tokens"):
        llm.generate(prompts, SamplingParams(max_tokens=max_tokens), use_tqdm=False)
    assert_all_blocks_free(llm.stats())  # nothing was queued, not even the good prompt


def test_detokenizer_primed_with_a_split_character(llama_fp32):
    """t0 is the first byte of a 3-byte character: P shows nothing of it, D's text completes it."""
    tok = Tokenizer(llama_fp32)
    ids = tok.encode("日本語", add_special_tokens=False)
    assert tok.decode(ids[:1]) == "\ufffd" and len(ids) > 2
    params = SamplingParams(max_tokens=len(ids))
    colocated, resumed = OutputProcessor(tok), OutputProcessor(tok)
    colocated.add_request("c", None, [1], params)
    resumed.add_request("d", None, [1, ids[0]], params, num_prior_output_tokens=1)
    outs = [_feed(colocated, "c", t, i == len(ids) - 1) for i, t in enumerate(ids)]
    t0_text = outs[0].outputs[0].text
    rest = [_feed(resumed, "d", t, i == len(ids) - 1) for i, t in enumerate(ids) if i]
    assert t0_text == "" and outs[-1].outputs[0].text == "日本語"
    assert "".join(o.new_text for o in rest) == rest[-1].outputs[0].text == "日本語"
    assert rest[-1].outputs[0].token_ids == ids[1:]
    assert rest[-1].num_output_tokens == outs[-1].num_output_tokens == len(ids)
    assert rest[-1].prompt_token_ids == [1] and rest[-1].prior_output_token_ids == ids[:1]


def _feed(processor: OutputProcessor, rid: str, token: int, last: bool) -> RequestOutput:
    out = EngineCoreOutput(
        request_id=rid, new_token_ids=[token], finish_reason="length" if last else None
    )
    return processor.process_outputs([out])[0][0]


# ---------------------------------------------------------------------------- on the engine
def _split_run(
    llm: LLM, prompt_ids: list[int], params: SamplingParams
) -> tuple[RequestOutput, RequestOutput, RequestOutput | None]:
    """(colocated, P's t0, D's continuation or None when t0 ended the request)."""
    colocated = llm.generate({"prompt_token_ids": prompt_ids}, params, use_tqdm=False)[0]
    p_params = msgspec.structs.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
    p = llm.generate({"prompt_token_ids": prompt_ids}, p_params, use_tqdm=False)[0]
    if p.outputs[0].finish_reason == "stop" or params.max_tokens == 1:
        return colocated, p, None
    resumed = {
        "prompt_token_ids": prompt_ids + p.outputs[0].token_ids,
        "num_prior_output_tokens": len(p.outputs[0].token_ids),
    }
    d = llm.generate(resumed, params, use_tqdm=False)[0]
    return colocated, p, d


def _assert_same_as_colocated(llm: LLM, prompt_ids: list[int], params: SamplingParams) -> None:
    colocated, p, d = _split_run(llm, prompt_ids, params)
    c, t0 = colocated.outputs[0], p.outputs[0]
    assert d is not None, "the case must reach the decode half"
    assert t0.token_ids + d.outputs[0].token_ids == c.token_ids
    shown = t0.text[: deliverable_text_len(t0.text, params.stop, params.include_stop_str_in_output)]
    assert shown + d.outputs[0].text == c.text
    assert (d.outputs[0].finish_reason, d.outputs[0].stop_reason) == (
        c.finish_reason,
        c.stop_reason,
    )
    assert d.prompt_token_ids == prompt_ids
    assert d.num_output_tokens == colocated.num_output_tokens == len(c.token_ids)
    if params.logprobs is not None:
        split = [lp.sampled.logprob for lp in t0.logprobs + d.outputs[0].logprobs]
        assert split == pytest.approx([lp.sampled.logprob for lp in c.logprobs], abs=1e-4)
        assert [[x.token_id for x in lp.top] for lp in d.outputs[0].logprobs] == [
            [x.token_id for x in lp.top] for lp in c.logprobs[1:]
        ]
    assert_all_blocks_free(llm.stats())


@pytest.mark.parametrize(
    ("prompt", "params"),
    [
        (
            "def main():",
            SamplingParams(
                temperature=0,
                max_tokens=16,
                presence_penalty=-2.0,
                frequency_penalty=-2.0,
                repetition_penalty=1.1,
                logprobs=3,
            ),
        ),
        (
            PROMPT,
            SamplingParams(
                temperature=0.9,
                top_p=0.95,
                seed=7,
                max_tokens=16,
                presence_penalty=1.0,
                frequency_penalty=1.0,
                repetition_penalty=1.1,
            ),
        ),
        (
            "x = 1",
            SamplingParams(
                temperature=0.8,
                seed=5,
                max_tokens=16,
                presence_penalty=-2.0,
                frequency_penalty=-1.0,
                logprobs=0,
            ),
        ),
    ],
    ids=["greedy", "seeded", "seeded-logprobs"],
)
def test_penalized_continuation_equals_colocated(llm, prompt, params):
    ids = llm.tokenizer.encode(prompt)
    _assert_same_as_colocated(llm, ids, params)
    # The case is one where counting t0 as a prompt token (what D did before) changes the text.
    colocated = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0]
    t0_as_prompt = {"prompt_token_ids": ids + colocated.token_ids[:1]}
    before = llm.generate(
        t0_as_prompt, msgspec.structs.replace(params, max_tokens=15), use_tqdm=False
    )[0].outputs[0]
    assert before.token_ids != colocated.token_ids[1:]


def test_min_tokens_continuation_equals_colocated(llm):
    ids = llm.tokenizer.encode(PROMPT)
    plain = (
        llm.generate(
            {"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False
        )[0]
        .outputs[0]
        .token_ids
    )
    # t1 as a stop token: min_tokens 3 masks it at t1 (1 output token so far, t0).
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=3, stop_token_ids=[plain[1]])
    colocated = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0]
    assert colocated.token_ids[1] != plain[1]  # the mask changed the continuation
    _assert_same_as_colocated(llm, ids, params)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_t0_and_t1(llm, include):
    ids = llm.tokenizer.encode(PROMPT)
    greedy = SamplingParams(temperature=0, max_tokens=8)
    full = llm.generate({"prompt_token_ids": ids}, greedy, use_tqdm=False)[0].outputs[0].text
    t0 = (
        llm.generate(
            {"prompt_token_ids": ids}, msgspec.structs.replace(greedy, max_tokens=1), use_tqdm=False
        )[0]
        .outputs[0]
        .text
    )
    stop = full[len(t0) - 2 : len(t0) + 2]
    assert len(t0) >= 2 and len(stop) == 4 and full.index(stop) == len(t0) - 2
    params = msgspec.structs.replace(
        greedy, stop=[stop], include_stop_str_in_output=include, logprobs=1
    )
    colocated = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0]
    assert colocated.finish_reason == "stop" and colocated.stop_reason == stop
    _assert_same_as_colocated(llm, ids, params)
