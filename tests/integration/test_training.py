"""A real model trained by real worker processes through Redis, with and without faults."""

from __future__ import annotations

import signal

import numpy as np
import pytest

from cohort import example, mlp
from cohort.coordinator.audit import audit
from cohort.events.models import Heartbeat, Join, StepCommitted, WorkerFailed, WorldChanged
from tests.helpers import wait_until
from tests.integration.cluster import Cluster, ms

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


def test_workers_started_long_before_any_coordinator_train_to_the_end_and_none_fails(
    cluster: Cluster,
) -> None:
    """Invariant 10 of docs/design.md, with real processes: compose and schedulers start everything
    at once, so workers may wait for a coordinator for many heartbeat timeouts."""
    workers = [cluster.example_worker(name, None) for name in ("a", "b")]  # the job's length
    early = 12.0  # six heartbeat timeouts

    wait_until(
        lambda: heartbeating_since(cluster, ("a", "b")) >= early,
        timeout=60,
        message=f"{early:g} s of heartbeats behind the Joins",
    )
    assert all(proc.alive() for proc in workers)
    coordinator = cluster.trainer_coordinator(
        "c1", "--max-steps", "40", interval=INTERVAL, timeout=TIMEOUT
    )
    for proc in (*workers, coordinator):  # the job ends: every process exits 0
        assert cluster.finished(proc, 120) == 0, proc.output()[-3000:]
    assert cluster.of_type(WorkerFailed) == []
    assert cluster.state.last_committed == 39 and cluster.state.finished == "max_steps=40 reached"
    for proc in workers:
        output = proc.output()
        assert proc.summary()["removed"] is None and proc.summary()["steps"] > 0
        assert proc.summary()["finished"] == "max_steps=40 reached"
        assert "waiting for a coordinator of job 'itest'" in output
        assert "Traceback" not in output


def test_workers_that_heartbeat_through_a_long_leaderless_gap_are_not_failed(
    cluster: Cluster,
) -> None:
    """The only coordinator dies mid-training and another starts six heartbeat timeouts
    later: it decides the backlog and fails nobody who kept heartbeating."""
    first = cluster.trainer_coordinator("c1", interval=INTERVAL, timeout=TIMEOUT)
    workers = [cluster.example_worker(name, 80, "--pace", "0.1") for name in ("a", "b")]
    cluster.until(lambda s: len(s.ranks) == 2 and s.last_committed >= 5, timeout=60)
    first.kill(signal.SIGKILL)
    first.wait(10)
    gap = 12.0
    last_fact = ms(cluster.journal_id)
    wait_until(
        lambda: heartbeating_since(cluster, ("a", "b"), after=last_fact) >= gap,
        timeout=60,
        message=f"{gap:g} s of heartbeats without a coordinator",
    )
    assert cluster.pull().last_committed < 79  # the job waited for a coordinator
    cluster.trainer_coordinator("c2", interval=INTERVAL, timeout=TIMEOUT)
    for proc in workers:
        assert cluster.finished(proc, 120) == 0, proc.output()[-3000:]
    assert cluster.of_type(WorkerFailed) == []
    assert cluster.state.last_committed == 79 and cluster.state.leader == "c2"


def heartbeating_since(
    cluster: Cluster, workers: tuple[str, ...], after: float | None = None
) -> float:
    """Seconds (server clock) that every one of `workers` has heartbeated since its Join, or
    since `after`; 0 until each has."""
    since = dict.fromkeys(workers, after)
    spans = dict.fromkeys(workers, 0.0)
    for entry_id, command in cluster.commands():
        worker = command.worker
        if worker not in spans:
            continue
        if isinstance(command, Join) and since[worker] is None:
            since[worker] = ms(entry_id)
        start = since[worker]
        if isinstance(command, Heartbeat) and start is not None:
            spans[worker] = ms(entry_id) - start
    return min(spans.values())
