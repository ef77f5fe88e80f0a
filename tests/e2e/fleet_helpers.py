"""E2E fleet helpers: real processes started by scripts/launch.py, on ports away from the defaults.

One fleet per (module, config), so tests in a module share its start-up cost. Leases are short
(5 s) so that blocks held for a request that stopped at t0 come back within a test.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from launch import Fleet, resolve_config  # noqa: E402

MODEL_NAME = "tiny-llama-float32"
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Server:\n    def __init__",
           "The quick brown fox jumps over the lazy dog. " * 6]
_PORTS = iter(range(20000, 29000, 100))


def start_fleet(config: str, model: str, tmp_dir: Path, lease_s: float = 5.0) -> Fleet:
    base = next(_PORTS)
    overrides = {"router": {"port": base, "health_interval_s": 0.5},
                 "prefill": {"base_port": base + 10}, "decode": {"base_port": base + 30},
                 "colocated": {"base_port": base + 50}}
    if "colocated" not in config:
        overrides["kv_transfer"] = {"lease_s": lease_s}
    if "redis" in config:
        overrides["redis"] = {"start": True, "port": base + 70}
        overrides["kv_transfer"]["options"] = {"url": f"redis://127.0.0.1:{base + 70}/0"}
    path, fleet = resolve_config(str(ROOT / "configs" / f"{config}.yaml"), model, None, overrides)
    log = open(tmp_dir / f"{config}.log", "w")  # noqa: SIM115 - lives as long as the fleet
    running = Fleet(path, fleet, quiet=True, log_file=log)
    try:
        running.start(timeout_s=120)
    except BaseException:
        running.stop()
        print((tmp_dir / f"{config}.log").read_text()[-5000:])
        raise
    return running


def instance_stats(fleet: Fleet) -> list[dict]:
    out = []
    for _, _, url in fleet.fleet.instances():
        try:
            out.append(httpx.get(f"{url}/health", timeout=2).json())
        except httpx.HTTPError:
            pass  # killed on purpose
    return out


def wait_all_blocks_free(fleet: Fleet, timeout_s: float = 12.0) -> None:
    """Every live instance's kv_blocks_free returns to kv_blocks_total (leases included)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = instance_stats(fleet)
        if all(s["kv_blocks_free"] == s["kv_blocks_total"] and s["running"] == 0 for s in stats):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"blocks not freed: {stats}")
        time.sleep(0.25)
