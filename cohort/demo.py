"""`cohort demo`: a whole elastic job on this machine, with a worker and a leader killed.

It starts (or uses) Redis, two coordinators and several simulated workers as real
processes, watches the journal, SIGKILLs a worker and then the leading
coordinator partway, adds a worker, and ends with a summary, an audit and an
exported journal that `cohort replay --file` explains. Every process and temp
dir it made is gone when it returns, also after Ctrl-C.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

from coordinator.audit import audit
from coordinator.replay import JournalWatch, export, from_redis
from events.connection import RedisSettings, connect
from events.keys import Keys
from events.models import LeaderElected, WorkerFailed
from events.streams import Journal

from .localredis import LocalRedis

console = Console(stderr=True)
DEADLINE = 240.0


@dataclass
class Proc:
    name: str
    argv: list[str]
    log: Path
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        handle = self.log.open("ab")
        self.popen = subprocess.Popen(
            self.argv,
            stdout=handle,
            stderr=handle,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        handle.close()

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            assert self.popen is not None
            os.killpg(self.popen.pid, sig)

    def stop(self, grace: float = 5.0) -> None:
        if self.popen is None:
            return
        self.signal(signal.SIGTERM)
        try:
            self.popen.wait(grace)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.popen.wait()

    def tail(self, lines: int = 8) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _table(watch: JournalWatch, events: list[str], steps: int) -> Table:
    state = watch.state
    table = Table(
        title=f"job {state.job or '?'}: step {state.last_committed + 1} "
        f"(target {steps} per worker), data epoch {state.epoch}, "
        f"world v{state.world_version}, leader {state.leader or '-'}"
    )
    table.add_column("worker")
    table.add_column("state")
    table.add_column("rank")
    for worker, member in sorted(state.members.items()):
        rank = state.rank_of(worker)
        table.add_row(worker, member.status, "-" if rank is None else str(rank))
    for line in events[-6:]:
        table.add_row("", f"[dim]{line}[/]", "")
    return table


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_demo(redis_url: str | None, job: str, workers: int, steps: int, keep: bool) -> int:
    cohort = [sys.executable, "-m", "cohort"]
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="cohort-demo-")))
        if redis_url is None:
            server = LocalRedis(appendonly=True, embedded_ok=True)
            server.start()
            if not keep:
                stack.callback(server.stop)
            redis_url = server.url
            kind = (
                "an embedded fakeredis server (no redis-server binary found)"
                if getattr(server, "embedded", False)
                else f"a private redis-server in {server.dir}"
            )
            console.print(f"[bold]cohort demo[/]: using {kind} at {redis_url}")
        settings = RedisSettings.resolve(redis_url)
        conn = connect(settings)
        keys = Keys(job)
        conn.delete(
            keys.inbox,
            keys.journal,
            keys.leader,
            keys.epoch,
            keys.cursor,
            keys.snapshot,
            keys.dead,
            keys.status,
        )
        base = [*cohort, "--redis-url", redis_url]
        coord_flags = [
            "--job",
            job,
            "--min-workers",
            "1",
            "--heartbeat-interval",
            "0.5",
            "--heartbeat-timeout",
            "3",
            "--dataset-size",
            "1500",
            "--batch-size",
            "16",
            "--lease",
            "2",
        ]
        procs: dict[str, Proc] = {}

        def spawn(name: str, argv: list[str]) -> None:
            procs[name] = Proc(name, argv, tmp / f"{name}.log")
            procs[name].start()

        def stop_all() -> None:
            for proc in procs.values():
                proc.stop()

        stack.callback(stop_all)
        for name in ("coord-1", "coord-2"):
            spawn(name, [*base, "coordinator", *coord_flags, "--id", name])
        for i in range(1, workers + 1):
            spawn(
                f"worker-{i}",
                [
                    *base,
                    "worker",
                    "--job",
                    job,
                    "--id",
                    f"worker-{i}",
                    "--steps",
                    str(steps),
                    "--step-time",
                    "0.05",
                ],
            )
        journal = Journal(conn, keys.journal)
        watch = JournalWatch(journal)
        events: list[str] = []
        started = time.monotonic()
        killed_worker = killed_leader = added = False
        leader_killed_at: float | None = None
        failover: float | None = None
        previous = signal.signal(signal.SIGTERM, _interrupt)
        stack.callback(signal.signal, signal.SIGTERM, previous)
        try:
            with Live(_table(watch, events, steps), console=console, refresh_per_second=8) as live:
                while True:
                    for fact in watch.pull():
                        if isinstance(fact, LeaderElected) and leader_killed_at is not None:
                            failover = failover or time.monotonic() - leader_killed_at
                        events.append(f"{type(fact).__name__}")
                    step = watch.state.last_committed + 1
                    if not killed_worker and step >= steps // 4:
                        killed_worker = True
                        procs["worker-1"].signal(signal.SIGKILL)
                        events.append("demo: SIGKILL worker-1")
                    elif killed_worker and not killed_leader and step >= steps // 2:
                        killed_leader = True
                        leader = watch.state.leader or "coord-1"
                        procs[leader].signal(signal.SIGKILL)
                        leader_killed_at = time.monotonic()
                        events.append(f"demo: SIGKILL leader {leader}")
                    elif killed_leader and not added and failover is not None:
                        added = True
                        spawn(
                            "worker-new",
                            [
                                *base,
                                "worker",
                                "--job",
                                job,
                                "--id",
                                "worker-new",
                                "--steps",
                                str(steps // 2),
                                "--step-time",
                                "0.05",
                            ],
                        )
                        events.append("demo: started worker-new")
                    live.update(_table(watch, events, steps))
                    workers_done = all(
                        not p.alive() for n, p in procs.items() if n.startswith("worker")
                    )
                    if added and workers_done:
                        break
                    if time.monotonic() - started > DEADLINE:
                        console.print("[red]demo did not finish in time; process logs:[/]")
                        for proc in procs.values():
                            console.print(f"[bold]{proc.name}[/]\n{proc.tail()}")
                        return 1
        except KeyboardInterrupt:
            console.print("[yellow]interrupted: stopping every process and removing temp files[/]")
            return 130
        run = from_redis(conn, job)
        out = Path.cwd() / f"cohort-{job}.export"
        with out.open("wb") as handle:
            export(run, handle, time.time())
        report = audit(f for _, f in watch.facts)
        state = watch.state
        failed = sum(1 for _, f in watch.facts if isinstance(f, WorkerFailed))
        took = f"{failover:.2f} s" if failover is not None else "not observed"
        console.print(
            f"\n[bold]summary[/]: {state.counters.steps_committed} steps committed, "
            f"{state.counters.epochs_finished} epochs finished, {failed} worker failure(s) "
            f"survived, {state.counters.elections} leader elections, new leader {took} "
            "after the leader's SIGKILL"
        )
        console.print(
            f"audit (every sample exactly once per epoch): "
            f"{'[green]passed[/]' if report.ok else '[red]FAILED[/]'}"
        )
        console.print(f"replay this run: [bold]cohort replay --file {out} --audit[/]")
        return 0 if report.ok else 1
    return 1
