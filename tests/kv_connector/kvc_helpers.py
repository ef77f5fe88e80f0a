"""Helpers of the connector tests (a uniquely named module: tests/ has no packages)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

import pytest


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A private redis-server: loopback only, no persistence."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            if os.environ.get("CI", "").lower() == "true":
                pytest.fail(
                    "redis-server is not installed (required in CI: apt-get install redis-server)"
                )
            pytest.skip("redis-server is not installed (apt-get install redis-server)")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "yes",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self._wait_ready()

    def _wait_ready(self, timeout: float = 10.0) -> None:
        import redis

        client = redis.Redis.from_url(self.url, socket_timeout=1)
        deadline = time.monotonic() + timeout
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    pytest.fail(f"redis-server on port {self.port} did not start")
                time.sleep(0.05)
            finally:
                client.close()

    def client(self):  # -> redis.Redis
        import redis

        return redis.Redis.from_url(self.url, socket_timeout=2)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


def nixl_missing() -> str | None:
    try:
        import nixl  # noqa: F401
    except ImportError as e:
        return f"nixl is not installed (optional extra: pip install 'splitserve[nixl]'): {e}"
    return None
