"""EngineCore: schedule → execute → update, one step at a time.

The core owns the model, the KV cache, the scheduler and both halves of the KV connector. It
speaks tokens only (EngineCoreRequest in, EngineCoreOutput out); the offline LLM drives it
in-process, the HTTP server from its own process over ZMQ.
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from pathlib import Path
from typing import Any

from splitserve.engine.config import EngineConfig
from splitserve.engine.kv_cache_manager import KVCacheManager
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.models.config import ModelArchConfig
from splitserve.engine.request import (
    EngineCoreOutput,
    EngineCoreRequest,
    Request,
    first_out_of_vocab,
)
from splitserve.engine.scheduler import ModelRunnerOutput, Scheduler
from splitserve.kv_connector.base import EngineInfo, KVConnectorRole
from splitserve.kv_connector.registry import create_connector

logger = logging.getLogger(__name__)


def model_fingerprint(model_dir: str, dtype: str, block_size: int) -> str:
    """Identity of (weights, dtype, block size): KV blocks are interchangeable only within it."""
    h = hashlib.blake2b(digest_size=8)
    for name in ("config.json", "model.safetensors.index.json"):
        path = Path(model_dir) / name
        if path.is_file():
            h.update(path.read_bytes())
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        h.update(f"{path.name}:{path.stat().st_size}".encode())
    h.update(f"{dtype}:{block_size}".encode())
    return h.hexdigest()


def read_eos_token_ids(model_dir: str, arch: ModelArchConfig) -> frozenset[int]:
    ids = set(arch.eos_token_ids)
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return frozenset(ids)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.arch = ModelArchConfig.from_hf(config.model.hf_config())
        self.max_model_len = self._max_model_len()
        self.eos_token_ids = read_eos_token_ids(config.model.model, self.arch)
        self.model_runner = ModelRunner(config, self.arch, self.max_model_len)
        cache = config.cache
        self.kv_cache_manager = KVCacheManager(self.model_runner.num_blocks, cache.block_size,
                                               cache.enable_prefix_caching)
        self.engine_id = config.engine_id or uuid.uuid4().hex[:12]
        info = EngineInfo(
            engine_id=self.engine_id, block_size=cache.block_size,
            num_blocks=self.model_runner.num_blocks, block_nbytes=self.model_runner.block_nbytes,
            model_fingerprint=model_fingerprint(config.model.model, str(self.model_runner.dtype),
                                                cache.block_size),
            device=str(self.model_runner.device))
        self.connector_scheduler = create_connector(config.kv_transfer, KVConnectorRole.SCHEDULER,
                                                    info)
        self.connector_worker = create_connector(config.kv_transfer, KVConnectorRole.WORKER, info)
        self.connector_worker.register_kv_caches(self.model_runner.kv_cache)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager, self.max_model_len,
                                   self.connector_scheduler, self.model_runner.device.type)
        self.num_steps = 0

    def _max_model_len(self) -> int:
        limit = self.arch.max_position_embeddings
        if self.arch.sliding_window:
            limit = min(limit, self.arch.sliding_window)
        requested = self.config.model.max_model_len
        if requested is not None and requested > limit:
            raise ValueError(f"max_model_len {requested} exceeds the model's limit {limit}")
        return requested or limit

    # ---------------------------------------------------------------- requests
    def validate_request(self, req: EngineCoreRequest) -> None:
        """Raise ValueError naming the problem; called before anything is allocated."""
        n = len(req.prompt_token_ids)
        if n == 0:
            raise ValueError("prompt is empty")
        if n > self.max_model_len - 1:
            raise ValueError(f"prompt is {n} tokens, longer than max_model_len "
                             f"{self.max_model_len} minus 1 token to generate")
        vocab = self.arch.vocab_size
        bad = first_out_of_vocab(req.prompt_token_ids, vocab)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} out of range [0, {vocab})")
        problem = req.sampling_params.vocab_error(vocab)
        if problem is not None:
            raise ValueError(problem[1])
        req.check_prior_output()

    def add_request(self, req: EngineCoreRequest) -> None:
        self.validate_request(req)
        self.scheduler.add_request(Request(req, self.eos_token_ids))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    # ---------------------------------------------------------------- the loop
    def step(self) -> list[EngineCoreOutput]:
        outputs = self._process_kv_transfers()
        sched_out = self.scheduler.schedule()
        meta = sched_out.kv_connector_metadata
        self.connector_worker.start_load_kv(meta)
        runner_out = ModelRunnerOutput({})
        if sched_out.scheduled:
            runner_out = self.model_runner.execute_model(sched_out)
        self.connector_worker.save_kv(meta)
        outputs += self.scheduler.update_from_output(sched_out, runner_out)
        self.num_steps += 1
        return outputs

    def _process_kv_transfers(self) -> list[EngineCoreOutput]:
        done_sending, done_recving, failed = self.connector_worker.get_finished()
        if not (done_sending or done_recving or failed):
            return []
        return self.scheduler.update_from_kv_xfer_finished(
            done_sending, done_recving, failed, self.config.kv_transfer.failure_policy)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_work(self) -> bool:
        """Requests to run or transfers to poll: the loop must keep stepping."""
        return self.scheduler.has_unfinished_requests() or self.scheduler.has_pending_transfers()

    def stats(self) -> dict[str, Any]:
        kv = self.kv_cache_manager
        return {
            "running": self.scheduler.num_running,
            "waiting": self.scheduler.num_waiting,
            "kv_blocks_free": kv.num_free_blocks,
            "kv_blocks_total": kv.num_blocks,
            "kv_usage": kv.usage(),
            "prefix_cache_queries": kv.block_pool.prefix_queries,
            "prefix_cache_hits": kv.block_pool.prefix_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "held_for_transfer": len(self.scheduler.sending),
        }

    def shutdown(self) -> None:
        for connector in (self.connector_worker, self.connector_scheduler):
            try:
                connector.shutdown()
            except Exception:  # shutdown must finish even if a peer is gone
                logger.exception("connector shutdown failed")
