"""Partitions: one process cut off from Redis by a TCP proxy the test owns, while it runs on.

A worker cut off for longer than the heartbeat timeout is failed, the survivors go on, its
late commands (held by the cut, delivered when it heals) change nothing, and it can join
again. A leader cut off loses its lease to the follower, and the appends it makes when the
link returns are refused by the fencing function (invariant 4 of docs/design.md).
"""

from __future__ import annotations

import re
import threading
import time

import pytest

from cohort.coordinator.audit import audit
from cohort.coordinator.fold import fold
from cohort.events.models import LeaderElected, StepCommitted, WorkerFailed, WorkerJoined
from cohort.localredis import LocalRedis
from tests.integration.cluster import Cluster, Process
from tests.integration.proxy import Proxy

pytestmark = [pytest.mark.redis_server, pytest.mark.slow]

TIMEOUT = 2.0
"""Heartbeat timeout; cuts last longer, and shorter than the clients' 10 s socket timeout."""
CUT = 6.0


def spawn_via(cluster: Cluster, proxy: Proxy, name: str, *args: str) -> Process:
    """`cohort *args` talking to Redis through `proxy`."""
    return cluster.python(name, "-m", "cohort", "--redis-url", proxy.url, *args)


def fenced_refusals(cluster: Cluster) -> int:
    """How many times Redis answered FENCED (a write refused by the fencing function)."""
    stats = cluster.conn.info("errorstats")
    return int(stats.get("errorstat_FENCED", {}).get("count", 0))


def test_a_worker_cut_off_is_failed_fenced_out_and_can_rejoin(
    cluster: Cluster, server: LocalRedis
) -> None:
    for name in ("c1", "c2"):
        cluster.trainer_coordinator(name, "--max-steps", "600", interval=0.5, timeout=TIMEOUT)
    worker = ("example-worker", "--job", cluster.job, "--pace", "0.05")
    survivors = [cluster.example_worker(f"w{i}", None, "--pace", "0.05") for i in range(2)]
    with Proxy(server.port) as proxy:
        cut_off = spawn_via(cluster, proxy, "w2", *worker, "--id", "w2")
        cluster.until(lambda s: len(s.ranks) == 3 and s.last_committed >= 10, 60, "3 ranks train")

        proxy.cut()
        cut_at = time.monotonic()
        cluster.until(lambda s: "w2" not in s.members, TIMEOUT + 5, "w2 failed")
        detected = time.monotonic() - cut_at
        failed_id, failed = cluster.of_type(WorkerFailed)[-1]
        assert failed.worker == "w2"
        resumed = cluster.state.last_committed
        cluster.until(lambda s: s.last_committed >= resumed + 10, 30, "the survivors go on")
        assert cut_off.alive(), "the cut-off process is to run on through the cut"
        proxy.heal()

        # It learns it was failed and ends; what it said late changed nothing.
        assert cluster.finished(cut_off, 30) == 0, cut_off.output()[-3000:]
        assert cut_off.summary()["removed"], cut_off.summary()
        late = [i for i, c in cluster.commands() if c.worker == "w2" and i > failed_id]
        assert late, "no late command of w2 reached the inbox (was it really cut mid-run?)"
        after = [f for i, f in cluster.facts if i > failed_id]
        assert not any(getattr(f, "worker", None) == "w2" for f in after)
        assert all("w2" not in f.ranks for f in after if hasattr(f, "ranks"))

        # It can join again, under the same name.
        again = spawn_via(cluster, proxy, "w2-again", *worker, "--id", "w2")
        cluster.until(lambda s: "w2" in s.ranks, 30, "w2 joined again")
        assert [f.worker for _, f in cluster.of_type(WorkerJoined)].count("w2") == 2
        finishers = [*survivors, again]
        for proc in finishers:
            assert cluster.finished(proc, 120) == 0, proc.output()[-3000:]
    facts = [f for _, f in cluster.facts]
    assert audit(facts).ok, audit(facts).problems
    ends = [proc.summary() for proc in finishers]
    assert len({e["weights_digest"] for e in ends}) == 1, ends
    print(f"w2 cut off: failed after {detected:.2f} s (timeout {TIMEOUT} s); late commands: "
          f"{len(late)}")  # fmt: skip


def test_a_leader_cut_off_loses_its_lease_and_its_late_appends_are_fenced(
    cluster: Cluster, server: LocalRedis
) -> None:
    flags = ("--min-workers", "2", "--dataset-size", "2048", "--batch-size", "32",
             "--heartbeat-interval", "0.5", "--heartbeat-timeout", str(TIMEOUT), "--lease", "1",
             "--max-steps", "400")  # fmt: skip
    with Proxy(server.port) as proxy:
        old = spawn_via(cluster, proxy, "c1", "coordinator", "--job", cluster.job, "--id", "c1",
                        *flags)  # fmt: skip
        cluster.until(lambda s: s.leader == "c1", 30, "c1 leads")
        cluster.coordinator("c2", *flags)
        workers = [cluster.example_worker(f"w{i}", None, "--pace", "0.03") for i in range(2)]
        cluster.until(lambda s: s.last_committed >= 10, 60, "training under way")
        refused_before = fenced_refusals(cluster)

        proxy.cut()
        cut_at = time.monotonic()
        cluster.until(lambda s: s.leader == "c2", 10, "c2 leads")
        took_over = time.monotonic() - cut_at
        elected_id = cluster.of_type(LeaderElected)[-1][0]
        resumed = cluster.state.last_committed
        cluster.until(lambda s: s.last_committed >= resumed + 10, 30, "training goes on under c2")
        # the length of the fault itself, not a wait for a condition
        threading.Event().wait(max(0.0, CUT - (time.monotonic() - cut_at)))
        proxy.heal()

        def told() -> str | None:
            log = old.output()
            for line in ("is no longer the leader", "failed to renew its lease"):
                if line in log:
                    return line
            return None

        how = cluster.until(lambda s: told(), 15, "c1 notices it lost the lease")
        refused = fenced_refusals(cluster) - refused_before
        # Its late append reached Redis and was refused there (a leader that happened to
        # be renewing when cut finds out by the renewal, before it appends).
        assert refused >= 1 or how == "failed to renew its lease", (how, refused)
        # Nothing c1 journaled is after c2's election.
        journaled = re.findall(r"\(journal (\d+-\d+)\)", old.output())
        assert all(_id(i) < _id(elected_id) for i in journaled), (journaled, elected_id)
        for proc in workers:
            assert cluster.finished(proc, 120) == 0, proc.output()[-3000:]
    facts = [f for _, f in cluster.facts]
    assert audit(facts).ok
    assert fold(facts).last_committed == cluster.state.last_committed
    commits = [f.step for f in facts if isinstance(f, StepCommitted)]
    assert commits == sorted(set(commits))
    ends = [proc.summary() for proc in workers]
    assert len({e["weights_digest"] for e in ends}) == 1, ends
    print(f"leader cut off: c2 led after {took_over:.2f} s; c1 found out by {how!r}; "
          f"FENCED refusals: {refused}")  # fmt: skip


def _id(entry_id: str) -> tuple[int, int]:
    ms, seq = entry_id.split("-")
    return int(ms), int(seq)
