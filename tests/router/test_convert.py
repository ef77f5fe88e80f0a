"""P/D message shaping, without processes."""

from __future__ import annotations

from splitserve.router import convert


def test_prefill_body_asks_p_to_hold_kv_only_when_a_decode_follows():
    p = convert.prefill_body({"prompt": "hi", "max_tokens": 8, "stream": True}, chat=False)
    assert p["kv_transfer_params"] == {"do_remote_decode": True}
    assert (p["max_tokens"], p["stream"], p["return_token_ids"]) == (1, False, True)
    one = convert.prefill_body({"prompt": "hi", "max_tokens": 1,
                                "kv_transfer_params": {"do_remote_decode": True}}, chat=False)
    assert "kv_transfer_params" not in one  # t0 is the whole answer: nothing to hand over
    chat = convert.prefill_body({"messages": [], "max_completion_tokens": 1}, chat=True)
    assert "kv_transfer_params" not in chat and "max_completion_tokens" not in chat
    assert "kv_transfer_params" in convert.prefill_body({"prompt": "hi"}, chat=False)  # 16


T0 = {"prompt_token_ids": [5, 6, 7], "token_ids": [9], "text": " old", "finish_reason": "length",
      "stop_reason": None, "logprobs": None, "kv_transfer_params": {"do_remote_prefill": True},
      "cached_tokens": 0}


def test_decode_body_marks_t0_as_prior_output_and_keeps_the_client_limits():
    body = {"prompt": "hi", "max_tokens": 8, "min_tokens": 3, "presence_penalty": 1.0}
    d = convert.decode_body(body, chat=False, t0=T0, stream=True)
    assert d["prompt"] == [5, 6, 7, 9] and d["num_prior_output_tokens"] == 1
    assert (d["max_tokens"], d["min_tokens"], d["presence_penalty"]) == (8, 3, 1.0)
    assert d["kv_transfer_params"] == {"do_remote_prefill": True}
    chat = convert.decode_body({"messages": [], "max_completion_tokens": 4}, chat=True, t0=T0,
                               stream=False)
    assert chat["max_tokens"] == 4 and "min_tokens" not in chat
    unbounded = convert.decode_body({"messages": []}, chat=True, t0=T0, stream=False)
    assert unbounded["max_tokens"] is None  # D's default: the context left after the prompt


def test_t0_text_holds_back_what_may_begin_a_stop_string():
    assert convert.t0_text_now({"prompt": "x"}, T0) == " old"
    assert convert.t0_text_now({"stop": "ld t"}, T0) == " o"
    assert convert.t0_text_now({"stop": ["zz", "d!"]}, T0) == " ol"
    assert convert.t0_text_now({"stop": "ld t", "include_stop_str_in_output": True}, T0) == " old"


def test_full_response_counts_usage_from_the_decode_instance():
    rest = {"choices": [{"text": "ld x", "token_ids": [10], "finish_reason": "length",
                         "stop_reason": None, "logprobs": None}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2}}
    out = convert.full_response({"prompt": "x", "stop": "ld t"}, False, "r", "m", T0, rest)
    assert out["choices"][0]["text"] == " old x"  # " o" from t0 at once, "ld x" from D
    assert out["usage"]["prompt_tokens"] == 3 and out["usage"]["completion_tokens"] == 2
