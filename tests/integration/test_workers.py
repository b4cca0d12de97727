"""Workers as real processes: a SIGKILLed worker is failed and its data reassigned; Redis
restarts are ridden out by coordinators and workers alike."""

from __future__ import annotations

import signal

import pytest

from cohort.coordinator.audit import audit
from cohort.coordinator.fold import fold
from cohort.events.deal import leftover, merge
from cohort.events.models import StepCommitted, WorkerFailed, WorldChanged
from cohort.localredis import LocalRedis
from tests.integration.cluster import Cluster, ms

pytestmark = [pytest.mark.redis_server, pytest.mark.slow]

INTERVAL, TIMEOUT = 0.5, 2.0
COORD = (
    "--heartbeat-interval",
    str(INTERVAL),
    "--heartbeat-timeout",
    str(TIMEOUT),
    "--min-workers",
    "2",
    "--dataset-size",
    "4000",
    "--batch-size",
    "8",
    "--lease",
    "1",
)


def start_job(cluster: Cluster, workers: int, steps: int = 100_000) -> None:
    cluster.coordinator("c1", *COORD)
    cluster.coordinator("c2", *COORD)
    for n in range(workers):
        cluster.worker(f"w{n}", "--steps", str(steps), "--step-time", "0.02")
    cluster.until(
        lambda s: len(s.ranks) == workers and s.last_committed >= 5,
        timeout=60,
        message=f"{workers} workers training",
    )


def test_killed_worker_is_failed_within_timeout_and_its_shard_is_reassigned(
    cluster: Cluster,
) -> None:
    start_job(cluster, workers=3)
    victim = next(p for p in cluster.procs if p.name == "w1")
    killed_at = victim.kill(signal.SIGKILL)
    cluster.until(lambda s: "w1" not in s.members, timeout=TIMEOUT + 10, message="w1 failed")
    ((failed_id, failed),) = cluster.of_type(WorkerFailed)
    assert failed.worker == "w1" and failed.timeout == TIMEOUT
    detected = ms(failed_id) - killed_at
    print(
        f"worker SIGKILL -> WorkerFailed in {detected:.3f} s "
        f"(timeout {TIMEOUT} s, interval {INTERVAL} s)"
    )
    assert detected <= TIMEOUT + INTERVAL + 0.5  # + the leader's inbox wait and a tick

    world_id, world = next((i, f) for i, f in cluster.of_type(WorldChanged) if i > failed_id)
    assert "w1" not in world.ranks and sorted(world.ranks) == ["w0", "w2"]
    resumed_from = cluster.state.last_committed
    cluster.until(
        lambda s: s.last_committed >= resumed_from + 10,
        timeout=30,
        message="survivors keep training",
    )
    report = audit(f for _, f in cluster.facts)
    assert report.ok, report
    # The new world's shards hold exactly what was left of the epoch, w1's part included.
    before = fold(f for i, f in cluster.facts if i < world_id)
    assert before.config is not None
    left = leftover(
        before.config, before.shards, before.base_step, world.start_step, before.unassigned
    )
    assigned = merge(sorted(r for s in world.shards for r in s.ranges))
    assert assigned == merge(sorted(left))
    for proc in cluster.procs:
        if proc.name in ("w0", "w2"):
            assert proc.alive(), proc.output()[-2000:]


def test_training_survives_a_redis_restart_and_loses_no_committed_step(
    cluster: Cluster, server: LocalRedis
) -> None:
    start_job(cluster, workers=2)
    before = cluster.state.last_committed
    server.kill()
    server.restart()
    cluster.conn = server.client()
    cluster.until(
        lambda s: s.last_committed >= before + 20,
        timeout=60,
        message="training continues after the restart",
    )
    commits = [f.step for _, f in cluster.facts if isinstance(f, StepCommitted)]
    assert commits == sorted(set(commits)), "a step committed twice or out of order"
    assert audit(f for _, f in cluster.facts).ok
    for proc in cluster.procs:
        assert proc.alive(), proc.output()[-2000:]
    logs = "".join(p.output() for p in cluster.procs)
    assert "Traceback" not in logs


def test_a_worker_leaves_cleanly_on_sigterm_and_reports_its_summary(cluster: Cluster) -> None:
    start_job(cluster, workers=3)
    leaver = next(p for p in cluster.procs if p.name == "w2")
    leaver.kill(signal.SIGTERM)
    assert leaver.wait(30) == 0, leaver.output()[-2000:]
    summary = leaver.summary()
    assert summary["worker"] == "w2" and summary["steps_committed"] > 0
    cluster.until(
        lambda s: "w2" not in s.members and sorted(s.ranks) == ["w0", "w1"],
        message="w2 left and the world shrank",
    )
    assert not cluster.of_type(WorkerFailed)
