"""Test helpers importable from any test folder as `testutil` (module names like `conftest`
clash between folders)."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

MODEL_CACHE = Path(os.environ.get("SPLITSERVE_TEST_MODELS",
                                  Path.home() / ".cache" / "splitserve" / "test-models"))


MODEL_CACHE = Path(os.environ.get("SPLITSERVE_TEST_MODELS",
                                  Path.home() / ".cache" / "splitserve" / "test-models"))


def tiny_model_dir(arch: str = "llama", dtype: str = "float32", rope_scaling: str | None = None,
                   preset: str = "tiny") -> str:
    """Build (once) and return a tiny model directory of the given kind."""
    from splitserve.scripts.make_tiny_model import make_model

    name = f"{preset}-{arch}-{dtype}" + (f"-{rope_scaling}" if rope_scaling else "")
    return str(make_model(MODEL_CACHE / name, arch=arch, preset=preset, dtype=dtype, seed=0,
                          rope_scaling=rope_scaling))


def assert_all_blocks_free(stats: dict) -> None:
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"], stats


def send_truncated_body(url: str, path: str) -> None:
    """A client that announces 1000 bytes of body, sends 10 and leaves."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  "Content-Length: 1000\r\n\r\n{\"prompt\":".encode())
    time.sleep(0.3)
