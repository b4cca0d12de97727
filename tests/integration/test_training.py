"""A real model trained by real worker processes through Redis, with and without faults."""

from __future__ import annotations

import signal

import numpy as np
import pytest

from cohort import example, mlp
from cohort.coordinator.audit import audit
from cohort.events.models import StepCommitted, WorkerFailed, WorldChanged

from .cluster import Cluster, ms

pytestmark = [pytest.mark.redis_server, pytest.mark.slow]

INTERVAL, TIMEOUT = 0.5, 2.0


def relative_difference(a: mlp.Params, b: mlp.Params) -> float:
    return max(float(np.abs(a[k] - b[k]).max() / (np.abs(b[k]).max() + 1e-12)) for k in b)


@pytest.mark.parametrize("n", [2, 3])
def test_n_workers_reach_the_weights_of_one_process_on_the_same_global_batches(
    cluster: Cluster, n: int
) -> None:
    cluster.trainer_coordinator("c1", workers=n, interval=INTERVAL, timeout=TIMEOUT)
    procs = [cluster.example_worker(f"w{i}", 80, save=True) for i in range(n)]
    for proc in procs:
        assert proc.wait(120) == 0, proc.output()[-3000:]
    digests = {p.summary()["weights_digest"] for p in procs}
    assert len(digests) == 1
    cluster.pull()
    expected = example.reference(f for _, f in cluster.facts)
    for i in range(n):
        with np.load(cluster.saved(f"w{i}")) as saved:
            got = {k: saved[k] for k in saved.files}
        assert relative_difference(got, expected) <= 1e-6
    assert procs[0].summary()["accuracy"] > 0.9
    assert audit(f for _, f in cluster.facts).ok


def test_a_killed_worker_and_a_newcomer_leave_survivors_equal_and_every_sample_used_once(
    cluster: Cluster,
) -> None:
    cluster.trainer_coordinator("c1", interval=INTERVAL, timeout=TIMEOUT)
    steps = 150
    workers = {name: cluster.example_worker(name, steps, save=True) for name in ("a", "b", "c")}
    cluster.until(
        lambda s: len(s.ranks) == 3 and s.last_committed >= 20,
        timeout=60,
        message="three workers training",
    )
    killed_at = workers["b"].kill(signal.SIGKILL)
    cluster.until(lambda s: "b" not in s.members, timeout=TIMEOUT + 10, message="b failed")
    failed_id = cluster.of_type(WorkerFailed)[0][0]
    cluster.until(
        lambda s: any(isinstance(f, StepCommitted) and i > failed_id for i, f in cluster.facts),
        timeout=30,
        message="survivors commit again",
    )
    resumed_id = next(i for i, f in cluster.facts if isinstance(f, StepCommitted) and i > failed_id)
    resumed = ms(resumed_id) - killed_at
    print(
        f"SIGKILL -> survivors' next committed step: {resumed:.3f} s "
        f"(heartbeat_timeout {TIMEOUT} s, interval {INTERVAL} s)"
    )
    assert resumed <= TIMEOUT + 2.0

    newcomer = cluster.example_worker("d", steps, save=True)
    cluster.until(lambda s: "d" in s.ranks, timeout=60, message="d joins the world")
    for name in ("a", "c"):
        assert cluster.finished(workers[name], 120) == 0, workers[name].output()[-3000:]
    assert cluster.finished(newcomer, 120) == 0, newcomer.output()[-3000:]

    ends = [workers["a"].summary(), workers["c"].summary(), newcomer.summary()]
    assert len({end["weights_digest"] for end in ends}) == 1
    assert 0 < ends[2]["steps"] < min(ends[0]["steps"], ends[1]["steps"])
    cluster.pull()
    report = audit(f for _, f in cluster.facts)
    assert report.ok, report
    assert any(e.finished for e in report.epochs.values())
    # The survivors' weights are what one process gets on the committed global batches:
    # nothing of an aborted step survived, nothing of a committed one was lost.
    expected = example.reference(f for _, f in cluster.facts)
    with np.load(cluster.saved("a")) as saved:
        got = {k: saved[k] for k in saved.files}
    assert relative_difference(got, expected) <= 1e-6
    worlds = [f for _, f in cluster.of_type(WorldChanged)]
    assert any("d" in w.ranks and "a" in w.ranks for w in worlds)
