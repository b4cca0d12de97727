"""`cohort demo`: a whole elastic job on this machine, with a worker and a leader killed.

It starts (or uses) Redis, two coordinators and several simulated workers as real
processes, watches the journal, SIGKILLs a worker and then the leading
coordinator partway, adds a worker, and ends with a summary, an audit and the
run exported to `cohort-JOB.export` in the working directory (the one file it
leaves), which `cohort replay --file` explains. Every process and temp dir it
made is gone when it returns, also after Ctrl-C, and also when a process it
waits on died: it says which, with the end of its log, instead of waiting on.
"""

from __future__ import annotations

import json
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from cohort.coordinator.audit import Audit, audit
from cohort.coordinator.replay import JournalWatch, export, fact_details, from_redis
from cohort.coordinator.timeline import failures_said
from cohort.errors import CohortError, Exit
from cohort.events.connection import Client, RedisSettings, connect
from cohort.events.deal import leftover
from cohort.events.models import LeaderElected, StepCommitted, WorkerFailed
from cohort.events.reset import delete_job
from cohort.events.shards import range_count
from cohort.localredis import LocalRedis
from cohort.processes import Proc, stop_all

console = Console(stderr=True)
DEADLINE = 240.0
DATASET_SIZE = 2048
COORDINATORS = ("coord-1", "coord-2")
COORDINATOR_FLAGS = (
    ("--min-workers", "1"),
    ("--heartbeat-interval", "0.5"),
    ("--heartbeat-timeout", "3"),
    ("--dataset-size", str(DATASET_SIZE)),
    ("--batch-size", "32"),
    ("--lease", "2"),
)


class DemoFailedError(CohortError):
    """The demo cannot go on; the logs of `procs` say why."""

    def __init__(self, message: str, procs: Sequence[Proc]) -> None:
        super().__init__(message)
        self.procs = tuple(procs)


def run_demo(redis_url: str | None, job: str, workers: int, steps: int, keep: bool) -> int:
    """The demo's exit code: 0 when it ran to an identical-weights, audited end; 130 on
    Ctrl-C at any moment (every process stopped and every temp file removed first)."""
    # A demo started as a script's background job inherits SIGINT ignored, and Python then
    # leaves it ignored: the demo would not stop when told to. It answers SIGINT whatever
    # it inherited.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with ExitStack() as stack:
            stack.callback(signal.signal, signal.SIGINT, previous)
            return Demo(stack, job, workers, steps).run(redis_url, keep)
    except KeyboardInterrupt:  # during start-up or shutdown; the live phases handle their own
        console.print("[yellow]interrupted: every process stopped and temp files removed[/]")
        return Exit.INTERRUPTED


class Demo:
    """One run of the demo. Whatever it starts is stopped by `stack`, in reverse order."""

    def __init__(self, stack: ExitStack, job: str, workers: int, steps: int) -> None:
        self.stack = stack
        self.job = job
        self.workers = workers
        self.steps = steps
        self.tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="cohort-demo-")))
        self.procs: dict[str, Proc] = {}
        self.killed: set[str] = set()
        self.events: list[str] = []
        self.failover: float | None = None
        self.leader_killed_at: float | None = None
        self.started = 0.0
        self.redis_url = ""
        self.progress = Progress(
            TextColumn("{task.description:<12}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
        )
        self.step_bar = self.progress.add_task("steps", total=steps)
        self.epoch_bar = self.progress.add_task("epoch 0", total=DATASET_SIZE)

    def run(self, redis_url: str | None, keep: bool) -> Exit:
        """The demo, phase by phase; its exit code."""
        self.start_redis(redis_url, keep)
        self.start_coordinators()
        self.start_workers()
        try:
            with self.live():
                self.kill_a_worker()
                self.kill_the_leader()
                self.add_a_worker()
                self.wait_for_the_end()
        except KeyboardInterrupt:
            console.print("[yellow]interrupted: stopping every process and removing temp files[/]")
            return Exit.INTERRUPTED
        except DemoFailedError as failure:
            self.show(failure)
            return Exit.FAILED
        return self.summarise(self.export(), audit(f for _, f in self.watch.facts))

    # ------------------------------------------------------------ phases

    def start_redis(self, redis_url: str | None, keep: bool) -> None:
        """Use `redis_url`, or start a private server (removed at the end unless `keep`);
        either way, clear what an earlier run of this job left there."""
        if redis_url is None:
            server = LocalRedis(appendonly=True, embedded_ok=True)
            server.start()
            if not keep:
                self.stack.callback(server.stop)
            redis_url = server.url
            kind = (
                "an embedded fakeredis server (no redis-server binary found)"
                if getattr(server, "embedded", False)
                else f"a private redis-server in {server.dir}"
            )
            console.print(f"[bold]cohort demo[/]: using {kind} at {redis_url}")
        self.redis_url = redis_url
        self.conn: Client = connect(RedisSettings.resolve(redis_url))
        delete_job(self.conn, self.job)  # an earlier run of the demo's job: a new run
        self.watch = JournalWatch.of(self.conn, self.job)
        self.stack.callback(lambda: stop_all(self.procs.values()))

    def start_coordinators(self) -> None:
        """Two coordinators: one leads, the other follows and takes over when it dies."""
        flags = [flag for pair in COORDINATOR_FLAGS for flag in pair]
        flags += ["--checkpoint-uri", str(self.tmp / "checkpoints"), "--checkpoint-every", "50"]
        flags += ["--max-steps", str(self.steps)]  # the job's length: then everyone exits 0
        for name in COORDINATORS:
            self._spawn(name, "coordinator", "--job", self.job, *flags, "--id", name)

    def start_workers(self) -> None:
        """worker-1 .. worker-N, each training the example model until the job's last step."""
        for i in range(1, self.workers + 1):
            self._start_worker(f"worker-{i}")

    def kill_a_worker(self) -> None:
        """A quarter of the way: SIGKILL worker-1; the leader fails it and reshards."""
        self._wait_until(lambda: self.step >= self.steps // 4)
        self.kill("worker-1")
        self.events.append("[bold red]demo: SIGKILL worker-1[/]")

    def kill_the_leader(self) -> None:
        """Half way: SIGKILL the leading coordinator; the follower takes over."""
        self._wait_until(lambda: self.step >= self.steps // 2)
        leader = self.watch.state.leader or "coord-1"
        self.kill(leader)
        self.leader_killed_at = time.monotonic()
        self.events.append(f"[bold red]demo: SIGKILL leader {leader}[/]")

    def add_a_worker(self) -> None:
        """Once a new leader is elected: start worker-new, which joins the running job."""
        self._wait_until(lambda: self.failover is not None)
        self._start_worker("worker-new")
        self.events.append("[bold green]demo: started worker-new[/]")

    def wait_for_the_end(self) -> None:
        """Until every process has exited: the job finishes at its last step, the workers
        leave with the final weights, and then the coordinators exit."""
        self._wait_until(lambda: not self._running("worker") and not self._running("coord"))

    def export(self) -> Path:
        """The whole run, journal and inbox, to cohort-JOB.export in the working directory:
        where the summary's replay command, and the README's, find it by its name alone."""
        out = Path.cwd() / f"cohort-{self.job}.export"
        with out.open("wb") as handle:
            export(from_redis(self.conn, self.job), handle, time.time())
        return out

    def summarise(self, out: Path, report: Audit) -> Exit:
        """What the run did, whether the workers agree and the audit passed; 0 if both."""
        ends = [_last_json(p) for n, p in self.procs.items() if n.startswith("worker")]
        # A worker activated only after the last step (a late joiner) trained nothing: its
        # weights are its own initial ones, so it does not count among the finishers.
        finished = [e for e in ends if e and e["steps"] > 0]
        idle = [e["worker"] for e in ends if e and e["steps"] == 0]
        state = self.watch.state
        failed = failures_said(
            [f for _, f in self.watch.facts if isinstance(f, WorkerFailed)],
            state.finished is not None,
        )
        took = f"{self.failover:.2f} s" if self.failover is not None else "not observed"
        digests = {e["weights_digest"] for e in finished}
        loss = finished[0]["loss"] if finished else float("nan")
        accuracy = finished[0]["accuracy"] if finished else float("nan")
        console.print(
            f"\n[bold]summary[/]: {state.counters.steps_committed} steps committed over "
            f"{state.counters.epochs_finished} finished epochs; loss {loss}, accuracy {accuracy}; "
            f"{failed}, without restarting anyone; new leader {took} "
            f"after the leader's SIGKILL; {state.counters.checkpoints} checkpoints written in "
            f"the background; {len(finished)} workers finished with "
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
            f"job {'finished: ' + state.finished if state.finished else '[red]NOT finished[/]'}"
            "; every worker left with the final weights and the coordinators exited"
        )
        console.print(
            "audit (every sample exactly once per epoch): "
            f"{'[green]passed[/]' if report.ok else '[red]FAILED[/]'}"
        )
        console.print(
            f"this run is exported to {out.name} in {out.parent}; replay it here with "
            f"[bold]cohort replay --file {out.name} --audit[/]"
        )
        ok = report.ok and len(digests) == 1 and state.finished is not None
        return Exit.OK if ok else Exit.FAILED

    def show(self, failure: DemoFailedError) -> None:
        """The failure on one line, as the command's other errors, then the end of each log
        that explains it."""
        console.print(f"[red]cohort: error: {escape(str(failure))}[/]", soft_wrap=True)
        for proc in failure.procs:
            console.print(f"[bold]{proc.name}[/]\n{escape(proc.tail())}", soft_wrap=True)

    # ------------------------------------------------------------ watching

    @property
    def step(self) -> int:
        """Steps the job has committed so far."""
        return self.watch.state.last_committed + 1

    def live(self) -> Live:
        """The live view while the phases run; SIGTERM interrupts like Ctrl-C meanwhile."""
        previous = signal.signal(signal.SIGTERM, _interrupt)
        self.stack.callback(signal.signal, signal.SIGTERM, previous)
        self.started = time.monotonic()
        self._live = Live(self._frame(), console=console, refresh_per_second=8)
        return self._live

    def _wait_until(self, done: Callable[[], bool]) -> None:
        """Follow the journal until `done()`. Fail at once when a process the job needs has
        exited, or at the deadline, rather than wait for what cannot happen."""
        while True:
            exited = self._exited()  # before the pull, so that it reads all they did
            self._pull()
            failure = self._failure(exited)
            if failure is not None:
                raise failure
            if done():
                return
            if time.monotonic() - self.started > DEADLINE:
                raise DemoFailedError(
                    "demo did not finish in time; process logs:", [*self.procs.values()]
                )

    def _exited(self) -> set[str]:
        """The kinds of process ("coord", "worker") of which not one still runs."""
        return {kind for kind in ("coord", "worker") if not self._running(kind)}

    def _failure(self, exited: set[str]) -> DemoFailedError | None:
        """Why the job cannot end: no coordinator left, or no worker before the last step."""
        if "coord" in exited and not self.watch.state.finished:
            return self._gone("coordinator", "coord", "before the job's end")
        if "worker" in exited and not self.watch.state.finished:
            return self._gone("worker", "worker", f"at step {self.step} of {self.steps}")
        return None

    def _gone(self, what: str, kind: str, when: str) -> DemoFailedError:
        """A failure naming each process of `kind` and showing the log of one the demo did
        not kill itself."""
        group = [p for n, p in self.procs.items() if n.startswith(kind)]
        how = ", ".join(
            f"{p.name}: {'killed by the demo' if p.name in self.killed else p.outcome()}"
            for p in group
        )
        culprit = next((p for p in group if p.name not in self.killed), group[0])
        return DemoFailedError(
            f"every {what} has exited {when} ({how}); {culprit.name}'s log ends:",
            [culprit],
        )

    def _pull(self) -> None:
        """Fold the journal's new facts, note the interesting ones, and redraw."""
        seen = len(self.watch.facts)
        self.watch.pull()
        for entry_id, fact in self.watch.facts[seen:]:
            if isinstance(fact, LeaderElected) and self.leader_killed_at is not None:
                self.failover = self.failover or time.monotonic() - self.leader_killed_at
            if not isinstance(fact, StepCommitted):
                self.events.append(f"{entry_id}  {type(fact).__name__} {fact_details(fact)}"[:150])
        self.progress.update(self.step_bar, completed=min(self.step, self.steps))
        done, total = _epoch_done(self.watch)
        self.progress.update(
            self.epoch_bar,
            completed=done,
            total=total,
            description=f"epoch {self.watch.state.epoch}",
        )
        self._live.update(self._frame())

    def _frame(self) -> Group:
        """Progress bars, one row per worker, and the latest facts."""
        state = self.watch.state
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
        for line in self.events[-6:]:
            lines.add_row(f"[dim]{line}[/]")
        return Group(self.progress, table, lines)

    # ------------------------------------------------------------ processes

    def _spawn(self, name: str, *args: str) -> None:
        argv = [sys.executable, "-m", "cohort", "--redis-url", self.redis_url, *args]
        self.procs[name] = Proc(name, argv, self.tmp / f"{name}.log")
        self.procs[name].start()

    def _start_worker(self, name: str) -> None:
        flags = ("--job", self.job, "--id", name, "--pace", "0.04")
        self._spawn(name, "example-worker", *flags)

    def kill(self, name: str) -> None:
        """SIGKILL `name`; its death is the demo's doing, not a failure to report."""
        self.killed.add(name)
        self.procs[name].signal(signal.SIGKILL)

    def _running(self, kind: str) -> list[Proc]:
        return [p for n, p in self.procs.items() if n.startswith(kind) and p.alive()]


def _epoch_done(watch: JournalWatch) -> tuple[int, int]:
    state = watch.state
    if state.config is None or state.dataset is None:
        return 0, 1
    total = state.dataset.size
    rest = leftover(state.config, state.shards, state.base_step, state.next_step, state.unassigned)
    return total - range_count(rest), total


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _last_json(proc: Proc) -> dict[str, Any] | None:
    for line in reversed(proc.tail(40).splitlines()):
        if line.startswith("{"):
            try:
                body = json.loads(line)
            except ValueError:
                return None
            return body if isinstance(body, dict) else None
    return None
