"""A long chaos run: random faults while a real model trains, then every invariant checked.

Two coordinators and three `cohort example-worker` processes train the bundled MLP on a
real redis-server (AOF, appendfsync always). Every process talks to Redis through its own
TCP proxy (tests/integration/proxy.py), so any one can be cut off. For `--minutes` the run
injects, in a random order, one fault of each kind per round:

- kill-coordinator: SIGKILL a coordinator, start it again;
- stop-coordinator: SIGSTOP a coordinator for 1-2.5 s, then SIGCONT;
- kill-worker: SIGKILL a worker (when more than two run), start a new one;
- stop-worker: SIGSTOP a worker for 0.5-1.5 s (under the heartbeat timeout), then SIGCONT;
- restart-redis: SIGKILL redis-server, start it again on its AOF;
- partition-worker: cut a worker off for 3-5 s (past the 2 s heartbeat timeout): it is
  failed, learns it when the cut heals and exits; a new worker takes its place;
- partition-coordinator: cut a coordinator off for 2-4 s (past the 1 s lease).

Then the faults stop; three workers told to stop 200 steps later join, the others leave,
and once the three finished the run checks: the live
leader's state is the fold of the journal, the audit passes (every sample once per
epoch, ranks a permutation), leader epochs and world versions only grow, every Join sent
was decided exactly once (commands lost 0, applied twice 0), and every worker that
finished holds the same weights.

    python -m bench.chaos --minutes 10          # prints the section
    python -m bench --only chaos                # the same for 10 minutes, into BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import msgpack

from bench.fleet import spawn
from bench.results import Section
from cohort.coordinator.audit import Audit, audit
from cohort.coordinator.fold import fold
from cohort.coordinator.replay import JournalWatch
from cohort.coordinator.state import state_hash
from cohort.events.codec import decode_command
from cohort.events.connection import UNAVAILABLE, Client
from cohort.events.errors import DecodeError
from cohort.events.keys import Keys
from cohort.events.models import Fact, Join, LeaderElected, WorkerJoined, WorldChanged
from cohort.localredis import LocalRedis
from cohort.processes import Proc
from tests.integration.proxy import Proxy

T = TypeVar("T")
JOB = "chaos"
TIMEOUT_S = 2.0
COORDINATOR = (
    "--min-workers", "2", "--dataset-size", "2048", "--batch-size", "32",
    "--heartbeat-interval", "0.5", "--heartbeat-timeout", str(TIMEOUT_S), "--lease", "1",
)  # fmt: skip
KINDS = (
    "kill-coordinator", "stop-coordinator", "kill-worker", "stop-worker", "restart-redis",
    "partition-worker", "partition-coordinator",
)  # fmt: skip
PACE = "0.05"
TAIL = 200
"""Steps trained after the chaos, by the workers that finish the job."""


class Run:
    """The job's processes, each behind its own proxy, and what the run has seen."""

    def __init__(self, server: LocalRedis, rng: random.Random, steps: int) -> None:
        self.server = server
        self.rng = rng
        self.steps = steps
        self.conn: Client = server.client()
        self.watch = JournalWatch.of(self.conn, JOB)
        self.proxies: dict[str, Proxy] = {}
        self.coordinators: dict[str, Proc] = {}
        self.workers: dict[str, Proc] = {}
        self.serial = 0
        self.joins: Counter[str] = Counter()  # Joins seen in the inbox, before any trim
        self.inbox_id = "0-0"
        self.pause = threading.Event()  # never set: waits here are the faults' lengths

    # ------------------------------------------------------------ processes
    def proxy(self, name: str) -> Proxy:
        if name not in self.proxies:
            self.proxies[name] = Proxy(self.server.port)
        return self.proxies[name]

    def coordinator(self, name: str) -> None:
        self.coordinators[name] = spawn(
            self.proxy(name).url, name, "coordinator", "--job", JOB, "--id", name, *COORDINATOR
        )

    def worker(self) -> None:
        self.serial += 1
        name = f"w{self.serial}"
        self.workers[name] = spawn(
            self.proxy(name).url, name, "example-worker", "--job", JOB, "--id", name,
            "--steps", str(self.steps), "--pace", PACE, "--gpu-interval", "0",
        )  # fmt: skip

    def running_workers(self) -> list[str]:
        return [n for n, p in self.workers.items() if p.alive()]

    # ------------------------------------------------------------ reading Redis
    def redis(self, read: Callable[[], T], what: str, limit: float = 120.0) -> T:
        """`read()`, retried while Redis restarts."""
        deadline = time.monotonic() + limit
        while True:
            try:
                return read()
            except UNAVAILABLE:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"Redis unreachable for {limit:g} s while {what}") from None
                self.pause.wait(0.2)

    def pull(self) -> None:
        self.redis(lambda: self.watch.pull(block_ms=0), "reading the journal")
        rows: Any = self.redis(
            lambda: self.conn.xrange(Keys(JOB).inbox, f"({self.inbox_id}", "+", count=10_000),
            "reading the inbox",
        )
        for entry_id, fields in rows:
            self.inbox_id = entry_id.decode()
            try:
                command = decode_command(fields[b"e"])
            except (DecodeError, KeyError):
                continue
            if isinstance(command, Join):
                self.joins[command.worker] += 1

    def until(self, done: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"chaos: {what} did not happen within {timeout:g} s")
            self.pull()
            self.pause.wait(0.1)

    # ------------------------------------------------------------ faults
    def inject(self, kind: str) -> None:
        rng, wait = self.rng, self.pause.wait
        if kind in ("kill-coordinator", "stop-coordinator", "partition-coordinator"):
            name = rng.choice(sorted(self.coordinators))
            proc = self.coordinators[name]
            if kind == "kill-coordinator":
                proc.signal(signal.SIGKILL)
                proc.stop()
                self.coordinator(name)
            elif kind == "stop-coordinator":
                proc.signal(signal.SIGSTOP)
                wait(rng.uniform(1.0, 2.5))
                proc.signal(signal.SIGCONT)
            else:
                self.proxies[name].cut()
                wait(rng.uniform(2.0, 4.0))
                self.proxies[name].heal()
        elif kind in ("kill-worker", "stop-worker", "partition-worker"):
            alive = self.running_workers()
            victim = rng.choice(alive) if alive else None
            if victim is not None and kind == "stop-worker":
                self.workers[victim].signal(signal.SIGSTOP)
                wait(rng.uniform(0.5, 1.5))
                self.workers[victim].signal(signal.SIGCONT)
                return
            if victim is not None and len(alive) > 2:
                if kind == "kill-worker":
                    self.workers[victim].signal(signal.SIGKILL)
                else:
                    self.proxies[victim].cut()
                    wait(rng.uniform(3.0, 5.0))
                    self.proxies[victim].heal()
            self.worker()  # a newcomer keeps the world at three or more
        else:
            self.server.kill()
            self.server.restart()

    def close(self) -> None:
        for proc in [*self.coordinators.values(), *self.workers.values()]:
            proc.signal(signal.SIGCONT)
            proc.stop()
        for proxy in self.proxies.values():
            proxy.close()


def measure(minutes: float, seed: int = 20261124) -> Section:
    rng = random.Random(seed)
    with LocalRedis(appendonly=True, appendfsync="always") as server:
        run = Run(server, rng, steps=10**9)
        try:
            _train(run)
            faults, chaos_s = _chaos(run, minutes)
            finishers = _finish(run)
            return _check(run, faults, chaos_s, minutes, seed, finishers)
        finally:
            run.close()


def _train(run: Run) -> None:
    """Two coordinators, three workers training (with no step count yet)."""
    for name in ("c1", "c2"):
        run.coordinator(name)
    for _ in range(3):
        run.worker()
    run.until(lambda: run.watch.state.last_committed >= 10, 120, "training under way")


def _finish(run: Run) -> list[Proc]:
    """End the job at a step all finishers share: three workers told to stop TAIL steps
    from now join, then the others leave (SIGTERM: finish the step, leave); the three."""
    run.steps = run.watch.state.last_committed + TAIL
    others = run.running_workers()
    for _ in range(3):
        run.worker()
    finishers = [run.workers[name] for name in list(run.workers)[-3:]]
    ranks = lambda: {str(r) for r in run.watch.state.ranks}  # noqa: E731
    run.until(lambda: {p.name for p in finishers} <= ranks(), 120, "the finishers joining")
    for name in others:
        run.workers[name].stop(30)
    run.until(lambda: not any(p.alive() for p in finishers), 600, "the finishers finishing")
    return finishers


def _chaos(run: Run, minutes: float) -> tuple[Counter[str], float]:
    faults: Counter[str] = Counter()
    plan: list[str] = []
    started = time.monotonic()
    end = started + minutes * 60
    while time.monotonic() < end:
        run.pull()
        if not plan:
            plan = list(KINDS)
            run.rng.shuffle(plan)
        kind = plan.pop()
        run.inject(kind)
        faults[kind] += 1
        run.pause.wait(run.rng.uniform(1.5, 3.0))
    return faults, time.monotonic() - started


def _check(
    run: Run, faults: Counter[str], chaos_s: float, minutes: float, seed: int, finishers: list[Proc]
) -> Section:
    run.pull()
    live = _live_status(run)
    found = _Findings.of(run, [f for _, f in run.watch.facts], live, finishers)
    return Section(
        key="chaos",
        title="Chaos: random faults while a real model trains, then every invariant",
        command=f"python -m bench.chaos --minutes {minutes:g}",
        header=["what", "value"],
        rows=_rows(run, faults, chaos_s, found),
        notes=[
            "Two coordinators, three or more `cohort example-worker` processes (the numpy "
            "MLP), each behind its own TCP proxy; redis-server with appendfsync always. "
            f"Heartbeat timeout {TIMEOUT_S:g} s, lease 1 s, seed {seed}. "
            + ("Every check passed." if found.ok else "**A check failed**: see the rows.")
        ],
        raw={
            "faults": dict(faults),
            "chaos_s": chaos_s,
            "steps": run.steps,
            "lost": found.lost,
            "twice": found.twice,
            "audit_problems": list(found.report.problems)[:20],
            "digests": sorted(str(d) for d in found.digests),
            "ok": found.ok,
        },
    )


def _live_status(run: Run) -> dict[str, Any]:
    """The status a live leader publishes once it has folded the whole journal."""
    live: dict[str, Any] = {}

    def leader_at_tail() -> bool:
        raw = run.redis(lambda: run.conn.get(Keys(JOB).status), "reading the status")
        body = msgpack.unpackb(raw) if raw else None
        run.pull()
        if body and body["journal_id"] == run.watch.journal_id:
            live.update(body)
            return True
        return False

    run.until(leader_at_tail, 30, "a leader publishing at the journal tail")
    return live


@dataclass(frozen=True)
class _Findings:
    """What the journal, the live leader and the finishers' last lines show."""

    replay_ok: bool
    report: Audit
    epochs: list[int]
    versions: list[int]
    lost: list[str]
    twice: list[str]
    ends: list[dict[str, Any]]
    digests: set[Any]

    @classmethod
    def of(
        cls, run: Run, facts: list[Fact], live: dict[str, Any], finishers: list[Proc]
    ) -> _Findings:
        joined = Counter(f.worker for f in facts if isinstance(f, WorkerJoined))
        ends = [_summary(p.log) for p in finishers]
        return cls(
            replay_ok=live["state_hash"] == state_hash(fold(facts)),
            report=audit(facts),
            epochs=[f.epoch for f in facts if isinstance(f, LeaderElected)],
            versions=[f.version for f in facts if isinstance(f, WorldChanged)],
            lost=sorted(set(run.joins) - set(joined)),
            twice=sorted(w for w, n in joined.items() if n > 1),
            ends=ends,
            digests={e.get("weights_digest") for e in ends},
        )

    @property
    def agree(self) -> bool:
        """Every finisher ended with the same weights."""
        return len(self.digests) == 1 and None not in self.digests

    @property
    def grow(self) -> bool:
        """Leader epochs and world versions only grow."""
        return _only_grow(self.epochs) and _only_grow(self.versions)

    @property
    def ok(self) -> bool:
        checks = [self.replay_ok, self.report.ok, self.grow, not self.lost, not self.twice,
                  self.agree, len(self.ends) >= 2]  # fmt: skip
        return all(checks)


def _only_grow(values: list[int]) -> bool:
    return values == sorted(set(values))


def _rows(run: Run, faults: Counter[str], chaos_s: float, found: _Findings) -> list[list[str]]:
    """The faults injected, what the run did, and each check's outcome."""
    rows = [[f"faults: {kind}", str(faults[kind])] for kind in KINDS]
    return rows + [
        ["faults in all", str(sum(faults.values()))],
        ["chaos, minutes", f"{chaos_s / 60:.1f}"],
        ["steps committed", str(run.watch.state.counters.steps_committed)],
        ["workers started", str(run.serial)],
        ["leader epochs", str(len(found.epochs))],
        ["worlds", str(len(found.versions))],
        ["commands lost (Joins never decided)", str(len(found.lost))],
        ["commands applied twice (Joins decided twice)", str(len(found.twice))],
        ["final weights agree", f"{found.agree} ({len(found.ends)} finishers)"],
        ["live leader state == replay of the journal", str(found.replay_ok)],
        ["audit (every sample once per epoch, ranks a permutation)", str(found.report.ok)],
        ["epochs and world versions only grow", str(found.grow)],
    ]


def _summary(log: Path) -> dict[str, Any]:
    """The JSON line a worker prints last."""
    for line in reversed(log.read_text(errors="replace").splitlines()):
        if line.startswith("{"):
            try:
                return dict(json.loads(line))
            except json.JSONDecodeError:
                break
    return {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=20261124)
    args = parser.parse_args()
    section = measure(args.minutes, args.seed)
    print(section.markdown())
    if not section.raw["ok"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
