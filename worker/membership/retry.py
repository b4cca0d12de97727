"""Riding out Redis outages: retry with capped, jittered backoff; log only when the link flips.

Every worker thread talks to Redis through `with_retry`, and they share one
`Link`, so an outage is one "lost" line and one "back" line, however many
threads notice it. The link also counts how long Redis has been away (`outage`), so a
collective's deadline can leave outage time out (`worker/collective/redis_collective.py`), and an
operation given `ride_out` gives up only once one outage lasted that long.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Protocol, TypeVar

import redis

from cohort.events.connection import UNAVAILABLE, Client, backoff, seconds_of, where
from cohort.worker.errors import OutageTooLongError, Stopped

T = TypeVar("T")

ENV_RIDE_OUT = "COHORT_RIDE_OUT"
JAMMED_RETRY = 0.1
"""Seconds at most between attempts at an append that a jammed stream refused: the leader
repairs the inbox in the turn that sees it, so the next attempt after that should come at
once (a refused XADD costs Redis one short reply)."""
DEFAULT_RIDE_OUT = 300.0
"""Seconds one Redis outage may last before a worker's collective gives up (a coordinator
waits outages out without a limit). 5 minutes: a Redis restart with a big AOF, a host
reboot; with the collective's own deadline, within the TTL of its keys (`wire.TTL_MS`,
10 minutes), so what the ranks wrote before the outage is still there after it."""


def url_of(conn: Client) -> str:
    """Where `conn` points, as a URL without credentials, for log lines (a `Link`'s `where`)."""
    return where(conn)


class Link:
    """The health of one Redis connection as all of a worker's threads see it."""

    def __init__(
        self, log: logging.Logger, where: str, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.log = log
        self.where = where
        self.clock = clock
        self._down = False
        self._reached = False  # some operation succeeded: a later failure loses a connection
        self._lock = threading.Lock()
        self._down_since = 0.0
        self._down_before = 0.0  # seconds of the outages that ended
        self._full = False  # Redis refused a write for memory; logged once until one lands
        self._jammed = False  # a stream refused an append for its IDs; logged once likewise

    def outage(self) -> float:
        """Seconds Redis has been unreachable in all, the current outage included: a
        deadline that must not count outages moves by what this grew meanwhile."""
        with self._lock:
            current = self.clock() - self._down_since if self._down else 0.0
            return self._down_before + current

    def down_for(self) -> float:
        """Seconds the current outage has lasted (0 while Redis answers)."""
        with self._lock:
            return self.clock() - self._down_since if self._down else 0.0

    @property
    def down(self) -> bool:
        return self._down

    @property
    def reached(self) -> bool:
        """Redis has answered this link at least once."""
        return self._reached

    def lost(self, exc: BaseException, what: str) -> None:
        with self._lock:
            if self._down:
                return
            self._down = True
            self._down_since = self.clock()
        self.log.warning(
            "%s Redis at %s while %s (%s: %s); retrying with backoff",
            "lost the connection to" if self._reached else "cannot reach",
            self.where,
            what,
            type(exc).__name__,
            exc,
        )

    def full(self, exc: BaseException, what: str) -> None:
        """Redis refused a write for memory (over maxmemory, noeviction): said once."""
        with self._lock:
            if self._full:
                return
            self._full = True
        self.log.warning(
            "Redis at %s is over its maxmemory while %s (%s); retrying with backoff, nothing "
            "is dropped: raise maxmemory or free memory on the server",
            self.where,
            what,
            exc,
        )

    def jammed(self, exc: BaseException, what: str) -> None:
        """A stream refused an append for its IDs (another writer exhausted them): said once
        until an operation succeeds; the leader repairs the inbox within a turn."""
        with self._lock:
            if self._jammed:
                return
            self._jammed = True
        self.log.warning(
            "Redis at %s refused an append while %s (%s): a stream's IDs were run ahead by "
            "another writer; retrying with backoff until the leader repairs it",
            self.where,
            what,
            exc,
        )

    def restored(self) -> None:
        self._reached = True
        self._full = False
        self._jammed = False
        if not self._down:  # the common case, without taking the lock
            return
        with self._lock:
            if not self._down:
                return
            self._down = False
            lasted = self.clock() - self._down_since
            self._down_before += lasted
        self.log.warning("the connection to Redis at %s is back after %.1f s", self.where, lasted)


def jammed(exc: redis.ResponseError) -> bool:
    """True for the refusal of an append to a stream whose IDs ran out: someone appended the
    largest ID a stream allows (docs/identity.md). Retried: the leader repairs the inbox."""
    return "exhausted the last possible id" in str(exc).lower()


class Halt(Protocol):
    """What `with_retry` waits on between attempts: a `threading.Event`, or `AnyOf` them."""

    def wait(self, timeout: float | None = None) -> bool: ...


class AnyOf:
    """Several stop events as one (set once any of them is), for a wait that either the
    worker's own stop or its caller's may end."""

    POLL = 0.1  # seconds between looks at the events after the first

    def __init__(self, *events: threading.Event) -> None:
        self.events = events

    def is_set(self) -> bool:
        return any(event.is_set() for event in self.events)

    def wait(self, timeout: float | None = None) -> bool:
        """True once any event is set; False after `timeout` (None: no limit)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.is_set():
            left = self.POLL if deadline is None else deadline - time.monotonic()
            if left <= 0:
                return False
            self.events[0].wait(min(left, self.POLL))
        return True


def with_retry(
    op: Callable[[], T],
    stop: Halt,
    link: Link,
    what: str,
    *,
    deadline: float | None = None,
    cap: float = 2.0,
    ride_out: float | None = None,
    wait_for_memory: bool = False,
) -> T:
    """`op()`, retried on connection errors until it succeeds.

    Raises `Stopped` when `stop` is set while waiting, the last connection
    error once `deadline` (time.monotonic seconds) would pass, and `OutageTooLongError`
    once the outage has lasted `ride_out` seconds. With `wait_for_memory`, a write Redis
    refuses for memory is retried the same way (back-pressure: a command waits, it is not
    dropped); so is an append to a stream whose IDs another writer exhausted (`jammed`).
    Other errors propagate at once: retrying cannot fix them.
    """
    attempt = 0
    while True:
        try:
            result = op()
        except redis.ResponseError as exc:  # OutOfMemoryError is one
            refused = _refused(exc, wait_for_memory)
            if refused is None:
                raise
            full = refused == "is full"
            (link.full if full else link.jammed)(exc, what)
            attempt += 1
            if deadline is not None and time.monotonic() + cap > deadline:
                raise
            if stop.wait(backoff(attempt, cap=cap if full else min(cap, JAMMED_RETRY))):
                raise Stopped(f"stopped while {what} (Redis at {link.where} {refused})") from exc
            continue
        except UNAVAILABLE as exc:
            link.lost(exc, what)
            delay = backoff(attempt, cap=cap)
            attempt += 1
            if deadline is not None and time.monotonic() + delay > deadline:
                raise
            lasted = link.down_for()
            if ride_out is not None and lasted + delay > ride_out:
                raise OutageTooLongError(
                    f"Redis at {link.where} has been unreachable for {lasted:.0f} s while "
                    f"{what}, longer than this worker rides out ({ride_out:g} s, "
                    f"${ENV_RIDE_OUT}); check the server, or raise {ENV_RIDE_OUT} to wait longer"
                ) from exc
            if stop.wait(delay):
                raise Stopped(f"stopped while {what} (Redis at {link.where} unreachable)") from exc
            continue
        link.restored()
        return result


def _refused(exc: redis.ResponseError, wait_for_memory: bool) -> str | None:
    """Why Redis refused a write that waiting may fix (for the log line), or None."""
    if isinstance(exc, redis.OutOfMemoryError):
        return "is full" if wait_for_memory else None
    return "has a jammed stream" if jammed(exc) else None


def ride_out_of(value: float | None = None, env: Mapping[str, str] | None = None) -> float:
    """How long a worker rides out one Redis outage: `value` if given, else $COHORT_RIDE_OUT,
    else DEFAULT_RIDE_OUT; SettingsError naming a value that is not seconds > 0."""
    return seconds_of(value, ENV_RIDE_OUT, DEFAULT_RIDE_OUT, env)
