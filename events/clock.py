"""Time as an argument: loops take a Clock, pure code takes `now`."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
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
    matter; intervals still come from this host's monotonic clock. TIME is read at most
    every `resync` seconds and carried forward by the monotonic clock in between (which
    drifts from it by microseconds over that): a leader's turn comes once per command
    batch, several per training step, and a round trip per turn was a third of its work.
    """

    def __init__(
        self, conn: Client, resync: float = 0.25, monotonic: Callable[[], float] = time.monotonic
    ) -> None:
        self.conn = conn
        self.resync = resync
        self._monotonic = monotonic
        self._read: tuple[float, float] | None = None
        """(monotonic, server) seconds at the last TIME."""

    def now(self) -> float:
        mono = self._monotonic()
        read = self._read
        if read is None or not 0 <= mono - read[0] < self.resync:
            seconds, micros = self.conn.time()
            read = self._read = (mono, seconds + micros / 1e6)
        return read[1] + (mono - read[0])

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
