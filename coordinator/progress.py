"""How far the job is and when it ends: steps per second, epoch progress and the time left.

`progress(state, now)` is pure. Its rate comes from the journaled `at` of the last
commits (`JobState.commits`, the leader's clock), never from sampling a clock here and
there, so `cohort status`, `cohort replay` and every coordinator's metrics agree; `now`
only says how long ago the last step committed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cohort.coordinator.state import JobState
from cohort.events import deal


@dataclass(frozen=True, slots=True)
class Progress:
    steps_per_second: float | None
    """Commits per second over the last commits of uninterrupted training (None: fewer
    than two since the last pause or rewind)."""
    epoch_progress: float | None
    """Fraction in [0, 1] of the current epoch's samples that committed steps used."""
    steps_left: int | None
    """Steps until the job's configured length (None: no length, or none can be counted
    yet); 0 once finished."""
    eta_seconds: float | None
    """Seconds until the job's end at `steps_per_second` (None: unknown, or paused)."""
    since_commit: float | None
    """Seconds since the last commit of the window (None: none since training last paused
    or rewound)."""

    def body(self) -> dict[str, float | int | None]:
        return {
            "steps_per_second": self.steps_per_second,
            "epoch_progress": self.epoch_progress,
            "steps_left": self.steps_left,
            "eta_seconds": self.eta_seconds,
            "since_commit": self.since_commit,
        }


def progress(state: JobState, now: float) -> Progress:
    """The job's progress as of `now` (seconds, the clock that stamped the facts)."""
    rate = steps_per_second(state)
    left = steps_left(state)
    since = max(0.0, now - state.commits[-1][1]) if state.commits else None
    return Progress(rate, epoch_progress(state), left, _eta(state, rate, left, now), since)


def steps_per_second(state: JobState) -> float | None:
    """Commits over the time they took, in the recent window."""
    if len(state.commits) < 2:
        return None
    span = state.commits[-1][1] - state.commits[0][1]
    return (len(state.commits) - 1) / span if span > 0 else None


def _samples_per_step(state: JobState) -> int:
    assert state.config is not None
    return sum(deal.counts(state.config, len(state.ranks)))


def _epoch_left(state: JobState) -> int | None:
    """Positions of the current epoch no committed step used (None: not known yet)."""
    if state.config is None or state.dataset is None or not state.started:
        return None
    rest = deal.leftover(
        state.config, state.shards, state.base_step, state.next_step, state.unassigned
    )
    return sum(stop - start for start, stop in rest)


def epoch_progress(state: JobState) -> float | None:
    left = _epoch_left(state)
    if left is None or state.dataset is None:
        return None
    return min(1.0, max(0.0, 1 - left / state.dataset.size))


def steps_left(state: JobState) -> int | None:
    """Steps to the configured end: the nearer of `max_steps` and `epochs`."""
    config = state.config
    if config is None:
        return None
    if state.finished:
        return 0
    candidates: list[int] = []
    if config.max_steps is not None:
        candidates.append(max(0, config.max_steps - state.next_step))
    if config.epochs is not None:
        by_epochs = _steps_for_epochs(state, config.epochs)
        if by_epochs is not None:
            candidates.append(by_epochs)
    return min(candidates) if candidates else None


def _steps_for_epochs(state: JobState, epochs: int) -> int | None:
    """Steps the rest of this epoch and the epochs after it take at the current world's
    samples per step (None: no world to count by)."""
    left, per_step = _epoch_left(state), _samples_per_step(state) if state.ranks else 0
    if left is None or per_step == 0 or state.dataset is None:
        return None
    whole = math.ceil(state.dataset.size / per_step)
    return math.ceil(left / per_step) + max(0, epochs - state.epoch - 1) * whole


def _eta(state: JobState, rate: float | None, left: int | None, now: float) -> float | None:
    if left == 0:
        return 0.0
    if rate is None or left is None or state.paused or not state.commits:
        return None
    return max(0.0, state.commits[-1][1] + left / rate - now)
