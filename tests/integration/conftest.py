from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cohort.localredis import LocalCluster, LocalRedis
from tests.helpers import require_redis_server
from tests.integration.cluster import Cluster
from tests.integration.launch import Launch
from tests.integration.quickbench import QuickBench
from tests.integration.torchrun_nodes import Nodes


@pytest.fixture(autouse=True)
def _no_launch_outlives_its_test() -> Iterator[None]:
    """A test that fails before its `cohort run` exits leaves no launcher behind (seen once:
    a timed-out wait left a paused job's launcher and coordinator running)."""
    yield
    Launch.end_all()


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


@pytest.fixture
def nodes(cluster: Cluster) -> Iterator[Nodes]:
    """torchrun nodes on `cluster`'s job; whatever is left of them dies with the test."""
    made = Nodes(cluster)
    yield made
    made.stop()


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[LocalCluster]:
    """A real Redis Cluster of this test module's own: 3 primaries, 3 replicas, AOF on."""
    nodes = LocalCluster(primaries=3, replicas=1, binary=require_redis_server())
    nodes.start()
    yield nodes
    nodes.stop()


@pytest.fixture
def quick_bench(tmp_path: Path) -> Iterator[QuickBench]:
    """Runs `python -m bench --quick` and fails a run that leaves a process it started
    running; whatever a run left (a timed-out one too) is killed after the test."""
    runs = QuickBench(tmp_path)
    yield runs
    runs.clean()
