"""The training side of membership: join, heartbeat, follow the journal, step, leave.

A `Worker` owns two threads. The tail thread follows the journal (XREAD BLOCK)
and folds every fact into a frozen `View` with `view.apply`; it publishes the
new view once per reply, because the facts of one coordinator decision arrive
together (StepCommitted, WorkerActivated, WorldChanged) and a waiter must never
see half a decision. The heartbeat thread says the worker is alive and how far
it got, from the moment its Join is in the inbox: a worker may start long before
any coordinator, and the leader that decides its Join from the backlog must see
it alive. The training loop calls the blocking methods (`wait_active`,
`wait_committed`, ...) which wait on a condition, never by sleeping.

Timeouts are real seconds; the `Clock` stamps the events the worker sends.
"""

from __future__ import annotations

import logging
import math
import os
import random
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import ValidationError

from cohort.events import identity
from cohort.events.clock import Clock, SystemClock
from cohort.events.connection import UNAVAILABLE, Client, credentials, reach, start_wait
from cohort.events.errors import DecodeError, RedisUnavailable
from cohort.events.keys import Keys
from cohort.events.models import (
    CheckpointWritten,
    Command,
    Dataset,
    GpuDevice,
    GpuReading,
    Heartbeat,
    Join,
    Leave,
    Node,
    RegisterWorkload,
    StepDone,
    TransfersWaiting,
    WeightsLoaded,
    Workload,
    finished_refusal,
)
from cohort.events.shards import Range
from cohort.events.streams import ZERO, Entry, Inbox, Journal
from cohort.worker.errors import (
    ActivationTimeout,
    CommitTimeout,
    Finished,
    IdentityMismatch,
    JoinRefusedError,
    JoinTimeout,
    NotAssigned,
    RedisUnreachable,
    Removed,
    Stopped,
    WaitTimeout,
    WorkerError,
    WorldChangedError,
)
from cohort.worker.membership import view as views
from cohort.worker.membership.outbox import Outbox
from cohort.worker.membership.retry import AnyOf, Halt, Link, url_of, with_retry
from cohort.worker.membership.transfers import Slot, TransferScheduler
from cohort.worker.membership.view import Assignment, GpuAdvice, View
from cohort.worker.telemetry import gpu
from cohort.worker.telemetry.gpu import GpuProbe
from cohort.worker.telemetry.node import this_node

if TYPE_CHECKING:
    from cohort.events.order import Indices

T = TypeVar("T")

TAIL_BLOCK_MS = 500  # bounds how long stop() waits for the tail thread
HISTORY_BATCH = 2048
DEFAULT_HEARTBEAT = 1.0
JOIN_NOTICE_EVERY = 10.0  # seconds between "waiting for a coordinator" lines
WITHDRAW_TIMEOUT = 2.0  # how long taking back an unanswered Join may try
STOP_POLL = 0.1  # how often a wait that a signal may end looks at its stop event


def default_worker_id() -> str:
    host = socket.gethostname().split(".")[0] or "host"
    host = "".join(c if c.isalnum() or c in "._-" else "-" for c in host)[:96]
    return f"{host}-{os.getpid()}-{random.randbytes(2).hex()}"


def signer_of(conn: Client, job: str, worker_id: str | None) -> identity.Signer | None:
    """How this worker signs its commands: with its own credential's password if `conn`
    logs in as a worker's own user (`cohort acl --worker`), else not at all. Raises
    IdentityMismatch if that user is another worker's (`worker_id` None: take its worker)."""
    username, password = credentials(conn)
    owner = identity.worker_of_user(job, username)
    if owner is None or not password:
        return None
    if worker_id is not None and worker_id != owner:
        raise IdentityMismatch(worker_id, owner, username or "")
    return identity.Signer(owner, password)


class Worker:
    """One training process's membership of job `job`."""

    def __init__(
        self,
        conn: Client,
        job: str,
        worker_id: str | None = None,
        clock: Clock | None = None,
        heartbeat_interval: float | None = None,
        log: logging.Logger | None = None,
        gpu_interval: float | None = None,
        gpu_probe: GpuProbe | None = None,
        dataset: Dataset | None = None,
        node: Node | None = None,
        role: str = "trainer",
        wait_for_redis: float | None = None,
    ) -> None:
        """`wait_for_redis`: seconds `join` waits at start-up for Redis to answer before it
        raises RedisUnreachable naming the URL (default $COHORT_WAIT_FOR_REDIS, else 10)."""
        self.conn = conn
        self.dataset = dataset
        """The data this worker trains on, declared in its Join (None: it takes the job's)."""
        self.node = node
        """What it says of its machine (None: described when it joins, worker/telemetry/node.py)."""
        self.role = role
        """The member's role: "agent" for a launcher's member that trains nothing of the job's
        dealing (events.models.Join)."""
        self.keys = Keys(job)
        self.job = job
        self.wait_for_redis = start_wait(wait_for_redis)
        self.signer = signer_of(conn, job, worker_id)
        self.id = worker_id or (self.signer.worker if self.signer else default_worker_id())
        self.clock: Clock = clock or SystemClock()
        self.log = log or logging.getLogger("cohort.worker")
        self.link = Link(self.log, url_of(conn))
        self.inbox = Inbox(conn, self.keys.inbox, self.signer)
        self.journal = Journal(conn, self.keys.journal)
        self._heartbeat_interval = heartbeat_interval

        self.stopping = threading.Event()
        """Set by the first SIGINT/SIGTERM: finish the step, then call leave()."""
        self.world_changed = threading.Event()
        """Set whenever a new world arrives; the training loop may clear it."""

        self._cond = threading.Condition()
        self._view = View(worker=self.id)
        self._position = ZERO  # journal ID folded up to
        self._stop = threading.Event()
        self._joining = threading.Event()  # a Join is sent and not answered yet: heartbeat
        self._wake = threading.Event()  # the heartbeat thread: stop, or the config changed
        self._threads: list[threading.Thread] = []
        self._undecodable: set[str] = set()  # fact types already logged as undecodable
        self._progress: tuple[int, int] | None = None  # (last finished step, its world)
        self._began: tuple[int, int] | None = None  # (step, world) of the last batch() call
        self._signals = 0
        self._handlers: dict[int, Any] = {}  # the script's own, before install_signal_handlers
        self._left = False  # leave() is done: a signal has nothing of cohort's to cut short
        self._gpu_interval = gpu_interval
        self._gpu_probe = gpu_probe
        self._advice_callbacks: list[Callable[[GpuAdvice], None]] = []
        self._transfers: TransferScheduler | None = None
        self._outbox = self._new_outbox()

    def _node(self) -> Node:
        if self.node is None:
            probe = self._gpu_probe or gpu.probe(self.log)
            try:
                self.node = this_node(probe)
            finally:
                if probe is not self._gpu_probe:
                    probe.close()
        return self.node

    # ------------------------------------------------------------ reading
    @property
    def view(self) -> View:
        with self._cond:
            return self._view

    @property
    def assignment(self) -> Assignment | None:
        return self.view.assignment

    @property
    def rank(self) -> int:
        return self._assigned().rank

    @property
    def world_size(self) -> int:
        return self._assigned().world_size

    @property
    def world_version(self) -> int:
        return self.view.world_version

    def rank_hosts(self) -> tuple[str, ...]:
        """The host of each rank of the current world, as its Join's node named it."""
        return self.view.rank_hosts()

    @property
    def next_step(self) -> int:
        """The step after the last committed one."""
        return self.view.next_step

    def batch(self, step: int) -> tuple[Range, ...]:
        """The ranges of positions this worker trains on at `step` (positions in the order of
        the step's epoch: `samples` gives the sample ids); marks the step as begun."""
        return self._begin(step)[1]

    def samples(self, step: int) -> Indices:
        """The ids of the samples this worker trains on at `step` (an int64 array): its
        `batch` mapped through the epoch's order (shuffled unless the job says not to);
        marks the step as begun."""
        view, ranges = self._begin(step)
        return views.order_for(view, step).samples(ranges)

    def _begin(self, step: int) -> tuple[View, tuple[Range, ...]]:
        view = self.view  # one view for all: the tail thread may fold a new plan meanwhile
        ranges = views.batch(view, step)
        self._began = (step, views.plan_for(view, step).world_version)
        return view, ranges

    def _assigned(self) -> Assignment:
        assignment = self.assignment
        if assignment is None:
            raise NotAssigned(f"worker {self.id!r} holds no rank in world {self.world_version}")
        return assignment

    # ------------------------------------------------------------ joining
    def join(self, timeout: float | None = None, stop: threading.Event | None = None) -> None:
        """Become a member of the job: send Join and wait for the coordinator's answer.

        Workers may start before any coordinator (compose and schedulers start everything
        at once): meanwhile this worker heartbeats, so the leader that finally decides the
        Join from the inbox backlog sees it alive, and logs a line every
        `JOIN_NOTICE_EVERY` s. `timeout` None waits until answered or until `stop`
        (default: `stopping`, set by the first SIGINT/SIGTERM) is set, then raises
        Stopped; a finite one raises JoinTimeout. Either way an unanswered Join is
        withdrawn with a Leave. Raises JoinRefusedError if the coordinator says no.
        """
        stop = self.stopping if stop is None else stop
        halt = AnyOf(self._stop, stop)  # Redis may be away too: retrying ends on either
        self._left = False
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        try:
            if not self._threads:
                self._reach(stop)
                self._start(deadline, halt)
            view = self.view
            if view.member:
                self.log.info("worker %s is already a member of job %r", self.id, self.job)
                return
            if view.finished is not None:  # no coordinator may run to refuse: say it here
                self.stop()
                raise JoinRefusedError(
                    self.id, finished_refusal(self.job, view.last_committed, view.finished)
                )
            joins, refusals = view.joins, view.refusals
            self._send(
                Join(
                    at=self.clock.now(),
                    job=self.job,
                    worker=self.id,
                    host=socket.gethostname()[:255],
                    pid=os.getpid(),
                    node=self._node(),
                    dataset=self.dataset,
                    role=self.role,  # type: ignore[arg-type]
                ),
                deadline=deadline,
                stop=halt,
            )
            self._joining.set()
            view = self._await_answer(
                lambda v: v.joins > joins or v.refusals > refusals, started, timeout, stop
            )
        except UNAVAILABLE as exc:
            self.stop()
            raise JoinTimeout(
                f"could not reach Redis at {self.link.where} within {timeout:g} s "
                f"to join job {self.job!r}"
            ) from exc
        except WorkerError as exc:
            if self._joining.is_set():
                self._withdraw(exc)
            self.stop()
            raise
        finally:
            self._joining.clear()
        if view.refusals > refusals:
            self.stop()
            raise JoinRefusedError(self.id, view.refused or "no reason given")
        self.log.info("worker %s joined job %r", self.id, self.job)

    def _reach(self, stop: threading.Event) -> None:
        """At start-up (Redis never answered yet), wait `wait_for_redis` s for it at most."""
        if self.link.reached:
            return
        try:
            reach(lambda: self.conn, self.link.where, self.wait_for_redis, stop)
        except RedisUnavailable as exc:
            if stop.is_set():
                raise Stopped(
                    f"worker {self.id!r} was stopped while waiting for Redis at {self.link.where} "
                    "(unreachable so far)"
                ) from None
            raise RedisUnreachable(str(exc)) from exc.__cause__
        self.link.restored()

    def _await_answer(
        self,
        answered: Callable[[View], bool],
        started: float,
        timeout: float | None,
        stop: threading.Event,
    ) -> View:
        """Wait for the answer to a Join, a line in the log every `JOIN_NOTICE_EVERY` s."""
        deadline = math.inf if timeout is None else started + timeout
        while True:
            notice = min(time.monotonic() + JOIN_NOTICE_EVERY, deadline)
            try:
                return self._wait(answered, notice, WaitTimeout, check_removed=False, stop=stop)
            except WaitTimeout:
                if notice >= deadline:
                    raise JoinTimeout(
                        f"no coordinator answered the join of {self.id!r} to job {self.job!r} "
                        f"at {self.link.where} within {timeout:g} s; check that one runs: "
                        f"cohort coordinator --job {self.job}"
                    ) from None
            except Stopped:
                raise Stopped(
                    f"worker {self.id!r} was stopped before a coordinator of job {self.job!r} "
                    "answered its join"
                ) from None
            self.log.info(
                "waiting for a coordinator of job %r at %s (%.0f s so far): start one with "
                "cohort coordinator --job %s",
                self.job,
                self.link.where,
                time.monotonic() - started,
                self.job,
            )

    def _withdraw(self, why: Exception) -> None:
        """Take back a Join nobody answered: a Leave behind it in the inbox, so a coordinator
        that decides both later lets this worker go at once instead of failing it."""
        try:
            self._send(
                Leave(
                    at=self.clock.now(),
                    job=self.job,
                    worker=self.id,
                    reason=f"gave up joining: {why}"[:1024],
                ),
                deadline=time.monotonic() + WITHDRAW_TIMEOUT,
            )
        except UNAVAILABLE + (Stopped,) as exc:
            self.log.warning("worker %s could not withdraw its join: %s", self.id, exc)

    def _start(self, deadline: float | None, halt: Halt) -> None:
        """Fold the journal so far, then follow it and start heartbeating."""
        self._stop.clear()
        self._wake.clear()
        last = with_retry(
            self.journal.last_id, halt, self.link, "reading the journal", deadline=deadline
        )
        for rows in self._journal_pages(ZERO, last, deadline, halt):
            self._fold(rows)
        with self._cond:
            self._position = last
        self._threads = [
            threading.Thread(target=self._tail, name=f"cohort-tail-{self.id}", daemon=True),
            threading.Thread(target=self._beat, name=f"cohort-heartbeat-{self.id}", daemon=True),
        ]
        if self._gpu_interval:
            probe = self._gpu_probe or gpu.probe(self.log)
            sampler = gpu.GpuSampler(
                probe, self._send_gpu, self._gpu_interval, self._stop, log=self.log
            )
            self._threads.append(
                threading.Thread(target=sampler.run, name=f"cohort-gpu-{self.id}", daemon=True)
            )
        for thread in self._threads:
            thread.start()

    def _journal_pages(
        self,
        after: str,
        until: str = "+",
        deadline: float | None = None,
        halt: Halt | None = None,
    ) -> Iterator[list[Entry]]:
        """The journal after `after`, a page at a time, each read retried through outages."""
        stop = self._stop if halt is None else halt

        def attempt(read: Callable[[], list[Entry]]) -> list[Entry]:
            return with_retry(read, stop, self.link, "reading the journal", deadline=deadline)

        return self.journal.pages(after, until, HISTORY_BATCH, attempt=attempt)

    def ready(self, step: int = 0, digest: str | None = None) -> None:
        """Tell the coordinator this worker loaded the weights of `step`."""
        self._send(
            WeightsLoaded(
                at=self.clock.now(), job=self.job, worker=self.id, step=step, digest=digest
            )
        )

    @property
    def finished(self) -> bool:
        """The job finished (JobFinished is in the journal): nothing trains any more."""
        return self.view.finished is not None

    def _finished(self, view: View) -> Finished:
        return Finished(self.job, view.last_committed, view.finished or "finished")

    def wait_active(self, timeout: float) -> Assignment:
        """Wait until this worker holds a rank and training is not paused; raise Finished
        once the job finished."""
        view = self._wait(
            lambda v: v.active or v.finished is not None,
            time.monotonic() + timeout,
            lambda: ActivationTimeout(
                f"worker {self.id!r} was not activated within {timeout:g} s "
                f"(status {self.view.status!r}, paused={self.view.paused})"
            ),
        )
        if not view.active:
            raise self._finished(view)
        assignment = view.assignment
        assert assignment is not None  # active implies a rank
        return assignment

    # ------------------------------------------------------------ stepping
    def step_done(
        self,
        step: int,
        step_time: float = 0.0,
        samples: int = 0,
        digest: str | None = None,
        loss: float | None = None,
        wait: bool = True,
    ) -> None:
        """Report `step` finished, in the world it began in (see `batch`).

        `wait=False` returns at once: the report goes out from a thread of the worker,
        retried through outages like a blocking one, and before any command sent after it
        (a training loop goes on with the next step and awaits the commit later)."""
        began = self._began
        world = began[1] if began is not None and began[0] == step else self.world_version
        self._progress = (step, world)
        done = StepDone(
            at=self.clock.now(),
            job=self.job,
            worker=self.id,
            step=step,
            world=world,
            step_time=step_time,
            samples=samples,
            digest=digest,
            loss=loss,
        )
        if wait:
            self._send(done)
        else:
            self._outbox.post(done)

    def checkpoint_written(
        self, step: int, uri: str, sha256: str, size: int, digest: str | None = None
    ) -> None:
        """Tell the leader the checkpoint of `step` it asked this worker for is whole at `uri`."""
        self._send(
            CheckpointWritten(
                at=self.clock.now(),
                job=self.job,
                worker=self.id,
                step=step,
                uri=uri,
                digest=digest,
                sha256=sha256,
                bytes=size,
            )
        )

    def wait_committed(self, step: int, timeout: float) -> None:
        """Return once `step` committed; raise WorldChangedError if a new world aborted it,
        Finished if the job ended before it."""
        progress = self._progress
        ran_in = progress[1] if progress is not None and progress[0] == step else None
        if ran_in is None:
            ran_in = self.world_version

        def settled(v: View) -> bool:
            return v.last_committed >= step or v.world_version > ran_in or v.finished is not None

        view = self._wait(
            settled,
            time.monotonic() + timeout,
            lambda: CommitTimeout(
                f"step {step} of job {self.job!r} did not commit within {timeout:g} s "
                f"(last committed: {self.view.last_committed}, paused={self.view.paused})"
            ),
            removed_first=False,
        )
        if view.last_committed >= step:
            return
        if view.removed:
            raise Removed(self.id, view.removed_reason)
        if view.finished is not None:
            raise self._finished(view)
        raise WorldChangedError(step, view.assignment)

    def committed(self, step: int, stop: threading.Event | None = None, poll: float = 0.5) -> bool:
        """Wait, without a deadline, for `step` to settle: True once it committed, False if a
        world change aborted it, the job finished before it, or `stop` (default: `stopping`)
        was set meanwhile.

        A training loop's "did my step count?": on False it rolls the step back and carries
        on from the current assignment. Raises Removed if this worker was failed or left.
        """
        stop = self.stopping if stop is None else stop
        while True:
            try:
                self.wait_committed(step, poll)
                return True
            except (WorldChangedError, Finished):
                return False
            except CommitTimeout:
                if stop.is_set():
                    return False

    def wait_for_change(self, since_version: int, timeout: float) -> bool:
        """True once the world version exceeds `since_version`; False after `timeout`."""
        try:
            self.wait_for(lambda v: v.world_version > since_version, timeout)
        except WaitTimeout:
            return False
        return True

    def wait_for(self, done: Callable[[View], bool], timeout: float) -> View:
        """The first view (as published after a whole journal reply) for which `done` holds.

        Raises Removed once this worker is no longer a member, WaitTimeout after `timeout`.
        """
        return self._wait(
            done,
            time.monotonic() + timeout,
            lambda: WaitTimeout(f"worker {self.id!r}: condition not met within {timeout:g} s"),
        )

    # ------------------------------------------------------------ leaving
    def leave(self, reason: str = "", timeout: float = 10.0) -> bool:
        """Ask to leave after the last finished step; wait for WorkerLeft; stop. True if seen."""
        if not self._threads:
            return False
        after = self._progress[0] if self._progress is not None else None
        seen = False
        try:
            if self.view.member:
                self._send(
                    Leave(
                        at=self.clock.now(),
                        job=self.job,
                        worker=self.id,
                        after_step=after,
                        reason=reason[:1024],
                    )
                )
                self._wait(
                    lambda v: not v.member,
                    time.monotonic() + timeout,
                    lambda: WaitTimeout("no WorkerLeft"),
                    check_removed=False,
                )
            seen = True
            self.log.info("worker %s left job %r", self.id, self.job)
        except WaitTimeout:
            self.log.warning(
                "worker %s sent Leave but saw no WorkerLeft within %g s; stopping anyway",
                self.id,
                timeout,
            )
        except Stopped:
            pass
        finally:
            self.stop()
            self._left = True
        return seen

    def stop(self) -> None:
        """Stop following the journal and heartbeating, without telling anyone."""
        self._stop.set()
        self._wake.set()
        with self._cond:
            self._cond.notify_all()
        current = threading.current_thread()
        for thread in self._threads:
            if thread is not current:
                thread.join()
        self._threads = []
        self._outbox.close()
        self._outbox = self._new_outbox()  # for a join after this stop

    # ------------------------------------------------------------ signals
    def install_signal_handlers(self) -> None:
        """First SIGINT/SIGTERM: finish the step and leave; second: exit now (main thread only).

        Once the leave is done there is nothing left to cut short: the next signal is only
        logged, and the script's own handlers are back for any after it (its saving code
        runs to its end)."""
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._handlers[signum] = signal.signal(signum, self.on_signal)

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        self._signals += 1
        if self._left:
            self.log.warning(
                "%s received: worker %s has already left job %r, nothing to cut short; the "
                "script goes on (send it again to interrupt the script itself)",
                name,
                self.id,
                self.job,
            )
            self._give_back_signals()
            return
        if self._signals == 1:
            self.log.warning(
                "%s received: worker %s finishes its step, then leaves; send it again to exit now",
                name,
                self.id,
            )
            self.stopping.set()
            return
        self.log.warning("%s received again: worker %s exits now", name, self.id)
        os._exit(130)

    def _give_back_signals(self) -> None:
        """The handlers the script had before `install_signal_handlers`, back in place."""
        for signum, handler in self._handlers.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._handlers = {}

    # ------------------------------------------------------------ plumbing
    def _new_outbox(self) -> Outbox:
        return Outbox(self._deliver, name=f"cohort-outbox-{self.id}")

    def _send(
        self, command: Command, deadline: float | None = None, stop: Halt | None = None
    ) -> str:
        """XADD `command` to the inbox, after every command posted to the outbox before it,
        retrying through outages until it is acknowledged (or `stop`, default the worker's
        own, is set)."""
        self._outbox.flush()
        return self._deliver(command, deadline, stop)

    def _deliver(
        self, command: Command, deadline: float | None = None, stop: Halt | None = None
    ) -> str:
        return with_retry(
            lambda: self.inbox.send(command),
            self._stop if stop is None else stop,
            self.link,
            f"sending {command.type}",
            deadline=deadline,
            wait_for_memory=True,
        )

    def _wait(
        self,
        done: Callable[[View], bool],
        deadline: float,
        timeout_error: Callable[[], Exception],
        check_removed: bool = True,
        removed_first: bool = True,
        stop: threading.Event | None = None,
    ) -> View:
        """Block until `done(view)`; raise Removed (if asked), Stopped (also once `stop` is
        set), or the timeout error."""
        with self._cond:
            while True:
                view = self._view
                if check_removed and removed_first and view.removed:
                    raise Removed(self.id, view.removed_reason)
                if done(view):
                    return view
                if check_removed and view.removed:
                    raise Removed(self.id, view.removed_reason)
                if self._stop.is_set() or (stop is not None and stop.is_set()):
                    raise Stopped(f"worker {self.id!r} was stopped")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise timeout_error()
                # `stop` is set by a signal handler, which must not take the condition's lock
                # (it may interrupt this very thread inside it): look at it every STOP_POLL s.
                self._cond.wait(remaining if stop is None else min(remaining, STOP_POLL))

    # ------------------------------------------------------------ GPU telemetry and advice
    @property
    def transfers(self) -> TransferScheduler:
        """This worker's transfer queue: honours its current GPU advice, and stages big
        transfers while it trains in a running world (worker/membership/transfers.py)."""
        if self._transfers is None:
            self._transfers = TransferScheduler(
                lambda: self.advice,
                lambda: self.view.active,
                self.clock,
                on_change=self._report_transfers,
            )
        return self._transfers

    def _report_transfers(self, stats: dict[str, float]) -> None:
        """The queue as it is now, to the leader's view and metrics, without waiting."""
        if not self.view.member:
            return
        waiting = TransfersWaiting(
            at=self.clock.now(),
            job=self.job,
            worker=self.id,
            pending=int(stats["pending"]),
            staged=int(stats["staged"]),
            delayed=stats["delayed_seconds"],
        )
        try:
            self._outbox.post(waiting)
        except WorkerError as exc:  # telemetry: a lost report is not the caller's problem
            self.log.warning("worker %s could not report its transfers: %s", self.id, exc)

    def register_workload(
        self,
        name: str,
        devices: tuple[int, ...] = (),
        memory: int = 0,
        priority: int = 0,
        pid: int | None = None,
    ) -> None:
        """Tell the leader this worker runs GPU workload `name` on `devices`, holding
        `memory` bytes, at `priority`; `cohort status` and the metrics show it. Registering
        the same name again updates it. ValueError names a bad value."""
        try:
            workload = Workload(
                name=name,
                pid=os.getpid() if pid is None else pid,
                devices=tuple(devices),
                memory=memory,
                priority=priority,
            )
        except ValidationError as exc:
            error = exc.errors()[0]
            where = ".".join(str(part) for part in error["loc"])
            raise ValueError(f"workload {where}={error.get('input')!r}: {error['msg']}") from None
        self._send(
            RegisterWorkload(at=self.clock.now(), job=self.job, worker=self.id, workload=workload)
        )

    def schedule_transfer(self, size: int, kind: str, priority: int = 0) -> Slot:
        """When a transfer of `size` bytes of `kind` ("model", "dataset", "checkpoint",
        "other") may start, as the GPU advice stands now; `transfers.due()` lists those
        that may start, in order, and `transfers.start(slot.transfer)` takes one."""
        return self.transfers.schedule_transfer(size, kind, priority)

    @property
    def advice(self) -> GpuAdvice:
        """The coordinator's current GPU advice for this worker (prefetch factor, delays)."""
        return views.gpu_advice(self.view)

    def on_advice(self, callback: Callable[[GpuAdvice], None]) -> None:
        """Call `callback(advice)` from the journal thread whenever this worker's advice changes
        (a data loader adjusts its prefetch depth there). Exceptions are logged, not raised."""
        self._advice_callbacks.append(callback)

    def _send_gpu(self, devices: tuple[GpuDevice, ...]) -> None:
        if self.view.member:
            self._send(
                GpuReading(at=self.clock.now(), job=self.job, worker=self.id, devices=devices)
            )

    def _advice_changed(self, view: View) -> None:
        advice = views.gpu_advice(view)
        self.log.info(
            "worker %s GPU advice now: prefetch x%g, delay %gs, model files first: %s",
            self.id,
            advice.prefetch_factor,
            advice.delay_seconds,
            advice.prioritise_model_files,
        )
        for callback in list(self._advice_callbacks):
            try:
                callback(advice)
            except Exception:
                self.log.exception("GPU advice callback %r failed", callback)

    def _fold(self, rows: list[Entry]) -> None:
        """Apply a reply's entries, then publish the view and wake waiters once."""
        if not rows:
            return
        with self._cond:
            before = self._view
            view = self._evolved(before, rows)
            self._view = view
            self._position = rows[-1].id
            if view.world_version > before.world_version:
                self.world_changed.set()
            if view.config is not before.config:
                self._wake.set()
            self._cond.notify_all()
        if view.advice != before.advice:
            self._advice_changed(view)

    def _evolved(self, view: View, rows: list[Entry]) -> View:
        """`view` after the facts of `rows`; a fact this worker cannot read is logged, once
        per kind, and skipped."""
        for entry in rows:
            try:
                fact = Journal.decode(entry)
            except DecodeError as exc:
                self._undecodable_fact(entry, exc)
                continue
            view = views.evolve(view, fact)
        return view

    def _undecodable_fact(self, entry: Entry, exc: DecodeError) -> None:
        kind = exc.reason.split("'")[1] if exc.reason.startswith("invalid '") else exc.reason
        level = logging.DEBUG if kind in self._undecodable else logging.WARNING
        self._undecodable.add(kind)
        self.log.log(
            level, "skipping journal entry %s this worker cannot read: %s", entry.id, exc.reason
        )

    def _tail(self) -> None:
        while not self._stop.is_set():
            try:
                rows = with_retry(
                    lambda: self.journal.tail(self._position, TAIL_BLOCK_MS),
                    self._stop,
                    self.link,
                    "following the journal",
                )
                if self._rolled_back(rows):
                    self._refold()
                    continue
                self._fold(rows)
            except Stopped:
                return
            except Exception:
                self.log.exception("worker %s could not follow the journal; retrying", self.id)
                self._stop.wait(1.0)

    def _rolled_back(self, rows: list[Entry]) -> bool:
        """True if a new leader's entries arrive and the journal no longer holds the entry
        this worker folded up to: Redis lost acknowledged facts (a failover to a lagging
        replica), and the coordinators have folded the journal again (docs/redis-ha.md)."""
        position = self._position
        if position == ZERO or not any(b"LeaderElected" in (r.raw or b"") for r in rows):
            return False
        held = with_retry(
            lambda: self.conn.xrange(self.keys.journal, position, position),
            self._stop,
            self.link,
            "checking the journal",
        )
        return not held

    def _refold(self) -> None:
        """Rebuild the view from the journal as it is now and publish it at once."""
        self.log.error(
            "worker %s: the journal of job %r lost entry %s and later ones (a Redis failover "
            "with asynchronous replication?); folding it again from the start",
            self.id,
            self.job,
            self._position,
        )
        view, after = View(worker=self.id), ZERO
        for rows in self._journal_pages(ZERO):
            view, after = self._evolved(view, rows), rows[-1].id
        with self._cond:
            self._view = view
            self._position = after
            self.world_changed.set()
            self._cond.notify_all()

    def _beat(self) -> None:
        """Heartbeat every interval; a JobConfigured arriving later re-paces the next beat."""
        last = time.monotonic()
        while True:
            self._wake.wait(max(0.0, last + self._interval() - time.monotonic()))
            self._wake.clear()
            if self._stop.is_set():
                return
            if time.monotonic() < last + self._interval():
                continue  # woken early by a new config; wait out the (new) interval
            last = time.monotonic()
            view = self.view
            if not (view.member or self._joining.is_set()):
                continue
            step, world = self._progress or (None, view.world_version)
            try:
                self._send(
                    Heartbeat(
                        at=self.clock.now(), job=self.job, worker=self.id, step=step, world=world
                    )
                )
            except Stopped:
                return
            except Exception:
                self.log.exception("worker %s could not send a heartbeat", self.id)

    def _interval(self) -> float:
        if self._heartbeat_interval is not None:
            return self._heartbeat_interval
        config = self.view.config
        return config.heartbeat_interval if config is not None else DEFAULT_HEARTBEAT
