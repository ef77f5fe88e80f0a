"""HeldKV: frees a producer's held blocks when the answer that names them goes nowhere.

A prefill instance (do_remote_decode) finishes a request holding its KV blocks for a consumer that
learns where they are only from the request's answer. If that answer is never delivered (the
client, usually the router, left or gave up), nobody will pull the blocks and they would wait for
the lease to end. The front end knows better: a request aborted or abandoned by its handler, or
named by the router's release (`POST /v1/kv/release {"request_id"}`), is *unwanted*; its hold is
released through the producer's side channel as soon as the request has finished, whichever of
the two comes first (the core may finish it while the abort is on its way).

Both maps are bounded: an entry is dropped after `capacity` newer ones, when the lease has
long freed the blocks anyway.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Any

from splitserve.kv_connector.side_channel import release_remote_kv

logger = logging.getLogger(__name__)


class HeldKV:
    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._held: OrderedDict[str, dict[str, Any]] = OrderedDict()  # finished, holding
        self._unwanted: OrderedDict[str, None] = OrderedDict()  # answer goes nowhere
        self._tasks: set[asyncio.Task] = set()  # releases in flight, kept referenced

    def finished(self, request_id: str, params: dict[str, Any]) -> None:
        """The output loop: a request finished with these kv_transfer_params."""
        if not params.get("remote_request_id"):
            return  # not a hold a consumer releases (e.g. redis frees once its save lands)
        if self._unwanted.pop(request_id, 0) is None:
            self._release(request_id, params)
            return
        self._held[request_id] = params
        _trim(self._held, self.capacity)

    def unwanted(self, request_id: str) -> bool:
        """Nobody will receive this request's answer: free its hold now or once it finishes.
        True when it held blocks already (their release is on its way)."""
        params = self._held.pop(request_id, None)
        if params is not None:
            self._release(request_id, params)
            return True
        self._unwanted[request_id] = None
        _trim(self._unwanted, self.capacity)
        return False

    def knows(self, request_id: str) -> bool:
        return request_id in self._held

    def _release(self, request_id: str, params: dict[str, Any]) -> None:
        task = asyncio.get_running_loop().create_task(
            asyncio.to_thread(release_remote_kv, params)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        logger.debug("%s: answer not delivered, held KV released", request_id)


def _trim(entries: OrderedDict, capacity: int) -> None:
    while len(entries) > capacity:
        entries.popitem(last=False)
