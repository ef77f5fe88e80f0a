"""Scheduler + KVCacheManager without a model: the "model" samples a fixed token."""

from __future__ import annotations

from splitserve.engine.config import SchedulerConfig
from splitserve.engine.kv_cache_manager import KVCacheManager
from splitserve.engine.request import EngineCoreRequest, Request, RequestStatus, SamplingParams
from splitserve.engine.scheduler import ModelRunnerOutput, Scheduler
from splitserve.kv_connector.base import EngineInfo, KVConnectorRole
from splitserve.kv_connector.config import KVTransferConfig
from splitserve.kv_connector.registry import create_connector

BLOCK = 4


def make_scheduler(num_blocks=64, caching=True, max_model_len=1024, **kwargs) -> Scheduler:
    info = EngineInfo(engine_id="t", block_size=BLOCK, num_blocks=num_blocks, block_nbytes=64,
                      model_fingerprint="f", device="cpu")
    connector = create_connector(KVTransferConfig(), KVConnectorRole.SCHEDULER, info)
    kv = KVCacheManager(num_blocks, BLOCK, caching)
    return Scheduler(SchedulerConfig(**kwargs), kv, max_model_len, connector)


def make_request(rid: str, prompt: list[int], max_tokens=4, priority=0, arrival=0.0) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    core = EngineCoreRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=params,
                             priority=priority, arrival_time=arrival or 1.0)
    return Request(core, eos_token_ids=frozenset())


def step(s: Scheduler, token: int = 7):
    out = s.schedule()
    sampled = {sr.request.request_id: token for sr in out.scheduled if sr.samples}
    return out, s.update_from_output(out, ModelRunnerOutput(sampled))


def run_to_completion(s: Scheduler, max_steps=1000):
    finished = {}
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            return finished
        _, outs = step(s)
        finished.update({o.request_id: o for o in outs if o.finished})
    raise AssertionError("did not finish")


def test_chunked_prefill_respects_token_budget():
    s = make_scheduler(max_num_batched_tokens=8)
    s.add_request(make_request("a", list(range(20)), max_tokens=2))
    out, outs = step(s)
    assert [sr.num_tokens for sr in out.scheduled] == [8] and outs == []
    out, _ = step(s)
    assert [sr.num_tokens for sr in out.scheduled] == [8]
    out, outs = step(s)  # last 4 tokens, samples the first output token
    assert [sr.num_tokens for sr in out.scheduled] == [4] and outs[0].new_token_ids == [7]
    out, _ = step(s)
    assert [sr.num_tokens for sr in out.scheduled] == [1]  # decode
    assert not s.has_unfinished_requests()
    assert s.kv.num_free_blocks == 64


def test_running_decodes_come_before_new_prefills():
    s = make_scheduler(max_num_batched_tokens=10)
    s.add_request(make_request("a", list(range(6)), max_tokens=5))
    step(s)
    s.add_request(make_request("b", list(range(100, 130)), max_tokens=5))
    out, _ = step(s)
    assert [(sr.request.request_id, sr.num_tokens) for sr in out.scheduled] == [("a", 1), ("b", 9)]


def test_max_num_seqs_limits_the_batch():
    s = make_scheduler(max_num_seqs=2)
    for i in range(3):
        s.add_request(make_request(str(i), [i] * 5))
    out, _ = step(s)
    assert [sr.request.request_id for sr in out.scheduled] == ["0", "1"]
    assert s.num_waiting == 1
    run_to_completion(s)
    assert s.kv.num_free_blocks == 64


def test_preemption_when_blocks_run_out_and_everything_finishes():
    s = make_scheduler(num_blocks=6, caching=False, max_model_len=24)
    # Two requests of 2 blocks each grow to 4 blocks each: they cannot both fit in 6.
    s.add_request(make_request("a", list(range(8)), max_tokens=8))
    s.add_request(make_request("b", list(range(50, 58)), max_tokens=8))
    preempted = []
    finished = {}
    for _ in range(200):
        if not s.has_unfinished_requests():
            break
        out, outs = step(s)
        preempted += out.preempted_req_ids
        finished.update({o.request_id: o for o in outs if o.finished})
    assert preempted and preempted[0] == "b"  # FCFS: the newest running request goes first
    assert set(finished) == {"a", "b"}
    assert s.requests == {} and s.kv.num_free_blocks == 6


def test_priority_policy_orders_waiting_and_picks_victims():
    s = make_scheduler(policy="priority", max_num_seqs=1)
    s.add_request(make_request("low", [1, 2], priority=5, arrival=1.0))
    s.add_request(make_request("high", [3, 4], priority=0, arrival=2.0))
    out, _ = step(s)
    assert [sr.request.request_id for sr in out.scheduled] == ["high"]
    victim = s._pick_victim([s.requests["high"], s.requests["low"]])
    assert victim.request_id == "low"


def test_prefix_cache_hit_skips_computed_blocks():
    s = make_scheduler()
    prompt = list(range(13))  # 3 full blocks + 1 token
    s.add_request(make_request("a", prompt, max_tokens=1))
    run_to_completion(s)
    s.add_request(make_request("b", prompt + [99, 98], max_tokens=1))
    out, _ = step(s)
    (sr,) = out.scheduled
    assert sr.num_computed_tokens == 12 and sr.num_tokens == 3
    assert sr.request.num_cached_tokens == 12
    run_to_completion(s)
    assert s.kv.num_free_blocks == 64


def test_fully_cached_prompt_recomputes_last_token():
    s = make_scheduler()
    prompt = list(range(8))  # exactly 2 blocks
    s.add_request(make_request("a", prompt, max_tokens=1))
    run_to_completion(s)
    s.add_request(make_request("b", prompt, max_tokens=1))
    out, _ = step(s)
    assert out.scheduled[0].num_computed_tokens == 4 and out.scheduled[0].num_tokens == 4


def test_abort_frees_blocks_in_every_state():
    s = make_scheduler(max_num_batched_tokens=8, max_num_seqs=1)
    s.add_request(make_request("run", list(range(20))))
    s.add_request(make_request("wait", list(range(20))))
    step(s)
    assert s.requests["run"].status == RequestStatus.RUNNING
    s.abort_requests(["run", "wait", "unknown"])
    assert not s.has_unfinished_requests()
    assert s.kv.num_free_blocks == 64 and s.requests == {}


def test_unset_token_budget_depends_on_the_device():
    """Unset: 1024 on CPU, 2048 on CUDA; a whole prompt without chunked prefill; a set value wins."""
    unset = SchedulerConfig()
    assert unset.token_budget("cpu", 4096) == 1024
    assert unset.token_budget("cuda", 4096) == 2048
    assert SchedulerConfig(enable_chunked_prefill=False).token_budget("cpu", 4096) == 4096
    assert SchedulerConfig(max_num_batched_tokens=64).token_budget("cuda", 4096) == 64
    s = make_scheduler(num_blocks=256, max_model_len=4096)  # CPU: 2000 tokens take two steps
    s.add_request(make_request("a", list(range(2000))))
    out, _ = step(s)
    assert [sr.num_tokens for sr in out.scheduled] == [1024]
