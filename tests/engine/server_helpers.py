"""Helpers of the instance-server tests (a uniquely named module: tests/ has no packages).

A test module starts one real server with the CLI (config file + overriding flags) and talks to
it over HTTP; the limits below are small so that queueing and size errors are easy to provoke.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

MAX_MODEL_LEN = 1024
MAX_NUM_SEQS = 4
MAX_WAITING = 6
MAX_BODY_BYTES = 64 * 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli() -> list[str]:
    exe = shutil.which("splitserve")
    return [exe] if exe else [sys.executable, "-m", "splitserve.cli"]


def prompt(n: int, seed: int = 0) -> list[int]:
    """n token ids, different per seed, clear of the special tokens."""
    return [(seed * 7919 + i * 104729) % 8000 + 10 for i in range(n)]


class Server:
    def __init__(self, proc: subprocess.Popen, port: int, log: Path, model: str) -> None:
        self.proc, self.port, self.log, self.model = proc, port, log, model
        self.url = f"http://127.0.0.1:{port}"

    def health(self) -> dict:
        r = httpx.get(f"{self.url}/health", timeout=10)
        assert r.status_code == 200, r.text
        return r.json()

    def wait_idle(self, timeout_s: float = 10.0) -> dict:
        """/health once nothing runs or waits (aborts reach the core asynchronously)."""
        deadline = time.monotonic() + timeout_s
        while True:
            h = self.health()
            if (h["running"] == 0 and h["waiting"] == 0) or time.monotonic() > deadline:
                return h
            time.sleep(0.05)

    def generated_tokens(self) -> float:
        """`splitserve:generation_tokens_total` from /metrics."""
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line.startswith("splitserve:generation_tokens_total"):
                return float(line.split()[-1])
        raise AssertionError("no splitserve:generation_tokens_total")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def _write_config(path: Path, model: str) -> None:
    path.write_text(
        f"engine:\n"
        f"  model: {{model: {model}, max_model_len: {MAX_MODEL_LEN}}}\n"
        f"  cache: {{kv_cache_memory: 32MiB, block_size: 16}}\n"
        f"  scheduler: {{max_num_seqs: 64}}\n"
        f"  num_threads: 1\n"
        f"server:\n"
        f"  port: 1\n"  # overridden by --port
        f"  max_body_bytes: {MAX_BODY_BYTES}\n"
        f"  max_waiting: {MAX_WAITING}\n"
        f"  role: colocated\n"
    )


def start_server(model: str, tmp: Path) -> Server:
    """`splitserve serve --config FILE --port P --max-num-seqs 4`, once /health answers."""
    config = tmp / "instance.yaml"
    _write_config(config, model)
    port = free_port()
    log = tmp / "server.log"
    cmd = cli() + ["serve", "--config", str(config), "--port", str(port)]
    cmd += ["--max-num-seqs", str(MAX_NUM_SEQS), "--log-level", "warning"]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    srv = Server(proc, port, log, Path(model).name)
    deadline = time.monotonic() + 180
    while True:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{srv.url}/health", timeout=2).status_code == 200:
                return srv
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"server not healthy after 180 s:\n{log.read_text()}")
        time.sleep(0.2)
