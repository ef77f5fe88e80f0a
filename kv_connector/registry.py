"""Connector name → "module:Class", imported on first use.

Built-in connectors import their transport library (nixl, torch.distributed, redis) only when the
worker side starts, so resolving a name (config validation) is cheap and works without the
optional extras installed. An out-of-tree connector is added with `register_connector` or with
`module_path` in the config.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from splitserve.kv_connector.base import (
        EngineInfo,
        KVConnectorBase,
        KVConnectorRole,
    )
    from splitserve.kv_connector.config import KVTransferConfig

_BUILTIN: dict[str, str] = {
    "none": "splitserve.kv_connector.base:NoOpConnector",
    "nixl": "splitserve.kv_connector.nixl.connector:NixlConnector",
    "nccl": "splitserve.kv_connector.nccl.connector:NcclConnector",
    "redis": "splitserve.kv_connector.redis.connector:RedisConnector",
}
_registry: dict[str, str] = dict(_BUILTIN)


def known_connectors() -> list[str]:
    return sorted(_registry)


def register_connector(name: str, target: str) -> None:
    """Register `name` → "package.module:Class" (idempotent for the same target)."""
    module, sep, cls = target.partition(":")
    if not (name and module and sep and cls):
        raise ValueError(f"connector target must look like 'package.module:Class', got {target!r}")
    current = _registry.get(name)
    if current is not None and current != target:
        raise ValueError(
            f"connector {name!r} is already registered as {current!r}; "
            f"pick another name for {target!r}"
        )
    _registry[name] = target


def connector_class(name: str, module_path: str | None = None) -> type[KVConnectorBase]:
    """The class registered under `name` (registering `module_path` under it first when given)."""
    if module_path is not None:
        current = _registry.get(name)
        if current is not None and current != module_path:
            register_connector(name, module_path)  # raises: the name is taken
        cls = _load(name, module_path)
        register_connector(name, module_path)
        return cls
    target = _registry.get(name)
    if target is None:
        raise ValueError(
            f"unknown connector {name!r} (known: {', '.join(known_connectors())}; "
            "an out-of-tree one needs module_path: 'package.module:Class')"
        )
    return _load(name, target)


def _load(name: str, target: str) -> type[KVConnectorBase]:
    from splitserve.kv_connector.base import KVConnectorBase

    module_name, sep, cls_name = target.partition(":")
    if not (module_name and sep and cls_name):
        raise ValueError(f"connector target must look like 'package.module:Class', got {target!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"connector {name!r}: cannot import {module_name!r} ({e})") from e
    cls = getattr(module, cls_name, None)
    if not (isinstance(cls, type) and issubclass(cls, KVConnectorBase)):
        raise ValueError(
            f"connector {name!r}: {target!r} is not a KVConnectorBase subclass "
            "(see splitserve/kv_connector/base.py)"
        )
    return cls


def create_connector(
    config: KVTransferConfig, role: KVConnectorRole, engine_info: EngineInfo
) -> KVConnectorBase:
    """Build the configured connector for one role."""
    return connector_class(config.connector, config.module_path)(config, role, engine_info)
