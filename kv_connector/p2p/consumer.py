"""Consumer side of the I/O thread: handshakes, loads, confirmation and verification.

```
LoadSpec ─▶ peer known? ──no──▶ Hello ─▶ HelloReply (compatible?) ─▶ transport connect
               │ yes                                                      │
               ▼                                                          ▼
          _io_begin_load ─┬─ Pin ──────────────▶ HoldReply(held) ─┐
                          └─ transport moves the bytes ─▶ Release ─┴─▶ verify ─▶ done
```

A pulling consumer (nixl) trusts what it read only when the producer answers its Pin with
`held=True`: the blocks were held from `request_finished` until the Pin arrived and pinned from
then until the Release, which is sent after the read; the read's own deadline (`timeout_s` from
before the Pin was sent) ends before the pin's. Sending the Pin as the read starts, instead of
asking after it, takes a side-channel round trip off every load. A pushing transport (nccl) has
the producer mark the hold busy when it accepts the send instead. Any failure on the way ends
the load in `failed` with a reason; a failure of the peer itself fails every load bound to it
and drops the cached handshake, so the next request starts afresh.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from splitserve.kv_connector.base import EngineInfo
from splitserve.kv_connector.config import KVTransferConfig
from splitserve.kv_connector.layout import block_checksums, first_mismatch
from splitserve.kv_connector.metrics import KVTransferStats
from splitserve.kv_connector.p2p.messages import LoadSpec
from splitserve.kv_connector.side_channel import (
    Hello,
    HelloReply,
    HoldReply,
    Pin,
    Release,
    SideChannel,
)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


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
    pinned: HoldReply | None = None  # the producer's yes to our Pin (pulling transports)


class ConsumerSide:
    """Mixin of P2PConnectorBase: what the I/O thread does for loads.

    Calls `_io_call`, `_finish` and the transport hooks `_io_connect`, `_io_begin_load`,
    `_io_abort_load`, `_io_disconnect` of P2PConnectorBase.
    """

    config: KVTransferConfig
    engine_info: EngineInfo
    engine_id: str
    stats: KVTransferStats
    timeout_s: float
    blocks: torch.Tensor | None
    channel: SideChannel | None
    _peers: dict[str, Peer]
    _loads: dict[str, Load]

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

    def _io_pin(self, load: Load) -> None:
        """Pulling transports, just before the read starts: ask the producer to keep the blocks
        until our Release; the reply travels while the bytes move."""
        spec = load.spec
        self._io_call(
            load.peer.address,
            Pin(request_id=spec.remote_request_id, want_checksums=self.config.verify),
            lambda r: self._io_on_pin(load, r),
            lambda e: self._io_fail(load, f"pinning the producer's blocks: {e}", release=False),
        )

    def _io_on_pin(self, load: Load, reply: Any) -> None:
        if self._loads.get(load.spec.request_id) is not load:
            return
        if not isinstance(reply, HoldReply):
            self._io_fail(load, f"unexpected reply {type(reply).__name__}", release=False)
        elif not reply.held:
            self._io_fail(load, reply.error or "producer no longer holds the blocks", release=False)
        else:
            load.pinned = reply
            if load.state == "read":
                self._io_land(load, reply.checksums)

    def _io_read(self, load: Load) -> None:
        """Pulling transports: every byte is in. Free the producer's blocks now; land once the
        Pin is confirmed (it usually is already)."""
        load.state = "read"
        spec = load.spec
        self._io_call(
            load.peer.address,
            Release(request_id=spec.remote_request_id, loaded=True),
            lambda r: None,
            lambda e: None,
        )
        if load.pinned is not None:
            self._io_land(load, load.pinned.checksums)

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
