"""Fixtures for connector tests: a real redis-server on a free port, started and stopped here,
and the engine fleet of the engine-level tests (one per test module)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from engine_fleet import Fleet
from kvc_helpers import RedisServer


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    yield server
    server.stop()


@pytest.fixture
def own_redis_server() -> Iterator[RedisServer]:
    """A server of this test alone (it may stop it)."""
    server = RedisServer()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def fleet(llama_fp32: str, redis_server: RedisServer) -> Iterator[Fleet]:
    """Producer and consumer engine processes for every connector (engine_fleet.py)."""
    stoppable = RedisServer()  # the Redis-stopped test kills this one
    try:
        f = Fleet(llama_fp32, redis_server, stoppable)
    except BaseException:
        stoppable.stop()
        raise
    yield f
    f.close()
    stoppable.stop()
