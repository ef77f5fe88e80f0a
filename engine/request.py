"""Request, RequestStatus, SamplingParams and the engine's output messages.

SamplingParams and the output structs are msgspec Structs: they cross the ZMQ boundary between the
HTTP front end and the engine-core process unchanged.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable
from typing import Any

import msgspec


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How to sample one request; vLLM's names and defaults. Validated on construction."""

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per token (plus the sampled one)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id → added to its logit (OpenAI)
    allowed_token_ids: list[int] | None = None  # sample only among these (vLLM)
    n: int = 1  # choices per prompt: the front end makes one request per choice (for_choice)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        checks = [
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.n >= 1, f"n must be >= 1, got {self.n}"),
            (self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (self.min_tokens <= self.max_tokens,
             f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= -1, f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.repetition_penalty > 0,
             f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (-2 <= self.presence_penalty <= 2,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.logprobs is None or 0 <= self.logprobs <= 20,
             f"logprobs must be in [0, 20], got {self.logprobs}"),
            (all(s for s in self.stop), "stop strings must be non-empty"),
            (all(t >= 0 for t in self.stop_token_ids), "stop_token_ids must be >= 0"),
            (all(t >= 0 and -100 <= b <= 100 for t, b in (self.logit_bias or {}).items()),
             "logit_bias: token ids must be >= 0 and biases in [-100, 100]"),
            (self.allowed_token_ids is None
             or (self.allowed_token_ids and all(t >= 0 for t in self.allowed_token_ids)),
             "allowed_token_ids must be a non-empty list of token ids >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def for_choice(self, j: int) -> SamplingParams:
        """The request of choice j (of `n`): one choice, seeded with `seed + j` (vLLM's rule),
        so choices differ and each is reproducible on its own."""
        if self.n == 1:
            return self
        seed = None if self.seed is None else self.seed + j
        return msgspec.structs.replace(self, n=1, seed=seed)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    def vocab_error(self, vocab_size: int) -> tuple[str, str] | None:
        """(field, message) for a logit_bias or allowed_token_ids id outside the vocabulary.
        (Stop token ids may be: they can never be sampled, so they never stop anything.)"""
        for field, ids in (("logit_bias", self.logit_bias or ()),
                           ("allowed_token_ids", self.allowed_token_ids or ())):
            bad = first_out_of_vocab(ids, vocab_size)
            if bad is not None:
                return field, f"{field}: token id {bad} is out of range [0, {vocab_size})"
        return None

    def choices_error(
        self, num_prior_output_tokens: int, kv_transfer_params: dict[str, Any] | None
    ) -> tuple[str, str] | None:
        """(field, message) when `n` > 1 meets what only one choice can have: prior output (one
        choice's tokens) or a KV transfer (the P/D router sends each choice on its own)."""
        if self.n == 1:
            return None
        for field, value in (("num_prior_output_tokens", num_prior_output_tokens),
                             ("kv_transfer_params", kv_transfer_params)):
            if value:
                return field, f"n > 1 cannot be combined with {field} (one choice per request)"
        return None

    @property
    def needs_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def first_out_of_vocab(token_ids: Iterable[int], vocab_size: int) -> int | None:
    """The first id not in [0, vocab_size), if any."""
    return next((t for t in token_ids if not 0 <= t < vocab_size), None)


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after PREEMPTED is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class EngineCoreRequest(msgspec.Struct, kw_only=True):
    """What the front end sends the engine core: tokens only, never text."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    priority: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    # The last k of `prompt_token_ids` are output this request generated elsewhere (the t0 of a
    # prefill instance): they count as output, so a decode instance continues exactly as a
    # colocated run would (penalties, min/max_tokens, the seeded position).
    num_prior_output_tokens: int = 0

    def check_prior_output(self) -> None:
        check_prior_output(self.num_prior_output_tokens, len(self.prompt_token_ids),
                           self.sampling_params.max_tokens)


def check_prior_output(num_prior: int, num_tokens: int, max_tokens: int) -> None:
    """Prior output needs a prompt before it and must leave something to generate."""
    if not 0 <= num_prior < num_tokens:
        raise ValueError(f"num_prior_output_tokens must be in [0, {num_tokens}) for a prompt of "
                         f"{num_tokens} tokens (at least one must be prompt), got {num_prior}")
    if num_prior >= max_tokens:
        raise ValueError(f"num_prior_output_tokens ({num_prior}) must be < max_tokens "
                         f"({max_tokens}): nothing would be left to generate")


class Logprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Logprob of the sampled token plus the top-k alternatives, for one position."""

    sampled: Logprob
    top: list[Logprob]


class EngineCoreOutput(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Per-request result of one engine step (only what is new since the last step)."""

    request_id: str
    new_token_ids: list[int] = msgspec.field(default_factory=list)
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache or a KV transfer
    kv_transfer_params: dict[str, Any] | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Request:
    """One request as the engine core tracks it.

    `num_computed_tokens` counts tokens whose KV is in the cache; the tokens still to compute are
    `all_token_ids[num_computed_tokens:]`. A running decode request has exactly one.

    Prior output (`num_prior_output_tokens` = k) is split off the incoming token list here, so
    the rest of the engine sees what a colocated run would after k steps: `output_token_ids`
    starts with them, and only tokens sampled here are ever emitted.
    """

    def __init__(self, core_request: EngineCoreRequest, eos_token_ids: frozenset[int]) -> None:
        self.request_id = core_request.request_id
        core_request.check_prior_output()
        ids, k = core_request.prompt_token_ids, core_request.num_prior_output_tokens
        self.prompt_token_ids: list[int] = list(ids[: len(ids) - k])
        self.sampling_params = core_request.sampling_params
        self.arrival_time = core_request.arrival_time or time.time()
        self.priority = core_request.priority
        self.kv_transfer_params = core_request.kv_transfer_params
        self.eos_token_ids = frozenset() if self.sampling_params.ignore_eos else eos_token_ids
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = list(ids[len(ids) - k :])
        self.all_token_ids: list[int] = list(ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # set when first scheduled
        self.num_preemptions = 0
        self.num_external_tokens = 0  # KV tokens a connector loads for this request
        # Who sets this: the scheduler, when a load failed under `recompute`. From then on the
        # request never asks the connector again (the same bad block would fail forever).
        self.external_kv_failed = False
        self.block_hashes: list[bytes] = []  # chained hash of each full block (KVCacheManager)
        self.stop_reason: int | str | None = None
        self.error: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> bool:
        """Token-level stop conditions (stop strings are checked by the detokenizing front end)."""
        params = self.sampling_params
        if self.num_output_tokens >= params.min_tokens:
            last = self.output_token_ids[-1]
            if last in self.eos_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in params.stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last
                return True
        if self.num_output_tokens >= params.max_tokens or self.num_tokens >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def __repr__(self) -> str:
        return (f"Request({self.request_id}, {self.status.name}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens})")
