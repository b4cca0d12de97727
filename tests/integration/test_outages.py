"""A Redis that goes away for longer than a collective's deadline, mid-training: the workers
ride it out (outage time does not count against the deadline), the job finishes, the weights
agree, the audit passes. Real redis-server, real worker and coordinator processes."""

from __future__ import annotations

import os
import threading
import time

import pytest

from cohort.coordinator.audit import audit
from cohort.events.models import StepCommitted, WorkerFailed, WorldChanged
from cohort.localredis import LocalRedis
from tests.integration.cluster import Cluster

pytestmark = [pytest.mark.redis_server, pytest.mark.slow]

COLLECTIVE_TIMEOUT = float(os.environ.get("COHORT_TEST_COLLECTIVE_TIMEOUT", "8"))
"""The workers' collective deadline, shortened from 60 s so the test stays short (the issue's
bar: COHORT_TEST_COLLECTIVE_TIMEOUT=60 COHORT_TEST_OUTAGE=90)."""
OUTAGE = float(os.environ.get("COHORT_TEST_OUTAGE", "20"))
"""Redis is down this long: 2.5 collective deadlines, 4 heartbeat timeouts, 20 leases."""
HEARTBEAT_TIMEOUT = 5.0
STEPS = 150


def test_workers_ride_out_a_redis_outage_longer_than_the_collective_deadline(
    cluster: Cluster, server: LocalRedis
) -> None:
    for name in ("c1", "c2"):
        cluster.trainer_coordinator(
            name, "--max-steps", str(STEPS), interval=0.5, timeout=HEARTBEAT_TIMEOUT
        )
    workers = [
        cluster.example_worker(
            f"w{i}", None, "--pace", "0.02", "--collective-timeout", str(COLLECTIVE_TIMEOUT)
        )
        for i in range(2)
    ]
    cluster.until(lambda s: len(s.ranks) == 2 and s.last_committed >= 20, 60, "training under way")
    world = cluster.state.world_version

    server.kill()  # SIGKILL: the AOF (appendfsync always) holds every acknowledged write
    down_at = time.monotonic()
    threading.Event().wait(OUTAGE)  # the length of the fault itself, not a wait for a condition
    for proc in workers:
        assert proc.alive(), f"{proc.name} died during the outage:\n{proc.output()[-3000:]}"
    server.restart()
    cluster.conn = server.client()
    in_flight = cluster.pull().last_committed + 1  # the step whose allreduce Redis cut off
    outage = time.monotonic() - down_at

    for proc in workers:
        assert cluster.finished(proc, 90) == 0, proc.output()[-3000:]
    cluster.pull()
    facts = [f for _, f in cluster.facts]
    assert not cluster.of_type(WorkerFailed), "a worker was failed for the outage's silence"
    # The step cut off mid-allreduce committed in the same world: the same call survived an
    # outage longer than its deadline (a failed call is never retried in its world).
    assert any(isinstance(f, StepCommitted) and f.step == in_flight for f in facts)
    worlds = [f.version for f in facts if isinstance(f, WorldChanged)]
    assert worlds[-1] == world, f"the world changed across the outage: {worlds}"
    report = audit(facts)
    assert report.ok, report.problems
    ends = [proc.summary() for proc in workers]
    assert len({e["weights_digest"] for e in ends}) == 1, ends
    assert all(e["finished"] for e in ends), ends
    logs = "".join(p.output() for p in cluster.procs)
    assert "Traceback" not in logs
    assert "is back after" in logs
    print(f"outage {outage:.1f} s, collective deadline {COLLECTIVE_TIMEOUT:g} s; step {in_flight}")
