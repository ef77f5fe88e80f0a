"""NCCL/gloo connector: the producer sends, the consumer receives, over a per-pair process group.

A consumer's first Hello makes the producer start a `TCPStore` for the pair; both sides then build
a two-rank process group over a `PrefixStore` of it (rank 0 producer, rank 1 consumer), never the
global default group, so any number of pairs coexist. NCCL on CUDA, gloo on CPU.

```
consumer                                        producer
Hello ──────────────────────────────────────▶ TCPStore(port 0) + pair thread (rank 0)
  ◀──────────────── HelloReply(store host:port, pair id)
pair thread (rank 1) joins the group
SendRequest(request id, its block ids, tag) ─▶ held? mark busy, queue the send
  ◀──────────────── SendReply(ok, checksums)
recv runs into its blocks ◀══ process group ══ send runs from its blocks; free (done_sending)
```

Blocks move as contiguous runs (`contiguous_runs`): long runs in place, short ones packed into
staging buffers (pair.py has the message plan and why). Every blocking collective call happens
on the pair's own thread with `timeout_s`; a peer that dies breaks its pair, fails the loads
queued on it, and the next request builds a new pair.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any, Literal

import msgspec
from pydantic import Field

from splitserve.kv_connector.layout import contiguous_runs, set_loopback_env
from splitserve.kv_connector.nccl.pair import Job, Pair
from splitserve.kv_connector.p2p import Load, P2PConnectorBase, P2POptions, Peer
from splitserve.kv_connector.side_channel import Hello, HelloReply

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


class NcclOptions(P2POptions):
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Process-group backend; `auto` is NCCL for a CUDA KV cache and gloo for a CPU one."""
    gloo_connections: int = Field(default=2, ge=1, le=16)
    """TCP connections per gloo pair (consecutive messages alternate between them); the
    producer's number is used by both sides. More help where cores are free to drive them."""


class PairInfo(msgspec.Struct, kw_only=True):
    store_host: str
    store_port: int
    pair_id: str
    backend: str
    gloo_connections: int = 2


class SendRequest(msgspec.Struct, tag="send_request", kw_only=True):
    request_id: str  # the producer's
    pair_id: str
    block_offset: int
    dst_block_ids: list[int]
    tag: int
    want_checksums: bool = False


class SendReply(msgspec.Struct, tag="send_reply", kw_only=True):
    ok: bool
    error: str | None = None
    checksums: list[int] | None = None


class NcclConnector(P2PConnectorBase):
    Options = NcclOptions
    MESSAGES = (SendRequest, SendReply)

    def _io_setup(self, kv_cache: torch.Tensor) -> None:
        set_loopback_env(self.bind_host, ("GLOO_SOCKET_IFNAME",))
        self.device = kv_cache.device
        backend = self.options.backend
        if backend == "auto":
            backend = "nccl" if kv_cache.device.type == "cuda" else "gloo"
        if (backend == "nccl") != (kv_cache.device.type == "cuda"):
            raise ValueError(f"backend {backend!r} cannot move a KV cache on {kv_cache.device}")
        self.backend = backend
        self._pairs: dict[str, Pair] = {}  # producer side, by pair id
        self._pair_threads: list[Pair] = []  # every pair started, both sides: joined at close
        self._tags = itertools.count(1)

    # ------------------------------------------------------------ producer
    def _io_hello(self, message: Hello) -> bytes:
        from torch.distributed import TCPStore

        timeout = datetime.timedelta(seconds=self.timeout_s)
        store = TCPStore(self.bind_host, 0, 2, True, timeout, wait_for_workers=False)
        pair_id = uuid.uuid4().hex
        lanes = self.options.gloo_connections
        pair = self._pairs[pair_id] = Pair(self, pair_id, 0, store, self.backend, lanes)
        self._start_pair(pair)
        logger.info("KV pair %s with %s (%s)", pair_id[:8], message.engine_id, self.backend)
        return msgspec.msgpack.encode(
            PairInfo(
                store_host=self.host,
                store_port=store.port,
                pair_id=pair_id,
                backend=self.backend,
                gloo_connections=lanes,
            )
        )

    def _io_other_request(self, identity: bytes, seq: bytes, message: Any) -> None:
        assert self.channel is not None
        if not isinstance(message, SendRequest):
            super()._io_other_request(identity, seq, message)
            return
        held = self._io_lookup(identity, seq, message)
        if held is None:
            return  # deferred until the hold arrives
        error = held if isinstance(held, str) else None
        pair = self._pairs.get(message.pair_id)
        n = len(message.dst_block_ids)
        if error is None and held.busy:
            error = f"request {message.request_id} is already being sent"
        elif error is None and (pair is None or pair.broken):
            error = f"no live process group {message.pair_id[:8]} (producer restarted?)"
        elif error is None and message.block_offset + n > len(held.block_ids):
            error = (
                f"asked for blocks [{message.block_offset}, {message.block_offset + n}) "
                f"of a request holding {len(held.block_ids)}"
            )
        if error is not None:
            self.channel.reply(identity, seq, SendReply(ok=False, error=error))
            return
        held.busy = True
        src = held.block_ids[message.block_offset : message.block_offset + n]
        job = Job(
            True,
            message.request_id,
            contiguous_runs(src, message.dst_block_ids),
            message.tag,
            time.monotonic(),
        )
        pair.jobs.put(job)
        sums = self._io_checksums(held) if message.want_checksums else None
        self.channel.reply(identity, seq, SendReply(ok=True, checksums=sums))

    def _io_refusal(self, message: Any, reason: str) -> Any:
        if isinstance(message, SendRequest):
            return SendReply(ok=False, error=reason)
        return super()._io_refusal(message, reason)

    # ------------------------------------------------------------ consumer
    def _io_connect(self, peer: Peer, reply: HelloReply) -> None:
        info = msgspec.msgpack.decode(reply.transport, type=PairInfo)
        if info.backend != self.backend:
            raise ValueError(f"producer uses {info.backend}, this engine {self.backend}")
        store = (info.store_host, info.store_port)
        pair = Pair(self, info.pair_id, 1, store, self.backend, info.gloo_connections)
        peer.transport = pair
        self._start_pair(pair)  # `pair_ready` arrives when the group is built

    def _io_begin_load(self, load: Load) -> None:
        pair, spec = load.peer.transport, load.spec
        assert isinstance(pair, Pair)
        tag = next(self._tags) % (1 << 24)
        load.state = "asking"
        self._io_call(
            load.peer.address,
            SendRequest(
                request_id=spec.remote_request_id,
                pair_id=pair.pair_id,
                block_offset=spec.block_offset,
                dst_block_ids=spec.local_block_ids,
                tag=tag,
                want_checksums=self.config.verify,
            ),
            lambda r: self._io_on_send_reply(load, pair, tag, r),
            lambda e: self._io_fail(load, f"asking the producer to send: {e}"),
        )

    def _io_on_send_reply(self, load: Load, pair: Pair, tag: int, reply: Any) -> None:
        if self._loads.get(load.spec.request_id) is not load:
            return
        if not isinstance(reply, SendReply) or not reply.ok:
            error = getattr(reply, "error", None) or f"unexpected reply {type(reply).__name__}"
            self._io_fail(load, error, release=False)
            return
        spec = load.spec
        load.state = "receiving"  # from here on the pair thread writes into our blocks
        load.transport = reply.checksums
        pair.jobs.put(
            Job(
                False,
                spec.request_id,
                contiguous_runs(spec.remote_block_ids, spec.local_block_ids),
                tag,
                time.monotonic(),
            )
        )

    def _io_fail(self, load: Load, reason: str, release: bool = True) -> None:
        if load.state == "receiving":
            # The pair thread may still be writing into these blocks: report when it lets go.
            load.state = f"doomed:{reason}"
            return
        super()._io_fail(load, reason, release)

    # ------------------------------------------------------------ transport thread events
    def _io_transport_event(self, kind: str, item: Any) -> None:
        if kind == "pair_ready":
            pair, error = item
            if pair.rank == 0:
                if error is not None:
                    logger.warning("KV pair %s failed: %s", pair.pair_id[:8], error)
                    self._drop_pair(pair)
                return
            peer = next((p for p in self._peers.values() if p.transport is pair), None)
            if peer is not None:
                if error is None:
                    self._io_peer_ready(peer)
                else:
                    self._io_peer_failed(peer, error)
        elif kind == "job_done":
            pair, job, error = item
            if job.send:
                self._io_sent(pair, job, error)
            else:
                self._io_received(pair, job, error)
        else:
            super()._io_transport_event(kind, item)

    def _io_sent(self, pair: Pair, job: Job, error: str | None) -> None:
        held = self._held.get(job.request_id)
        if held is not None:
            if error is None:
                nblocks = sum(n for _, _, n in job.runs)
                self.stats.record(
                    time.monotonic() - job.started,
                    nblocks * self.engine_info.block_nbytes,
                    nblocks,
                    loaded=False,
                )
            self._io_unhold(job.request_id, "sent" if error is None else f"send failed: {error}")
        if error is not None:
            self.stats.num_failed_transfers += 1
            logger.warning("%s: KV send failed: %s", job.request_id, error)
            self._drop_pair(pair)

    def _io_received(self, pair: Pair, job: Job, error: str | None) -> None:
        load = self._loads.get(job.request_id)
        if load is None:
            return
        doomed = load.state.removeprefix("doomed:") if load.state.startswith("doomed:") else None
        load.state = "received"  # the pair thread let go of the blocks
        if error is not None and load.peer.state != "dead":
            self._io_peer_failed(load.peer, error)  # fails the loads queued behind it too
        reason = error or doomed
        if reason is not None:
            super()._io_fail(load, reason, release=False)
        else:
            self._io_land(load, load.transport)

    def _start_pair(self, pair: Pair) -> None:
        self._pair_threads = [p for p in self._pair_threads if p.is_alive()] + [pair]
        pair.start()

    def _drop_pair(self, pair: Pair) -> None:
        self._pairs.pop(pair.pair_id, None)
        pair.jobs.put(None)

    def _io_disconnect(self, peer: Peer) -> None:
        pair = peer.transport
        if isinstance(pair, Pair):
            pair.jobs.put(None)

    def _io_close(self) -> None:
        pairs = self._pair_threads
        for pair in pairs:
            pair.jobs.put(None)
        for pair in pairs:  # a pair thread still tearing down its group at exit aborts Python
            pair.join(timeout=self.timeout_s)
