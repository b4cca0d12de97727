"""Fixtures every suite may use: a real redis-server for the session, and connections.

Contract tests take `conn`, which runs each test on fakeredis and on the real server.
"""

from __future__ import annotations

from collections.abc import Iterator

import fakeredis
import pytest
import redis

from cohort.events.connection import RedisSettings, connect
from cohort.localredis import LocalRedis
from tests.helpers import require_redis_server


@pytest.fixture(scope="session")
def redis_server() -> Iterator[LocalRedis]:
    """One redis-server (AOF on) on a free port in a temp dir, for the whole session.

    Without a binary the tests that need it are skipped locally, but fail in CI (CI=true),
    where a missing server means the suite proved nothing.
    """
    server = LocalRedis(appendonly=True, binary=require_redis_server())
    server.start()
    yield server
    server.stop()


@pytest.fixture
def real_conn(redis_server: LocalRedis) -> Iterator[redis.Redis]:
    """A client to the session's redis-server, emptied (keys and functions) before the test."""
    conn = connect(RedisSettings(url=redis_server.url))
    conn.flushall()
    conn.function_flush()
    yield conn
    conn.close()


@pytest.fixture
def fake_conn() -> Iterator[redis.Redis]:
    """A fakeredis client on a server of its own (instances would otherwise share one)."""
    conn = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    yield conn
    conn.close()


@pytest.fixture(params=["fakeredis", pytest.param("redis-server", marks=pytest.mark.redis_server)])
def conn(request: pytest.FixtureRequest) -> redis.Redis:
    """The same test on both backends: the storage seam must not care which one it gets."""
    name = "fake_conn" if request.param == "fakeredis" else "real_conn"
    client: redis.Redis = request.getfixturevalue(name)
    return client
