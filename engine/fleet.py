"""The fleet config: one YAML file that describes a router and its prefill/decode instances.

```yaml
model: models/tiny-llama            # shorthand for engine.model.model
engine: {cache: {kv_cache_memory: 256MiB}, num_threads: 1}   # shared by every instance
kv_transfer: {connector: nixl, failure_policy: recompute, lease_s: 30}
router: {port: 8000, prefill_policy: round_robin, decode_policy: least_loaded}
prefill: {count: 1, base_port: 8100, engine: {}}   # per-role engine overrides, deep-merged
decode:  {count: 1, base_port: 8200, engine: {}}
colocated: {count: 0, base_port: 8300}
redis: {start: false, port: 6379}
```

The fleet file only holds *plain data* for the engine sections: each instance's `EngineConfig` is
validated when the instance starts (`instance_configs`), with the shared section, the role's
overrides and the role's `kv_transfer.kv_role` merged in that order. Instance `i` of a role
listens on `base_port + i`; the connector's side channel picks a free port (0) and publishes it
in `kv_transfer_params`, so side channels never collide.

The router section lives here too: the router reads this file, never the engine's internals.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from splitserve.engine.config import EngineConfig, build_config, load_yaml

Role = Literal["prefill", "decode", "colocated"]
KV_ROLE: dict[str, str] = {"prefill": "producer", "decode": "consumer", "colocated": "both"}
"""The connector role each instance role gets."""

POLICIES = ("round_robin", "least_loaded", "prefix_aware")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class RouterConfig(_Frozen):
    host: str = "127.0.0.1"
    """Bind address of the public endpoint."""
    port: int = Field(default=8000, ge=0, le=65535)
    prefill_policy: Literal["round_robin", "least_loaded", "prefix_aware"] = "round_robin"
    decode_policy: Literal["round_robin", "least_loaded", "prefix_aware"] = "least_loaded"
    colocated_policy: Literal["round_robin", "least_loaded", "prefix_aware"] = "least_loaded"
    request_timeout_s: float = Field(default=120.0, gt=0)
    """Longest wait for an instance's next byte (prefill answer or the next streamed token)."""
    connect_timeout_s: float = Field(default=2.0, gt=0)
    health_interval_s: float = Field(default=1.0, gt=0)
    max_body_bytes: int = Field(default=8 * 2**20, gt=0)
    api_key: str | None = None
    """When set, clients must send `Authorization: Bearer <api_key>`."""
    prefill_retries: int = Field(default=1, ge=0)
    """Other prefill instances tried after the first fails, before decode-only fallback."""


class RoleConfig(_Frozen):
    count: int = Field(default=0, ge=0)
    base_port: int = Field(default=8100, ge=1, le=65535)
    host: str = "127.0.0.1"
    """Address the instances bind and the router dials."""
    engine: dict[str, Any] = Field(default_factory=dict)
    """EngineConfig overrides for this role, deep-merged over the shared `engine` section."""
    server: dict[str, Any] = Field(default_factory=dict)
    """ServerConfig overrides (max_waiting, max_body_bytes, ...); port and role are set here."""

    def url(self, index: int) -> str:
        return f"http://{self.host}:{self.base_port + index}"


class RedisConfig(_Frozen):
    start: bool = False
    """launch.py starts a local redis-server (loopback, no persistence) when true."""
    port: int = Field(default=6379, ge=1, le=65535)


class FleetConfig(_Frozen):
    model: str | None = None
    """Shorthand for engine.model.model."""
    engine: dict[str, Any] = Field(default_factory=dict)
    kv_transfer: dict[str, Any] = Field(default_factory=dict)
    router: RouterConfig = Field(default_factory=RouterConfig)
    prefill: RoleConfig = Field(default_factory=lambda: RoleConfig(count=0, base_port=8100))
    decode: RoleConfig = Field(default_factory=lambda: RoleConfig(count=0, base_port=8200))
    colocated: RoleConfig = Field(default_factory=lambda: RoleConfig(count=0, base_port=8300))
    redis: RedisConfig = Field(default_factory=RedisConfig)

    @model_validator(mode="after")
    def _check_topology(self) -> FleetConfig:
        if self.colocated.count == 0:
            if self.prefill.count < 1:
                raise ValueError("prefill.count: must be >= 1 (or set colocated.count)")
            if self.decode.count < 1:
                raise ValueError("decode.count: must be >= 1 (or set colocated.count)")
        elif self.prefill.count or self.decode.count:
            raise ValueError("colocated.count: cannot be combined with prefill/decode instances")
        if self.model is None and "model" not in self.engine:
            raise ValueError("model: required (or engine.model.model)")
        ports = [self.router.port]
        for name in ("prefill", "decode", "colocated"):
            role: RoleConfig = getattr(self, name)
            ports += [role.base_port + i for i in range(role.count)]
        if len(set(ports)) != len(ports):
            raise ValueError(f"router.port, prefill/decode/colocated.base_port: ports overlap "
                             f"({sorted(ports)})")
        return self

    @property
    def is_colocated(self) -> bool:
        return self.colocated.count > 0

    def role(self, name: str) -> RoleConfig:
        if name not in KV_ROLE:
            raise ValueError(f"unknown role {name!r} (known: {', '.join(KV_ROLE)})")
        return getattr(self, name)

    def instances(self) -> list[tuple[str, int, str]]:
        """(role, index, url) of every instance the fleet launches."""
        roles = ("colocated",) if self.is_colocated else ("prefill", "decode")
        return [(r, i, self.role(r).url(i)) for r in roles for i in range(self.role(r).count)]

    def instance_data(self, role: str, index: int) -> dict[str, Any]:
        """Plain `{"engine": ..., "server": ...}` of one instance (validate with InstanceConfig)."""
        section = self.role(role)
        if not 0 <= index < section.count:
            raise ValueError(f"--index: {index} is out of range ({role}.count is {section.count})")
        engine = copy.deepcopy(self.engine)
        if self.model is not None:
            model = engine.get("model")
            engine["model"] = {**(model if isinstance(model, dict) else {}), "model": self.model}
        engine = deep_merge(engine, section.engine)
        transfer = deep_merge(dict(self.kv_transfer), engine.get("kv_transfer") or {})
        if transfer.get("connector", "none") != "none" or role != "colocated":
            transfer["kv_role"] = KV_ROLE[role]
        if transfer:
            engine["kv_transfer"] = transfer
        engine.setdefault("engine_id", f"{role}-{index}-{section.base_port + index}")
        server = {**section.server, "host": section.host, "port": section.base_port + index,
                  "role": role}
        return {"engine": engine, "server": server}

    def engine_config(self, role: str, index: int) -> EngineConfig:
        """The validated EngineConfig of one instance (errors name the field)."""
        data = self.instance_data(role, index)["engine"]
        return build_config(EngineConfig, data, f"{role} {index}")


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """`override` over `base`, recursing into mappings; neither input is modified."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def parse_fleet(data: dict[str, Any], source: str = "") -> FleetConfig:
    """Validate a fleet mapping; ValueError names the field (`prefill.count: ...`)."""
    return build_config(FleetConfig, data, source)


def load_fleet(path: str | Path, overrides: dict[str, Any] | None = None) -> FleetConfig:
    """Read a fleet YAML, deep-merge `overrides` (e.g. from command-line flags), validate."""
    data = deep_merge(load_yaml(path), overrides or {})
    return parse_fleet(data, str(path))
