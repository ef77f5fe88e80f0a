"""An engine-less driver: runs a connector pair on a real KV tensor the way the engine does.

For transport tests and `scripts/bench_transfer.py`, not for serving. `SimEngine` owns both roles
of one connector, a block-major KV tensor of random (never zero) values and a free-block list;
each `step()` is an engine step without a model (get_finished → build_connector_meta →
start_load_kv → save_kv). remote_engine.py runs one in a spawned process, so a producer and a
consumer really are two processes.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

import xxhash

from splitserve.kv_connector.base import EngineInfo, KVConnectorRole
from splitserve.kv_connector.config import KVTransferConfig
from splitserve.kv_connector.layout import block_bytes, cdiv
from splitserve.kv_connector.registry import create_connector


@dataclass(frozen=True)
class KVShape:
    """Model geometry of a KV cache: [num_blocks, num_layers, 2, block_size, kv_heads, head_dim]."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    dtype: str = "float32"

    @property
    def block_nbytes(self) -> int:
        itemsize = 2 if self.dtype in ("bfloat16", "float16") else 4
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * itemsize


PRESETS = {
    "tiny": KVShape(num_layers=4, num_kv_heads=4, head_dim=32),
    "small": KVShape(num_layers=24, num_kv_heads=2, head_dim=64),
}


def chain_block_hashes(token_ids: list[int], block_size: int) -> list[bytes]:
    """h_i = xxh128(h_{i-1} ‖ tokens of block i), for each full block (the engine has its own)."""
    out, prev = [], b""
    for i in range(len(token_ids) // block_size):
        h = xxhash.xxh128(prev)
        h.update(
            b",".join(str(t).encode() for t in token_ids[i * block_size : (i + 1) * block_size])
        )
        prev = h.digest()
        out.append(prev)
    return out


@dataclass
class SimRequest:
    """Satisfies RequestView, as the engine's Request does."""

    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None = None
    num_computed_tokens: int = 0
    all_token_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return max(len(self.all_token_ids), len(self.prompt_token_ids))


def sim_kv_cache(shape: KVShape, num_blocks: int, seed: int) -> Any:
    """[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], values in [1, 2)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    kv = torch.rand(
        num_blocks,
        shape.num_layers,
        2,
        shape.block_size,
        shape.num_kv_heads,
        shape.head_dim,
        generator=gen,
    )
    return kv.add_(1).to(getattr(torch, shape.dtype))


class SimEngine:
    def __init__(
        self,
        config: dict[str, Any],
        shape: KVShape,
        num_blocks: int,
        engine_id: str,
        seed: int = 0,
        shuffle_blocks: bool = True,
    ) -> None:
        self.shape = shape
        self.config = KVTransferConfig.model_validate(config)
        self.info = EngineInfo(
            engine_id=engine_id,
            block_size=shape.block_size,
            num_blocks=num_blocks,
            block_nbytes=shape.block_nbytes,
            model_fingerprint=xxhash.xxh64_hexdigest(repr(shape).encode()),
            device="cpu",
        )
        self.kv_cache = sim_kv_cache(shape, num_blocks, seed)
        self.blocks = block_bytes(self.kv_cache, num_blocks, shape.block_nbytes)
        self.free = list(range(num_blocks))
        if shuffle_blocks:
            random.Random(seed).shuffle(self.free)
        self.scheduler = create_connector(self.config, KVConnectorRole.SCHEDULER, self.info)
        self.worker = create_connector(self.config, KVConnectorRole.WORKER, self.info)
        self.worker.register_kv_caches(self.kv_cache)
        self.requests: dict[str, tuple[SimRequest, list[int]]] = {}
        self.sending: set[str] = set()  # held after request_finished said delay_free
        self.loading: dict[str, float] = {}  # request → when its load started
        self.done_sending: dict[str, float] = {}  # request → when it was reported
        self.done_recving: dict[str, float] = {}  # request → load seconds
        self.failed: dict[str, str] = {}
        self.finished_at: dict[str, float] = {}  # producer request → when request_finished ran

    # ------------------------------------------------------------ requests
    def _allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"out of blocks: need {n}, {len(self.free)} free")
        out, self.free = self.free[:n], self.free[n:]
        return out

    def _release(self, rid: str) -> None:
        _, block_ids = self.requests.pop(rid)
        self.free.extend(block_ids)

    def prefill(
        self, request_id: str, token_ids: list[int], params: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Pretend the prompt was computed into fresh blocks, then finish the request.

        Returns {"params": kv_transfer_params for the client, "block_ids": its blocks}."""
        req = SimRequest(request_id, list(token_ids), params, all_token_ids=list(token_ids))
        req.block_hashes = chain_block_hashes(req.all_token_ids, self.shape.block_size)
        block_ids = self._allocate(cdiv(len(token_ids), self.shape.block_size))
        self.requests[request_id] = (req, block_ids)
        req.num_computed_tokens = len(token_ids)
        req.all_token_ids.append(1)  # the sampled first token; its KV is not computed
        self.finished_at[request_id] = time.perf_counter()
        delay, out = self.scheduler.request_finished(req, block_ids)
        if delay:
            self.sending.add(request_id)
        else:
            self._release(request_id)
        return {"params": out, "block_ids": block_ids}

    def load(
        self,
        request_id: str,
        token_ids: list[int],
        params: dict[str, Any] | None = None,
        num_local_tokens: int = 0,
    ) -> int:
        """Admit a request whose KV comes from outside; returns the external token count."""
        req = SimRequest(request_id, list(token_ids), params, all_token_ids=list(token_ids))
        req.block_hashes = chain_block_hashes(req.all_token_ids, self.shape.block_size)
        num, is_async = self.scheduler.get_num_new_matched_tokens(req, num_local_tokens)
        block_ids = self._allocate(cdiv(len(token_ids), self.shape.block_size))
        self.requests[request_id] = (req, block_ids)
        req.num_computed_tokens = num_local_tokens
        self.scheduler.update_state_after_alloc(req, block_ids, num if is_async else 0)
        if is_async and num > 0:
            self.loading[request_id] = time.perf_counter()
        return num

    def finish(self, request_id: str) -> None:
        """A loaded request completes (consumer side)."""
        req, block_ids = self.requests[request_id]
        delay, _ = self.scheduler.request_finished(req, block_ids)
        if delay:
            self.sending.add(request_id)
        else:
            self._release(request_id)

    # ------------------------------------------------------------ the step
    def step(self) -> None:
        sent, recved, failed = self.worker.get_finished()
        now = time.perf_counter()
        for rid in sent:
            self.done_sending[rid] = now
            if rid in self.sending:
                self.sending.discard(rid)
                self._release(rid)
        for rid in recved:
            self.done_recving[rid] = now - self.loading.pop(rid, now)
        for rid, reason in failed.items():
            self.loading.pop(rid, None)
            self.failed[rid] = reason
        meta = self.scheduler.build_connector_meta()
        self.worker.start_load_kv(meta)
        self.worker.save_kv(meta)

    def run_until(
        self, request_ids: list[str], timeout: float, interval_s: float = 0.0002
    ) -> dict[str, Any]:
        """Step until each request is reported (loaded, failed or released); then status().

        Waiting here instead of polling status() over the pipe keeps the other processes idle
        while a transfer runs (benchmarks)."""
        deadline = time.monotonic() + timeout
        done = (self.done_recving, self.failed, self.done_sending)
        while not all(any(r in d for d in done) for r in request_ids):
            if time.monotonic() > deadline:
                break
            self.step()
            time.sleep(interval_s)
        return self.status()

    # ------------------------------------------------------------ inspection
    def block_ids(self, request_id: str) -> list[int]:
        return list(self.requests[request_id][1])

    def block_data(self, block_ids: list[int]) -> bytes:
        return self.blocks[block_ids].numpy().tobytes()

    def store_keys(self, token_ids: list[int]) -> list[str]:
        """Store keys of a prompt's full blocks (connectors with a `key(block_hash)`)."""
        hashes = chain_block_hashes(list(token_ids), self.shape.block_size)
        return [self.worker.key(h) for h in hashes]  # type: ignore[attr-defined]

    def corrupt(self, block_id: int) -> None:
        self.kv_cache[block_id].add_(1)

    def held_seconds(self, request_id: str) -> float | None:
        """From request_finished to done_sending (a save's duration, for store connectors)."""
        if request_id not in self.done_sending:
            return None
        return self.done_sending[request_id] - self.finished_at[request_id]

    def status(self) -> dict[str, Any]:
        return {
            "done_sending": dict(self.done_sending),
            "done_recving": dict(self.done_recving),
            "failed": dict(self.failed),
            "sending": sorted(self.sending),
            "loading": sorted(self.loading),
            "num_free": len(self.free),
            "stats": self.worker.stats.as_dict(),
            "port": getattr(self.worker, "port", None),
        }

    def shutdown(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()
