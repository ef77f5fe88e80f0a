"""KV connectors: move KV cache blocks between instances (prefill → decode, or a shared store).

- base.py: the API the engine drives (KVConnectorBase, EngineInfo, RequestView, NoOpConnector).
- config.py: `KVTransferConfig`, the `kv_transfer` section of an engine config.
- registry.py: connector name → "module:Class", imported on first use.
- p2p/: what the point-to-point connectors share (leases, side channel, I/O thread).
- nixl/, nccl/, redis/: the connectors. driver.py: an engine-less driver for tests and benchmarks;
  remote_engine.py runs one in its own process.

Importing this package is cheap: no torch, no transport library.
"""

from splitserve.kv_connector.base import (
    EngineInfo,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
    NoOpConnector,
    RequestView,
)
from splitserve.kv_connector.config import KVTransferConfig
from splitserve.kv_connector.registry import create_connector, known_connectors, register_connector

__all__ = [
    "EngineInfo",
    "KVConnectorBase",
    "KVConnectorMetadata",
    "KVConnectorRole",
    "KVTransferConfig",
    "NoOpConnector",
    "RequestView",
    "create_connector",
    "known_connectors",
    "register_connector",
]
