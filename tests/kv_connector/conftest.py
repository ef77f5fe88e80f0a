"""Fixtures for connector tests: a real redis-server on a free port, started and stopped here."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
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
