"""cohort through Redis Sentinel: the primary is SIGKILLed mid-run, Sentinel promotes the
replica, and the job carries on to the end through redis+sentinel:// alone."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from cohort.coordinator.audit import audit
from cohort.coordinator.state import JobState
from cohort.events.connection import RedisSettings, connect
from cohort.events.models import LeaderElected, StepCommitted
from cohort.localredis import HOST, LocalRedis, LocalSentinel
from tests.helpers import require_redis_server, wait_until
from tests.integration.cluster import Cluster

pytestmark = [pytest.mark.redis_server, pytest.mark.slow]

SERVICE = "cohort"


@dataclass
class Watched:
    """A primary, its replica and a Sentinel (quorum 1) watching them."""

    primary: LocalRedis
    replica: LocalRedis
    sentinel: LocalSentinel

    @property
    def url(self) -> str:
        return f"redis+sentinel://{HOST}:{self.sentinel.port}/{SERVICE}"


def _replication(server: LocalRedis) -> dict[str, Any]:
    probe = redis.Redis(host=HOST, port=server.port, socket_timeout=1.0)
    try:
        return dict(probe.info("replication"))
    finally:
        probe.close()


def _known_replicas(sentinel: LocalSentinel) -> int:
    probe = redis.Redis(host=HOST, port=sentinel.port, socket_timeout=1.0)
    try:
        replicas: Any = probe.sentinel_slaves(SERVICE)
    finally:
        probe.close()
    return sum(1 for r in replicas if not r.get("is_sdown") and not r.get("is_odown"))


@pytest.fixture
def watched() -> Iterator[Watched]:
    binary = require_redis_server()
    started: list[LocalRedis] = []
    try:
        primary = LocalRedis(binary=binary, appendonly=True)
        started.append(primary.start())
        replica = LocalRedis(
            binary=binary, appendonly=True, extra_args=("--replicaof", HOST, str(primary.port))
        )
        started.append(replica.start())
        wait_until(
            lambda: _replication(replica).get("master_link_status") == "up",
            15,
            0.05,
            "the replica is in sync",
        )
        sentinel = LocalSentinel(
            primary.port, SERVICE, binary=binary, down_after_ms=1000, failover_timeout_ms=5000
        )
        started.append(sentinel.start())
        wait_until(lambda: _known_replicas(sentinel) == 1, 30, 0.1, "Sentinel sees the replica")
        yield Watched(primary, replica, sentinel)
    finally:
        for server in reversed(started):
            server.stop()


def _pull_through_failover(job: Cluster, predicate: Callable[[JobState], bool]) -> bool:
    try:
        return predicate(job.pull())
    except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
        return False  # READONLY / refused while Sentinel moves the primary


def test_training_continues_when_sentinel_promotes_the_replica(
    watched: Watched, tmp_path: Path
) -> None:
    conn = connect(RedisSettings(url=watched.url))
    job = Cluster(url=watched.url, conn=conn, job="sentineltrain", tmp=tmp_path)
    try:
        for name in ("c1", "c2"):
            job.trainer_coordinator(name, timeout=8)
        workers = {name: job.example_worker(name, 160) for name in ("a", "b", "c")}
        job.until(
            lambda s: len(s.ranks) == 3 and s.last_committed >= 20,
            timeout=60,
            message="three workers training through Sentinel",
        )
        before = job.state.last_committed
        watched.primary.kill()  # SIGKILL: whatever the replica had not received is gone
        wait_until(
            lambda: watched.sentinel.primary() == (HOST, watched.replica.port),
            30,
            0.1,
            "Sentinel promotes the replica",
        )
        print(f"primary SIGKILLed after step {before}; Sentinel promoted the replica")
        try:
            wait_until(
                lambda: _pull_through_failover(job, lambda s: s.last_committed >= before + 20),
                60,
                0.05,
                "training continues on the new primary",
            )
        except AssertionError:
            for proc in job.procs:
                print(f"----- {proc.name} (alive={proc.alive()})\n{proc.output()[-3000:]}")
            raise
        for name, proc in workers.items():
            assert job.finished(proc, 120) == 0, f"{name}: {proc.output()[-3000:]}"
        ends = [p.summary() for p in workers.values()]
        assert all(end["removed"] is None for end in ends), ends
        assert len({end["weights_digest"] for end in ends}) == 1, ends
        # The journal as the new primary holds it (the test saw the old primary's too).
        now = Cluster(url=watched.url, conn=conn, job=job.job, tmp=tmp_path)
        now.pull()
        held = {i for i, _ in now.facts}
        lost = [(i, type(f).__name__) for i, f in job.facts if i not in held]
        print(f"facts the old primary acknowledged and the failover lost: {lost}")
        commits = [f.step for _, f in now.facts if isinstance(f, StepCommitted)]
        assert commits == sorted(set(commits)), "a step committed twice or out of order"
        assert commits[-1] == 159
        assert audit(f for _, f in now.facts).ok
        epochs = [f.epoch for _, f in now.facts if isinstance(f, LeaderElected)]
        assert epochs == sorted(set(epochs))  # leader epochs only grow, across the failover
        logs = "".join(p.output() for p in job.procs)
        assert "Traceback" not in logs
        if lost:  # whoever had folded a lost entry noticed and folded the journal again
            assert "no longer holds entry" in logs or "lost entry" in logs, logs[-5000:]
    finally:
        job.stop()
        conn.close()
