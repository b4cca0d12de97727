"""A worker's Join on its way to an answer: Redis reached, the Join sent, the answer awaited.

Workers may start before any coordinator (compose and schedulers start everything at once):
the wait has no deadline unless given and says so in the log every `JOIN_NOTICE_EVERY` s; a
Join nobody answered is withdrawn with a Leave behind it, so a coordinator that decides both
later lets the worker go at once instead of failing it.
"""

from __future__ import annotations

import logging
import math
import threading
import time

from cohort.events.connection import UNAVAILABLE, Client, reach
from cohort.events.errors import RedisUnavailableError
from cohort.events.models import Command, Join, Leave, finished_refusal
from cohort.worker.errors import JoinTimeoutError, RedisUnreachableError, Stopped, WaitTimeoutError
from cohort.worker.membership.delivery import Delivery
from cohort.worker.membership.following import JournalFollower
from cohort.worker.membership.retry import Halt, Link
from cohort.worker.membership.stamp import Stamp
from cohort.worker.membership.view import View

JOIN_NOTICE_EVERY = 10.0  # seconds between "waiting for a coordinator" lines
WITHDRAW_TIMEOUT = 2.0  # how long taking back an unanswered Join may try


class JoinRequest:
    """One worker's Joins, sent through `delivery`; `following` brings the answer, and
    `pending` is set while one is in the inbox unanswered (the heartbeat beats meanwhile)."""

    def __init__(
        self,
        conn: Client,
        wait_for_redis: float,
        following: JournalFollower,
        delivery: Delivery,
        stamp: Stamp,
        link: Link,
        log: logging.Logger,
        pending: threading.Event,
    ) -> None:
        self.conn = conn
        self.wait_for_redis = wait_for_redis
        self.following = following
        self.delivery = delivery
        self._stamp = stamp
        self.link = link
        self.log = log
        self.pending = pending

    def reach(self, stop: threading.Event) -> None:
        """At start-up (Redis never answered yet), wait `wait_for_redis` s for it at most."""
        if self.link.reached:
            return
        try:
            reach(lambda: self.conn, self.link.where, self.wait_for_redis, stop)
        except RedisUnavailableError as exc:
            if stop.is_set():
                raise Stopped(
                    f"worker {self._stamp.worker!r} was stopped while waiting for Redis at "
                    f"{self.link.where} (unreachable so far)"
                ) from None
            raise RedisUnreachableError(str(exc)) from exc.__cause__
        self.link.restored()

    def send(self, join: Join, deadline: float | None, halt: Halt) -> None:
        """`join` in the inbox (retried until `deadline` or `halt`); pending from now on."""
        self.delivery.send(join, deadline, halt)
        self.pending.set()

    def await_answer(
        self, before: View, started: float, timeout: float | None, stop: threading.Event
    ) -> View:
        """The view that answers the Join sent at `before` (a WorkerJoined or a JoinRefused),
        a line in the log every `JOIN_NOTICE_EVERY` s; JoinTimeoutError `timeout` s after
        `started`, Stopped once `stop` is set."""
        job, worker = self._stamp.job, self._stamp.worker
        deadline = math.inf if timeout is None else started + timeout
        while True:
            notice = min(time.monotonic() + JOIN_NOTICE_EVERY, deadline)
            try:
                return self.following.wait(
                    lambda v: _answered(before, v),
                    notice,
                    WaitTimeoutError,
                    check_removed=False,
                    stop=stop,
                )
            except WaitTimeoutError:
                if notice >= deadline:
                    raise JoinTimeoutError(
                        f"no coordinator answered the join of {worker!r} to job {job!r} "
                        f"at {self.link.where} within {timeout:g} s; check that one runs: "
                        f"cohort coordinator --job {job}"
                    ) from None
            except Stopped:
                raise Stopped(
                    f"worker {worker!r} was stopped before a coordinator of job {job!r} "
                    "answered its join"
                ) from None
            self.log.info(
                "waiting for a coordinator of job %r at %s (%.0f s so far): start one with "
                "cohort coordinator --job %s",
                job,
                self.link.where,
                time.monotonic() - started,
                job,
            )

    def withdraw(self, why: Exception) -> None:
        """Take back a pending Join: a Leave behind it in the inbox (tried for
        `WITHDRAW_TIMEOUT` s), so a coordinator that decides both later lets this worker go
        at once instead of failing it. Nothing pending: nothing to do."""
        if not self.pending.is_set():
            return
        leave: Command = self._stamp(Leave, reason=f"gave up joining: {why}"[:1024])
        try:
            self.delivery.send(leave, deadline=time.monotonic() + WITHDRAW_TIMEOUT)
        except UNAVAILABLE + (Stopped,) as exc:
            self.log.warning("worker %s could not withdraw its join: %s", self._stamp.worker, exc)


def _answered(before: View, now: View) -> bool:
    """The coordinator answered the Join sent at `before`: a WorkerJoined or a JoinRefused,
    or the job finished first (its coordinators may end with it, leaving the Join unread)."""
    finished = now.finished is not None and not now.member
    return now.joins > before.joins or now.refusals > before.refusals or finished


def refusal(before: View, answered: View, job: str) -> str | None:
    """Why the Join sent at `before` was refused by the time of `answered` (a JoinRefused,
    or the job finished without it), or None: it was accepted."""
    if answered.refusals > before.refusals:
        return answered.refused or "no reason given"
    if answered.finished is not None and not answered.member:
        return finished_refusal(job, answered.last_committed, answered.finished)
    return None
