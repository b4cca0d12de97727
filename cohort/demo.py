"""`cohort demo`: a whole elastic job on this machine, with a worker and a leader killed.

It starts (or uses) Redis, two coordinators and several simulated workers as real
processes, watches the journal, SIGKILLs a worker and then the leading
coordinator partway, adds a worker, and ends with a summary, an audit and an
exported journal that `cohort replay --file` explains. Every process and temp
dir it made is gone when it returns, also after Ctrl-C.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from cohort.coordinator.audit import audit
from cohort.coordinator.replay import JournalWatch, describe, export, from_redis
from cohort.coordinator.shards import leftover
from cohort.events.connection import RedisSettings, connect
from cohort.events.keys import Keys
from cohort.events.models import LeaderElected, StepCommitted, WorkerFailed
from cohort.events.shards import range_count
from cohort.events.streams import Journal

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


def _view(watch: JournalWatch, events: list[str], steps: int, progress: Progress) -> Group:
    state = watch.state
    table = Table(
        title=f"world v{state.world_version}, leader {state.leader or '-'}"
        f"{'  [yellow]paused[/]' if state.paused and state.started else ''}",
        title_justify="left",
    )
    table.add_column("worker")
    table.add_column("state")
    table.add_column("rank")
    table.add_column("shard left")
    config = state.config
    used = (state.next_step - state.base_step) * (config.batch_size if config else 0)
    for worker, member in sorted(state.members.items()):
        rank = state.rank_of(worker)
        left = max(0, state.shards[rank].size - used) if rank is not None else None
        table.add_row(
            worker,
            member.status,
            "-" if rank is None else str(rank),
            "-" if left is None else str(left),
        )
    lines = Table.grid()
    for line in events[-6:]:
        lines.add_row(f"[dim]{line}[/]")
    return Group(progress, table, lines)


def _epoch_done(watch: JournalWatch) -> tuple[int, int]:
    state = watch.state
    if state.config is None:
        return 0, 1
    total = state.config.dataset_size
    rest = leftover(
        state.shards, state.base_step, state.next_step, state.config.batch_size, state.unassigned
    )
    return total - range_count(rest), total


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_demo(redis_url: str | None, job: str, workers: int, steps: int, keep: bool) -> int:
    """The demo's exit code: 0 when it ran to an identical-weights, audited end; 130 on
    Ctrl-C at any moment (every process stopped and every temp file removed first)."""
    try:
        return _run(redis_url, job, workers, steps, keep)
    except KeyboardInterrupt:  # during start-up or shutdown; the live loop handles its own
        console.print("[yellow]interrupted: every process stopped and temp files removed[/]")
        return 130


def _run(redis_url: str | None, job: str, workers: int, steps: int, keep: bool) -> int:
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
        conn = connect(RedisSettings.resolve(redis_url))
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
            "2048",
            "--batch-size",
            "32",
            "--lease",
            "2",
        ]
        procs: dict[str, Proc] = {}

        def spawn(name: str, argv: list[str]) -> None:
            procs[name] = Proc(name, argv, tmp / f"{name}.log")
            procs[name].start()

        def worker(name: str) -> None:
            spawn(
                name,
                [
                    *base,
                    "example-worker",
                    "--job",
                    job,
                    "--id",
                    name,
                    "--steps",
                    str(steps),
                    "--pace",
                    "0.04",
                ],
            )

        def stop_all() -> None:
            for proc in procs.values():
                proc.stop()

        stack.callback(stop_all)
        for name in ("coord-1", "coord-2"):
            spawn(name, [*base, "coordinator", *coord_flags, "--id", name])
        for i in range(1, workers + 1):
            worker(f"worker-{i}")
        watch = JournalWatch(Journal(conn, keys.journal))
        events: list[str] = []
        started = time.monotonic()
        killed_worker = killed_leader = added = False
        leader_killed_at: float | None = None
        failover: float | None = None
        previous = signal.signal(signal.SIGTERM, _interrupt)
        stack.callback(signal.signal, signal.SIGTERM, previous)
        progress = Progress(
            TextColumn("{task.description:<12}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
        )
        step_bar = progress.add_task("steps", total=steps)
        epoch_bar = progress.add_task("epoch 0", total=2048)
        try:
            with Live(
                _view(watch, events, steps, progress), console=console, refresh_per_second=8
            ) as live:
                while True:
                    seen = len(watch.facts)
                    watch.pull()
                    for entry_id, fact in watch.facts[seen:]:
                        if isinstance(fact, LeaderElected) and leader_killed_at is not None:
                            failover = failover or time.monotonic() - leader_killed_at
                        if not isinstance(fact, StepCommitted):
                            events.append(
                                f"{entry_id}  {type(fact).__name__} {describe(fact)}"[:150]
                            )
                    step = watch.state.last_committed + 1
                    done, total = _epoch_done(watch)
                    progress.update(step_bar, completed=min(step, steps))
                    progress.update(
                        epoch_bar,
                        completed=done,
                        total=total,
                        description=f"epoch {watch.state.epoch}",
                    )
                    if not killed_worker and step >= steps // 4:
                        killed_worker = True
                        procs["worker-1"].signal(signal.SIGKILL)
                        events.append("[bold red]demo: SIGKILL worker-1[/]")
                    elif killed_worker and not killed_leader and step >= steps // 2:
                        killed_leader = True
                        leader = watch.state.leader or "coord-1"
                        procs[leader].signal(signal.SIGKILL)
                        leader_killed_at = time.monotonic()
                        events.append(f"[bold red]demo: SIGKILL leader {leader}[/]")
                    elif killed_leader and not added and failover is not None:
                        added = True
                        worker("worker-new")
                        events.append("[bold green]demo: started worker-new[/]")
                    live.update(_view(watch, events, steps, progress))
                    running = [p for n, p in procs.items() if n.startswith("worker") and p.alive()]
                    if added and not running:
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
        ends = [_last_json(p) for n, p in procs.items() if n.startswith("worker")]
        # A worker activated only after the last step (a late joiner) trained nothing: its
        # weights are its own initial ones, so it does not count among the finishers.
        finished = [e for e in ends if e and e["steps"] > 0]
        idle = [e["worker"] for e in ends if e and e["steps"] == 0]
        state = watch.state
        failed = sum(1 for _, f in watch.facts if isinstance(f, WorkerFailed))
        took = f"{failover:.2f} s" if failover is not None else "not observed"
        digests = {e["weights_digest"] for e in finished}
        loss = finished[0]["loss"] if finished else float("nan")
        accuracy = finished[0]["accuracy"] if finished else float("nan")
        console.print(
            f"\n[bold]summary[/]: {state.counters.steps_committed} steps committed over "
            f"{state.counters.epochs_finished} finished epochs; loss {loss}, accuracy {accuracy}; "
            f"{failed} worker failure(s) survived without restarting anyone; new leader {took} "
            f"after the leader's SIGKILL; {len(finished)} workers finished with "
            f"{'identical' if len(digests) == 1 else 'DIFFERENT'} weights"
            + (f" ({', '.join(idle)} joined after the last step: trained none)" if idle else "")
        )
        if len(digests) > 1:
            for e in finished:
                console.print(
                    f"  {e['worker']}: {e['steps']} steps trained, "
                    f"{e['world_changes']} world changes, weights {e['weights_digest']}"
                )
        console.print(
            "audit (every sample exactly once per epoch): "
            f"{'[green]passed[/]' if report.ok else '[red]FAILED[/]'}"
        )
        console.print(f"replay this run: [bold]cohort replay --file {out} --audit[/]")
        return 0 if report.ok and len(digests) == 1 else 1
    return 1


def _last_json(proc: Proc) -> dict[str, Any] | None:
    for line in reversed(proc.tail(40).splitlines()):
        if line.startswith("{"):
            try:
                body = json.loads(line)
            except ValueError:
                return None
            return body if isinstance(body, dict) else None
    return None
