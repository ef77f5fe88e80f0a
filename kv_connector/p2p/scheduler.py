"""Scheduler side of the point-to-point connectors: kv_transfer_params ↔ typed metadata.

A consumer request carrying `do_remote_prefill` becomes a `LoadSpec` (which producer blocks land
in which local blocks); a finished producer request carrying `do_remote_decode` becomes a
`HoldSpec` and the kv_transfer_params the router forwards to the consumer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import msgspec

from splitserve.kv_connector.base import EngineInfo, KVConnectorMetadata, RequestView
from splitserve.kv_connector.config import KVTransferConfig
from splitserve.kv_connector.layout import block_range, bounded_put, cdiv
from splitserve.kv_connector.p2p.messages import (
    HoldSpec,
    LoadSpec,
    P2PMetadata,
    ReleaseSpec,
    RemotePrefill,
)

logger = logging.getLogger(__name__)


@dataclass
class _Pending:
    """Between get_num_new_matched_tokens and update_state_after_alloc (scheduler side)."""

    remote: RemotePrefill | None
    num_computed_tokens: int
    error: str | None = None


class P2PSchedulerSide:
    """Mixin of P2PConnectorBase: the scheduler-role methods."""

    config: KVTransferConfig
    engine_info: EngineInfo
    engine_id: str
    host: str  # advertised side-channel address
    port: int
    is_producer: bool
    is_consumer: bool
    _pending: dict[str, _Pending]
    _meta: P2PMetadata

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
        # Everything but the newest token is loadable: on a decode instance that is the whole
        # prompt the producer computed, and t0 (prior output) is the first token run here.
        loadable = request.num_tokens - 1
        try:
            remote = self._parse_remote(params)
        except ValueError as e:
            num = loadable - num_computed_tokens
            if num > 0:  # report it through `failed` so the failure policy applies
                bounded_put(self._pending, rid, _Pending(None, num_computed_tokens, str(e)))
                return num, True
            logger.warning("%s: %s", rid, e)
            return 0, False
        num = min(remote.num_tokens, loadable) - num_computed_tokens
        if num <= 0:  # local prefix cache covers it: only free the producer's blocks
            self._release(rid, remote)
            return 0, False
        bounded_put(self._pending, rid, _Pending(remote, num_computed_tokens))
        return num, True

    def _release(self, rid: str, remote: RemotePrefill) -> None:
        """Queue a "done, free your blocks" for the producer without loading anything."""
        self._meta.releases.append(
            ReleaseSpec(
                request_id=rid,
                remote_request_id=remote.remote_request_id,
                remote_host=remote.remote_host,
                remote_port=remote.remote_port,
            )
        )

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
                self._release(rid, remote)
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
            self._release(rid, pending.remote)
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
