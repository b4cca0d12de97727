"""Stragglers: a rank whose step time stays well above the world's median.

A rank is a straggler once its time exceeded `straggler_factor` x the median
of its world's times in each of the last `straggler_steps` committed steps, and
stops being one after as many steps at or under that bound. One slow step is
noise; several in a row is a slow machine. Requiring the same streak to clear
as to detect is the hysteresis that keeps the flag from flapping.
"""

from __future__ import annotations

from collections.abc import Iterator

from cohort.coordinator.liveness import Liveness
from cohort.coordinator.state import JobState
from cohort.events.models import JobConfig


def _slow(mine: float | None, middle: float, factor: float) -> bool | None:
    """Whether a time is over the bound (None: the rank reported no time for that step)."""
    return None if mine is None else mine > factor * middle and mine > 0


def changes(
    state: JobState, seen: Liveness, step: int, config: JobConfig
) -> Iterator[tuple[str, bool, float, float]]:
    """(worker, now_straggling, its time, median) for each rank whose flag should flip at `step`.

    Each step's times and median are looked up once for the whole world, and a rank whose
    time at `step` agrees with its flag is passed over at once: a streak that flips the flag
    ends with a step that disagrees with it (one commit looks at every rank)."""
    window = [seen.timed(s) for s in range(step - config.straggler_steps + 1, step + 1)]
    if not window or any(timed is None for timed in window):
        return  # a step of the window with fewer than two times: no rank has a streak
    steps = [timed for timed in window if timed is not None]
    factor = config.straggler_factor
    times, middle = steps[-1]
    for worker in state.ranks:
        member = state.members.get(worker)
        slow = _slow(times.get(worker), middle, factor)
        if member is None or slow is None or slow == member.straggler:
            continue
        if all(_slow(other.get(worker), median, factor) is slow for other, median in steps):
            yield worker, slow, times[worker], middle
