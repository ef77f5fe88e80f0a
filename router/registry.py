"""The router's view of its instances: who they are, whether they answer, how loaded they are.

An instance comes from the fleet config or `POST /register`. A background task polls every
instance's `GET /health` each `health_interval_s`: a failed poll (or a failed request, which
calls `mark_down` at once) takes the instance out of rotation; the next good poll puts it back.
The load figures the `least_loaded` policy reads are the last poll's `running`/`waiting`/
`kv_blocks_free`, plus the router's own count of requests in flight there (fresher than a poll).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import msgspec

from splitserve.router.upstream import InstanceUnavailable, UpstreamClient

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "colocated")


@dataclass
class Instance:
    url: str
    role: str
    healthy: bool = True  # who sets this: the health loop and mark_down
    running: int = 0  # from the last /health
    waiting: int = 0
    kv_blocks_free: int = 0
    kv_blocks_total: int = 0
    in_flight: int = 0  # requests the router has sent and not finished (router-side)
    model: str | None = None
    max_model_len: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def load(self) -> float:
        """Requests queued or running, by the freshest numbers we have."""
        return max(self.in_flight, self.running + self.waiting)

    def describe(self) -> dict[str, Any]:
        return {"url": self.url, "role": self.role, "healthy": self.healthy,
                "running": self.running, "waiting": self.waiting, "in_flight": self.in_flight,
                "kv_blocks_free": self.kv_blocks_free, "kv_blocks_total": self.kv_blocks_total}


class InstanceRegistry:
    def __init__(self, client: UpstreamClient, health_interval_s: float = 1.0) -> None:
        self.client = client
        self.health_interval_s = health_interval_s
        self._instances: dict[str, Instance] = {}
        self._task: asyncio.Task | None = None

    # ------------------------------------------------------------------ membership
    def add(self, url: str, role: str, healthy: bool = False) -> Instance:
        """Register (or re-role) an instance; unhealthy until its first good health check."""
        if role not in ROLES:
            raise ValueError(f"role: must be one of {', '.join(ROLES)}, got {role!r}")
        url = url.rstrip("/")
        inst = self._instances.get(url)
        if inst is None:
            inst = self._instances[url] = Instance(url, role, healthy=healthy)
            logger.info("instance %s (%s) registered", url, role)
        inst.role = role
        return inst

    def remove(self, url: str) -> bool:
        removed = self._instances.pop(url.rstrip("/"), None) is not None
        if removed:
            logger.info("instance %s deregistered", url)
        return removed

    def get(self, url: str) -> Instance | None:
        return self._instances.get(url.rstrip("/"))

    def all(self) -> list[Instance]:
        return list(self._instances.values())

    def healthy(self, role: str) -> list[Instance]:
        return [i for i in self._instances.values() if i.role == role and i.healthy]

    def mark_down(self, inst: Instance, reason: str) -> None:
        if inst.healthy:
            logger.warning("instance %s (%s) marked down: %s", inst.url, inst.role, reason)
        inst.healthy = False

    # ------------------------------------------------------------------ health checks
    async def check(self, inst: Instance) -> None:
        try:
            status, content, _ = await self.client.request(
                "GET", f"{inst.url}/health", timeout_s=max(1.0, self.health_interval_s))
            body = msgspec.json.decode(content)
            ok = status == 200 and body.get("status") == "ok"
        except InstanceUnavailable as err:
            ok, body = False, {"error": str(err)}
        except (ValueError, AttributeError) as err:  # not a JSON object
            ok, body = False, {"error": f"{type(err).__name__}: {err}"}
        if not ok:
            self.mark_down(inst, str(body.get("error", "health check failed")))
            return
        for key in ("running", "waiting", "kv_blocks_free", "kv_blocks_total"):
            setattr(inst, key, int(body.get(key) or 0))
        inst.model = body.get("model", inst.model)
        if not inst.healthy:
            logger.info("instance %s (%s) is healthy", inst.url, inst.role)
        inst.healthy = True

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(i) for i in self.all()))

    async def _loop(self) -> None:
        while True:
            try:
                await self.check_all()
            except Exception:  # never let the loop die: the fleet would look dead forever
                logger.exception("health check round failed")
            await asyncio.sleep(self.health_interval_s)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
