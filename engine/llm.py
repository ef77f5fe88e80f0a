"""Offline batch generation with vLLM's interface: `LLM(model=...).generate(prompts, params)`."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from splitserve.engine.config import EngineConfig
from splitserve.engine.core import EngineCore
from splitserve.engine.output_processor import OutputProcessor, RequestOutput
from splitserve.engine.request import EngineCoreRequest, SamplingParams
from splitserve.engine.tokenizer import Tokenizer

PromptType = str | dict[str, Any]


class LLM:
    """An engine core in this process plus the front-end work (tokenize, detokenize, stop).

    Keyword arguments are the fields of EngineConfig's sections, flat as in vLLM:
    `LLM(model=DIR, dtype="auto", block_size=16, kv_cache_memory="512MiB", max_num_seqs=256,
    max_num_batched_tokens=None, enable_prefix_caching=True, max_model_len=None, ...)`.
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        self.config = EngineConfig.from_flat(model=model, **kwargs)
        self.tokenizer = Tokenizer(self.config.model.model)
        self.engine = EngineCore(self.config)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        kv_transfer_params: Sequence[dict[str, Any] | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; results in prompt order, one per prompt with its
        `sampling_params.n` choices in `outputs` (choice j seeded with `seed + j`).

        A prompt is a string or `{"prompt_token_ids": [...]}`, optionally with
        `"num_prior_output_tokens": k` (its last k tokens are output generated before; see
        EngineCoreRequest). Every prompt is validated before any is queued, so a bad one raises
        ValueError and nothing runs.
        """
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        n = len(prompts)
        params = _broadcast(sampling_params or SamplingParams(), n, "sampling_params")
        priorities = _broadcast(list(priority) if priority is not None else 0, n, "priority")
        transfers = _broadcast(list(kv_transfer_params) if kv_transfer_params else None, n,
                               "kv_transfer_params")
        for p, sp, kt in zip(prompts, params, transfers, strict=True):
            prior = p.get("num_prior_output_tokens", 0) if isinstance(p, dict) else 0
            problem = sp.choices_error(prior, kt) if isinstance(sp, SamplingParams) else None
            if problem is not None:
                raise ValueError(problem[1])
        requests = [self._make_request(p, sp.for_choice(j), prio, kt) for p, sp, prio, kt
                    in zip(prompts, params, priorities, transfers, strict=True)
                    for j in range(sp.n)]
        for _, req in requests:
            self.engine.validate_request(req)
        for text, req in requests:
            self.output_processor.add_request(req.request_id, text, req.prompt_token_ids,
                                              req.sampling_params, req.num_prior_output_tokens)
            self.engine.add_request(req)
        outputs = self._run([req.request_id for _, req in requests], use_tqdm)
        return _merge_choices(outputs, [sp.n for sp in params])

    def _make_request(self, prompt: PromptType, params: SamplingParams, priority: int,
                      kv_transfer_params: dict[str, Any] | None
                      ) -> tuple[str | None, EngineCoreRequest]:
        num_prior = 0
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, token_ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
            num_prior = int(prompt.get("num_prior_output_tokens", 0))
        else:
            raise ValueError("a prompt must be a string or {'prompt_token_ids': [...]}")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        req = EngineCoreRequest(request_id=str(next(self._ids)), prompt_token_ids=token_ids,
                                sampling_params=params, arrival_time=time.time(),
                                priority=priority, kv_transfer_params=kv_transfer_params,
                                num_prior_output_tokens=num_prior)
        return text, req

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="generate", disable=not use_tqdm)
        try:
            while len(results) < len(request_ids):
                outputs, to_abort = self.output_processor.process_outputs(self.engine.step())
                self.engine.abort_requests(to_abort)
                for out in outputs:
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        except BaseException:
            pending = [r for r in request_ids if r not in results]
            self.engine.abort_requests(pending)
            for rid in pending:
                self.output_processor.abort(rid)
            raise
        finally:
            bar.close()
        return [results[rid] for rid in request_ids]

    def wait_for_transfers(self, timeout_s: float = 30.0) -> bool:
        """Producer side: keep stepping until every held KV block was pulled or its lease ended."""
        deadline = time.monotonic() + timeout_s
        while self.engine.scheduler.has_pending_transfers():
            if time.monotonic() > deadline:
                return False
            self.engine.step()
            time.sleep(0.001)
        return True

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def shutdown(self) -> None:
        self.engine.shutdown()


def _merge_choices(outputs: list[RequestOutput], ns: list[int]) -> list[RequestOutput]:
    """One RequestOutput per prompt: its n choices' outputs, `index` 0..n-1 (vLLM's shape)."""
    merged, at = [], 0
    for n in ns:
        group, at = outputs[at : at + n], at + n
        if n == 1:
            merged.append(group[0])
            continue
        choices = [dataclasses.replace(o.outputs[0], index=j) for j, o in enumerate(group)]
        merged.append(dataclasses.replace(group[0], outputs=choices))
    return merged


def _broadcast(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, list | tuple):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
        return list(value)
    return [value] * n
