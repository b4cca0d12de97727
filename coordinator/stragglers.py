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


def _streak(seen: Liveness, worker: str, last_step: int, steps: int, factor: float) -> bool | None:
    """True if slow in each of the last `steps` steps, False if fast in each, None if mixed."""
    verdicts = set()
    for step in range(last_step - steps + 1, last_step + 1):
        pair = seen.step_time_ratio(worker, step)
        if pair is None:
            return None
        mine, middle = pair
        verdicts.add(mine > factor * middle and mine > 0)
        if len(verdicts) > 1:
            return None
    return verdicts.pop() if verdicts else None


def changes(
    state: JobState, seen: Liveness, step: int, config: JobConfig
) -> Iterator[tuple[str, bool, float, float]]:
    """(worker, now_straggling, its time, median) for each rank whose flag should flip at `step`."""
    for worker in state.ranks:
        member = state.members.get(worker)
        if member is None:
            continue
        slow = _streak(seen, worker, step, config.straggler_steps, config.straggler_factor)
        if slow is None or slow == member.straggler:
            continue
        mine, middle = seen.step_time_ratio(worker, step) or (0.0, 0.0)
        yield worker, slow, mine, middle
