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

Blocks move as contiguous runs (`contiguous_runs`), in place, when runs are long; scattered
blocks are packed into 32 MiB messages (per-message overhead dominates small ones). Every
blocking collective call happens on the pair's own thread with `timeout_s`; a peer that dies
breaks its pair, fails the loads queued on it, and the next request builds a new pair.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from splitserve.kv_connector.layout import contiguous_runs, set_loopback_env
from splitserve.kv_connector.p2p import Load, P2PConnectorBase, P2POptions, Peer
from splitserve.kv_connector.side_channel import Hello, HelloReply

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


_PACK_BELOW = 1 << 20  # runs shorter than this on average travel packed
_PACK_CHUNK = 32 << 20  # bytes per packed message


class NcclOptions(P2POptions):
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Process-group backend; `auto` is NCCL for a CUDA KV cache and gloo for a CPU one."""


class PairInfo(msgspec.Struct, kw_only=True):
    store_host: str
    store_port: int
    pair_id: str
    backend: str


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


@dataclass
class _Job:
    send: bool  # send (producer) or recv (consumer)
    request_id: str
    runs: list[tuple[int, int, int]]  # (src_start, dst_start, length)
    tag: int
    started: float


class _Pair(threading.Thread):
    """One side of a two-rank process group; runs its jobs one at a time."""

    def __init__(
        self, owner: NcclConnector, pair_id: str, rank: int, store: Any, backend: str
    ) -> None:
        super().__init__(daemon=True, name=f"kv-nccl-pair-{pair_id[:8]}-r{rank}")
        self.owner, self.pair_id, self.rank, self.store, self.backend = (
            owner,
            pair_id,
            rank,
            store,
            backend,
        )
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.broken: str | None = None
        self._staging: list[torch.Tensor] | None = None  # two packing buffers, made on first use

    def run(self) -> None:
        from torch.distributed import PrefixStore

        owner = self.owner
        timeout = datetime.timedelta(seconds=owner.timeout_s)
        try:
            if isinstance(self.store, tuple):  # consumer: dial the producer's store
                from torch.distributed import TCPStore

                host, port = self.store
                self.store = TCPStore(host, port, 2, False, timeout)
            prefix = PrefixStore(f"splitserve/kv/{self.pair_id}", self.store)
            pg = self._make_group(prefix, timeout)
        except Exception as e:
            self.broken = f"building the {self.backend} process group failed: {e}"
            owner._submit("pair_ready", (self, self.broken))
            return
        owner._submit("pair_ready", (self, None))
        while True:
            job = self.jobs.get()
            if job is None:
                break
            if self.broken is None:
                try:
                    self._run(pg, job, timeout)
                    owner._submit("job_done", (self, job, None))
                    continue
                except Exception as e:
                    self.broken = f"{'send' if job.send else 'recv'} failed: {e}"
            owner._submit("job_done", (self, job, self.broken))
        try:
            pg.abort() if self.broken else pg.shutdown()
        except Exception:
            logger.debug("process group teardown failed", exc_info=True)

    def _make_group(self, prefix: Any, timeout: datetime.timedelta) -> Any:
        import torch.distributed as dist

        if self.backend == "nccl":
            import torch

            torch.cuda.set_device(self.owner.device)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            return dist.ProcessGroupNCCL(prefix, self.rank, 2, options)
        return dist.ProcessGroupGloo(prefix, self.rank, 2, timeout)

    def _run(self, pg: Any, job: _Job, timeout: datetime.timedelta) -> None:
        blocks = self.owner.blocks
        assert blocks is not None
        nblocks = sum(n for _, _, n in job.runs)
        if len(job.runs) > 1 and nblocks * blocks.shape[1] < _PACK_BELOW * len(job.runs):
            self._run_packed(pg, job, timeout, blocks)
        else:  # long runs: each one is a contiguous region, sent in place
            peer = 1 - self.rank
            works = []
            for src, dst, n in job.runs:
                if job.send:
                    works.append(pg.send([blocks[src : src + n]], peer, job.tag))
                else:
                    works.append(pg.recv([blocks[dst : dst + n]], peer, job.tag))
            for work in works:
                work.wait(timeout)
        if self.backend == "nccl":
            import torch

            torch.cuda.synchronize(self.owner.device)

    def _run_packed(
        self, pg: Any, job: _Job, timeout: datetime.timedelta, blocks: torch.Tensor
    ) -> None:
        """Scattered blocks: gather them into chunks, one message each (per-message overhead
        dominates small ones), through two reused staging buffers so packing overlaps the wire.
        Both sides derive the same chunks from the same runs."""
        import torch

        ids = [(s if job.send else d) + i for s, d, n in job.runs for i in range(n)]
        per = max(1, _PACK_CHUNK // blocks.shape[1])
        chunks = [
            torch.tensor(ids[i : i + per], device=blocks.device) for i in range(0, len(ids), per)
        ]
        if self._staging is None or self._staging[0].shape[0] < per:
            # Reused, so pages are faulted in once (a fresh buffer per chunk costs more than
            # the copy itself).
            self._staging = [
                torch.empty((per, blocks.shape[1]), dtype=torch.uint8, device=blocks.device)
                for _ in range(2)
            ]
        words = _as_words(blocks)  # gather/scatter 8 bytes at a time
        peer = 1 - self.rank
        if job.send:
            previous = None
            for i, chunk in enumerate(chunks):
                buf = self._staging[i % 2][: len(chunk)]
                torch.index_select(words, 0, chunk, out=_as_words(buf))
                work = pg.send([buf], peer, job.tag)
                if previous is not None:  # the buffer chunk i + 1 packs into is free again
                    previous.wait(timeout)
                previous = work
            if previous is not None:
                previous.wait(timeout)
            return
        posted = [
            pg.recv([self._staging[i % 2][: len(c)]], peer, job.tag)
            for i, c in enumerate(chunks[:2])
        ]
        for i, chunk in enumerate(chunks):
            posted[i].wait(timeout)
            buf = self._staging[i % 2][: len(chunk)]
            words.index_copy_(0, chunk, _as_words(buf))
            if i + 2 < len(chunks):
                nxt = chunks[i + 2]
                posted.append(pg.recv([self._staging[i % 2][: len(nxt)]], peer, job.tag))


def _as_words(t: torch.Tensor) -> torch.Tensor:
    """A [rows, nbytes] uint8 tensor as int64 words when the row size allows (faster copies)."""
    import torch

    return t.view(torch.int64) if t.shape[1] % 8 == 0 else t


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
        self._pairs: dict[str, _Pair] = {}  # producer side, by pair id
        self._pair_threads: list[_Pair] = []  # every pair started, both sides: joined at close
        self._tags = itertools.count(1)

    # ------------------------------------------------------------ producer
    def _io_hello(self, message: Hello) -> bytes:
        from torch.distributed import TCPStore

        timeout = datetime.timedelta(seconds=self.timeout_s)
        store = TCPStore(self.bind_host, 0, 2, True, timeout, wait_for_workers=False)
        pair_id = uuid.uuid4().hex
        pair = self._pairs[pair_id] = _Pair(self, pair_id, 0, store, self.backend)
        self._start_pair(pair)
        logger.info("KV pair %s with %s (%s)", pair_id[:8], message.engine_id, self.backend)
        return msgspec.msgpack.encode(
            PairInfo(
                store_host=self.host, store_port=store.port, pair_id=pair_id, backend=self.backend
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
        job = _Job(
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
        pair = _Pair(self, info.pair_id, 1, (info.store_host, info.store_port), self.backend)
        peer.transport = pair
        self._start_pair(pair)  # `pair_ready` arrives when the group is built

    def _io_begin_load(self, load: Load) -> None:
        pair, spec = load.peer.transport, load.spec
        assert isinstance(pair, _Pair)
        tag = next(self._tags) % (1 << 30)
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

    def _io_on_send_reply(self, load: Load, pair: _Pair, tag: int, reply: Any) -> None:
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
            _Job(
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

    def _io_sent(self, pair: _Pair, job: _Job, error: str | None) -> None:
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

    def _io_received(self, pair: _Pair, job: _Job, error: str | None) -> None:
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

    def _start_pair(self, pair: _Pair) -> None:
        self._pair_threads = [p for p in self._pair_threads if p.is_alive()] + [pair]
        pair.start()

    def _drop_pair(self, pair: _Pair) -> None:
        self._pairs.pop(pair.pair_id, None)
        pair.jobs.put(None)

    def _io_disconnect(self, peer: Peer) -> None:
        pair = peer.transport
        if isinstance(pair, _Pair):
            pair.jobs.put(None)

    def _io_close(self) -> None:
        pairs = self._pair_threads
        for pair in pairs:
            pair.jobs.put(None)
        for pair in pairs:  # a pair thread still tearing down its group at exit aborts Python
            pair.join(timeout=self.timeout_s)
