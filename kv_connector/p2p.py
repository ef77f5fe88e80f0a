"""What the NIXL and NCCL connectors share: P/D bookkeeping, leases, and the I/O thread.

Scheduler side: a consumer request carrying `do_remote_prefill` becomes a `LoadSpec` (which
producer blocks land in which local blocks); a finished producer request carrying
`do_remote_decode` becomes a `HoldSpec` and kv_transfer_params for the router.

Worker side: one I/O thread per connector owns every socket and the transport, so the engine
thread never blocks. `start_load_kv` and `save_kv` hand it work through a queue; results come back
through `get_finished`. On the producer the thread serves the side channel and runs the leases:

```
request_finished ─▶ HoldSpec ─▶ held (lease clock starts) ─┬─ consumer Release ─▶ done_sending
                                                            └─ lease_s passes    ─▶ done_sending
                                                                (expired_leases += 1; a later
                                                                 Release is told "lease expired")
```

A consumer trusts what it read only after the producer answers its Release with `held=True`:
the blocks were held (so unchanged) for the whole transfer. A Release may reach the producer
before its engine has stepped past `request_finished`; it waits (up to `timeout_s`) for the hold.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec
from pydantic import Field

from splitserve.kv_connector.base import (
    EngineInfo,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
    RequestView,
)
from splitserve.kv_connector.config import ConnectorOptions, KVTransferConfig
from splitserve.kv_connector.layout import (
    block_bytes,
    block_checksums,
    block_range,
    cdiv,
    first_mismatch,
)
from splitserve.kv_connector.side_channel import (
    COMMON_MESSAGES,
    Hello,
    HelloReply,
    Release,
    ReleaseReply,
    SideChannel,
    advertised_host,
    resolve_port,
)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_GONE_MEMORY = 4096  # released/expired request ids remembered to answer late callers precisely


class P2POptions(ConnectorOptions):
    timeout_s: float = Field(default=30.0, gt=0)
    """Longest wait for a peer's reply or a transfer before the load fails."""


# ---------------------------------------------------------------- scheduler → worker messages
class LoadSpec(msgspec.Struct, kw_only=True):
    request_id: str
    remote_request_id: str
    remote_engine_id: str
    remote_host: str
    remote_port: int
    block_offset: int  # index of the first loaded block within the request's blocks
    remote_block_ids: list[int]  # producer blocks to read, in order
    local_block_ids: list[int]  # where they land, same length
    error: str | None = None  # set when the request's kv_transfer_params were unusable


class HoldSpec(msgspec.Struct, kw_only=True):
    request_id: str
    block_ids: list[int]  # positions [0, num_tokens) of the request
    lease_s: float


class ReleaseSpec(msgspec.Struct, kw_only=True):
    """Free a producer's blocks without reading them (everything was a local cache hit)."""

    request_id: str
    remote_request_id: str
    remote_host: str
    remote_port: int


class P2PMetadata(KVConnectorMetadata, kw_only=True):
    loads: list[LoadSpec] = msgspec.field(default_factory=list)
    holds: list[HoldSpec] = msgspec.field(default_factory=list)
    releases: list[ReleaseSpec] = msgspec.field(default_factory=list)


class RemotePrefill(msgspec.Struct, kw_only=True):
    """The kv_transfer_params a consumer request arrives with."""

    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_block_ids: list[int]
    remote_request_id: str
    num_tokens: int
    connector: str | None = None


@dataclass
class _Pending:
    """Between get_num_new_matched_tokens and update_state_after_alloc (scheduler side)."""

    remote: RemotePrefill | None
    num_computed_tokens: int
    error: str | None = None


# ---------------------------------------------------------------- I/O-thread state
@dataclass
class _Held:
    block_ids: list[int]
    deadline: float
    checksums: list[int] | None
    busy: bool = False  # a transfer reads the blocks now: the lease cannot end under it


@dataclass
class Peer:
    address: str
    engine_id: str
    state: str = "hello"  # hello → ready | dead
    waiting: list[Load] = field(default_factory=list)
    info: HelloReply | None = None
    transport: Any = None  # the subclass's per-peer state


@dataclass
class Load:
    spec: LoadSpec
    peer: Peer
    started: float
    nbytes: int
    state: str = "queued"
    transport: Any = None  # the subclass's per-load state


@dataclass
class _Deferred:
    identity: bytes
    seq: bytes
    message: Any
    deadline: float


class P2PConnectorBase(KVConnectorBase):
    """Scheduler side and I/O-thread skeleton; subclasses supply the transport (`_io_*` hooks)."""

    Options = P2POptions
    MESSAGES: ClassVar[tuple[type, ...]] = ()  # transport-specific side-channel messages

    def __init__(
        self, config: KVTransferConfig, role: KVConnectorRole, engine_info: EngineInfo
    ) -> None:
        super().__init__(config, role, engine_info)
        self.engine_id = engine_info.engine_id
        self.bind_host = config.side_channel_host
        self.port = resolve_port(config.side_channel_host, config.side_channel_port, self.engine_id)
        self.host = advertised_host(config.side_channel_host)
        self.timeout_s: float = self.options.timeout_s
        # Scheduler side.
        self._pending: dict[str, _Pending] = {}
        self._meta = P2PMetadata()
        # Worker side: engine thread ↔ I/O thread.
        self.blocks: torch.Tensor | None = None  # [num_blocks, block_nbytes] uint8 view
        self.channel: SideChannel | None = None
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._done_sending: set[str] = set()
        self._done_recving: set[str] = set()
        self._failed: dict[str, str] = {}
        # I/O thread only.
        self._held: dict[str, _Held] = {}
        self._gone: OrderedDict[str, str] = OrderedDict()
        self._deferred: list[_Deferred] = []
        self._peers: dict[str, Peer] = {}
        self._loads: dict[str, Load] = {}

    # ============================================================ scheduler side
    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_prefill"):
            return 0, False
        if not self.is_consumer:
            logger.warning(
                "%s: do_remote_prefill on a producer-only instance; ignored", request.request_id
            )
            return 0, False
        rid = request.request_id
        loadable = request.num_prompt_tokens - 1  # the last prompt token is computed here
        try:
            remote = self._parse_remote(params)
        except ValueError as e:
            num = loadable - num_computed_tokens
            if num > 0:  # report it through `failed` so the failure policy applies
                self._pending[rid] = _Pending(None, num_computed_tokens, str(e))
                return num, True
            logger.warning("%s: %s", rid, e)
            return 0, False
        num = min(remote.num_tokens, loadable) - num_computed_tokens
        if num <= 0:  # local prefix cache covers it: only free the producer's blocks
            self._meta.releases.append(
                ReleaseSpec(
                    request_id=rid,
                    remote_request_id=remote.remote_request_id,
                    remote_host=remote.remote_host,
                    remote_port=remote.remote_port,
                )
            )
            return 0, False
        self._pending[rid] = _Pending(remote, num_computed_tokens)
        return num, True

    def _parse_remote(self, params: dict[str, Any]) -> RemotePrefill:
        try:
            remote = msgspec.convert(params, RemotePrefill)
        except msgspec.ValidationError as e:
            raise ValueError(f"invalid kv_transfer_params for a remote prefill: {e}") from None
        if remote.connector is not None and remote.connector != self.config.connector:
            raise ValueError(
                f"the producer serves this KV with connector {remote.connector!r}, "
                f"this instance uses {self.config.connector!r}"
            )
        need = cdiv(remote.num_tokens, self.engine_info.block_size)
        if remote.num_tokens < 0 or len(remote.remote_block_ids) < need:
            raise ValueError(
                f"kv_transfer_params: {len(remote.remote_block_ids)} remote blocks "
                f"cannot hold {remote.num_tokens} tokens"
            )
        return remote

    def update_state_after_alloc(
        self, request: RequestView, block_ids: list[int], num_external_tokens: int
    ) -> None:
        pending = self._pending.pop(request.request_id, None)
        if pending is None:
            return
        remote, rid = pending.remote, request.request_id
        if num_external_tokens <= 0:
            if remote is not None:
                self._meta.releases.append(
                    ReleaseSpec(
                        request_id=rid,
                        remote_request_id=remote.remote_request_id,
                        remote_host=remote.remote_host,
                        remote_port=remote.remote_port,
                    )
                )
            return
        rng = block_range(
            pending.num_computed_tokens, num_external_tokens, self.engine_info.block_size
        )
        error = pending.error
        if remote is None:
            remote = RemotePrefill(
                remote_engine_id="",
                remote_host="",
                remote_port=0,
                remote_block_ids=[],
                remote_request_id="",
                num_tokens=0,
            )
        elif rng.stop > len(block_ids) or rng.stop > len(remote.remote_block_ids):
            error = (
                f"{num_external_tokens} tokens from position {pending.num_computed_tokens} "
                f"need blocks up to {rng.stop}, the request has {len(block_ids)} "
                f"and the producer {len(remote.remote_block_ids)}"
            )
        self._meta.loads.append(
            LoadSpec(
                request_id=rid,
                remote_request_id=remote.remote_request_id,
                remote_engine_id=remote.remote_engine_id,
                remote_host=remote.remote_host,
                remote_port=remote.remote_port,
                block_offset=rng.start,
                remote_block_ids=[] if error else remote.remote_block_ids[rng.start : rng.stop],
                local_block_ids=[] if error else list(block_ids[rng.start : rng.stop]),
                error=error,
            )
        )

    def build_connector_meta(self) -> KVConnectorMetadata:
        meta, self._meta = self._meta, P2PMetadata()
        return meta

    def request_finished(
        self, request: RequestView, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        pending = self._pending.pop(rid, None)
        if pending is not None and pending.remote is not None:
            r = pending.remote
            self._meta.releases.append(
                ReleaseSpec(
                    request_id=rid,
                    remote_request_id=r.remote_request_id,
                    remote_host=r.remote_host,
                    remote_port=r.remote_port,
                )
            )
        params = request.kv_transfer_params or {}
        if not (self.is_producer and params.get("do_remote_decode")):
            return False, None
        num_tokens = min(request.num_computed_tokens, request.num_prompt_tokens)
        held = list(block_ids[: cdiv(num_tokens, self.engine_info.block_size)])
        if num_tokens <= 0 or not held:
            return False, None
        lease_s = self.config.lease_s
        asked = params.get("lease_s")
        if isinstance(asked, (int, float)) and not isinstance(asked, bool) and asked > 0:
            lease_s = min(float(asked), lease_s)
        self._meta.holds.append(HoldSpec(request_id=rid, block_ids=held, lease_s=lease_s))
        return True, {
            "do_remote_prefill": True,
            "connector": self.config.connector,
            "remote_engine_id": self.engine_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_block_ids": held,
            "remote_request_id": rid,
            "num_tokens": num_tokens,
            "lease_s": lease_s,
        }

    # ============================================================ worker side (engine thread)
    def register_kv_caches(self, kv_cache: torch.Tensor) -> None:
        info = self.engine_info
        self.blocks = block_bytes(kv_cache, info.num_blocks, info.block_nbytes)
        self._io_setup(kv_cache)
        bind = (self.bind_host, self.port) if self.is_producer else None
        self.channel = SideChannel(COMMON_MESSAGES + self.MESSAGES, bind)
        self._thread = threading.Thread(
            target=self._io_run, daemon=True, name=f"kv-{self.config.connector}-{self.engine_id}"
        )
        self._thread.start()
        if bind:
            logger.info("KV side channel of %s on tcp://%s:%d", self.engine_id, *bind)

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        assert isinstance(meta, P2PMetadata), type(meta)
        # Holds first and as early as possible: a consumer's Release may already be waiting.
        for hold in meta.holds:
            checksums = None
            if self.config.verify:
                assert self.blocks is not None
                checksums = block_checksums(self.blocks, hold.block_ids)
            self._submit("hold", (hold, checksums))
        for load in meta.loads:
            if load.error is not None:
                self.stats.num_failed_transfers += 1
                logger.warning("%s: KV load failed: %s", load.request_id, load.error)
                self._finish(load.request_id, failed=load.error)
            else:
                self._submit("load", load)
        for release in meta.releases:
            self._submit("release", release)

    def save_kv(self, meta: KVConnectorMetadata) -> None:
        """Nothing to push: holds began in start_load_kv, consumers pull."""

    def get_finished(self) -> tuple[set[str], set[str], dict[str, str]]:
        with self._lock:
            out = (self._done_sending, self._done_recving, self._failed)
            self._done_sending, self._done_recving, self._failed = set(), set(), {}
        return out

    def shutdown(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        assert self.channel is not None
        self.channel.wake()
        self._thread.join(timeout=10)
        if self._thread.is_alive():
            logger.error("KV connector I/O thread of %s did not stop", self.engine_id)
        self._thread = None

    def _submit(self, kind: str, item: Any) -> None:
        """Hand work or a transport event to the I/O thread (any thread)."""
        if self.channel is None:
            raise RuntimeError("register_kv_caches must be called before transfers")
        if self._stop.is_set():
            return  # shutting down: nobody will read it
        self._inbox.put((kind, item))
        assert self.channel is not None
        self.channel.wake()

    def _finish(self, request_id: str, *, sent: bool = False, failed: str | None = None) -> None:
        """Report a result to the engine (any thread)."""
        with self._lock:
            if sent:
                self._done_sending.add(request_id)
            elif failed is not None:
                self._failed[request_id] = failed
            else:
                self._done_recving.add(request_id)

    # ============================================================ I/O thread
    def _io_run(self) -> None:
        assert self.channel is not None
        try:
            while not self._stop.is_set():
                events = self.channel.poll(self._io_timeout_ms())
                self._io_step(events)
        except Exception:
            logger.exception("KV connector I/O thread of %s died", self.engine_id)
        finally:
            for load in list(self._loads.values()):
                self._io_fail(load, "KV connector shut down", release=False)
            self._io_close()
            self.channel.close()

    def _io_step(self, events: set[Any]) -> None:
        channel = self.channel
        assert channel is not None
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                break
            self._guard(self._io_command, kind, item)
        for identity, seq, message in channel.incoming(events):
            self._guard(self._io_request, identity, seq, message)
        channel.dispatch_replies(events)
        self._guard(self._io_progress)
        now = time.monotonic()
        channel.expire_calls(now)
        self._io_expire(now)

    def _guard(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception:
            logger.exception("KV connector %s: error in %s", self.engine_id, fn.__name__)

    def _io_timeout_ms(self) -> float:
        busy = self._loads or self._deferred or self._io_busy()
        interval = 1.0 if busy else 100.0
        if self._held:
            next_expiry = min(h.deadline for h in self._held.values())
            interval = min(interval, max(0.0, (next_expiry - time.monotonic()) * 1000))
        return interval

    def _io_command(self, kind: str, item: Any) -> None:
        if kind == "hold":
            hold, checksums = item
            deadline = time.monotonic() + hold.lease_s
            self._held[hold.request_id] = _Held(hold.block_ids, deadline, checksums)
            waiting = [d for d in self._deferred if _request_id(d.message) == hold.request_id]
            for d in waiting:
                self._deferred.remove(d)
                self._io_request(d.identity, d.seq, d.message)
        elif kind == "load":
            self._io_start_load(item)
        elif kind == "release":
            address = f"tcp://{item.remote_host}:{item.remote_port}"
            self._io_call(
                address, Release(request_id=item.remote_request_id), lambda r: None, lambda e: None
            )
        else:
            self._io_transport_event(kind, item)

    def _io_call(self, address: str, message: Any, on_reply: Any, on_error: Any) -> None:
        assert self.channel is not None
        self.channel.call(address, message, on_reply, on_error, self.timeout_s)

    # ------------------------------------------------------------ producer
    def _io_request(self, identity: bytes, seq: bytes, message: Any) -> None:
        assert self.channel is not None
        if isinstance(message, Hello):
            info = self.engine_info
            reply = HelloReply(
                engine_id=self.engine_id,
                connector=self.config.connector,
                model_fingerprint=info.model_fingerprint,
                block_size=info.block_size,
                block_nbytes=info.block_nbytes,
                num_blocks=info.num_blocks,
            )
            ours = (
                self.config.connector,
                info.model_fingerprint,
                info.block_size,
                info.block_nbytes,
            )
            theirs = (
                message.connector,
                message.model_fingerprint,
                message.block_size,
                message.block_nbytes,
            )
            if ours == theirs:  # else the consumer explains the mismatch from our reply
                try:
                    reply.transport = self._io_hello(message)
                except Exception as e:
                    logger.exception("KV handshake from %s failed", message.engine_id)
                    reply.error = f"producer {self.engine_id} handshake failed: {e}"
            self.channel.reply(identity, seq, reply)
        elif isinstance(message, Release):
            held = self._io_lookup(identity, seq, message)
            if isinstance(held, str):
                self.channel.reply(identity, seq, ReleaseReply(held=False, error=held))
            elif held is not None:
                sums = self._io_checksums(held) if message.want_checksums else None
                if message.loaded:
                    nbytes = len(held.block_ids) * self.engine_info.block_nbytes
                    self.stats.bytes_saved += nbytes
                    self.stats.blocks_saved += len(held.block_ids)
                if not held.busy:
                    self._io_unhold(message.request_id, "released")
                self.channel.reply(identity, seq, ReleaseReply(held=True, checksums=sums))
        else:
            self._io_other_request(identity, seq, message)

    def _io_lookup(self, identity: bytes, seq: bytes, message: Any) -> _Held | str | None:
        """The hold a request names; a reason string when it is gone; None when deferred."""
        rid = _request_id(message)
        held = self._held.get(rid)
        if held is not None:
            return held
        if rid in self._gone:
            return f"producer {self.engine_id} no longer holds request {rid}: {self._gone[rid]}"
        self._deferred.append(_Deferred(identity, seq, message, time.monotonic() + self.timeout_s))
        return None

    def _io_checksums(self, held: _Held) -> list[int]:
        """Checksums taken when the hold began (verify on here), else of the held blocks now."""
        if held.checksums is None:
            assert self.blocks is not None
            held.checksums = block_checksums(self.blocks, held.block_ids)
        return held.checksums

    def _io_unhold(self, request_id: str, why: str) -> None:
        self._held.pop(request_id, None)
        self._gone[request_id] = why
        while len(self._gone) > _GONE_MEMORY:
            self._gone.popitem(last=False)
        self._finish(request_id, sent=True)

    def _io_expire(self, now: float) -> None:
        assert self.channel is not None
        for rid, held in list(self._held.items()):
            if held.deadline <= now and not held.busy:
                self.stats.expired_leases += 1
                logger.warning(
                    "%s: lease of %d blocks expired before the consumer was done",
                    rid,
                    len(held.block_ids),
                )
                self._io_unhold(rid, "lease expired")
        for d in [d for d in self._deferred if d.deadline <= now]:
            self._deferred.remove(d)
            reason = f"producer {self.engine_id} does not know request {_request_id(d.message)}"
            self.channel.reply(d.identity, d.seq, self._io_refusal(d.message, reason))

    def _io_refusal(self, message: Any, reason: str) -> Any:
        """The negative reply to a deferred request that timed out."""
        return ReleaseReply(held=False, error=reason)

    # ------------------------------------------------------------ consumer
    def _io_start_load(self, spec: LoadSpec) -> None:
        address = f"tcp://{spec.remote_host}:{spec.remote_port}"
        peer = self._peers.get(address)
        if peer is None:
            peer = self._peers[address] = Peer(address, spec.remote_engine_id)
            info = self.engine_info
            hello = Hello(
                engine_id=self.engine_id,
                connector=self.config.connector,
                model_fingerprint=info.model_fingerprint,
                block_size=info.block_size,
                block_nbytes=info.block_nbytes,
            )
            self._io_call(
                address,
                hello,
                lambda r: self._io_on_hello(peer, r),
                lambda e: self._io_peer_failed(peer, f"handshake: {e}"),
            )
        nbytes = len(spec.local_block_ids) * self.engine_info.block_nbytes
        load = Load(spec, peer, time.monotonic(), nbytes)
        self._loads[spec.request_id] = load
        if peer.state == "ready":
            self._guard_load(load, self._io_begin_load, load)
        else:
            peer.waiting.append(load)

    def _io_on_hello(self, peer: Peer, reply: Any) -> None:
        if peer.state == "dead":
            return
        info = self.engine_info
        problem = None
        if not isinstance(reply, HelloReply):
            problem = f"unexpected handshake reply {type(reply).__name__}"
        elif reply.error:
            problem = reply.error
        elif peer.engine_id and reply.engine_id != peer.engine_id:
            problem = f"{peer.address} is engine {reply.engine_id}, expected {peer.engine_id}"
        elif reply.connector != self.config.connector:
            problem = f"producer uses connector {reply.connector!r}"
        elif reply.model_fingerprint != info.model_fingerprint:
            problem = (
                f"producer model fingerprint {reply.model_fingerprint} differs from "
                f"this engine's {info.model_fingerprint} (different model, dtype or "
                "block size: its KV is not usable here)"
            )
        elif (reply.block_size, reply.block_nbytes) != (info.block_size, info.block_nbytes):
            problem = (
                f"producer blocks are {reply.block_size} tokens/{reply.block_nbytes} "
                f"bytes, this engine's {info.block_size}/{info.block_nbytes}"
            )
        if problem is not None:
            self._io_peer_failed(peer, problem, release=True)  # it is alive: let it free
            return
        peer.info = reply
        try:
            self._io_connect(peer, reply)
        except Exception as e:
            logger.exception("KV connect to %s failed", peer.address)
            self._io_peer_failed(peer, f"connecting to producer failed: {e}")

    def _io_peer_ready(self, peer: Peer) -> None:
        if peer.state == "dead":
            return
        peer.state = "ready"
        waiting, peer.waiting = peer.waiting, []
        for load in waiting:
            if self._loads.get(load.spec.request_id) is load:
                self._guard_load(load, self._io_begin_load, load)

    def _io_peer_failed(self, peer: Peer, reason: str, release: bool = False) -> None:
        """Drop a producer and fail its loads; `release` tells it to free their blocks (when it
        is alive but unusable, e.g. a different model)."""
        if peer.state == "dead":
            return
        peer.state = "dead"
        if self._peers.get(peer.address) is peer:
            del self._peers[peer.address]
        reason = f"producer {peer.engine_id or peer.address}: {reason}"
        logger.warning("KV peer %s dropped: %s", peer.address, reason)
        try:
            self._io_disconnect(peer)
        except Exception:
            logger.exception("KV disconnect from %s failed", peer.address)
        loads = [ld for ld in self._loads.values() if ld.peer is peer]
        for load in loads:
            self._io_fail(load, reason, release=False)
        assert self.channel is not None
        self.channel.drop(peer.address, reason)
        if release:
            for load in loads:
                self._io_call(
                    peer.address,
                    Release(request_id=load.spec.remote_request_id),
                    lambda r: None,
                    lambda e: None,
                )

    def _guard_load(self, load: Load, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as e:
            logger.exception("%s: KV load step failed", load.spec.request_id)
            self._io_fail(load, f"{type(e).__name__}: {e}")

    def _io_confirm(self, load: Load) -> None:
        """The bytes landed: ask the producer whether they were still held, then finish."""
        load.state = "confirming"
        spec = load.spec
        self._io_call(
            load.peer.address,
            Release(
                request_id=spec.remote_request_id, want_checksums=self.config.verify, loaded=True
            ),
            lambda r: self._io_on_confirm(load, r),
            lambda e: self._io_fail(load, f"confirming with the producer: {e}", release=False),
        )

    def _io_on_confirm(self, load: Load, reply: Any) -> None:
        if not isinstance(reply, ReleaseReply):
            self._io_fail(load, f"unexpected reply {type(reply).__name__}", release=False)
        elif not reply.held:
            self._io_fail(load, reply.error or "producer no longer holds the blocks", release=False)
        else:
            self._io_land(load, reply.checksums)

    def _io_land(self, load: Load, checksums: list[int] | None) -> None:
        """Verify (when asked) and report a load whose bytes are all in place."""
        spec = load.spec
        if self.config.verify:
            n = len(spec.local_block_ids)
            expected = (checksums or [])[spec.block_offset : spec.block_offset + n]
            if len(expected) != n:
                self._io_fail(
                    load, "verify is on but the producer sent no checksums", release=False
                )
                return
            assert self.blocks is not None
            bad = first_mismatch(expected, block_checksums(self.blocks, spec.local_block_ids))
            if bad is not None:
                self._io_fail(
                    load,
                    f"checksum mismatch in block {spec.block_offset + bad} "
                    f"(local block {spec.local_block_ids[bad]})",
                    release=False,
                )
                return
        self._loads.pop(spec.request_id, None)
        seconds = time.monotonic() - load.started
        self.stats.record(seconds, load.nbytes, len(spec.local_block_ids), loaded=True)
        logger.debug(
            "%s: loaded %d blocks (%d bytes) in %.4fs",
            spec.request_id,
            len(spec.local_block_ids),
            load.nbytes,
            seconds,
        )
        self._finish(spec.request_id)

    def _io_fail(self, load: Load, reason: str, release: bool = True) -> None:
        spec = load.spec
        if self._loads.get(spec.request_id) is not load:
            return  # already finished
        del self._loads[spec.request_id]
        try:
            self._io_abort_load(load)
        except Exception:
            logger.exception("%s: aborting the transfer failed", spec.request_id)
        self.stats.num_failed_transfers += 1
        logger.warning("%s: KV load failed: %s", spec.request_id, reason)
        self._finish(spec.request_id, failed=reason)
        if release and load.peer.state != "dead":  # let the producer free its blocks early
            self._io_call(
                load.peer.address,
                Release(request_id=spec.remote_request_id),
                lambda r: None,
                lambda e: None,
            )

    # ------------------------------------------------------------ transport hooks
    def _io_setup(self, kv_cache: torch.Tensor) -> None:
        """Engine thread, in register_kv_caches: create the transport, register memory."""

    def _io_hello(self, message: Hello) -> bytes:
        """Producer: the transport part of the handshake reply."""
        return b""

    def _io_connect(self, peer: Peer, reply: HelloReply) -> None:
        """Consumer: set up the transport to a producer; call `_io_peer_ready` when done."""
        self._io_peer_ready(peer)

    def _io_begin_load(self, load: Load) -> None:
        """Consumer: start moving the load's blocks; end with `_io_confirm`/`_io_land`/`_io_fail`."""
        raise NotImplementedError

    def _io_abort_load(self, load: Load) -> None:
        """Consumer: stop whatever the transport is doing for a failed load."""

    def _io_disconnect(self, peer: Peer) -> None:
        """Consumer: forget a producer's transport state."""

    def _io_progress(self) -> None:
        """Each loop turn: drive the transport, poll transfer states."""

    def _io_busy(self) -> bool:
        """Whether the transport needs frequent polling."""
        return False

    def _io_other_request(self, identity: bytes, seq: bytes, message: Any) -> None:
        """Producer: a transport-specific side-channel request."""
        logger.warning("KV side channel: unexpected %s", type(message).__name__)

    def _io_transport_event(self, kind: str, item: Any) -> None:
        """An event a transport thread posted with `_submit`."""
        raise ValueError(f"unknown I/O event {kind!r}")

    def _io_close(self) -> None:
        """I/O thread, at exit: release the transport."""


def _request_id(message: Any) -> str:
    return message.request_id
