from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cohort.localredis import LocalRedis
from tests.helpers import require_redis_server

from .cluster import Cluster


@pytest.fixture
def server(tmp_path: Path) -> Iterator[LocalRedis]:
    """A redis-server of this test's own (AOF on), so it may be killed and restarted."""
    redis_server = LocalRedis(appendonly=True, appendfsync="always", binary=require_redis_server())
    redis_server.start()
    yield redis_server
    redis_server.stop()


@pytest.fixture
def cluster(server: LocalRedis, tmp_path: Path) -> Iterator[Cluster]:
    job = Cluster(url=server.url, conn=server.client(), job="itest", tmp=tmp_path)
    yield job
    job.stop()
