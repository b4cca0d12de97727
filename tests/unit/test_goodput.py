"""The goodput benchmark counts only steps that reach the final model (bench/goodput.py).

Its runs take minutes, so the counting is specified here on made-up timelines; the
benchmark itself runs in `python -m bench --only goodput`.
"""

from __future__ import annotations

import pytest

from bench.goodput import Run, _periods, committed_between, progress_at


def test_a_restart_from_a_checkpoint_takes_back_the_steps_since_it() -> None:
    # steps 1..5 done, a kill, the restart resumes from the checkpoint at 3 and redoes 4, 5
    points = [(1.0, 1), (2.0, 2), (3.0, 3), (4.0, 4), (5.0, 5), (9.0, 4), (10.0, 5), (11.0, 6)]
    assert progress_at(points, 0.5) == 0
    assert progress_at(points, 5.0) == 5
    assert progress_at(points, 9.5) == 4  # back to the checkpoint and one step on
    assert progress_at(points, 11.0) - progress_at(points, 5.0) == 1  # only step 6 is new


def test_committed_steps_count_in_the_window_they_were_committed_in() -> None:
    times = [0.5, 1.0, 1.5, 2.0, 2.5]
    assert committed_between(times, 1.0, 2.0) == 2  # 1.0 and 1.5; 2.0 is the next window's
    assert committed_between(times, 3.0, 4.0) == 0


class Timeline:
    """A side that trains a step every 0.1 s of a fake clock, and stops for `outage` s
    after each kill (the fake clock moves 0.1 s per poll)."""

    def __init__(self, outage: float) -> None:
        self.clock = 100.0
        self.outage = outage
        self.resume_at = 0.0
        self.times: list[float] = []
        self.kills: list[float] = []

    def now(self) -> float:
        return self.clock

    def poll(self) -> None:
        self.clock = round(self.clock + 0.1, 6)
        if self.clock >= self.resume_at:
            self.times.append(self.clock)

    def kill(self, _: int) -> None:
        self.kills.append(self.clock)
        self.resume_at = self.clock + self.outage


def run(outage: float) -> Run:
    side = Timeline(outage)
    return _periods(
        side.now, 10, 20, 3, side.times, side.poll, side.kill,
        counted=committed_between,
        outage=lambda times, at: min(t for t in times if t > at) - at,
    )  # fmt: skip


def test_goodput_is_the_rate_over_the_periods_against_the_failure_free_rate() -> None:
    got = run(outage=4.0)
    assert got.failure_free == pytest.approx(10.0, rel=0.02)  # a step per 0.1 s
    assert got.seconds == pytest.approx(60.0, abs=0.2)  # three periods of 20 s
    # each period loses its first 4 s: 16 of every 20 s count
    assert got.goodput == pytest.approx(16 / 20, abs=0.02)
    assert got.outages == pytest.approx([4.0, 4.0, 4.0], abs=0.11)


def test_a_side_that_never_stops_has_a_goodput_of_one() -> None:
    assert run(outage=0.0).goodput == pytest.approx(1.0, abs=0.02)


def test_with_a_window_after_the_failure_free_rate_is_the_mean_of_both() -> None:
    # a machine that slows from a step per 0.1 s to one per 0.125 s once the first window ends
    side = Timeline(outage=0.0)
    kept: list[float] = []

    def slowing_poll() -> None:
        side.poll()
        if side.times and side.times[-1] > 110.05 and len(kept) % 5 == 4:
            side.times.pop()  # one step in five not done: 8 steps/s
        kept.append(side.clock)

    got = _periods(
        side.now, 10, 20, 1, side.times, slowing_poll, side.kill,
        counted=committed_between, outage=lambda times, at: 0.0, free_after=True,
    )  # fmt: skip
    assert got.free_windows == pytest.approx((10.0, 8.0), rel=0.03)
    assert got.failure_free == pytest.approx(9.0, rel=0.03)
    assert got.goodput == pytest.approx(8.0 / 9.0, rel=0.03)  # the drift is not the kill's
