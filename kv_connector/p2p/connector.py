"""P2PConnectorBase: one connector class for both roles, with one I/O thread per worker.

Worker side: the I/O thread owns every socket and the transport, so the engine thread never
blocks; `start_load_kv` hands it work through a queue, results come back through `get_finished`.
The scheduler half lives in scheduler.py, the producer and consumer halves of the thread in
producer.py and consumer.py; a transport (nixl, nccl) overrides the `_io_*` hooks at the end.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from abc import abstractmethod
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import Field

from splitserve.kv_connector.base import (
    EngineInfo,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
)
from splitserve.kv_connector.config import ConnectorOptions, KVTransferConfig
from splitserve.kv_connector.hugepages import use_huge_pages
from splitserve.kv_connector.layout import block_bytes, block_checksums
from splitserve.kv_connector.p2p.consumer import ConsumerSide, Load, Peer
from splitserve.kv_connector.p2p.messages import P2PMetadata
from splitserve.kv_connector.p2p.producer import ProducerSide, _Deferred, _Held
from splitserve.kv_connector.p2p.scheduler import P2PSchedulerSide, _Pending
from splitserve.kv_connector.side_channel import (
    COMMON_MESSAGES,
    Hello,
    HelloReply,
    Release,
    SideChannel,
    advertised_host,
    resolve_port,
)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


class P2POptions(ConnectorOptions):
    timeout_s: float = Field(default=30.0, gt=0)
    """Longest wait for a peer's reply or a transfer before the load fails."""


class P2PConnectorBase(P2PSchedulerSide, ProducerSide, ConsumerSide, KVConnectorBase):
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
        # I/O thread only.
        self._held: dict[str, _Held] = {}
        self._gone: OrderedDict[str, str] = OrderedDict()
        self._deferred: list[_Deferred] = []
        self._peers: dict[str, Peer] = {}
        self._loads: dict[str, Load] = {}

    # ============================================================ worker side (engine thread)
    def register_kv_caches(self, kv_cache: torch.Tensor) -> None:
        info = self.engine_info
        self.blocks = block_bytes(kv_cache, info.num_blocks, info.block_nbytes)
        use_huge_pages(kv_cache)  # before _io_setup registers (pins) the memory
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
        if sent:
            self.finished.sent(request_id)
        elif failed is not None:
            self.finished.failed(request_id, failed)
        else:
            self.finished.recved(request_id)

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
        """How long the loop may sleep: 1 ms while the transport needs polling (`_io_busy`) or
        a request waits for its hold, else until the next lease ends and at most 100 ms (call
        timeouts are checked then). Loads need no polling of their own: replies, inbox items and
        transport events all wake the loop, and a two-sided transfer gets the cores to itself."""
        busy = self._deferred or self._io_busy()
        interval = 1.0 if busy else 100.0
        wait_ms = (self._io_next_expiry() - time.monotonic()) * 1000
        return min(interval, max(0.0, wait_ms))

    def _io_command(self, kind: str, item: Any) -> None:
        if kind == "hold":
            hold, checksums = item
            self._io_take_hold(hold.request_id, hold.block_ids, hold.lease_s, checksums)
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

    # ------------------------------------------------------------ transport hooks
    def _io_setup(self, kv_cache: torch.Tensor) -> None:
        """Engine thread, in register_kv_caches: create the transport, register memory."""

    def _io_hello(self, message: Hello) -> bytes:
        """Producer: the transport part of the handshake reply."""
        return b""

    def _io_connect(self, peer: Peer, reply: HelloReply) -> None:
        """Consumer: set up the transport to a producer; call `_io_peer_ready` when done."""
        self._io_peer_ready(peer)

    @abstractmethod
    def _io_begin_load(self, load: Load) -> None:
        """Consumer: start moving the load's blocks; end with `_io_read` (pull, after `_io_pin`),
        `_io_land` (push) or `_io_fail`."""

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
