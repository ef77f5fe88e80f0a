"""Shared fixtures: tiny models built once per machine (cached), and block-leak checks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

MODEL_CACHE = Path(os.environ.get("SPLITSERVE_TEST_MODELS",
                                  Path.home() / ".cache" / "splitserve" / "test-models"))


def tiny_model_dir(arch: str = "llama", dtype: str = "float32", rope_scaling: str | None = None,
                   preset: str = "tiny") -> str:
    """Build (once) and return a tiny model directory of the given kind."""
    from splitserve.scripts.make_tiny_model import make_model

    name = f"{preset}-{arch}-{dtype}" + (f"-{rope_scaling}" if rope_scaling else "")
    return str(make_model(MODEL_CACHE / name, arch=arch, preset=preset, dtype=dtype, seed=0,
                          rope_scaling=rope_scaling))


@pytest.fixture(scope="session")
def llama_fp32() -> str:
    return tiny_model_dir("llama", "float32")


@pytest.fixture(scope="session")
def llama_bf16() -> str:
    return tiny_model_dir("llama", "bfloat16")


def assert_all_blocks_free(stats: dict) -> None:
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"], stats
