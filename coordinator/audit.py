"""Audit of a journal: every sample of each epoch used by exactly one committed step.

Works from facts alone (DESIGN.md invariant 3): the state before each
`StepCommitted` says which shard every rank held, so the committed batches can
be recomputed and checked for overlaps (a sample used twice) and, for finished
epochs, gaps (a sample never used).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from cohort.events.models import EpochFinished, Fact, StepCommitted, WorldChanged
from cohort.events.shards import Range

from .fold import evolve
from .shards import batch, merge
from .state import JobState


@dataclass
class EpochAudit:
    epoch: int
    finished: bool = False
    used: int = 0
    steps: int = 0
    duplicates: list[Range] = field(default_factory=list)
    missing: list[Range] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.duplicates and not self.missing


@dataclass
class Audit:
    epochs: dict[int, EpochAudit] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and all(e.ok for e in self.epochs.values())


def _overlaps_and_gaps(ranges: list[Range], size: int | None) -> tuple[list[Range], list[Range]]:
    dupes: list[Range] = []
    gaps: list[Range] = []
    pos = 0
    for start, stop in sorted(ranges):
        if start < pos:
            dupes.append((start, min(stop, pos)))
        elif start > pos and size is not None:
            gaps.append((pos, start))
        pos = max(pos, stop)
    if size is not None and pos < size:
        gaps.append((pos, size))
    return list(merge(dupes)), list(merge(gaps))


def committed_batches(
    facts: Iterable[Fact], state: JobState | None = None
) -> Iterator[tuple[Fact, JobState, tuple[tuple[Range, ...], ...] | None]]:
    """Each fact with the state before it and, for a StepCommitted, every rank's batch.

    The global batch of a committed step is the union of its ranks' batches: what a
    single process training on the same data would have used at that step.
    """
    state = JobState() if state is None else state
    for fact in facts:
        batches = None
        if isinstance(fact, StepCommitted) and state.config is not None:
            size = state.config.batch_size
            batches = tuple(batch(s, state.base_step, fact.step, size) for s in state.shards)
        yield fact, state, batches
        state = evolve(state, fact)


def audit(facts: Iterable[Fact], start: JobState | None = None) -> Audit:
    """Check invariants 2 and 3 over `facts` (from the start of the journal)."""
    used: dict[int, list[Range]] = defaultdict(list)
    report = Audit()
    state = JobState() if start is None else start
    for fact, before, batches in committed_batches(facts, start):
        match fact:
            case StepCommitted() if batches is not None:
                for rank_batch in batches:
                    used[before.epoch].extend(rank_batch)
                report.epochs.setdefault(before.epoch, EpochAudit(before.epoch)).steps += 1
            case EpochFinished():
                report.epochs.setdefault(fact.epoch, EpochAudit(fact.epoch)).finished = True
            case WorldChanged():
                if fact.version <= before.world_version:
                    report.problems.append(
                        f"world version went from {before.world_version} to {fact.version}"
                    )
                if fact.epoch < before.epoch:
                    report.problems.append(f"epoch went back from {before.epoch} to {fact.epoch}")
        state = evolve(before, fact)
    dataset = state.config.dataset_size if state.config else None
    for epoch, ranges in used.items():
        entry = report.epochs.setdefault(epoch, EpochAudit(epoch))
        entry.used = sum(stop - start for start, stop in ranges)
        dupes, gaps = _overlaps_and_gaps(ranges, dataset if entry.finished else None)
        entry.duplicates, entry.missing = dupes, gaps
    return report
