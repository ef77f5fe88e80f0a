"""The continuous-batching scheduler: waiting/running queues under a token budget."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from splitserve.engine.config import SchedulerConfig
from splitserve.engine.kv_cache_manager import KVCacheManager
from splitserve.engine.request import EngineCoreOutput, Request, RequestStatus, TokenLogprobs
from splitserve.engine.request_queue import make_queue

logger = logging.getLogger(__name__)


@dataclass
class ScheduledRequest:
    request: Request
    num_computed_tokens: int  # KV already in the cache before this step
    num_tokens: int  # tokens computed this step
    block_ids: list[int]

    @property
    def samples(self) -> bool:
        """A chunk that reaches the last known token produces the next token."""
        return self.num_computed_tokens + self.num_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)
    kv_connector_metadata: Any = None

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, int]
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 max_model_len: int, connector: Any, device_type: str = "cpu") -> None:
        self.config = config
        self.token_budget = config.token_budget(device_type, max_model_len)
        self.kv = kv_cache_manager
        self.max_model_len = max_model_len
        self.connector = connector  # scheduler-side KV connector (no-op when transfer is off)
        self.waiting = make_queue(config.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # Consumer: requests whose KV is being loaded; they never block the batch.
        self.waiting_for_remote: dict[str, Request] = {}
        # Producer: finished requests whose blocks are held until the consumer is done.
        self.sending: dict[str, Request] = {}
        # Requests aborted while a load was writing into their blocks: freed when it ends.
        self.free_after_load: set[str] = set()
        self.num_preemptions = 0

    # ---------------------------------------------------------------- intake
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            request = self.requests.get(rid)
            # Blocks held for a consumer (`sending`) are never freed here: the connector may
            # still be serving or saving them; they go when it reports done_sending.
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif rid in self.waiting_for_remote:
                del self.waiting_for_remote[rid]
                self.free_after_load.add(rid)
            else:
                self.waiting.remove(request)
            request.status = RequestStatus.FINISHED_ABORTED
            self._release(request, notify_connector=False)

    # ---------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        """One step's work: which requests compute how many tokens.

        There is no "prefill phase" and no "decode phase". Each request has `num_computed_tokens`
        (KV already in the cache) and `num_tokens` (prompt + output so far); a step gives it some
        of the difference. A decode step is one token, a prompt is one or more chunks. Running
        requests are served first, in order, so ongoing generations keep their pace; the budget
        that is left admits waiting requests (FCFS or priority order). When a running request
        needs a block and none is free, the lowest-priority running request is preempted: its
        blocks are freed and it is recomputed later (its prefix may still hit the cache). Requests
        whose KV comes from a remote instance wait aside until their load completes, so a slow
        transfer never stalls the batch.
        """
        out = SchedulerOutput()
        budget = self.token_budget
        budget = self._schedule_running(out, budget)
        if not out.preempted_req_ids:
            self._schedule_waiting(out, budget)
        for sr in out.scheduled:
            sr.request.num_computed_tokens += sr.num_tokens
        out.kv_connector_metadata = self.connector.build_connector_meta()
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while self.kv.allocate_slots(request, num_new) is None:
                victim = self._pick_victim(self.running[i:])
                self._preempt(victim, out)
                if victim is request:
                    break
            else:
                out.scheduled.append(self._scheduled(request, num_new))
                budget -= num_new
                i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            hits, num_external, load_async = [], 0, False
            fresh = request.num_computed_tokens == 0  # else: its remote KV just landed
            if fresh:
                hits, num_local = self.kv.get_computed_blocks(request)
                if not request.external_kv_failed:
                    num_external, load_async = self.connector.get_num_new_matched_tokens(
                        request, num_local)
                request.num_computed_tokens = num_local
            if load_async and num_external > 0:
                if not self._start_remote_load(request, hits, num_external):
                    request.num_computed_tokens = 0
                    break
                continue
            num_new = request.num_tokens - request.num_computed_tokens
            if not self.config.enable_chunked_prefill and num_new > budget:
                num_new = 0  # does not fit this step
            num_new = min(num_new, budget)
            if num_new == 0 or self.kv.allocate_slots(request, num_new, hits) is None:
                if fresh:  # nothing was taken: look the prefix up again next step
                    request.num_computed_tokens = 0
                break
            self.waiting.pop()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = request.num_computed_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(self._scheduled(request, num_new))
            budget -= num_new

    def _start_remote_load(self, request: Request, hits: list, num_external: int) -> bool:
        if self.kv.allocate_slots(request, 0, hits, num_external, delay_caching=True) is None:
            return False
        self.waiting.pop()
        block_ids = list(self.kv.get_block_ids(request.request_id))
        self.connector.update_state_after_alloc(request, block_ids, num_external)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        request.num_external_tokens = num_external
        self.waiting_for_remote[request.request_id] = request
        logger.debug("%s: loading %d tokens of KV", request.request_id, num_external)
        return True

    def _scheduled(self, request: Request, num_tokens: int) -> ScheduledRequest:
        return ScheduledRequest(request, request.num_computed_tokens, num_tokens,
                                self.kv.get_block_ids(request.request_id))

    def _pick_victim(self, candidates: list[Request]) -> Request:
        if self.config.policy == "priority":
            return max(candidates, key=lambda r: (r.priority, r.arrival_time))
        return candidates[-1]

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)
        out.preempted_req_ids.append(request.request_id)
        logger.debug("%s: preempted (no free KV blocks)", request.request_id)

    # ---------------------------------------------------------------- results
    def update_from_output(self, out: SchedulerOutput,
                           runner_out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs = []
        for sr in out.scheduled:
            request = sr.request
            token = runner_out.sampled_token_ids.get(request.request_id)
            if request.is_finished or token is None:
                continue
            request.append_output_token(token)
            lp = runner_out.logprobs.get(request.request_id)
            finished = request.check_stop(self.max_model_len)
            output = EngineCoreOutput(
                request_id=request.request_id, new_token_ids=[token],
                new_logprobs=[lp] if lp is not None else None,
                num_cached_tokens=max(request.num_cached_tokens, 0))
            if finished:
                self.running.remove(request)
                output.kv_transfer_params = self._release(request)
                output.finish_reason = request.status.finish_reason
                output.stop_reason = request.stop_reason
            outputs.append(output)
        return outputs

    def _release(self, request: Request, notify_connector: bool = True) -> dict | None:
        """Free a finished request's blocks, or hold them while a consumer pulls them."""
        params = None
        if notify_connector:
            self.kv.update_block_hashes(request)
            delay, params = self.connector.request_finished(
                request, list(self.kv.get_block_ids(request.request_id)))
            if delay:
                self.sending[request.request_id] = request
                return params
        if request.request_id not in self.free_after_load:
            self.kv.free(request)
            del self.requests[request.request_id]
        return params

    def update_from_kv_xfer_finished(self, done_sending: set[str], done_recving: set[str],
                                     failed: dict[str, str], failure_policy: str
                                     ) -> list[EngineCoreOutput]:
        """Apply what the connector's worker side reports; returns outputs of failed requests."""
        for rid in done_sending:
            request = self.sending.pop(rid, None)
            if request is not None:
                self.kv.free(request)
                self.requests.pop(rid, None)
        outputs = []
        for rid in set(done_recving) | set(failed):
            request = self.requests.get(rid)
            if rid in self.free_after_load:
                self.free_after_load.discard(rid)
                if request is not None:
                    self.kv.free(request)
                    del self.requests[rid]
                continue
            if request is None or rid not in self.waiting_for_remote:
                continue
            del self.waiting_for_remote[rid]
            if rid in failed:
                output = self._on_load_failed(request, failed[rid], failure_policy)
                if output is not None:
                    outputs.append(output)
            else:
                self._on_load_done(request)
        return outputs

    def _on_load_done(self, request: Request) -> None:
        request.num_computed_tokens += request.num_external_tokens
        self.kv.cache_blocks(request, request.num_computed_tokens)
        request.num_cached_tokens = request.num_computed_tokens
        request.kv_transfer_params = None  # loaded once; a preemption later recomputes locally
        request.status = RequestStatus.WAITING
        self.waiting.prepend(request)

    def _on_load_failed(self, request: Request, reason: str,
                        policy: str) -> EngineCoreOutput | None:
        self.kv.free(request)
        logger.warning("%s: KV load failed (%s); policy %s", request.request_id, reason, policy)
        if policy == "recompute":
            request.num_computed_tokens = 0
            request.kv_transfer_params = None
            request.external_kv_failed = True  # prefill locally, never ask the connector again
            request.status = RequestStatus.WAITING
            self.waiting.prepend(request)
            return None
        request.status = RequestStatus.FINISHED_ERROR
        request.error = f"KV load failed: {reason}"
        del self.requests[request.request_id]
        return EngineCoreOutput(request_id=request.request_id, finish_reason="error",
                                error=request.error)

    # ---------------------------------------------------------------- state
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.waiting_for_remote)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting or self.waiting_for_remote)

    def has_pending_transfers(self) -> bool:
        return bool(self.sending or self.waiting_for_remote or self.free_after_load)
