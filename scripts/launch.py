"""Launch a whole fleet from one config: `python scripts/launch.py CONFIG [--model DIR] [--port N]`.

Starts (in order) a local redis-server when `redis.start` is set, every prefill/decode (or
colocated) instance, then the router; waits until the router reports every instance healthy;
prints the endpoint; prefixes each process's output (`[prefill-0] ...`). Ctrl-C or SIGTERM stops
everything. No orphans: each child runs in its own process group (killed as a group, which takes
the engine-core grandchildren too), and asks the kernel to SIGTERM it if the launcher dies.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from splitserve.engine.fleet import FleetConfig, deep_merge, load_yaml, parse_fleet

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the launcher dies; own process group."""
    os.setsid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


@dataclass
class Child:
    name: str
    proc: subprocess.Popen

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass


class Fleet:
    """The processes of one fleet; a context manager that always stops them all."""

    def __init__(self, config_path: str, fleet: FleetConfig, quiet: bool = False,
                 log_file: Any = None) -> None:
        self.config_path, self.fleet, self.quiet, self.log_file = (
            config_path, fleet, quiet, log_file)
        self.children: list[Child] = []

    @property
    def url(self) -> str:
        return f"http://{self.fleet.router.host}:{self.fleet.router.port}"

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Child:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent,
                                env={**os.environ, **(env or {})})
        child = Child(name, proc)
        self.children.append(child)
        threading.Thread(target=self._pump, args=(child,), daemon=True).start()
        return child

    def _pump(self, child: Child) -> None:
        assert child.proc.stdout is not None
        for raw in child.proc.stdout:
            line = f"[{child.name}] {raw.decode(errors='replace').rstrip()}\n"
            if self.log_file is not None:
                self.log_file.write(line)
                self.log_file.flush()
            if not self.quiet:
                sys.stdout.write(line)
                sys.stdout.flush()

    def start_instance(self, role: str, index: int) -> Child:
        argv = [sys.executable, "-m", "splitserve.cli", role, "--config", self.config_path,
                "--index", str(index)]
        return self.spawn(f"{role}-{index}", argv)

    def start(self, timeout_s: float = 180.0) -> None:
        if self.fleet.redis.start:
            self.spawn("redis", ["redis-server", "--bind", "127.0.0.1", "--port",
                                 str(self.fleet.redis.port), "--save", "", "--appendonly", "no"])
        for role, index, _ in self.fleet.instances():
            self.start_instance(role, index)
        self.spawn("router", [sys.executable, "-m", "splitserve.router",
                              "--config", self.config_path, "--log-level", "warning"])
        self.wait_healthy(timeout_s)

    def wait_healthy(self, timeout_s: float) -> None:
        deadline, want = time.monotonic() + timeout_s, len(self.fleet.instances())
        while time.monotonic() < deadline:
            for child in self.children:
                if child.proc.poll() is not None:
                    raise RuntimeError(f"{child.name} exited with status {child.proc.returncode}"
                                       " during start-up (see its log lines)")
            health = fetch_json(f"{self.url}/health")
            if health and sum(i["healthy"] for i in health["instances"]) == want:
                return
            time.sleep(0.5)
        raise TimeoutError(f"fleet not healthy after {timeout_s:.0f}s")

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def stop(self) -> None:
        for child in reversed(self.children):  # router first, redis last
            child.stop(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for child in self.children:
            try:
                child.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.stop(signal.SIGKILL)
                child.proc.wait()
            child.stop(signal.SIGKILL)  # stragglers in its group (engine cores)

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def fetch_json(url: str, timeout: float = 2.0) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - loopback
            return json.loads(r.read())
    except Exception:  # noqa: BLE001 - not up yet
        return None


def resolve_config(path: str, model: str | None = None, port: int | None = None,
                   overrides: dict[str, Any] | None = None) -> tuple[str, FleetConfig]:
    """Apply flags to the file; write the result where every child reads the same thing."""
    data = deep_merge(load_yaml(path), overrides or {})
    if model:
        data["model"] = model
    if port:
        data = deep_merge(data, {"router": {"port": port}})
    fleet = parse_fleet(data, path)
    fd, out = tempfile.mkstemp(prefix=f"fleet-{Path(path).stem}-", suffix=".yaml")
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(data, f)
    return out, fleet


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--model", help="override the fleet's model directory")
    parser.add_argument("--port", type=int, help="override router.port")
    parser.add_argument("--timeout", type=float, default=300.0, help="start-up timeout (s)")
    args = parser.parse_args(argv)
    try:
        path, fleet = resolve_config(args.config, args.model, args.port)
    except ValueError as err:
        print(f"launch: error: {err}", file=sys.stderr)
        return 2
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with Fleet(path, fleet) as running:
        try:
            running.start(args.timeout)
        except (RuntimeError, TimeoutError) as err:
            print(f"launch: error: {err}", file=sys.stderr)
            return 1
        print(f"launch: fleet ready: {running.url}/v1 (Ctrl-C stops it)", flush=True)
        while not stop.wait(0.5):
            dead = [c.name for c in running.children if c.proc.poll() is not None]
            if dead:
                print(f"launch: {', '.join(dead)} exited; stopping", file=sys.stderr)
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
