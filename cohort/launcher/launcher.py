"""The launcher's one loop: load what happened (ranks that exited, the journal), decide with
the supervision rules, act (start, replace, stop), show.

One `Launcher` runs one node of a job: its ranks (the user's command, once per local rank,
each told who it is through the environment), its coordinators (a standby until it leads,
so leadership moves with the nodes) and, where no Redis is given, a private one in the run
directory. Everything it starts runs in a session of its own and is known to the reaper,
so nothing outlives the launcher; a signal to the launcher is forwarded as one SIGTERM to
each rank (finish the step, leave), a second one kills everything at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import redis
from rich.console import Console
from rich.live import Live
from rich.text import Text

from cohort.acl import AclError
from cohort.coordinator.audit import Audit, audit
from cohort.coordinator.progress import progress
from cohort.coordinator.replay import JournalWatch, export, from_redis
from cohort.coordinator.timeline import failures_said
from cohort.errors import CohortError, Exit
from cohort.events.connection import Client, RedisSettings, connect
from cohort.events.keys import Keys
from cohort.events.models import ProcessExited, WorkerFailed, WorkerJoined
from cohort.events.streams import Inbox
from cohort.launcher import rundir, shadowing, supervision
from cohort.launcher.credentials import Credentials
from cohort.launcher.reaper import Reaper
from cohort.launcher.slurm import SlurmJob, publish
from cohort.launcher.supervision import Exited, Policy, Slot, State
from cohort.localredis import LocalRedis, LocalRedisError
from cohort.processes import Proc, outcome

FATAL_COORDINATOR_EXITS = {Exit.USAGE, Exit.REDIS, Exit.DATA}
"""A coordinator that exits with one of these will not do better if started again (bad
settings, settings that differ from the journal's, Redis refusing it)."""
TURN_MS = 100
"""How long a turn of the loop waits on the journal: the launcher's pace."""
COORDINATOR_EXIT_WAIT = 10.0
"""Once the job finished, how long the coordinators get to exit on their own."""
FATE_MARGIN = 10.0
"""With spares: beyond the heartbeat timeout, how long a dead rank's replacement waits for
its fate (and a spare's promotion) to be journaled before it picks its role anyway."""
FATE_WAIT = 5.0
"""At the end of an unfinished run, how long the leader may take to journal the deaths the
launcher told it."""


class LaunchError(CohortError):
    """The launcher cannot go on; the message says why, `log` which log shows more."""

    def __init__(self, message: str, log: Path | None = None, code: Exit = Exit.FAILED) -> None:
        super().__init__(message)
        self.log = log
        self.code = code


@dataclass(frozen=True)
class LaunchSettings:
    """What `cohort run` was given, checked."""

    job: str
    command: tuple[str, ...]
    ranks: int
    node: str
    run_dir: Path
    redis_url: str | None = None
    """None: start a private Redis in the run directory."""
    coordinators: int = 1
    job_flags: tuple[str, ...] = ()
    """The job settings as flags, for the coordinators (`JobSettings.argv`)."""
    policy: Policy = Policy()
    export: Path | None = None
    chaos: float | None = None
    """Seconds between SIGKILLs of a random local rank (None: none)."""
    live: bool = False
    log_level: str = "info"
    stop_grace: float = 30.0
    """After a signal, how long the ranks get to finish their step and leave."""
    worker_credentials: bool = False
    """Give each rank its own credential even if the job does not sign its commands yet."""
    exit_reports: bool = True
    """Tell the leader when a rank's process ends (ProcessExited): it is failed at once."""
    spares: int = 0
    """Warm spares to keep on this node besides `ranks` (their scripts wait, synced, for a
    lost rank's place)."""
    gpus: tuple[str, ...] = ()
    """Each slot's own GPU, its process's CUDA_VISIBLE_DEVICES (slot i, trainer or spare, and
    every process that replaces it: the i-th; launcher/gpus.py). Empty: the node has no GPU,
    and the processes' environment is left as it is."""
    shard_group: int | None = None
    """Ranks per HSDP copy of a sharded model, given to the scripts as $COHORT_SHARD_GROUP
    (None: the environment as it is)."""
    resuming: bool = False
    """`run_dir` holds an earlier run of the job that did not finish: its private Redis is
    started again on the run's AOF and the job goes on from there."""
    drain_signal: signal.Signals | None = None
    """A signal that drains the node like a first SIGTERM and ends the launcher with exit
    REQUEUE (SLURM's --signal=USR1@SECONDS before a time limit); every process the launcher
    starts ignores it, since SLURM signals each process of the job step."""
    redis_host: str = "127.0.0.1"
    """The address the private Redis listens on (and is reached at)."""
    redis_password: str | None = None
    """The private Redis's password (one bound to an address other hosts reach)."""
    slurm: SlurmJob | None = None
    """Under SLURM, where this node's private Redis is the job's: its URL is published for
    the job's other nodes (launcher/slurm.py)."""


@dataclass
class Member:
    """A slot of the launcher, its supervision state and its current process."""

    slot: Slot
    proc: Proc | None = None
    worker: str = ""
    spare: bool = False
    """Whether its current process was started as a spare."""
    fate_by: float | None = None
    """While its replacement waits for the dead worker's fate to be journaled: until when."""


def audit_said(report: Audit) -> str:
    """The summary's word on the audit: "passed" only where committed steps were checked (a
    job that committed none passed nothing)."""
    if not report.ok:
        return "audit (every sample exactly once per epoch): FAILED"
    if report.steps == 0:
        return "audit: nothing to audit (no step committed)"
    return "audit (every sample exactly once per epoch): passed"


class Launcher:
    """One node of a job under `cohort run`."""

    def __init__(
        self,
        settings: LaunchSettings,
        console: Console,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.console = console
        self.clock = clock
        self.ranks = [
            Member(Slot(i), spare=i >= settings.ranks)
            for i in range(settings.ranks + settings.spares)
        ]
        """The node's slots: `ranks` started as trainers, then `spares` started as spares."""
        self.coordinators = [Member(Slot(i)) for i in range(settings.coordinators)]
        self.restarts = 0
        self.signals = 0
        self.drained = False
        """The drain signal came: the node drains and the launcher asks to be run again."""
        self.stop_deadline: float | None = None
        self.redis_url = settings.redis_url or ""
        self.embedded = False
        self.private: LocalRedis | None = None
        """The private Redis it started, where none was given."""
        self.redis_slot = Slot(0)
        self.redis_started = 0.0
        self.redis_lost: float | None = None
        """Since when Redis has not answered (None: it answers)."""
        self.started = 0.0
        self.next_chaos: float | None = None
        self.chaos_rng = random.Random(settings.job)
        self.chaos_victims: set[int] = set()
        self.reported: set[str] = set()
        """Workers whose process's end the launcher told the leader (ProcessExited)."""
        """Pids the launcher killed on purpose (--chaos)."""
        self.log_dir = settings.run_dir

    # ------------------------------------------------------------ the run

    def run(self) -> Exit:
        """Start everything, supervise until the node's work is over, then stop and report."""
        with ExitStack() as stack:
            self.stack = stack
            self._prepare()
            self._start_coordinators()
            self._start_ranks()
            with self._signals_forwarded(), self._showing():
                while not self._over():
                    self._turn()
            return self._finish()

    def _prepare(self) -> None:
        """The run directory (held: one launcher in it), the reaper, Redis, and the journal
        followed."""
        try:
            self.stack.enter_context(rundir.held(self.settings.run_dir))
        except rundir.RunDirError as exc:
            raise LaunchError(str(exc), code=Exit.USAGE) from None
        self.reaper = Reaper(ignore=self._ignored())
        self.stack.callback(self.reaper.release)
        self.stack.callback(self._kill_all)
        if not self.redis_url:
            self._start_private_redis()
        self.conn: Client = connect(RedisSettings.resolve(self.redis_url))
        self.watch = JournalWatch.of(self.conn, self.settings.job)
        self.watch.pull(0)
        self._skip_used_worker_ids()
        if self.settings.resuming:
            self._say_resuming()
        self._prepare_credentials()
        self.started_at = time.time()
        self._write_run_json()
        self.started = self.clock()

    def _skip_used_worker_ids(self) -> None:
        """Each slot's first process gets a worker id the journal has not seen: after a lost
        launcher, its ranks are still members until failed, and a new process under one
        of their ids would be taken for it."""
        used = {fact.worker for _, fact in self.watch.facts if isinstance(fact, WorkerJoined)}
        for index, member in enumerate(self.ranks):
            base = f"{self.settings.node}-{index}"
            member.slot = replace(member.slot, generation=supervision.unused_generation(base, used))

    def _say_resuming(self) -> None:
        """One line: which run goes on, from which step (and, where the job keeps no
        checkpoint, that its weights went with the ranks)."""
        state, job = self.watch.state, self.settings.job
        self.say(
            f"cohort run: resuming job {job!r} from {self.settings.run_dir} at step "
            f"{state.last_committed}"
            + (
                ""
                if state.checkpoints or state.last_committed < 0
                else f" (it keeps no checkpoint: it pauses until `cohort resume --redis-url "
                f"{self.redis_url} --job {job} --from-scratch`)"
            )
        )

    def _prepare_credentials(self) -> None:
        """Where the job signs its commands, the first rank's credential is issued now: a
        launcher whose Redis user may not issue them stops before anything starts."""
        self.credentials: Credentials | None = None
        job = self.settings.job
        if not Credentials.needed(self.conn, job, self.settings.worker_credentials):
            return
        self.credentials = Credentials(self.conn, job, self.redis_url)
        self.stack.callback(self._retire_credentials)
        try:
            self.credentials.url_for(f"{self.settings.node}-0")
        except (AclError, redis.RedisError) as exc:
            raise LaunchError(
                f"job {job!r} signs its commands, so each rank needs its own credential, "
                f"and this launcher's Redis user could not issue one: {exc}",
                code=Exit.REDIS,
            ) from None
        self.say(f"cohort run: job {job!r} signs its commands: each rank gets its own credential")

    def _retire(self, worker: str) -> None:
        """A rank's process ended: its credential goes (else at the end, with the rest)."""
        if self.credentials is None:
            return
        try:
            self.credentials.retire(worker)
        except (AclError, redis.RedisError) as exc:
            self.say(f"could not delete rank {worker}'s credential now ({exc}): at the end")

    def _retire_credentials(self) -> None:
        if self.credentials is not None:
            for problem in self.credentials.retire_all():
                self.say(f"could not delete the credential {problem}: delete it by hand")

    def _start_private_redis(self) -> None:
        server = LocalRedis(
            appendonly=True,
            embedded_ok=True,
            data_dir=self.settings.run_dir / "redis",
            own_session=True,
            host=self.settings.redis_host,
            password=self.settings.redis_password,
            launcher=self._ignoring(),
        )
        server.start()
        self.stack.callback(server.stop)
        if server.process is not None:
            self.reaper.watch(server.process.pid)
        self.private = server
        self.redis_started = self.clock()
        self.embedded = server.embedded
        self.redis_url = server.url
        kind = (
            "an embedded fakeredis server (no redis-server binary found)"
            if server.embedded
            else f"a private redis-server (AOF on, data in {server.dir})"
        )
        shown = RedisSettings.resolve(server.url).display_url
        self.say(f"cohort run: no Redis given: using {kind} at {shown}")
        if self.settings.slurm is not None:
            path = publish(self.settings.slurm, server.url)
            self.say(f"cohort run: the job's other nodes find its Redis in {path}")

    def _write_run_json(self, **more: Any) -> None:
        settings = self.settings
        body = {
            "job": settings.job,
            "redis_url": RedisSettings.resolve(self.redis_url).display_url,
            "private_redis": settings.redis_url is None,
            "node": settings.node,
            "ranks": settings.ranks,
            "spares": settings.spares,
            "gpus": list(settings.gpus),
            "command": list(settings.command),
            "run_dir": str(settings.run_dir),
            "started": self.started_at,
            **more,
        }
        path = settings.run_dir / "run.json"
        partial = path.with_name(".run.json.partial")
        partial.write_text(json.dumps(body, indent=1) + "\n")
        os.replace(partial, path)  # a reader (a tool, a test) never sees half a file

    # ------------------------------------------------------------ one turn

    def _turn(self) -> None:
        """Load, decide, act, show: one pass over what happened since the last."""
        self._pull(TURN_MS)
        now = self.clock()
        self._settle_private_redis(now)
        for index, member in enumerate(self.ranks):
            self._settle_rank(index, member, now)
        for index, member in enumerate(self.coordinators):
            self._settle_coordinator(index, member, now)
        self._stop_late_ranks(now)
        self._chaos(now)
        self._show()

    def _pull(self, block_ms: int) -> None:
        """Fold the journal's news. While Redis does not answer, say so once and supervise
        on: the ranks and coordinators ride out an outage by themselves."""
        try:
            self.watch.pull(block_ms)
        except redis.RedisError as exc:
            if self.redis_lost is None:
                self.redis_lost = self.clock()
                self.say(f"Redis does not answer ({exc}): supervising on, the ranks ride it out")
            time.sleep(block_ms / 1000)  # the loop's pace, as the blocking read gives it
            return
        if self.redis_lost is not None:
            self.say(f"Redis answers again, after {self.clock() - self.redis_lost:.0f} s")
            self.redis_lost = None

    def _settle_private_redis(self, now: float) -> None:
        """A private redis-server that stopped is started again on its port from its AOF,
        under the ranks' rules: one that keeps stopping ends the launcher, naming its log."""
        server = self.private
        if server is None or server.embedded or server.alive() or self.stopping:
            return
        if self.redis_slot.state is State.RUNNING:
            code = server.process.returncode if server.process is not None else 1
            self._private_redis_failed(outcome(code), now - self.redis_started, now)
        if not supervision.due(self.redis_slot, now):
            return
        self.redis_slot = supervision.started(self.redis_slot)
        self.redis_started = now
        try:
            server.restart()
        except LocalRedisError as exc:
            self._private_redis_failed(f"could not start again: {exc}", 0.0, now)
            return
        if server.process is not None:
            self.reaper.watch(server.process.pid)

    def _private_redis_failed(self, how: str, ran_for: float, now: float) -> None:
        stopped = Exited(code=1, how=how, ran_for=ran_for, finished=False)
        self.redis_slot = supervision.on_exit(self.redis_slot, stopped, now, self.settings.policy)
        log = Path(self.private.dir if self.private and self.private.dir else ".") / "redis.log"
        if self.redis_slot.state is State.GIVEN_UP:
            raise LaunchError(
                f"the private Redis keeps stopping ({how}; {self.redis_slot.quick_failures} "
                "times in a row soon after starting)",
                log,
            )
        self.say(f"the private Redis stopped ({how}): starting it again from its AOF ({log})")

    def _settle_rank(self, index: int, member: Member, now: float) -> None:
        """A rank that exited gets the supervision's answer; a due slot a new process."""
        proc = member.proc
        if member.slot.state is State.RUNNING and proc is not None and not proc.alive():
            self._exited(member, proc, now, "rank")
        elif supervision.due(member.slot, now) and not self.stopping:
            role = self._replacement_role(member, now)
            if role is None:
                return  # its fate is not journaled yet: the next turns look again
            self.restarts += 1
            self._start_rank(index, spare=role == "spare")
        elif member.slot.state is State.WAITING and (self.stopping or self.finished):
            member.slot = supervision.stopped_waiting(member.slot)

    def _settle_coordinator(self, index: int, member: Member, now: float) -> None:
        proc = member.proc
        if member.slot.state is State.RUNNING and proc is not None and not proc.alive():
            assert proc.popen is not None
            if proc.popen.returncode in FATAL_COORDINATOR_EXITS and not self.finished:
                raise LaunchError(
                    f"coordinator {proc.name} stopped ({proc.outcome()}): "
                    + _last_line(proc.tail(5)),
                    proc.log,
                    Exit(proc.popen.returncode),
                )
            self._exited(member, proc, now, "coordinator")
        elif supervision.due(member.slot, now) and not self.stopping and not self.finished:
            self._start_coordinator(index)

    def _exited(self, member: Member, proc: Proc, now: float, kind: str) -> None:
        """Supervision's answer to a process that ended, said in one line; a rank's death
        told to the leader first."""
        assert proc.popen is not None
        if kind == "rank":
            self._report_exit(member.worker, proc.popen.returncode, proc.outcome())
        proc.drained()
        self.reaper.forget(proc.popen.pid)
        exited = Exited(
            code=proc.popen.returncode,
            how=proc.outcome(),
            ran_for=now - proc.started_at,
            finished=self.finished,
            intended=proc.popen.pid in self.chaos_victims,
        )
        member.slot = supervision.on_exit(member.slot, exited, now, self.settings.policy)
        if kind == "rank":
            self._retire(member.worker)
        if member.slot.state is State.WAITING and not self.stopping:
            wait = max(0.0, (member.slot.restart_at or now) - now)
            self.say(f"{kind} {proc.name} {exited.how}: replacing it in {wait:.0f} s")
        elif member.slot.state is State.GIVEN_UP:
            tail = proc.tail(15)
            self.say(
                f"{kind} {proc.name} {exited.how}, its {member.slot.quick_failures}th failure "
                f"in a row within {self.settings.policy.stable_after:g} s of starting: giving "
                f"up on it. Its log ({proc.log}) ends:\n{tail}{shadowing.hint(tail)}"
            )

    def _report_exit(self, worker: str, code: int, how: str) -> None:
        """Tell the leader that `worker`'s process ended (ProcessExited, signed in its name
        where the job signs commands): it fails the member at once, and a spare takes its
        place, without waiting for its connections' grace or its silence. A process that
        exited 0 and is no member any more (it left) needs no word."""
        if not self.settings.exit_reports or (code == 0 and worker not in self.watch.state.members):
            return
        signer = self.credentials.signer(worker) if self.credentials is not None else None
        command = ProcessExited(at=time.time(), job=self.settings.job, worker=worker, how=how)
        try:
            Inbox(self.conn, Keys(self.settings.job).inbox, signer).send(command)
            self.reported.add(worker)
        except redis.RedisError as exc:
            self.say(f"could not tell the leader that {worker} exited ({exc}): its closed "
                     "connections or its silence will")  # fmt: skip

    def _replacement_role(self, member: Member, now: float) -> str | None:
        """The role a slot's next process starts in: with no spares, a trainer; else as the
        journal says (supervision.replacement_role), once the dead worker is no longer a
        member or FATE_MARGIN past its heartbeat timeout, whichever comes first."""
        if not self.settings.spares:
            return "trainer"
        state = self.watch.state
        if member.fate_by is None:
            timeout = state.config.heartbeat_timeout if state.config is not None else 5.0
            member.fate_by = now + timeout + FATE_MARGIN
        alive = 0
        for other in self.ranks:
            if other is member or other.proc is None or not other.proc.alive():
                continue
            journaled = state.members.get(other.worker)
            alive += not (journaled.spare if journaled is not None else other.spare)
        role = supervision.replacement_role(
            member.worker not in state.members, now >= member.fate_by, alive, self.settings.ranks
        )
        if role is not None:
            member.fate_by = None
        return role

    # ------------------------------------------------------------ processes

    def _start_ranks(self) -> None:
        for index, member in enumerate(self.ranks):
            self._start_rank(index, member.spare)

    def _start_rank(self, index: int, spare: bool = False) -> None:
        """A process for local rank `index`: the user's command, told who it is (and
        whether it is a spare)."""
        member = self.ranks[index]
        if member.proc is not None:
            member.slot = supervision.started(member.slot)
        generation = member.slot.generation
        worker = f"{self.settings.node}-{index}" + (f".{generation}" if generation else "")
        url = self._url_for(member, worker)
        if url is None:
            return
        env = {
            **os.environ,
            "COHORT_JOB": self.settings.job,
            "COHORT_REDIS_URL": url,
            "COHORT_LOCAL_RANK": str(index),
            "COHORT_LOCAL_WORLD_SIZE": str(self.settings.ranks),
            "COHORT_NODE": self.settings.node,
            "COHORT_WORKER_ID": worker,
            "COHORT_SPARE": "1" if spare else "0",
            "PYTHONUNBUFFERED": "1",
            **({"CUDA_VISIBLE_DEVICES": self.settings.gpus[index]} if self.settings.gpus else {}),
            **(
                {"COHORT_SHARD_GROUP": str(self.settings.shard_group)}
                if self.settings.shard_group
                else {}
            ),
        }
        log = self.log_dir / f"rank-{index}.log"
        with log.open("a") as handle:
            role = " (a spare)" if spare else ""
            handle.write(f"==== {worker}{role}: {' '.join(self.settings.command)}\n")
        member.worker, member.spare = worker, spare
        member.proc = Proc(
            worker,
            [*self._ignoring(), *self.settings.command],
            log,
            env=env,
            echo=self._echo_for(worker),
        )
        member.proc.start()
        assert member.proc.popen is not None
        self.reaper.watch(member.proc.popen.pid)

    def _url_for(self, member: Member, worker: str) -> str | None:
        """The Redis URL `worker` is given: its own credential's where the job signs its
        commands. None: that could not be issued, which counts as a failed start."""
        if self.credentials is None:
            return self.redis_url
        try:
            return self.credentials.url_for(worker)
        except (AclError, redis.RedisError) as exc:
            now = self.clock()
            failed = Exited(code=1, how=f"got no credential ({exc})", ran_for=0.0,
                            finished=self.finished)  # fmt: skip
            member.slot = supervision.on_exit(member.slot, failed, now, self.settings.policy)
            self.say(f"rank {worker} {failed.how}")
            return None

    def _start_coordinators(self) -> None:
        for index in range(self.settings.coordinators):
            self._start_coordinator(index)

    def _start_coordinator(self, index: int) -> None:
        member = self.coordinators[index]
        if member.proc is not None:
            member.slot = supervision.started(member.slot)
        name = f"{self.settings.node}-coordinator-{index}"
        argv = [
            sys.executable, "-m", "cohort", "--redis-url", self.redis_url,
            "--log-level", self.settings.log_level, "coordinator", "--job", self.settings.job,
            *self.settings.job_flags, "--id", name,
            *(["--allow-volatile"] if self.embedded else []),
        ]  # fmt: skip
        argv = [*self._ignoring(), *argv]
        member.proc = Proc(name, argv, self.log_dir / f"coordinator-{index}.log")
        member.proc.start()
        assert member.proc.popen is not None
        self.reaper.watch(member.proc.popen.pid)

    def _echo_for(self, worker: str) -> Callable[[str], None]:
        """How a rank's output lines are shown: after its worker id and current rank."""

        def echo(line: str) -> None:
            state = self.watch.state
            rank, member = state.rank_of(worker), state.members.get(worker)
            spare = member is not None and member.spare
            where = "spare" if spare else "r-" if rank is None else f"r{rank}"
            prefix = Text(f"[{worker} {where}] ", style="dim")
            self.console.print(prefix + Text(line), soft_wrap=True, highlight=False)

        return echo

    def _procs(self) -> Iterator[Proc]:
        for member in (*self.ranks, *self.coordinators):
            if member.proc is not None:
                yield member.proc

    def _kill_all(self) -> None:
        """Whatever still runs, killed (the end of a run that failed or was killed)."""
        for proc in self._procs():
            proc.signal(signal.SIGKILL)
            if proc.popen is not None:
                proc.popen.wait()

    # ------------------------------------------------------------ stopping

    @property
    def finished(self) -> bool:
        return self.watch.state.finished is not None

    @property
    def stopping(self) -> bool:
        return self.signals > 0

    def _over(self) -> bool:
        """Every rank slot has ended and no rank process runs."""
        return all(m.slot.ended for m in self.ranks) and not any(
            m.proc is not None and m.proc.alive() for m in self.ranks
        )

    @contextlib.contextmanager
    def _signals_forwarded(self) -> Iterator[None]:
        """SIGINT/SIGTERM while supervising: the first one a SIGTERM to every rank, the
        second kills everything now."""
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        if self.settings.drain_signal is not None:
            drain = self.settings.drain_signal
            previous[drain] = signal.signal(drain, self._on_drain)
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _ignored(self) -> tuple[signal.Signals, ...]:
        return (self.settings.drain_signal,) if self.settings.drain_signal else ()

    def _ignoring(self) -> tuple[str, ...]:
        """The prefix that starts a process with the drain signal ignored (inherited through
        exec; a script may still handle it): SLURM sends it to every process of the step,
        and a Python or a redis-server it reaches unhandled would die of it."""
        sig = self.settings.drain_signal
        return ("env", f"--ignore-signal={sig.name[3:]}") if sig else ()

    def _on_drain(self, signum: int, frame: object) -> None:
        """The drain signal: the node drains as on a first SIGTERM, and the launcher ends
        with exit REQUEUE so that the job is run again (and resumes). Once stopping, it
        changes nothing."""
        if self.stopping:
            return
        self.drained = True
        self._on_signal(signum, frame)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.signals += 1
        name = signal.Signals(signum).name
        if self.signals > 1:
            self.say(f"{name} again: killing every process now")
            self._kill_all()
            for member in self.ranks:
                member.slot = replace(member.slot, state=State.DONE)
            return
        self.say(
            f"{name}: every rank finishes its step and leaves (again to kill them now); "
            f"at most {self.settings.stop_grace:g} s"
        )
        self.stop_deadline = self.clock() + self.settings.stop_grace
        for member in self.ranks:
            if member.proc is not None:
                member.proc.signal(signal.SIGTERM)

    def _stop_late_ranks(self, now: float) -> None:
        """Ranks still running past the grace after a signal are killed."""
        if self.stop_deadline is None or now < self.stop_deadline:
            return
        for member in self.ranks:
            if member.proc is not None and member.proc.alive():
                self.say(f"rank {member.worker} did not leave within the grace: killing it")
                member.proc.signal(signal.SIGKILL)

    def _chaos(self, now: float) -> None:
        """--chaos: SIGKILL a random local rank after every so many seconds of whole, healed
        training (every local rank a rank of the current world)."""
        if not self.settings.chaos or self.finished or self.stopping:
            return
        if not self._healed():
            self.next_chaos = None  # the clock starts again once the job has healed
            return
        if self.next_chaos is None:
            self.next_chaos = now + self.settings.chaos
        if now < self.next_chaos:
            return
        state = self.watch.state
        victim = self.chaos_rng.choice([m for m in self.ranks if m.worker in state.ranks])
        assert victim.proc is not None and victim.proc.popen is not None
        self.say(f"chaos: SIGKILL {victim.worker}")
        self.chaos_victims.add(victim.proc.popen.pid)
        victim.proc.signal(signal.SIGKILL)
        self.next_chaos = None

    def _healed(self) -> bool:
        """Training runs and every local slot runs, as a rank of the current world or a
        ready spare, with the node's number of ranks in the world."""
        state = self.watch.state
        if state.last_committed < 0 or state.paused:
            return False

        def placed(worker: str) -> bool:
            member = state.members.get(worker)
            return worker in state.ranks or (member is not None and member.status == "ready")

        return sum(m.worker in state.ranks for m in self.ranks) >= self.settings.ranks and all(
            m.slot.state is State.RUNNING and m.proc is not None and m.proc.alive()
            and placed(m.worker)
            for m in self.ranks
        )  # fmt: skip

    # ------------------------------------------------------------ the end

    def _finish(self) -> Exit:
        """Stop the coordinators, export, audit and summarise; the launcher's exit code."""
        self._await_reported_fates()
        self._stop_coordinators()
        self._pull(0)
        report = audit(fact for _, fact in self.watch.facts)
        try:
            exported = self._export()
        except redis.RedisError as exc:
            exported = None
            self.say(f"could not export the journal ({exc}): `cohort export` it later")
        code = self._verdict(report)
        self._summarise(report, exported, code)
        state = self.watch.state
        self._write_run_json(
            exit=int(code), finished=state.finished, promotions=state.counters.promotions
        )
        return code

    def _await_reported_fates(self) -> None:
        """Ranks that all died together were each told to the leader, but the last ones'
        ProcessExited may still wait in its inbox: let it journal them (up to FATE_WAIT)
        before the coordinators stop, so the summary and the journal name every failure."""
        if self.finished or self.stopping:
            return
        deadline = self.clock() + FATE_WAIT
        while self.clock() < deadline and any(w in self.watch.state.members for w in self.reported):
            if not any(m.proc is not None and m.proc.alive() for m in self.coordinators):
                return
            self._pull(100)

    def _stop_coordinators(self) -> None:
        """After the job finished they exit on their own once its last worker left; else,
        and past the wait, SIGTERM (a standby elsewhere takes over)."""
        procs = [m.proc for m in self.coordinators if m.proc is not None and m.proc.popen]
        wait = COORDINATOR_EXIT_WAIT if self.finished and not self.stopping else 0.0
        deadline = self.clock() + wait
        for proc in procs:
            _wait_for(proc, max(0.0, deadline - self.clock()))
            proc.signal(signal.SIGTERM)
        for proc in procs:
            if not _wait_for(proc, 10.0):
                proc.signal(signal.SIGKILL)
                _wait_for(proc, 10.0)
            assert proc.popen is not None
            self.reaper.forget(proc.popen.pid)

    def _export(self) -> Path | None:
        out = self.settings.export
        if out is None:
            return None
        with out.open("wb") as handle:
            export(from_redis(self.conn, self.settings.job), handle, time.time())
        return out

    def _verdict(self, report: Audit) -> Exit:
        """0 only for a job that reached its length (and passed the audit)."""
        if self.drained and not self.finished:
            return Exit.REQUEUE
        if self.stopping:
            return Exit.INTERRUPTED
        if self.finished:
            return Exit.OK if report.ok else Exit.DATA
        if any(m.slot.state is State.GIVEN_UP for m in self.ranks):
            return Exit.FAILED
        return Exit.UNFINISHED  # every rank's script ended by itself before the job did

    def _summarise(self, report: Audit, exported: Path | None, code: Exit) -> None:
        state = self.watch.state
        failures = [fact for _, fact in self.watch.facts if isinstance(fact, WorkerFailed)]
        failed = failures_said(failures, state.finished is not None)
        took = self.clock() - self.started
        end = (
            f"job {self.settings.job!r} finished ({state.finished})"
            if state.finished
            else f"job {self.settings.job!r} did not finish (last committed step "
            f"{state.last_committed})"
        )
        redone = f" ({report.discarded} redone after a rewind)" if report.discarded else ""
        self.say(
            f"cohort run: {end}: {report.steps} steps committed over "
            f"{report.epochs_finished} epochs{redone} in {took:.0f} s; {failed}, "
            f"{self.restarts} rank(s) restarted{self._spares_said()}; {audit_said(report)}"
        )
        self.say(f"logs: {self.settings.run_dir}" + (f"; export: {exported}" if exported else ""))
        if code is Exit.REQUEUE:
            sig = self.settings.drain_signal
            self.say(
                f"exit {int(code)}: drained on {sig.name if sig else 'a signal'}: run the job "
                "again (`scontrol requeue $SLURM_JOB_ID`) and it resumes at its last "
                "committed step"
            )
        elif code is Exit.FAILED:
            self.say("every local rank was given up on: see its log above")
        elif code is Exit.UNFINISHED:
            self.say(
                f"exit {int(code)}: the ranks' scripts ended before the job reached its length "
                "(give it once, to cohort run: --epochs N or --max-steps N; the script's "
                "job.epochs() then trains to it)"
            )

    def _spares_said(self, live: bool = False) -> str:
        """The spares' part of the summary or (`live`) the status line; nothing without."""
        if not self.settings.spares:
            return ""
        state = self.watch.state
        ready = sum(1 for m in state.spares if m.status == "ready")
        now = f" ({ready} ready)" if live else ""
        return f", {self.settings.spares} spare(s){now}, {state.counters.promotions} promoted"

    # ------------------------------------------------------------ showing

    def say(self, line: str) -> None:
        self.console.print(Text(line), soft_wrap=True, highlight=False)

    @contextlib.contextmanager
    def _showing(self) -> Iterator[None]:
        """On a terminal, a live line with the job's step, epoch, rate and ETA."""
        if not self.settings.live:
            self._live: Live | None = None
            yield
            return
        with Live(self._status(), console=self.console, transient=True) as live:
            self._live = live
            yield

    def _show(self) -> None:
        if self._live is not None:
            self._live.update(self._status())

    def _status(self) -> Text:
        state = self.watch.state
        now = progress(state, time.time())
        rate = f"{now.steps_per_second:.1f} steps/s" if now.steps_per_second else "- steps/s"
        eta = f"ETA {now.eta_seconds:.0f} s" if now.eta_seconds is not None else "ETA -"
        return Text(
            f"{self.settings.job}: step {state.last_committed + 1}, epoch {state.epoch}, "
            f"{len(state.ranks)} ranks (world v{state.world_version}), {rate}, {eta}, "
            f"{self.restarts} restart(s){self._spares_said(live=True)}"
            + ("  [paused]" if state.paused else ""),
            style="bold",
        )


def _wait_for(proc: Proc, timeout: float) -> bool:
    """Wait up to `timeout` s for `proc` to exit; True once it has."""
    assert proc.popen is not None
    try:
        proc.popen.wait(timeout)
    except subprocess.TimeoutExpired:
        return False
    return True


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def launcher_console() -> Console:
    """The launcher's console: stdout, no markup or highlighting of what the ranks print."""
    return Console(file=sys.stdout, highlight=False, markup=False)
