"""Chaos: coordinators and workers SIGKILLed and SIGSTOPped and redis-server restarted (or,
with replicas, its primary failed over) while a real model trains; afterwards the invariants
of docs/design.md must hold. Bounded in time."""

from __future__ import annotations

import json
import random
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import msgpack
import pytest

from cohort.coordinator.audit import audit
from cohort.coordinator.fold import fold
from cohort.coordinator.state import state_hash
from cohort.events.codec import decode_command
from cohort.events.errors import DecodeError
from cohort.events.keys import Keys
from cohort.events.models import Join, LeaderElected, WorkerJoined, WorldChanged
from cohort.localredis import LocalRedis
from tests.helpers import wait_until
from tests.integration.cluster import Cluster, Process
from tests.integration.quickbench import QuickBench

pytestmark = [pytest.mark.redis_server, pytest.mark.slow]

STEPS = 1500
CHAOS_SECONDS = 40.0
COORD = (
    "--min-workers",
    "2",
    "--dataset-size",
    "2048",
    "--batch-size",
    "32",
    "--heartbeat-interval",
    "0.5",
    "--heartbeat-timeout",
    "2",
    "--lease",
    "1",
)


class _Chaos:
    """Two coordinators and the workers of a chaos run, and the faults it injects: every
    kind once per round, in a random order, at a random pace."""

    def __init__(self, cluster: Cluster, server: LocalRedis, rng: random.Random) -> None:
        self.cluster, self.server, self.rng = cluster, server, rng
        self.coordinators = {name: cluster.coordinator(name, *COORD) for name in ("c1", "c2")}
        self.workers: dict[str, Process] = {}
        self.serial = 0
        self.faults: Counter[str] = Counter()
        self.pause = threading.Event()
        self.ended: list[str] = []
        """The output of each coordinator killed and started again (for a failure's story)."""

    def start_worker(self) -> None:
        self.serial += 1
        name = f"w{self.serial}"
        self.workers[name] = self.cluster.example_worker(name, STEPS, "--pace", "0.03")

    def run(self, seconds: float) -> None:
        """Faults for `seconds`, or until the job nears its end."""
        deadline = time.monotonic() + seconds
        plan: list[str] = []
        while time.monotonic() < deadline and self.cluster.pull().last_committed < STEPS - 80:
            if not plan:  # every kind of fault in each round, in a random order
                plan = ["kill-coordinator", "stop-coordinator", "kill-worker", "restart-redis"]
                self.rng.shuffle(plan)
            action = plan.pop()
            self.inject(action)
            self.faults[action] += 1
            self.pause.wait(self.rng.uniform(1.5, 3.0))  # the pace of the chaos itself

    def inject(self, action: str) -> None:
        if action == "kill-coordinator":
            name = self.rng.choice(sorted(self.coordinators))
            self.coordinators[name].kill(signal.SIGKILL)
            self.coordinators[name].wait(10)
            self.ended.append(self.coordinators[name].output())
            self.coordinators[name] = self.cluster.coordinator(name, *COORD)
        elif action == "stop-coordinator":
            name = self.rng.choice(sorted(self.coordinators))
            self.coordinators[name].kill(signal.SIGSTOP)
            # a stopped process, not a wait for a condition
            self.pause.wait(self.rng.uniform(1.0, 2.5))
            self.coordinators[name].kill(signal.SIGCONT)
        elif action == "kill-worker":
            alive = [n for n, p in self.workers.items() if p.alive()]
            if len(alive) > 2:
                victim = self.rng.choice(alive)
                self.workers[victim].kill(signal.SIGKILL)
                self.workers[victim].wait(10)
            self.start_worker()
        else:
            self.server.kill()
            self.server.restart()
            self.cluster.conn = self.server.client()


def _joins_sent(cluster: Cluster) -> set[str]:
    """Every worker with a Join in the inbox (entries that do not decode are skipped)."""
    sent = set()
    for _, fields in cluster.conn.xrange(Keys(cluster.job).inbox):
        try:
            command = decode_command(fields[b"e"])
        except DecodeError:
            continue
        if isinstance(command, Join):
            sent.add(command.worker)
    return sent


def _story(chaos: _Chaos, workers: set[str]) -> str:
    """What the inbox, the dead letters, the journal and the coordinators' logs say of
    `workers`: the evidence a failed invariant 5 is read from."""
    cluster = chaos.cluster
    lines = [
        f"inbox {i}: {c.type} {c.worker}" for i, c in cluster.commands() if c.worker in workers
    ]
    for entry_id, fields in cluster.conn.xrange(Keys(cluster.job).dead):
        lines.append(f"dead {entry_id!r}: {fields!r}"[:400])
    lines += [
        f"fact {i}: {f!r}"[:400] for i, f in cluster.facts if any(w in repr(f) for w in workers)
    ]
    logs = [*chaos.ended, *(p.output() for p in chaos.coordinators.values())]
    marks = (*workers, "repaired", "could not", "Traceback")
    lines += [line for log in logs for line in log.splitlines() if any(m in line for m in marks)]
    return "\n".join(lines[-200:])


def test_training_survives_chaos_and_keeps_every_invariant(
    cluster: Cluster, server: LocalRedis
) -> None:
    chaos = _Chaos(cluster, server, random.Random(20261123))
    for _ in range(3):
        chaos.start_worker()
    cluster.until(
        lambda s: len(s.ranks) >= 2 and s.last_committed >= 10,
        timeout=60,
        message="training under way",
    )

    chaos.run(CHAOS_SECONDS)
    faults, workers, serial = chaos.faults, chaos.workers, chaos.serial

    finishers = [p for p in workers.values() if p.alive()]
    for proc in finishers:
        assert cluster.finished(proc, 180) == 0, proc.output()[-3000:]
    cluster.pull()
    facts = [f for _, f in cluster.facts]
    print(
        f"faults injected: {dict(faults)}; workers started: {serial}; "
        f"facts: {len(facts)}; steps committed: {cluster.state.counters.steps_committed}"
    )
    assert sum(faults.values()) >= 5

    # Invariant 1: the live leader's state is the replay of the journal.
    def leader_at_tail() -> dict | None:
        raw = cluster.conn.get(Keys(cluster.job).status)
        body = msgpack.unpackb(raw) if raw else None
        cluster.pull()
        return body if body and body["journal_id"] == cluster.journal_id else None

    live = wait_until(leader_at_tail, 20, message="a leader publishing at the journal tail")
    assert live["state_hash"] == state_hash(fold(facts))

    # Invariants 2 and 3: versions and epochs only grow; every sample once per epoch.
    report = audit(facts)
    assert report.ok, (report.problems, report.epochs)
    epochs = [f.epoch for f in facts if isinstance(f, LeaderElected)]
    assert epochs == sorted(set(epochs))
    versions = [f.version for f in facts if isinstance(f, WorldChanged)]
    assert versions == sorted(set(versions))

    # Invariant 5: no command lost or applied twice: every worker that ever sent a Join
    # was decided exactly once (workers never rejoin here).
    sent = _joins_sent(cluster)
    joined = Counter(f.worker for f in facts if isinstance(f, WorkerJoined))
    assert set(joined) == sent == set(workers), _story(chaos, sent ^ set(joined))
    assert max(joined.values()) == 1

    # Invariant 7: everyone who finished holds the same weights.
    ends = [p.summary() for p in finishers]
    assert len({e["weights_digest"] for e in ends}) == 1, ends
    assert all(e["steps"] > 0 for e in ends)


def test_the_chaos_benchmark_keeps_every_invariant_for_half_a_minute(
    tmp_path: Path, quick_bench: QuickBench
) -> None:
    """The quick version of `python -m bench.chaos` (`python -m bench --quick --only chaos`):
    every kind of fault, partitions through the proxies included, then every check of the
    benchmark's table; and nothing it started is left running."""
    result = quick_bench.quick("chaos")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "Every check passed." in result.stdout
    assert "| commands lost (Joins never decided) | 0 |" in result.stdout
    assert "| commands applied twice (Joins decided twice) | 0 |" in result.stdout
    (section,) = json.loads((tmp_path / "B.json").read_text())
    assert section["command"] == "python -m bench.chaos --minutes 0.5"
    raw = section["raw"]
    assert raw["ok"] and not raw["lost"] and not raw["twice"] and raw["steps"] > 0
    assert raw["chaos_s"] > 0 and sum(raw["faults"].values()) > 0


@pytest.mark.parametrize("topology", ["sentinel", "cluster"])
def test_the_chaos_benchmark_survives_a_failover_with_wait_losing_nothing_acted_on(
    tmp_path: Path, quick_bench: QuickBench, topology: str
) -> None:
    """The quick version of one column of `python -m bench --only chaos-ha`: every fault kind
    once (a SIGKILLed primary among them, a replica promoted, the killed server back as a
    replica), the coordinators on `--wait-replicas 1`; then every check of the table, and
    nothing the workers or a leader acted on rolled back. Its column lands in the page given
    to --into, and nothing it started is left running."""
    page = tmp_path / "B.md"
    argv = [
        sys.executable, "-m", "bench.chaos", "--minutes", "0.2", "--topology", topology,
        "--wait-replicas", "1", "--into", str(page),
    ]  # fmt: skip
    result = quick_bench.run(argv, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    (section,) = json.loads(page.with_suffix(".json").read_text())
    assert section["key"] == "chaos-ha" and f"| what | {topology}, --wait-replicas 1 |" in (
        page.read_text()
    )
    raw = section["raw"]["cells"][f"{topology}/1"]
    assert raw["ok"], raw
    assert raw["faults"]["failover-primary"] == len(raw["failovers"]) >= 1
    assert all(f["promote_s"] > 0 and f["rejoin_s"] > 0 for f in raw["failovers"])
    assert raw["lost"] == [] and raw["twice"] == []
    assert raw["acted_on"] == 0 and raw["leaders_acted"] == 0 and raw["unnoticed"] == []
    assert raw["replay_ok"] and raw["audit_ok"] and raw["grow"] and raw["agree"]
    assert raw["disagree"] == 0 and raw["diverged"] == 0 and raw["replayed"] <= 1e-6
