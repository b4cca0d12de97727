"""Riding out Redis outages: retry with capped, jittered backoff; log only when the link flips.

Every worker thread talks to Redis through `with_retry`, and they share one
`Link`, so an outage is one "lost" line and one "back" line, however many
threads notice it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

from cohort.events.connection import UNAVAILABLE, Client, backoff, where

from .errors import Stopped

T = TypeVar("T")


def describe(conn: Client) -> str:
    """Where `conn` points, for log lines (never includes a password)."""
    return where(conn)


class Link:
    """The health of one Redis connection as all of a worker's threads see it."""

    def __init__(self, log: logging.Logger, where: str) -> None:
        self.log = log
        self.where = where
        self._down = False
        self._reached = False  # some operation succeeded: a later failure loses a connection
        self._lock = threading.Lock()

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
        self.log.warning(
            "%s Redis at %s while %s (%s: %s); retrying with backoff",
            "lost the connection to" if self._reached else "cannot reach",
            self.where,
            what,
            type(exc).__name__,
            exc,
        )

    def restored(self) -> None:
        self._reached = True
        if not self._down:  # the common case, without taking the lock
            return
        with self._lock:
            if not self._down:
                return
            self._down = False
        self.log.warning("the connection to Redis at %s is back", self.where)


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
) -> T:
    """`op()`, retried on connection errors until it succeeds.

    Raises `Stopped` when `stop` is set while waiting, and the last connection
    error once `deadline` (time.monotonic seconds) would pass. Other errors
    propagate at once: retrying cannot fix them.
    """
    attempt = 0
    while True:
        try:
            result = op()
        except UNAVAILABLE as exc:
            link.lost(exc, what)
            delay = backoff(attempt, cap=cap)
            attempt += 1
            if deadline is not None and time.monotonic() + delay > deadline:
                raise
            if stop.wait(delay):
                raise Stopped(f"stopped while {what} (Redis at {link.where} unreachable)") from exc
            continue
        link.restored()
        return result
