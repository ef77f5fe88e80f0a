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
