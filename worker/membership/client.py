"""The training side of membership: join, heartbeat, follow the journal, step, leave.

A `Worker` composes the pieces of a membership and runs them: its `JournalFollower`
(following.py) folds the journal into a frozen `View` on the tail thread, its
`HeartbeatThread` (heartbeat.py) says it is alive from the moment its Join is in the inbox,
its `AdviceChannel` (advice.py) carries GPU readings, workloads and transfers up and the GPU
advice back, its `ShutdownSignals` (signals.py) turn SIGINT/SIGTERM into a leave, and its
`Stamp` (stamp.py) heads every command it sends. The training loop calls the blocking
methods (`wait_active`, `wait_committed`, ...), which wait on the follower's condition,
never by sleeping.

Timeouts are real seconds; the `Clock` stamps the events the worker sends.
"""

from __future__ import annotations

import logging
import math
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Mapping
from types import FrameType
from typing import TYPE_CHECKING, Any, TypeVar

from cohort.events import identity
from cohort.events.clock import Clock, SystemClock
from cohort.events.connection import UNAVAILABLE, Client, credentials, start_wait, where
from cohort.events.keys import Keys
from cohort.events.models import (
    CheckpointWritten,
    Command,
    Dataset,
    Join,
    Leave,
    Node,
    StepDone,
    WeightsLoaded,
    finished_refusal,
)
from cohort.events.shards import Range
from cohort.events.streams import Inbox, Journal
from cohort.worker.errors import (
    ActivationTimeoutError,
    CommitTimeoutError,
    Finished,
    IdentityMismatchError,
    JoinRefusedError,
    JoinTimeoutError,
    NotAssignedError,
    RemovedError,
    Stopped,
    WaitTimeoutError,
    WorkerError,
    WorldChangedError,
)
from cohort.worker.membership import view as views
from cohort.worker.membership.advice import AdviceChannel
from cohort.worker.membership.credential import CredentialRefresh
from cohort.worker.membership.delivery import Delivery
from cohort.worker.membership.following import JournalFollower
from cohort.worker.membership.heartbeat import HeartbeatThread
from cohort.worker.membership.joining import JoinRequest, refusal
from cohort.worker.membership.presence import PresenceThread
from cohort.worker.membership.retry import AnyOf, Halt, Link, url_of
from cohort.worker.membership.signals import ShutdownSignals
from cohort.worker.membership.stamp import Stamp
from cohort.worker.membership.transfers import Slot, TransferScheduler
from cohort.worker.membership.view import Assignment, GpuAdvice, View
from cohort.worker.telemetry.gpu import GpuProbe
from cohort.worker.telemetry.node import probed_node

if TYPE_CHECKING:
    from cohort.events.order import Indices

C = TypeVar("C", bound=Command)


WORKER_ID_ENV = "COHORT_WORKER_ID"
"""The worker id a launcher gives a rank it starts (`cohort run`): the default when the
script names none."""


def default_worker_id() -> str:
    """$COHORT_WORKER_ID if set, else host-pid-random (unique among a job's workers)."""
    if os.environ.get(WORKER_ID_ENV):
        return os.environ[WORKER_ID_ENV]
    host = socket.gethostname().split(".")[0] or "host"
    host = "".join(c if c.isalnum() or c in "._-" else "-" for c in host)[:96]
    return f"{host}-{os.getpid()}-{random.randbytes(2).hex()}"


def signer_of(conn: Client, job: str, worker_id: str | None) -> identity.Signer | None:
    """How this worker signs its commands: with its own credential's password if `conn`
    logs in as a worker's own user (`cohort acl --worker`), else not at all. Raises
    IdentityMismatchError if that user is another worker's (`worker_id` None: take its worker)."""
    username, password = credentials(conn)
    owner = identity.worker_of_user(job, username)
    if owner is None or not password:
        return None
    if worker_id is not None and worker_id != owner:
        raise IdentityMismatchError(worker_id, owner, username or "")
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
        spare: bool = False,
    ) -> None:
        """`wait_for_redis`: seconds `join` waits at start-up for Redis to answer before it
        raises RedisUnreachableError naming the URL (default $COHORT_WAIT_FOR_REDIS, else 10)."""
        self.conn = conn
        self.dataset = dataset
        """The data this worker trains on, declared in its Join (None: it takes the job's)."""
        self.node = node
        """What it says of its machine (None: described when it joins, worker/telemetry/node.py)."""
        self.role = role
        """The member's role: "agent" for a launcher's member that trains nothing of the job's
        dealing (events.models.Join)."""
        self.spare = spare  # a spare's loop clears it once promoted: a rejoin is a trainer's
        self.keys, self.job = Keys(job), job
        self.wait_for_redis = start_wait(wait_for_redis)
        signer = signer_of(conn, job, worker_id)
        self.id = worker_id or (signer.worker if signer else default_worker_id())
        self.clock: Clock = clock or SystemClock()
        self.log = log or logging.getLogger("cohort.worker")
        self.link = Link(self.log, url_of(conn))
        self.inbox = Inbox(conn, self.keys.inbox, signer)  # its signer: the credential, if any
        self.journal = Journal(conn, self.keys.journal)

        self.stopping = threading.Event()
        """Set by the first SIGINT/SIGTERM: finish the step, then call leave()."""
        self.world_changed = threading.Event()
        """Set whenever a new world arrives; the training loop may clear it."""

        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._progress: tuple[int, int] | None = None  # (last finished step, its world)
        self._began: tuple[int, int] | None = None  # (step, world) of the last batch() call
        self._gpu_probe = gpu_probe
        self._delivery = Delivery(self.inbox, self.link, self._stop, f"cohort-outbox-{self.id}")
        self._compose(heartbeat_interval, gpu_interval)

    def _compose(self, heartbeat_interval: float | None, gpu_interval: float | None) -> None:
        """The pieces of the membership, each given what it needs of this worker."""
        self._stamp = Stamp(self.clock, self.job, self.id)
        self._signals = ShutdownSignals(self.stopping, self.log, self.id, self.job)
        self._heartbeat = HeartbeatThread(
            self._delivery.send,
            self._stamp,
            lambda: self.view,
            lambda: self._progress,
            self._stop,
            self.log,
            heartbeat_interval,
            chore=CredentialRefresh(self.conn, self.job, self.inbox, self.log),
        )
        self._gpu = AdviceChannel(
            self._stamp,
            self._delivery.send,
            self._delivery.post,
            lambda: self.view,
            self.log,
            gpu_interval,
            self._gpu_probe,
        )
        self._following = JournalFollower(
            self.journal,
            self.job,
            self.id,
            self.link,
            self._stop,
            self.log,
            world_changed=self.world_changed,
            config_changed=self._heartbeat.wake,  # a new config re-paces the heartbeat
            advice_changed=self._gpu.advice_changed,
        )
        presence = self.keys.presence(self.id)
        self._presence = PresenceThread(self.conn, presence, self._stop, self.log)
        self._joining = JoinRequest(
            self.conn,
            self.wait_for_redis,
            self._following,
            self._delivery,
            self._stamp,
            self.link,
            self.log,
            pending=self._heartbeat.joining,
        )

    def _node(self) -> Node:
        if self.node is None:
            self.node = probed_node(self._gpu_probe, self.log)
        return self.node

    # ------------------------------------------------------------ reading
    @property
    def view(self) -> View:
        return self._following.view

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

    @property
    def ranks(self) -> tuple[str, ...]:  # the worker holding each rank of the world, in order
        return self.view.ranks

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
            raise NotAssignedError(
                f"worker {self.id!r} holds no rank in world {self.world_version}"
            )
        return assignment

    # ------------------------------------------------------------ joining
    def join(self, timeout: float | None = None, stop: threading.Event | None = None) -> None:
        """Become a member of the job: send Join and wait for the coordinator's answer.

        Workers may start before any coordinator (compose and schedulers start everything
        at once): meanwhile this worker heartbeats, so the leader that finally decides the
        Join from the inbox backlog sees it alive, and logs a line every
        `joining.JOIN_NOTICE_EVERY` s. `timeout` None waits until answered or until `stop`
        (default: `stopping`, set by the first SIGINT/SIGTERM) is set, then raises
        Stopped; a finite one raises JoinTimeoutError. Either way an unanswered Join is
        withdrawn with a Leave. Raises JoinRefusedError if the coordinator says no.
        """
        stop = self.stopping if stop is None else stop
        halt = AnyOf(self._stop, stop)  # Redis may be away too: retrying ends on either
        self._signals.left = False
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        try:
            self._start(deadline, halt, stop)
            before = self.view
            if self._member_already(before):
                return
            self._joining.send(self._join_command(), deadline, halt)
            view = self._joining.await_answer(before, started, timeout, stop)
        except UNAVAILABLE as exc:
            self.stop()
            raise JoinTimeoutError(
                f"could not reach Redis at {self.link.where} within {timeout:g} s "
                f"to join job {self.job!r}"
            ) from exc
        except WorkerError as exc:
            self._joining.withdraw(exc)
            self.stop()
            raise
        finally:
            self._joining.pending.clear()
        self._accepted(before, view)

    def _member_already(self, view: View) -> bool:
        """True if `view` has this worker a member already; JoinRefusedError if the job
        finished (no coordinator may run to refuse: say it here)."""
        if view.member:
            self.log.info("worker %s is already a member of job %r", self.id, self.job)
            return True
        if view.finished is not None:
            raise JoinRefusedError(
                self.id, finished_refusal(self.job, view.last_committed, view.finished)
            )
        return False

    def _join_command(self) -> Join:
        return self._stamp(
            Join, host=socket.gethostname()[:255], pid=os.getpid(), node=self._node(),
            dataset=self.dataset, role=self.role, spare=self.spare,
        )  # fmt: skip

    def _accepted(self, before: View, answered: View) -> None:
        """Raise JoinRefusedError if the answer to the Join sent at `before` is a refusal."""
        if (refused := refusal(before, answered, self.job)) is not None:
            self.stop()
            raise JoinRefusedError(self.id, refused)
        self.log.info("worker %s joined job %r on Redis %s", self.id, self.job, where(self.conn))

    def _start(self, deadline: float | None, halt: Halt, stop: threading.Event) -> None:
        """Once per join after a stop: reach Redis, fold the journal so far, then follow it,
        heartbeat and (if asked) send GPU readings, each on a thread of its own."""
        if self._threads:
            return
        self._joining.reach(stop)
        self._stop.clear()
        self._heartbeat.wake.clear()
        self._following.catch_up(deadline, halt)
        runs = {"tail": self._following.run, "heartbeat": self._heartbeat.run}
        runs["presence"] = self._presence.run  # a subscription that dies with the process
        sampler = self._gpu.sampler(self._stop)
        if sampler is not None:
            runs["gpu"] = sampler
        self._threads = [
            threading.Thread(target=run, name=f"cohort-{name}-{self.id}", daemon=True)
            for name, run in runs.items()
        ]
        for thread in self._threads:
            thread.start()

    def ready(self, step: int = 0, digest: str | None = None) -> None:
        """Tell the coordinator this worker loaded the weights of `step`."""
        self._send(self._stamp(WeightsLoaded, step=step, digest=digest))

    @property
    def finished(self) -> bool:
        """The job finished (JobFinished is in the journal): nothing trains any more."""
        return self.view.finished is not None

    def _finished(self, view: View) -> Finished:
        return Finished(self.job, view.last_committed, view.finished or "finished")

    def wait_active(self, timeout: float) -> Assignment:
        """Wait until this worker holds a rank and training is not paused; raise Finished
        once the job finished."""
        view = self._following.wait(
            lambda v: v.active or v.finished is not None,
            time.monotonic() + timeout,
            lambda: ActivationTimeoutError(
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
        metrics: Mapping[str, float] | None = None,
    ) -> None:
        """Report `step` finished, in the world it began in (see `batch`), with the
        script's figures of it (`loss`, and any other named `metrics`). `wait=False`
        returns at once: the report goes out from a thread of the worker, retried through
        outages like a blocking one, and before any command sent after it (a training
        loop goes on with the next step and awaits the commit later)."""
        began = self._began
        world = began[1] if began is not None and began[0] == step else self.world_version
        self._progress = (step, world)
        figures = dict(metrics) if metrics else None
        done = self._stamp(
            StepDone, step=step, world=world, step_time=step_time, samples=samples,
            digest=digest, loss=loss, metrics=figures,
        )  # fmt: skip
        if wait:
            self._send(done)
        else:
            self._delivery.post(done)

    def checkpoint_written(
        self, step: int, uri: str, sha256: str, size: int, digest: str | None = None
    ) -> None:
        """Tell the leader the checkpoint of `step` it asked this worker for is whole at `uri`."""
        self._send(
            self._stamp(
                CheckpointWritten, step=step, uri=uri, digest=digest, sha256=sha256, bytes=size
            )
        )

    def wait_committed(self, step: int, timeout: float) -> None:
        """Return once `step` committed; raise WorldChangedError if a new world aborted it,
        Finished if the job ended before it."""
        self._delivery.land()  # its StepDone, if refused on the wire, is retried now
        progress = self._progress
        ran_in = progress[1] if progress is not None and progress[0] == step else self.world_version

        def settled(v: View) -> bool:
            return v.last_committed >= step or v.world_version > ran_in or v.finished is not None

        view = self._following.wait(
            settled,
            time.monotonic() + timeout,
            lambda: CommitTimeoutError(
                f"step {step} of job {self.job!r} did not commit within {timeout:g} s "
                f"(last committed: {self.view.last_committed}, paused={self.view.paused})"
            ),
            removed_first=False,
        )
        if view.last_committed >= step:
            return
        if view.removed:
            raise RemovedError(self.id, view.removed_reason)
        if view.finished is not None:
            raise self._finished(view)
        raise WorldChangedError(step, view.assignment)

    def committed(self, step: int, stop: threading.Event | None = None, poll: float = 0.5) -> bool:
        """Wait, without a deadline, for `step` to settle: True once it committed, False if a
        world change aborted it, the job finished before it, or `stop` (default: `stopping`)
        was set meanwhile.

        A training loop's "did my step count?": on False it rolls the step back and carries
        on from the current assignment. Raises RemovedError if this worker was failed or left.
        """
        stop = self.stopping if stop is None else stop
        while True:
            try:
                self.wait_committed(step, poll)
                return True
            except (WorldChangedError, Finished):
                return False
            except CommitTimeoutError:
                if stop.is_set():
                    return False

    def wait_for_change(self, since_version: int, timeout: float) -> bool:
        """True once the world version exceeds `since_version`; False after `timeout`."""
        try:
            self.wait_for(lambda v: v.world_version > since_version, timeout)
        except WaitTimeoutError:
            return False
        return True

    def wait_for(
        self,
        done: Callable[[View], bool],
        timeout: float | None,
        *,
        stop: threading.Event | None = None,
        removed: bool = True,
    ) -> View:
        """The first view (as published after a whole journal reply) for which `done` holds.

        Raises WaitTimeoutError after `timeout` s (None: no deadline), Stopped once `stop`
        is set, RemovedError once this worker is no longer a member (`removed=False`: go on
        waiting, for a condition that holds after the end).
        """
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        return self._following.wait(
            done,
            deadline,
            lambda: WaitTimeoutError(f"worker {self.id!r}: condition not met within {timeout:g} s"),
            check_removed=removed,
            stop=stop,
        )

    def send(self, kind: Callable[..., C], **fields: Any) -> str:
        """Send this member's `kind` command, `fields` its own (the header is stamped here),
        after every command sent before it and retried through Redis outages: how a member
        that is not a trainer (the evaluator's EvalDone) reports. Returns its inbox ID."""
        return self._send(self._stamp(kind, **fields))

    # ------------------------------------------------------------ leaving
    def leave(self, reason: str = "", timeout: float = 10.0, *, drain: bool = True) -> bool:
        """Ask to leave after the last finished step (`drain=False`: at once, for a step the
        job will never commit); wait for WorkerLeft; stop. True if seen."""
        if not self._threads:
            return False
        after = self._progress[0] if self._progress is not None and drain else None
        seen = False
        try:
            if self.view.member:
                self._send(self._stamp(Leave, after_step=after, reason=reason[:1024]))
                self._following.wait(
                    lambda v: not v.member,
                    time.monotonic() + timeout,
                    lambda: WaitTimeoutError("no WorkerLeft"),
                    check_removed=False,
                )
            seen = True
            self.log.info("worker %s left job %r", self.id, self.job)
        except WaitTimeoutError:
            self.log.warning(
                "worker %s sent Leave but saw no WorkerLeft within %g s; stopping anyway",
                self.id,
                timeout,
            )
        except Stopped:
            pass
        finally:
            self.stop()
            self._signals.left = True
        return seen

    def stop(self) -> None:
        """Stop following the journal and heartbeating, without telling anyone."""
        self._stop.set()
        self._heartbeat.wake.set()
        self._following.wake_waiters()
        current = threading.current_thread()
        for thread in self._threads:
            if thread is not current:
                thread.join()
        self._threads = []
        self._delivery.close()

    # ------------------------------------------------------------ signals
    def install_signal_handlers(self) -> None:
        """First SIGINT/SIGTERM: finish the step and leave; second: exit now (main thread only).

        Once the leave is done there is nothing left to cut short: the next signal is only
        logged, and the script's own handlers are back for any after it (its saving code
        runs to its end)."""
        self._signals.install()

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        """What a SIGINT/SIGTERM does (signals.py); tests call it as a plain method."""
        self._signals.on_signal(signum, frame)

    # ------------------------------------------------------------ plumbing
    def _send(
        self, command: Command, deadline: float | None = None, stop: Halt | None = None
    ) -> str:
        """`command` in the inbox, after everything posted before it (`Delivery.send`)."""
        return self._delivery.send(command, deadline, stop)

    # ------------------------------------------------------------ GPU telemetry and advice
    @property
    def transfers(self) -> TransferScheduler:
        """This worker's transfer queue: honours its current GPU advice, and stages big
        transfers while it trains in a running world (worker/membership/transfers.py)."""
        return self._gpu.transfers

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
        self._gpu.register_workload(name, devices, memory, priority, pid)

    def schedule_transfer(self, size: int, kind: str, priority: int = 0) -> Slot:
        """When a transfer of `size` bytes of `kind` ("model", "dataset", "checkpoint",
        "other") may start, as the GPU advice stands now; `transfers.due()` lists those
        that may start, in order, and `transfers.start(slot.transfer)` takes one."""
        return self.transfers.schedule_transfer(size, kind, priority)

    @property
    def advice(self) -> GpuAdvice:
        """The coordinator's current GPU advice for this worker (prefetch factor, delays)."""
        return self._gpu.advice

    def on_advice(self, callback: Callable[[GpuAdvice], None]) -> None:
        """Call `callback(advice)` from the journal thread whenever this worker's advice changes
        (a data loader adjusts its prefetch depth there). Exceptions are logged, not raised."""
        self._gpu.on_advice(callback)
