"""A run's facts as lines a person reads: runs of commits folded into one, membership kept.

A healthy job journals one StepCommitted per step, so a plain list of facts is mostly
commits and the joins, failures and world changes scroll out of sight. `lines` folds each
run of consecutive commits into one line ("steps 120–340 committed"); `recent` keeps the
last lines and every membership line before them, so a failure is never cut off.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from cohort.coordinator.replay import fact_details
from cohort.events.models import (
    Fact,
    JoinRefused,
    SparePromoted,
    StepCommitted,
    WorkerActivated,
    WorkerFailed,
    WorkerJoined,
    WorkerLeaving,
    WorkerLeft,
    WorldChanged,
)

MEMBERSHIP = (
    WorkerJoined,
    JoinRefused,
    WorkerActivated,
    SparePromoted,
    WorkerLeaving,
    WorkerLeft,
    WorkerFailed,
    WorldChanged,
)
"""Facts that change who is in the job: never dropped from a shortened timeline."""


@dataclass(frozen=True)
class Line:
    """One line of a timeline: a fact, or a run of commits (`entry_id` and `at`: its first)."""

    entry_id: str
    at: float
    type: str
    text: str
    membership: bool = False


class Folder:
    """Builds `lines` a fact at a time, for readers that walk the facts once for many uses."""

    def __init__(self) -> None:
        self.lines: list[Line] = []
        self._run: list[tuple[str, StepCommitted]] = []

    def add(self, entry_id: str, fact: Fact) -> None:
        if isinstance(fact, StepCommitted):
            self._run.append((entry_id, fact))
            return
        self._close_run()
        name, member = type(fact).__name__, isinstance(fact, MEMBERSHIP)
        self.lines.append(Line(entry_id, fact.at, name, fact_details(fact), member))

    def done(self) -> list[Line]:
        """Every line, the last run of commits included."""
        self._close_run()
        return self.lines

    def _close_run(self) -> None:
        if self._run:
            self.lines.append(_commits(self._run))
            self._run = []


def lines(facts: Iterable[tuple[str, Fact]]) -> list[Line]:
    """One line per fact, each run of consecutive StepCommitted folded into one."""
    folder = Folder()
    for entry_id, fact in facts:
        folder.add(entry_id, fact)
    return folder.done()


def _commits(run: Sequence[tuple[str, StepCommitted]]) -> Line:
    entry_id, first = run[0]
    if len(run) == 1:
        return Line(entry_id, first.at, "StepCommitted", fact_details(first))
    last = run[-1][1]
    worlds = sorted({c.world for _, c in run})
    where = f"world {worlds[0]}" if len(worlds) == 1 else f"worlds {worlds[0]}–{worlds[-1]}"
    return Line(
        entry_id,
        first.at,
        "StepCommitted",
        f"steps {first.step}–{last.step} committed ({len(run)} commits, {where})",
    )


def recent(timeline: Sequence[Line], limit: int) -> list[Line]:
    """The last `limit` lines, and every membership line before them, in order."""
    cut = max(0, len(timeline) - limit)
    return [line for line in timeline[:cut] if line.membership] + list(timeline[cut:])


def failures_said(failures: list[WorkerFailed], finished: bool, named: int = 3) -> str:
    """The failures of a run for its summary, each as journaled (WorkerFailed.reason), the
    first `named` by worker: "survived" only when the job finished after them (the summary
    already says that a job did not finish)."""
    if not failures:
        return "no failures"
    said = "; ".join(f"{f.worker} {f.reason}" for f in failures[:named])
    more = f"; and {len(failures) - named} more" if len(failures) > named else ""
    outcome = " survived" if finished else ""
    return f"{len(failures)} failure(s){outcome} ({said}{more})"
