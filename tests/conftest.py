"""Shared fixtures: tiny models built once per machine (cached)."""

from __future__ import annotations

import pytest
from testutil import assert_all_blocks_free, tiny_model_dir

__all__ = ["assert_all_blocks_free", "tiny_model_dir"]


@pytest.fixture(scope="session")
def llama_fp32() -> str:
    return tiny_model_dir("llama", "float32")


@pytest.fixture(scope="session")
def llama_bf16() -> str:
    return tiny_model_dir("llama", "bfloat16")
