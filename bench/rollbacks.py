"""What a Redis failover took back from a job's journal, who had acted on it, and whether the
journal left holds what every worker did.

Pure functions over what a chaos run recorded: every fact its observer read (by journal ID,
before and after failovers), the journal as the last primary holds it, the StepDones the
workers sent (by inbox ID), and the processes' logs.

A worker acts on a fact when it sends a report that only that fact allows: a StepDone for a
step after a commit (it applied the next step on top of the committed one), a StepDone in a
world (it trained as one of that world's ranks). A rolled-back fact was acted on if such a
report came after the fact and before the final journal decided the same thing again (the
commit of that step, the world of that version); reports after that rest on the new fact.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from cohort.events.models import Fact, StepCommitted, StepDone, WeightsDiverged, WorldChanged
from cohort.events.streams import id_key

Report = tuple[str, StepDone]
"""A StepDone and its inbox entry ID."""

WORKER_NOTICED = re.compile(r"lost entry (\S+) and later ones")
"""What a worker logs when the journal no longer holds the entry it folded up to
(worker/membership/following.py)."""
COORDINATOR_NOTICED = re.compile(r"no longer holds entry (\S+), which \S+ had folded")
"""What a coordinator logs then (coordinator/service.py); a leader adds "stepping down"."""
LEADER_STEPPED_DOWN = "and stepping down"


@dataclass(frozen=True)
class RolledBack:
    """A fact the observer read that the final journal does not hold (under its ID)."""

    entry: str
    fact: Fact
    acted_on_by: tuple[str, ...]
    """Workers whose reports rested on it (see the module docstring)."""


def rolled_back(
    seen: Mapping[str, Fact], final: Sequence[tuple[str, Fact]], reports: Sequence[Report]
) -> list[RolledBack]:
    """Every fact of `seen` that `final` does not hold, with who acted on it."""
    held = dict(final)
    gone = []
    for entry, fact in seen.items():
        if held.get(entry) == fact:
            continue
        again = _decided_again(entry, fact, final)
        actors = {
            report.worker
            for at, report in reports
            if id_key(entry) < id_key(at)
            and (again is None or id_key(at) < id_key(again))
            and _rests_on(report, fact)
        }
        gone.append(RolledBack(entry, fact, tuple(sorted(actors))))
    return gone


def _rests_on(report: StepDone, fact: Fact) -> bool:
    if isinstance(fact, StepCommitted):
        return report.step > fact.step
    if isinstance(fact, WorldChanged):
        return report.world == fact.version
    return False


def _decided_again(entry: str, fact: Fact, final: Sequence[tuple[str, Fact]]) -> str | None:
    """The ID of the first fact of `final` after `entry` that decides what `fact` did: the
    commit of the same step, the world of the same version (None: none does)."""
    decides = _decision(fact)
    if decides is None:
        return None
    for at, other in final:
        if id_key(at) > id_key(entry) and _decision(other) == decides:
            return at
    return None


def _decision(fact: Fact) -> tuple[str, int] | None:
    """What `fact` decides, where a worker acts on it: ("step", s), ("world", v)."""
    if isinstance(fact, StepCommitted):
        return ("step", fact.step)
    if isinstance(fact, WorldChanged):
        return ("world", fact.version)
    return None


def disagreeing(final: Sequence[tuple[str, Fact]], reports: Sequence[Report]) -> list[Report]:
    """Reports whose weights digest is not the one the final journal committed for their
    step in their world: a worker whose weights left the journal's lineage."""
    committed = {
        (f.step, f.world): f.digest
        for _, f in final
        if isinstance(f, StepCommitted) and f.digest is not None
    }
    return [
        (at, r)
        for at, r in reports
        if r.digest is not None and committed.get((r.step, r.world), r.digest) != r.digest
    ]


def diverged(final: Iterable[tuple[str, Fact]]) -> int:
    """How many times the leader saw the ranks of a world hold different weights."""
    return sum(1 for _, f in final if isinstance(f, WeightsDiverged))


@dataclass(frozen=True)
class Noticed:
    """Which processes logged that the journal lost an entry they had folded."""

    coordinators: dict[str, list[str]]
    """Coordinator -> the entries (journal IDs) it had folded and found gone."""
    workers: dict[str, list[str]]
    leaders: int
    """Times a leader found its own folded entries gone (and stepped down)."""

    @property
    def entries(self) -> set[str]:
        """Every lost entry some process had folded."""
        found = [*self.coordinators.values(), *self.workers.values()]
        return {entry for entries in found for entry in entries}


def noticed(coordinator_logs: Mapping[str, str], worker_logs: Mapping[str, str]) -> Noticed:
    """What each process's log says it noticed (logs by process name)."""
    coordinators = _found(coordinator_logs, COORDINATOR_NOTICED)
    leaders = sum(
        1
        for log in coordinator_logs.values()
        for line in log.splitlines()
        if COORDINATOR_NOTICED.search(line) and LEADER_STEPPED_DOWN in line
    )
    return Noticed(coordinators, _found(worker_logs, WORKER_NOTICED), leaders)


def _found(logs: Mapping[str, str], pattern: re.Pattern[str]) -> dict[str, list[str]]:
    found = {name: pattern.findall(log) for name, log in logs.items()}
    return {name: entries for name, entries in found.items() if entries}
