"""A long chaos run: random faults while a real model trains, then every invariant checked.

Two coordinators and three `cohort example-worker` processes train the bundled MLP on real
redis-server processes (AOF, appendfsync always), in one of three topologies (`--topology`,
bench/topologies.py):

- single (the default): one redis-server; every process talks to it through its own TCP
  proxy (tests/integration/proxy.py), so any one can be cut off;
- sentinel: a primary and two replicas watched by three Sentinels (quorum 2); every process
  finds the primary through `redis+sentinel://`;
- cluster: a Redis Cluster of three primaries with a replica each, on `redis+cluster://`.

Every coordinator gets `--wait-replicas N`. For `--minutes` (and until each kind has
happened once) the run injects, in a random order, one fault of each kind per round:

- kill-coordinator: SIGKILL a coordinator, start it again;
- stop-coordinator: SIGSTOP a coordinator for 1-2.5 s, then SIGCONT;
- kill-worker: SIGKILL a worker (when more than two run), start a new one;
- stop-worker: SIGSTOP a worker for 0.5-1.5 s (under the heartbeat timeout), then SIGCONT;
- restart-redis (single): SIGKILL redis-server, start it again on its AOF;
- failover-primary (sentinel, cluster): SIGKILL the primary (on a cluster, the one owning the
  job's slot), wait until Sentinel or the cluster promotes a replica, start the killed
  server again on its AOF and wait until it is a replica of the new primary;
- partition-worker (single): cut a worker off for 3-5 s (past the 2 s heartbeat timeout):
  it is failed, learns it when the cut heals and exits; a new worker takes its place;
- partition-coordinator (single): cut a coordinator off for 2-4 s (past the 1 s lease).

The partitions need a proxy per process in front of the server it uses; Sentinel and a
cluster tell every client the same address of the primary, so there they are left out.

Then the faults stop; three workers told to stop 200 steps later join, the others leave,
and once the three finished the run checks: the live leader's state is the fold of the
journal, the audit passes (every sample once per epoch, ranks a permutation), leader epochs
and world versions only grow, every Join sent was decided exactly once (commands lost 0,
applied twice 0), every worker that finished holds the same weights, and the journal holds
what every worker did (no WeightsDiverged, each StepDone's weights digest the one its step
committed with, the finishers' weights those of one process replaying the journal's
committed batches). With replicas it also counts what the failovers took back
(bench/rollbacks.py): facts the run's observer read that the final journal no longer holds,
which of them a worker acted on, which leader had acted on a lost fact, and which processes
noticed; with `--wait-replicas 1` nothing anyone acted on may be lost.

    python -m bench.chaos --minutes 10                      # single: prints the section
    python -m bench.chaos --minutes 10 --topology sentinel --wait-replicas 1 --into BENCHMARKS.md
    python -m bench --only chaos                # single, 10 minutes, into BENCHMARKS.md
    python -m bench --only chaos-ha             # sentinel and cluster, WAIT 0 and 1, 10 min each
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import msgpack
import numpy as np
import redis

from bench.fleet import spawn
from bench.results import Section, load, publish
from bench.rollbacks import Report, disagreeing, diverged, noticed, rolled_back
from bench.topologies import TOPOLOGIES, Failover, Topology
from cohort import example
from cohort.coordinator.audit import audit
from cohort.coordinator.fold import fold
from cohort.coordinator.replay import JournalWatch
from cohort.coordinator.state import state_hash
from cohort.events.codec import decode_command
from cohort.events.connection import UNAVAILABLE, Client
from cohort.events.errors import DecodeError
from cohort.events.keys import Keys
from cohort.events.models import (
    Fact,
    Join,
    LeaderElected,
    StepCommitted,
    StepDone,
    WorkerJoined,
    WorldChanged,
)
from cohort.events.streams import ZERO, id_key
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
"""The faults on one server, in the order a round is shuffled from."""
HA_KINDS = (
    "kill-coordinator", "stop-coordinator", "kill-worker", "stop-worker", "failover-primary",
)  # fmt: skip
"""The faults with replicas: the primary's loss is a failover, and no partitions."""
PACE = "0.05"
TAIL = 200
"""Steps trained after the chaos, by the workers that finish the job."""
REPLAYED_WITHIN = 1e-6
"""How far (relative) a finisher's weights may be from one process replaying the journal:
the ranks sum their gradients in another order than one process does."""
CELLS = (("sentinel", 0), ("sentinel", 1), ("cluster", 0), ("cluster", 1))
"""The chaos-ha section's runs: (topology, --wait-replicas)."""
RETRIED: tuple[type[BaseException], ...] = (*UNAVAILABLE, redis.exceptions.ClusterError)
"""What the observer waits out while a failover moves the primary."""


class Run:
    """The job's processes (on one server each behind its own proxy), the topology they
    train on, and what the run has seen."""

    def __init__(
        self, topology: Topology, rng: random.Random, steps: int, wait_replicas: int = 0
    ) -> None:
        self.topology = topology
        self.rng = rng
        self.steps = steps
        self.wait_replicas = wait_replicas
        self.kinds = KINDS if topology.proxy_target() is not None else HA_KINDS
        self.conn: Client = topology.client()
        self.watch = self._watch()
        self.seen: dict[str, Fact] = {}  # every fact the observer read, by journal ID
        self._recorded = 0  # facts of `watch` copied into `seen`
        self.refolds = 0  # times the observer found its journal position gone
        self.reports: list[Report] = []  # StepDones seen in the inbox
        self.failovers: list[Failover] = []
        self.proxies: dict[str, Proxy] = {}
        self.coordinators: dict[str, Proc] = {}
        self.workers: dict[str, Proc] = {}
        self.started: list[Proc] = []  # every process, restarted ones too: their logs
        self.saved = Path(tempfile.mkdtemp(prefix="cohort-chaos-"))
        self.serial = 0
        self.joins: Counter[str] = Counter()  # Joins seen in the inbox, before any trim
        self.inbox_id = "0-0"
        self.pause = threading.Event()  # never set: waits here are the faults' lengths

    def _watch(self) -> JournalWatch:
        return JournalWatch.of(self.conn, JOB)

    # ------------------------------------------------------------ processes
    def url(self, name: str) -> str:
        """Where process `name` reaches Redis: its own proxy, or the topology's URL."""
        target = self.topology.proxy_target()
        if target is None:
            return self.topology.url
        if name not in self.proxies:
            self.proxies[name] = Proxy(target)
        return self.proxies[name].url

    def spawn(self, name: str, *args: str) -> Proc:
        proc = spawn(self.url(name), name, *args)
        self.started.append(proc)
        return proc

    def coordinator(self, name: str) -> None:
        self.coordinators[name] = self.spawn(
            name, "coordinator", "--job", JOB, "--id", name, *COORDINATOR,
            "--wait-replicas", str(self.wait_replicas),
        )  # fmt: skip

    def worker(self, save: bool = False) -> None:
        self.serial += 1
        name = f"w{self.serial}"
        keep = ("--save", str(self.saved / f"{name}.npz")) if save else ()
        self.workers[name] = self.spawn(
            name, "example-worker", "--job", JOB, "--id", name,
            "--steps", str(self.steps), "--pace", PACE, "--gpu-interval", "0", *keep,
        )  # fmt: skip

    def running_workers(self) -> list[str]:
        return [n for n, p in self.workers.items() if p.alive()]

    # ------------------------------------------------------------ reading Redis
    def redis(self, read: Callable[[], T], what: str, limit: float = 120.0) -> T:
        """`read()`, retried while Redis restarts or fails over."""
        deadline = time.monotonic() + limit
        while True:
            try:
                return read()
            except RETRIED:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"Redis unreachable for {limit:g} s while {what}") from None
                self.pause.wait(0.2)

    def pull(self) -> None:
        self.redis(self._pull_journal, "reading the journal")
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
            elif isinstance(command, StepDone):
                self.reports.append((self.inbox_id, command))

    def _pull_journal(self) -> None:
        """Fold what the journal gained; if it no longer holds the entry folded up to (a
        failover took it back), fold it again from the start, as every reader does."""
        at = self.watch.journal_id
        if at != ZERO and not self.conn.xrange(Keys(JOB).journal, at, at):
            self.refolds += 1
            self.watch, self._recorded = self._watch(), 0
        self.watch.pull(block_ms=0)
        self.seen.update(self.watch.facts[self._recorded :])
        self._recorded = len(self.watch.facts)

    def until(self, done: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                lost = self.watch.state.weights_lost
                why = f" (the job lost the weights of step {lost})" if lost is not None else ""
                raise TimeoutError(f"chaos: {what} did not happen within {timeout:g} s{why}")
            self.pull()
            self.pause.wait(0.1)

    # ------------------------------------------------------------ faults
    def inject(self, kind: str) -> None:
        if kind.endswith("-coordinator"):
            self._coordinator_fault(kind)
        elif kind.endswith("-worker"):
            self._worker_fault(kind)
        else:
            self.pull()  # the observer reads up to the moment of the crash
            self.failovers.append(self.topology.lose_primary(Keys(JOB).journal))

    def _coordinator_fault(self, kind: str) -> None:
        name = self.rng.choice(sorted(self.coordinators))
        proc = self.coordinators[name]
        if kind == "kill-coordinator":
            proc.signal(signal.SIGKILL)
            proc.stop()
            self.coordinator(name)
        elif kind == "stop-coordinator":
            proc.signal(signal.SIGSTOP)
            self.pause.wait(self.rng.uniform(1.0, 2.5))
            proc.signal(signal.SIGCONT)
        else:
            self.proxies[name].cut()
            self.pause.wait(self.rng.uniform(2.0, 4.0))
            self.proxies[name].heal()

    def _worker_fault(self, kind: str) -> None:
        rng, wait = self.rng, self.pause.wait
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

    def logs(self, of: dict[str, Proc]) -> dict[str, str]:
        """The log of every process ever started under a name of `of`, by name (a second
        start of c1 is "c1#2")."""
        logs: dict[str, str] = {}
        for proc in self.started:
            if proc.name in of:
                starts = sum(1 for n in logs if n.split("#")[0] == proc.name)
                name = proc.name + (f"#{starts + 1}" if starts else "")
                logs[name] = proc.log.read_text(errors="replace")
        return logs

    def keep_logs(self, into: Path) -> None:
        """Every process's log as `into`/NAME.log (a second start of c1: c1#2.log)."""
        into.mkdir(parents=True, exist_ok=True)
        for name, text in {**self.logs(self.coordinators), **self.logs(self.workers)}.items():
            (into / f"{name}.log").write_text(text)

    def close(self) -> None:
        for proc in [*self.coordinators.values(), *self.workers.values()]:
            proc.signal(signal.SIGCONT)
            proc.stop()
        for proxy in self.proxies.values():
            proxy.close()
        self.conn.close()
        shutil.rmtree(self.saved, ignore_errors=True)


def run_cell(
    minutes: float,
    seed: int = 20261124,
    topology: str = "single",
    wait_replicas: int = 0,
    logs: Path | None = None,
) -> dict[str, Any]:
    """One chaos run on `topology`: what it did and what every check found (JSON-able);
    with `logs`, every server's and process's log is copied there at the end."""
    if topology not in TOPOLOGIES:
        raise ValueError(f"unknown topology {topology!r}: choose from {', '.join(TOPOLOGIES)}")
    if wait_replicas and topology == "single":
        raise ValueError("--wait-replicas needs replicas: choose --topology sentinel or cluster")
    servers = TOPOLOGIES[topology]()
    servers.start()
    try:
        run = Run(servers, random.Random(seed), steps=10**9, wait_replicas=wait_replicas)
        try:
            _train(run)
            faults, chaos_s = _chaos(run, minutes)
            finishers = _finish(run)
            raw = _check(run, faults, chaos_s, finishers)
        finally:
            run.close()
            if logs is not None:
                run.keep_logs(logs)
    finally:
        if logs is not None:
            servers.keep_logs(logs)
        servers.stop()
    raw.update(topology=topology, wait_replicas=wait_replicas, minutes=minutes, seed=seed)
    raw.update(describe=servers.describe(), ok=passed(raw))
    return raw


def measure(
    minutes: float, seed: int = 20261124, topology: str = "single", wait_replicas: int = 0
) -> Section:
    """The chaos section of one run: on one server the "chaos" section, with replicas the
    "chaos-ha" section with this run's column only."""
    raw = run_cell(minutes, seed, topology, wait_replicas)
    if topology == "single":
        return _single_section(raw)
    return ha_section({_name(raw): raw}, _command(raw))


def measure_ha(
    minutes: float, cells: Sequence[tuple[str, int]] = CELLS, seed: int = 20261124
) -> Section:
    """The chaos-ha section: a run per cell, one after another; a cell that fails is
    reported as failed and the others still run."""
    raw: dict[str, dict[str, Any]] = {}
    for topology, wait in cells:
        try:
            raw[cell_name(topology, wait)] = run_cell(minutes, seed, topology, wait)
        except Exception as exc:  # a deadline missed mid-run: say which and go on
            raw[cell_name(topology, wait)] = {
                "topology": topology, "wait_replicas": wait, "minutes": minutes,
                "error": f"{type(exc).__name__}: {exc}", "ok": False,
            }  # fmt: skip
    return ha_section(raw, "python -m bench --only chaos-ha")


def cell_name(topology: str, wait_replicas: int) -> str:
    return f"{topology}/{wait_replicas}"


def _name(raw: dict[str, Any]) -> str:
    return cell_name(raw["topology"], raw["wait_replicas"])


def _command(raw: dict[str, Any]) -> str:
    command = f"python -m bench.chaos --minutes {raw['minutes']:g}"
    if raw["topology"] != "single":
        command += f" --topology {raw['topology']} --wait-replicas {raw['wait_replicas']}"
    return command


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
    run.pull()  # the last fault may have been long (a failover): "now" is the journal's now
    run.steps = run.watch.state.last_committed + TAIL
    others = run.running_workers()
    for _ in range(3):
        run.worker(save=True)
    finishers = [run.workers[name] for name in list(run.workers)[-3:]]
    ranks = lambda: {str(r) for r in run.watch.state.ranks}  # noqa: E731
    run.until(lambda: {p.name for p in finishers} <= ranks(), 120, "the finishers joining")
    for name in others:
        run.workers[name].stop(30)
    run.until(lambda: not any(p.alive() for p in finishers), 600, "the finishers finishing")
    return finishers


def _chaos(run: Run, minutes: float) -> tuple[Counter[str], float]:
    """Faults for `minutes`, and on until every kind has happened once."""
    faults: Counter[str] = Counter()
    plan: list[str] = []
    started = time.monotonic()
    end = started + minutes * 60
    while time.monotonic() < end or len(faults) < len(run.kinds):
        run.pull()
        if not plan:
            plan = list(run.kinds)
            run.rng.shuffle(plan)
        kind = plan.pop()
        run.inject(kind)
        faults[kind] += 1
        run.pause.wait(run.rng.uniform(1.5, 3.0))
    return faults, time.monotonic() - started


def _check(run: Run, faults: Counter[str], chaos_s: float, finishers: list[Proc]) -> dict[str, Any]:
    """Every check on what the run left, as the cell's raw results."""
    run.pull()
    live = _live_status(run)
    final = list(run.watch.facts)
    facts = [f for _, f in final]
    report = audit(facts)
    joined = Counter(f.worker for f in facts if isinstance(f, WorkerJoined))
    epochs = [f.epoch for f in facts if isinstance(f, LeaderElected)]
    versions = [f.version for f in facts if isinstance(f, WorldChanged)]
    digests = sorted({str(_summary(p.log).get("weights_digest")) for p in finishers})
    return {
        "kinds": list(run.kinds),
        "faults": dict(faults),
        "chaos_s": chaos_s,
        "steps": run.steps,
        "committed": run.watch.state.counters.steps_committed,
        "workers": run.serial,
        "epochs": len(epochs),
        "worlds": len(versions),
        "grow": _only_grow(epochs) and _only_grow(versions),
        "lost": sorted(set(run.joins) - set(joined)),
        "twice": sorted(w for w, n in joined.items() if n > 1),
        "finishers": len(finishers),
        "digests": digests,
        "agree": len(digests) == 1 and digests != ["None"] and len(finishers) >= 2,
        "replay_ok": live["state_hash"] == state_hash(fold(facts)),
        "audit_ok": report.ok,
        "audit_problems": list(report.problems)[:20],
        "diverged": diverged(final),
        "disagree": len(disagreeing(final, run.reports)),
        "reports": len(run.reports),
        "replayed": _replayed(run, finishers, facts),
        "commit_gap_s": _longest_gap([i for i, f in final if isinstance(f, StepCommitted)]),
        "worker_outcomes": dict(Counter(p.outcome() for p in run.started if p.name in run.workers)),
        **_rollbacks(run, final),
    }


def _rollbacks(run: Run, final: list[tuple[str, Fact]]) -> dict[str, Any]:
    """What the failovers took back, who had acted on it and who noticed; how long each
    failover took, and how many appends WAIT confirmed on fewer replicas than asked."""
    gone = rolled_back(run.seen, final, run.reports)
    coordinator_logs, worker_logs = run.logs(run.coordinators), run.logs(run.workers)
    found = noticed(coordinator_logs, worker_logs)
    actors = {w for g in gone for w in g.acted_on_by}
    noticing = {name.split("#")[0] for name in found.workers}
    return {
        "failovers": [
            {
                "promote_s": round(f.promote_s, 2),
                "rejoin_s": round(f.rejoin_s, 2),
                "killed": f.killed,
                "promoted": f.primary,
                "settled": f.settled,
            }
            for f in run.failovers
        ],  # fmt: skip
        "rolled_back": len(gone),
        "rolled_back_types": dict(Counter(type(g.fact).__name__ for g in gone)),
        "rolled_back_entries": [[g.entry, type(g.fact).__name__, *g.acted_on_by] for g in gone][
            :50
        ],
        "acted_on": sum(1 for g in gone if g.acted_on_by),
        "acted_by": sorted(actors),
        "unnoticed": sorted(actors - noticing),
        "leaders_acted": found.leaders,
        "noticed_coordinators": sorted(found.coordinators),
        "noticed_workers": sorted(found.workers),
        "folded_lost": len(found.entries),
        "observer_refolds": run.refolds,
        "unreplicated": sum(log.count("WAIT: journal entry") for log in coordinator_logs.values()),
    }


def _replayed(run: Run, finishers: list[Proc], facts: list[Fact]) -> float | None:
    """The largest relative difference between a finisher's saved weights and those one
    process gets replaying the journal's committed batches (None: none saved)."""
    expected = example.reference(facts)
    worst: float | None = None
    for proc in finishers:
        path = run.saved / f"{proc.name}.npz"
        if not path.exists():
            continue
        with np.load(path) as saved:
            diff = max(
                float(np.abs(saved[k] - v).max() / (np.abs(v).max() + 1e-12))
                for k, v in expected.items()
            )
        worst = diff if worst is None else max(worst, diff)
    return worst


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


def _longest_gap(entries: list[str]) -> float:
    """The longest time between two consecutive journal entries (their IDs' server times)."""
    times = [id_key(e)[0] / 1000 for e in entries]
    return round(max((b - a for a, b in zip(times, times[1:], strict=False)), default=0.0), 2)


def _only_grow(values: list[int]) -> bool:
    return values == sorted(set(values))


def passed(raw: dict[str, Any]) -> bool:
    """Every check passed; with --wait-replicas, nothing anyone acted on was lost."""
    replayed = raw["replayed"]
    checks = [
        raw["replay_ok"], raw["audit_ok"], raw["grow"], not raw["lost"], not raw["twice"],
        raw["agree"], not raw["diverged"], not raw["disagree"],
        replayed is not None and replayed <= REPLAYED_WITHIN, not raw["unnoticed"],
    ]  # fmt: skip
    if raw["topology"] != "single":
        checks.append(len(raw["failovers"]) > 0)
    if raw["wait_replicas"]:
        checks += [not raw["acted_on"], not raw["leaders_acted"]]
    return all(checks)


def figures(raw: dict[str, Any]) -> list[tuple[str, str]]:
    """The faults injected, what the run did, and each check's outcome, as (what, value)."""
    rows = [(f"faults: {kind}", str(raw["faults"].get(kind, 0))) for kind in raw["kinds"]]
    rows += [
        ("faults in all", str(sum(raw["faults"].values()))),
        ("chaos, minutes", f"{raw['chaos_s'] / 60:.1f}"),
        ("steps committed", str(raw["committed"])),
        ("workers started", str(raw["workers"])),
        ("leader epochs", str(raw["epochs"])),
        ("worlds", str(raw["worlds"])),
    ]
    if raw["topology"] != "single":
        rows += _failover_figures(raw)
    return rows + [
        ("commands lost (Joins never decided)", str(len(raw["lost"]))),
        ("commands applied twice (Joins decided twice)", str(len(raw["twice"]))),
        ("final weights agree", f"{raw['agree']} ({raw['finishers']} finishers)"),
        ("final weights == one process replaying the journal (max relative difference)",
         _replayed_figure(raw["replayed"])),
        ("StepDones whose weights digest is not their commit's", str(raw["disagree"])),
        ("WeightsDiverged in the journal", str(raw["diverged"])),
        ("live leader state == replay of the journal", str(raw["replay_ok"])),
        ("audit (every sample once per epoch, ranks a permutation)", str(raw["audit_ok"])),
        ("epochs and world versions only grow", str(raw["grow"])),
    ]  # fmt: skip


def _failover_figures(raw: dict[str, Any]) -> list[tuple[str, str]]:
    promote = [f["promote_s"] for f in raw["failovers"]]
    rejoin = [f["rejoin_s"] for f in raw["failovers"]]
    types = ", ".join(f"{n} {t}" for t, n in sorted(raw["rolled_back_types"].items()))
    return [
        ("failover: kill to a replica promoted and followed, s (median, max)", _spread(promote)),
        ("failover: then the killed server a replica in sync, s (median, max)", _spread(rejoin)),
        ("primary moved again, not by a fault", str(_moved(raw["failovers"]))),
        ("longest time between two commits, s", f"{raw['commit_gap_s']:.1f}"),
        ("appends WAIT confirmed on fewer replicas than asked", str(raw["unreplicated"])),
        ("facts the observer read that the final journal lacks (rolled back)",
         str(raw["rolled_back"]) + (f" ({types})" if types else "")),
        ("... of them acted on by a worker", str(raw["acted_on"])),
        ("lost entries a leader had acted on (it stepped down)", str(raw["leaders_acted"])),
        ("lost entries some process had folded (from the logs)", str(raw["folded_lost"])),
        ("processes that noticed a rollback: coordinators, workers",
         f"{len(raw['noticed_coordinators'])}, {len(raw['noticed_workers'])}"),
        ("workers that acted on a lost fact and did not notice", str(len(raw["unnoticed"]))),
    ]  # fmt: skip


def _moved(failovers: list[dict[str, int]]) -> int:
    """Times the primary changed other than by the kill of a failover-primary fault: while a
    failover settled (it settled on another primary than it promoted), or between two."""
    during = sum(1 for f in failovers if f["settled"] != f["promoted"])
    between = sum(
        1 for a, b in zip(failovers, failovers[1:], strict=False) if b["killed"] != a["settled"]
    )
    return during + between


def _spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{float(np.median(values)):.1f}, {max(values):.1f}"


def _replayed_figure(value: float | None) -> str:
    if value is None:
        return "**no weights saved**"
    return f"{value <= REPLAYED_WITHIN} ({value:.1e})"


def _single_section(raw: dict[str, Any]) -> Section:
    return Section(
        key="chaos",
        title="Chaos: random faults while a real model trains, then every invariant",
        command=_command(raw),
        header=["what", "value"],
        rows=[list(row) for row in figures(raw)],
        notes=[
            "Two coordinators, three or more `cohort example-worker` processes (the numpy "
            f"MLP), each behind its own TCP proxy; {raw['describe']}. Heartbeat timeout "
            f"{TIMEOUT_S:g} s, lease 1 s, seed {raw['seed']}. "
            + ("Every check passed." if raw["ok"] else "**A check failed**: see the rows.")
        ],
        raw=raw,
    )


HA_TITLE = "Chaos with replicas: a Redis failover loses nothing that was acted on"


def ha_section(cells: dict[str, dict[str, Any]], command: str) -> Section:
    """A column per run (topology and --wait-replicas), a row per figure."""
    names = list(cells)
    columns = {n: dict(figures(raw)) if "error" not in raw else {} for n, raw in cells.items()}
    whats = list(dict.fromkeys(w for name in names for w in columns[name]))
    rows = [[w, *(columns[n].get(w, "") for n in names)] for w in whats]
    rows.append(["every check passed", *(_verdict(cells[n]) for n in names)])
    header = ["what"] + [
        f"{cells[n]['topology']}, --wait-replicas {cells[n]['wait_replicas']}" for n in names
    ]
    return Section(
        key="chaos-ha",
        title=HA_TITLE,
        command=command,
        header=header,
        rows=rows,
        notes=_ha_notes(cells),
        raw={"cells": cells},
    )


def _verdict(raw: dict[str, Any]) -> str:
    if "error" in raw:
        return f"**failed**: {raw['error']}"
    return "yes" if raw["ok"] else "**no**"


HA_READING = [
    "How to read the failover rows: failover-primary SIGKILLs the primary (on the cluster the "
    "one owning the job's slot); *promoted and followed* runs from the kill until a replica "
    "serves as the primary (behind Sentinel: until the failover is over and the other replica "
    "follows it); *a replica in sync* from then until the killed server, started again on its "
    "own AOF, replicates the new primary with its link up (Sentinel demotes a restarted old "
    "primary some 8 s after it reports itself). *Primary moved again* counts changes of "
    "primary no fault asked for. *Longest time between two commits* is the longest the job "
    "stood still (journal times).",
    "How to read the rollback rows: the bench's observer reads the journal as workers do and "
    "keeps every fact it read; *rolled back* are those the final journal lacks. One was "
    "*acted on by a worker* if a StepDone rested on it (a later step after a lost commit, a "
    "step in a lost world) before the journal decided it again; a leader had acted on a lost "
    "entry if it found entries it had folded gone while leading (it logs it and steps down). "
    "Who noticed is what the processes logged (`no longer holds entry`, `lost entry ... "
    "folding it again`). With `--wait-replicas 1` a run passes only if nothing a worker or a "
    "leader acted on was rolled back; without it a rollback is reported, and must be noticed.",
    "How the journal is checked against what the workers did: each StepDone's weights digest "
    "is the one its step committed with, the journal holds no WeightsDiverged, and the "
    "finishers' saved weights are those of one process replaying the journal's committed "
    "global batches (`cohort.example.reference`), up to the order floats are summed in.",
    "Sentinel's down-after is 3 s. The first runs used 1 s, and there a just-promoted "
    "primary on these busy cores once missed a second of pings and was failed over again at "
    "once, to the replica still syncing from it: for 10 s two primaries served (the leader "
    "on the replaced one), its writes were then thrown away, every worker had left or been "
    'failed, and the job stopped with its weights lost (docs/redis-ha.md, "Two primaries '
    'for a while"). The killed server is also started again only once the failover is over.',
    "Left out: the partition faults of the one-server run. Its per-process proxies need an "
    "address per process for the same server; Sentinel and a cluster give every client the "
    "primary's own address.",
]
"""The chaos-ha section's notes that do not depend on the figures."""


def _ha_notes(cells: dict[str, dict[str, Any]]) -> list[str]:
    """How the runs were made, how to read them, and what the runs without WAIT lost."""
    made = sorted({f"{r['topology']}: {r['describe']}" for r in cells.values() if "describe" in r})
    unwaited = [r for r in cells.values() if "error" not in r and not r["wait_replicas"]]
    gone = sum(r["rolled_back"] for r in unwaited)
    acted = sum(r["acted_on"] for r in unwaited)
    notes = [
        "Each column is one run of `python -m bench.chaos --topology T --wait-replicas N "
        "--minutes M --into BENCHMARKS.md` (the command above runs them one after another); "
        "two coordinators, three or more `cohort example-worker` processes (the numpy MLP), "
        f"every coordinator given `--wait-replicas N`. Heartbeat timeout {TIMEOUT_S:g} s, "
        "lease 1 s. " + "; ".join(made) + ".",
        *HA_READING,
        f"Without WAIT these runs rolled back {gone} facts the observer had read ({acted} "
        "acted on by a worker). On one host that is what to expect: a primary writes a reply "
        "to its clients and the replication stream to its replicas in the same pass of its "
        "event loop, so a SIGKILL leaves the replicas with everything a client was told. WAIT "
        "matters where a replica lags the clients (another host, a stalled replica); "
        "docs/redis-ha.md says what it then covers and what it does not "
        "(tests/integration/test_wait_replicas.py: a reader takes a fact no replica has).",
        *_wait_costs(cells),
    ]
    return [f"- {note}" for note in notes]  # a list: the page joins notes line by line


def _wait_costs(cells: dict[str, dict[str, Any]]) -> list[str]:
    """What WAIT cost where a primary has one replica: the cluster's runs side by side."""
    ran = {(r["topology"], r["wait_replicas"]): r for r in cells.values() if "error" not in r}
    waited, plain = ran.get(("cluster", 1)), ran.get(("cluster", 0))
    if waited is None or plain is None:
        return []
    behind = ran.get(("sentinel", 1))
    sentinel = (
        f" Behind Sentinel the other replica confirms meanwhile: {behind['unreplicated']} "
        "appends fell short there."
        if behind is not None
        else ""
    )
    return [
        "What WAIT costs where each primary has one replica (the cluster): while the killed "
        "node is away the new primary has no replica, so each append waits until the node is "
        f"back, up to the 5 s timeout ({waited['unreplicated']} appends fell short and were "
        "acted on unreplicated; no failover came before the node was back, so none was lost), "
        "and a leader that waits longer than its 1 s lease loses it: "
        f"{waited['epochs']} leader epochs against {plain['epochs']} without WAIT, "
        f"{waited['committed']:,} steps committed against {plain['committed']:,}." + sentinel,
    ]


def stored_cells(page: Path) -> dict[str, dict[str, Any]]:
    """The chaos-ha runs stored beside `page` (none: {})."""
    stored = load(page.with_suffix(".json")).get("chaos-ha")
    return dict(stored.raw.get("cells", {})) if stored is not None else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=20261124)
    parser.add_argument("--topology", choices=sorted(TOPOLOGIES), default="single")
    parser.add_argument(
        "--wait-replicas", type=int, default=0, help="given to every coordinator (replicas only)"
    )
    parser.add_argument(
        "--into",
        type=Path,
        help="also write the section into this page (e.g. BENCHMARKS.md) and its JSON; with "
        "replicas, this run's column replaces its own in the stored chaos-ha section",
    )
    parser.add_argument(
        "--logs", type=Path, help="copy every server's and process's log into this folder"
    )
    args = parser.parse_args()
    if args.wait_replicas < 0 or (args.wait_replicas and args.topology == "single"):
        parser.error("--wait-replicas N (N >= 0) needs replicas: --topology sentinel or cluster")
    raw = run_cell(args.minutes, args.seed, args.topology, args.wait_replicas, args.logs)
    section = _single_section(raw) if args.topology == "single" else None
    if section is None:
        cells = {**(stored_cells(args.into) if args.into else {}), _name(raw): raw}
        section = ha_section(
            cells, "python -m bench --only chaos-ha" if len(cells) > 1 else _command(raw)
        )
    print(section.markdown())
    if args.into is not None:
        from bench.__main__ import FULL  # the suite's order (late: it imports this module)

        publish(args.into, [section], _command(raw), list(FULL))
        print(f"wrote {args.into} and {args.into.with_suffix('.json')}")
    if not raw["ok"]:
        raise SystemExit(1)


def _summary(log: Path) -> dict[str, Any]:
    """The JSON line a worker prints last."""
    for line in reversed(log.read_text(errors="replace").splitlines()):
        if line.startswith("{"):
            try:
                return dict(json.loads(line))
            except json.JSONDecodeError:
                break
    return {}


if __name__ == "__main__":
    main()
