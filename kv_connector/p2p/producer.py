"""Producer side of the I/O thread: serving the side channel, running the leases.

```
request_finished ─▶ HoldSpec ─▶ held (lease clock starts) ─┬─ consumer Release ─▶ done_sending
                                                            └─ lease_s passes    ─▶ done_sending
                                                                (expired_leases += 1; a later
                                                                 Pin/Release is told "lease expired")
```

A consumer's Pin (it is reading now) or a send in progress (nccl) keeps the lease from ending
under a transfer; a Pin lasts until the Release or `timeout_s`, whichever comes first. A Pin or
Release may reach the producer before its engine has stepped past `request_finished`; it waits
(up to `timeout_s`) for the hold to begin instead of being refused.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from splitserve.kv_connector.base import EngineInfo
from splitserve.kv_connector.config import KVTransferConfig
from splitserve.kv_connector.layout import block_checksums
from splitserve.kv_connector.metrics import KVTransferStats
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

_GONE_MEMORY = 4096  # released/expired request ids remembered to answer late callers precisely


@dataclass
class _Held:
    block_ids: list[int]
    deadline: float
    checksums: list[int] | None
    busy: bool = False  # this producer sends them now (nccl): the lease cannot end under it
    pinned_until: float = 0.0  # a consumer reads them (Pin): the lease ends no earlier

    def expires_at(self) -> float:
        """When the lease may end (infinity while a send runs)."""
        return float("inf") if self.busy else max(self.deadline, self.pinned_until)


@dataclass
class _Deferred:
    identity: bytes
    seq: bytes
    message: Any
    deadline: float


class ProducerSide:
    """Mixin of P2PConnectorBase: what the I/O thread does for requests it holds.

    Calls `_io_hello`, `_io_other_request` (transport hooks) and `_finish` of P2PConnectorBase.
    """

    config: KVTransferConfig
    engine_info: EngineInfo
    engine_id: str
    stats: KVTransferStats
    timeout_s: float
    blocks: torch.Tensor | None
    channel: SideChannel | None
    _held: dict[str, _Held]
    _gone: OrderedDict[str, str]
    _deferred: list[_Deferred]

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
        elif isinstance(message, (Pin, Release)):
            held = self._io_lookup(identity, seq, message)
            if isinstance(held, str):
                self.channel.reply(identity, seq, HoldReply(held=False, error=held))
            elif held is not None:
                self.channel.reply(identity, seq, self._io_pin_or_release(held, message))
        else:
            self._io_other_request(identity, seq, message)

    def _io_pin_or_release(self, held: _Held, message: Pin | Release) -> HoldReply:
        if isinstance(message, Pin):
            held.pinned_until = time.monotonic() + self.timeout_s
            sums = self._io_checksums(held) if message.want_checksums else None
            return HoldReply(held=True, checksums=sums)
        if message.loaded:
            self.stats.bytes_saved += len(held.block_ids) * self.engine_info.block_nbytes
            self.stats.blocks_saved += len(held.block_ids)
        if not held.busy:
            self._io_unhold(message.request_id, "released")
        return HoldReply(held=True)

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
            if held.expires_at() <= now:
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
        return HoldReply(held=False, error=reason)

    def _io_next_expiry(self) -> float:
        """Monotonic time of the next lease or deferred request to end (infinity: none)."""
        times = [h.expires_at() for h in self._held.values()]
        times.extend(d.deadline for d in self._deferred)
        return min(times, default=float("inf"))

    def _io_take_hold(
        self, request_id: str, block_ids: list[int], lease_s: float, checksums: list[int] | None
    ) -> None:
        self._held[request_id] = _Held(block_ids, time.monotonic() + lease_s, checksums)
        waiting = [d for d in self._deferred if _request_id(d.message) == request_id]
        for d in waiting:
            self._deferred.remove(d)
            self._io_request(d.identity, d.seq, d.message)


def _request_id(message: Any) -> str:
    return message.request_id
