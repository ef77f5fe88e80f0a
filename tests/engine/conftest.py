"""Fixtures of the instance-server tests: one real server per test module, and clients of it."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from server_helpers import MAX_MODEL_LEN, Server, start_server


@pytest.fixture(scope="module")
def server(llama_fp32: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(llama_fp32, tmp_path_factory.mktemp("server"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(llama_fp32: str):
    from splitserve import LLM

    llm = LLM(llama_fp32, kv_cache_memory="16MiB", num_threads=1, max_model_len=MAX_MODEL_LEN)
    yield llm
    llm.shutdown()
