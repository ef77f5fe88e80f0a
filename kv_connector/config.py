"""The `kv_transfer` section of an engine config: which connector, its role, its options.

`engine/config.py` embeds `KVTransferConfig`; nothing here imports the engine. Validation resolves
the connector by name through the registry (importing its module, never its transport library) so
that a typo or an unknown option fails when the YAML is loaded, not when the first request arrives.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConnectorOptions(BaseModel):
    """Base of each connector's `Options` model: frozen, unknown keys rejected."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class KVTransferConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    connector: str = "none"
    """`nixl` | `nccl` | `redis` | `none` | a name added with `module_path`."""
    kv_role: Literal["producer", "consumer", "both"] = "both"
    """`producer` holds/saves KV for others (prefill), `consumer` loads it (decode)."""
    failure_policy: Literal["recompute", "fail"] = "recompute"
    """What the engine does when a load fails: prefill the tokens itself, or fail the request."""
    lease_s: float = Field(default=30.0, gt=0)
    """How long a producer holds a finished request's blocks for its consumer."""
    verify: bool = False
    """Per-block xxhash64 checksums, computed by the producer and checked after landing."""
    module_path: str | None = None
    """Out-of-tree connector as "package.module:Class", registered under `connector`."""
    side_channel_host: str = "127.0.0.1"
    """Address the producer's side channel binds and advertises (nixl, nccl)."""
    side_channel_port: int = Field(default=0, ge=0, le=65535)
    """Side-channel port; 0 picks a free one."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Connector-specific settings, validated by the connector's own `Options` model."""

    @model_validator(mode="after")
    def _check_connector(self) -> KVTransferConfig:
        from splitserve.kv_connector.registry import connector_class

        cls = connector_class(self.connector, self.module_path)
        validate_options(self.connector, cls.Options, self.options)
        return self


def validate_options(
    connector: str, model: type[ConnectorOptions], options: dict[str, Any]
) -> ConnectorOptions:
    """`options` as `model`, or a ValueError that names the bad key and the known ones."""
    try:
        return model.model_validate(options)
    except ValidationError as e:
        known = ", ".join(sorted(model.model_fields)) or "none"
        problems = []
        for err in e.errors():
            key = ".".join(str(p) for p in err["loc"]) or "options"
            if err["type"] == "extra_forbidden":
                problems.append(f"unknown option {key!r}")
            else:
                problems.append(f"option {key!r}: {err['msg']}")
        raise ValueError(
            f"connector {connector!r}: {'; '.join(problems)} (known options: {known})"
        ) from None
