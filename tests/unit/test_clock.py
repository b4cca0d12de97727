"""The server clock reads Redis's TIME at most every `resync` seconds and carries it forward
on this host's monotonic clock in between (events/clock.py)."""

from __future__ import annotations

from typing import Any

import pytest

from cohort.events.clock import ManualClock, ServerClock


class _Server:
    """TIME from a clock of its own, counting how often it is asked."""

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self.asked = 0

    def time(self) -> tuple[int, int]:
        self.asked += 1
        now = self.clock.now()
        return int(now), round((now - int(now)) * 1e6)


def clocks() -> tuple[ManualClock, _Server, ServerClock]:
    host = ManualClock()
    server = _Server(ManualClock(start=1_800_000_000.0))
    conn: Any = server
    return host, server, ServerClock(conn, resync=0.25, monotonic=host.monotonic)


def test_time_is_read_once_per_resync_and_carried_forward_meanwhile() -> None:
    host, server, clock = clocks()
    assert clock.now() == pytest.approx(1_800_000_000.0)
    for _ in range(10):
        host.advance(0.02)
        server.clock.advance(0.02)
        assert clock.now() == pytest.approx(server.clock.now(), abs=1e-6)
    assert server.asked == 1
    host.advance(0.1)  # past the resync: TIME again
    server.clock.advance(0.1)
    assert clock.now() == pytest.approx(server.clock.now(), abs=1e-6)
    assert server.asked == 2


def test_a_server_clock_that_jumped_is_seen_at_the_next_resync() -> None:
    host, server, clock = clocks()
    clock.now()
    server.clock.advance(30.0)  # e.g. the server's clock was stepped (NTP)
    host.advance(0.1)
    assert clock.now() == pytest.approx(1_800_000_000.1)  # not yet: the last reading, carried
    host.advance(0.2)
    assert clock.now() == pytest.approx(1_800_000_030.0)
