"""Scheduler → worker messages of the point-to-point connectors (one step's work)."""

from __future__ import annotations

import msgspec

from splitserve.kv_connector.base import KVConnectorMetadata


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
