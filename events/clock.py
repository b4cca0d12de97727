"""Time as an argument: loops take a Clock, pure code takes `now`."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from cohort.events.connection import Client


class Clock(Protocol):
    def now(self) -> float:
        """Wall-clock seconds since the epoch (facts are stamped with it)."""
        ...

    def monotonic(self) -> float:
        """Seconds from an arbitrary origin that never goes back (for intervals and leases)."""
        ...


class SystemClock:
    def now(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()


class ServerClock:
    """Redis's own clock (TIME): the clock that stamps stream entry IDs.

    The coordinator judges silence against it, so workers' and coordinators' clocks never
    matter; intervals still come from this host's monotonic clock.
    """

    def __init__(self, conn: Client) -> None:
        self.conn = conn

    def now(self) -> float:
        seconds, micros = self.conn.time()
        return seconds + micros / 1e6

    def monotonic(self) -> float:
        return time.monotonic()


class ManualClock:
    """A clock that moves only when told to: tests advance it instead of sleeping."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self._now = start
        self._mono = 0.0
        self._lock = threading.Lock()

    def now(self) -> float:
        with self._lock:
            return self._now

    def monotonic(self) -> float:
        with self._lock:
            return self._mono

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a clock cannot go back: advance({seconds!r})")
        with self._lock:
            self._now += seconds
            self._mono += seconds
