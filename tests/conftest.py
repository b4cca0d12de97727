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
    """A client to the session's redis-server, emptied (keys and functions) before the test,
    and of functions after it: a stub library left behind would claim the server for the
    tests that use `redis_server` directly."""
    conn = connect(RedisSettings(url=redis_server.url))
    conn.flushall()
    conn.function_flush()
    yield conn
    conn.function_flush()
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


SHARED_GROUPS = {
    # quickbench counts every process naming this checkout's bench/ as the run's own: two of
    # these modules side by side would each see the other's
    "test_bench": "bench",
    "test_bench_torchft": "bench",
    "test_chaos": "bench",
    "test_gpu_bench": "bench",
    "test_netsim": "bench",
}
LONGEST_FIRST = ("bench", "test_slurm", "test_elastic_job", "test_lm_example", "test_sharded")
"""The groups that take longest start first, so none of them is left running alone at the end."""


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (`-n`, pyproject's addopts): each module's tests run on one worker,
    in order, with its module-scoped fixtures (a Redis Cluster, a test's shared run) made
    once; modules that must not run beside each other share a group. Runs first: xdist reads
    the groups in its own hook."""
    for item in items:
        stem = item.path.stem
        item.add_marker(pytest.mark.xdist_group(SHARED_GROUPS.get(stem, stem)))

    def rank(item: pytest.Item) -> int:
        group = SHARED_GROUPS.get(item.path.stem, item.path.stem)
        return LONGEST_FIRST.index(group) if group in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: each module's own order is kept
