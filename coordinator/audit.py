"""Audit of a journal: every sample of each epoch used by exactly one committed step of the
lineage the final model descends from, and every world started from the right weights.

Works from facts alone (invariant 3 of docs/design.md): the state before each
`StepCommitted` says which shard every rank held, so the committed batches can
be recomputed. Shards hold positions in each epoch's order; the check maps every used
position through its epoch's order (the one workers train with) and looks, in sample
space, for samples used twice and, for finished epochs, samples never used. With a
bijection that is the same as checking positions; done on samples, it also catches a
broken order. One pass per epoch, vectorised, in chunks: a bitmap of the data set's
size is the memory it takes.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cohort.coordinator.fold import evolve
from cohort.coordinator.refusals import Totals
from cohort.coordinator.state import JobState
from cohort.events.deal import batch, merge
from cohort.events.models import (
    AGENT_SUCCEEDED,
    CheckpointSaved,
    CommandsRefused,
    EpochFinished,
    Fact,
    InboxRepaired,
    RendezvousRound,
    Rewound,
    StepCommitted,
    WorkerFailed,
    WorkerLeft,
    WorldChanged,
)
from cohort.events.order import Order
from cohort.events.shards import Range

if TYPE_CHECKING:  # numpy loads when an audit runs
    import numpy as np

CHUNK = 1 << 20
"""Positions mapped at a time: bounds the audit's memory beside its bitmap."""

Batches = tuple[tuple[Range, ...], ...]
"""Every rank's batch of one committed step, by rank."""


@dataclass
class EpochAudit:
    """One epoch's exactly-once check. `duplicates` and `missing` are ranges of sample ids."""

    epoch: int
    finished: bool = False
    used: int = 0
    steps: int = 0
    duplicates: list[Range] = field(default_factory=list)
    missing: list[Range] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.duplicates and not self.missing


LAUNCHER_COVERS = (
    "membership only: the agents' joins, failures, leaves and rendezvous rounds; the "
    "workers trained with torch.distributed, which journals no steps, data or weights, so "
    "exactly-once data and the weights' lineage are not audited"
)


@dataclass
class LauncherAudit:
    """A torchrun job's record: rounds and how each agent of its last run ended."""

    rounds: int = 0
    runs: int = 0
    ended: dict[str, str] = field(default_factory=dict)
    """agent -> how it left the last run: its Leave reason, or "failed: " and why"""
    running: list[str] = field(default_factory=list)
    """Agents still members at the journal's end."""
    covers: str = LAUNCHER_COVERS

    @property
    def restarts(self) -> int:
        return self.rounds - self.runs

    def follow(self, fact: Fact, before: JobState, after: JobState) -> None:
        member = before.members.get(getattr(fact, "worker", ""))
        match fact:
            case RendezvousRound():
                self.rounds += 1
                if after.counters.runs > before.counters.runs:
                    self.runs += 1
                    self.ended = {}
            case WorkerLeft() if member is not None and member.role == "agent":
                self.ended[fact.worker] = fact.reason
            case WorkerFailed() if member is not None and member.role == "agent":
                self.ended[fact.worker] = f"failed: {fact.reason}"

    def problems(self) -> list[str]:
        """A run that ended with no agent whose workers succeeded."""
        if self.running or not self.ended or AGENT_SUCCEEDED in self.ended.values():
            return []
        how = "; ".join(f"{agent}: {reason}" for agent, reason in sorted(self.ended.items()))
        return [f"the last torchrun run ended with no agent whose workers succeeded ({how})"]


@dataclass
class Audit:
    epochs: dict[int, EpochAudit] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    rewinds: list[tuple[int, int, str]] = field(default_factory=list)
    """(from_step, to_step, source) of each rewind: steps after to_step left the lineage."""
    refused: Totals = field(default_factory=Totals)
    """Inbox entries the leaders dead-lettered, by sender and kind: evidence of a hostile or
    broken sender, listed beside the verdict (they change no training)."""
    repairs: list[InboxRepaired] = field(default_factory=list)
    """Every time a leader put the inbox back in order."""
    launcher: LauncherAudit | None = None
    """A torchrun job's record (None for a job cohort trains): what the audit covers."""

    @property
    def discarded(self) -> int:
        """Committed steps rewinds took off the lineage."""
        return sum(frm - to for frm, to, _ in self.rewinds)

    @property
    def steps(self) -> int:
        """Committed steps on the lineage the final model descends from: a job's length,
        where the journal's counters also count the steps rewinds discarded."""
        return sum(e.steps for e in self.epochs.values())

    @property
    def epochs_finished(self) -> int:
        """Epochs that lineage finished (an epoch finished again after a rewind counts once)."""
        return sum(e.finished for e in self.epochs.values())

    @property
    def ok(self) -> bool:
        return not self.problems and all(e.ok for e in self.epochs.values())


def _exactly_once(
    order: Order, used: Sequence[Range], finished: bool
) -> tuple[list[Range], list[Range], int]:
    """Samples of `used` positions seen twice, samples never seen (if `finished`), and how
    many positions fell outside the epoch or mapped outside the data set."""
    import numpy as np

    size = order.size
    inside = [(start, min(stop, size)) for start, stop in used if start < size]
    outside = sum(stop - start for start, stop in used) - sum(b - a for a, b in inside)
    seen = np.zeros(size, dtype=bool)
    twice: list[np.ndarray] = []
    for chunk in _chunks(inside, CHUNK):
        samples = order.samples(chunk)
        valid = (samples >= 0) & (samples < size)
        outside += int(samples.size - valid.sum())
        samples = np.sort(samples[valid])
        twice.append(samples[1:][samples[1:] == samples[:-1]])  # twice within the chunk
        twice.append(samples[seen[samples]])  # seen in an earlier chunk
        seen[samples] = True
    duplicates = _runs(np.unique(np.concatenate(twice))) if twice else []
    missing = _runs(np.flatnonzero(~seen)) if finished else []
    return duplicates, missing, outside


def _chunks(ranges: Iterable[Range], size: int) -> Iterator[list[Range]]:
    """`ranges` cut into lists of at most `size` positions, in order."""
    chunk: list[Range] = []
    room = size
    for start, stop in ranges:
        while start < stop:
            end = min(stop, start + room)
            chunk.append((start, end))
            room -= end - start
            start = end
            if room == 0:
                yield chunk
                chunk, room = [], size
    if chunk:
        yield chunk


def _runs(ids: np.ndarray) -> list[Range]:
    """Sorted distinct ids as half-open ranges of consecutive ones."""
    import numpy as np

    if not ids.size:
        return []
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = ids[np.concatenate(([0], breaks))]
    stops = ids[np.concatenate((breaks - 1, [ids.size - 1]))] + 1
    return list(zip(starts.tolist(), stops.tolist(), strict=True))


def committed_batches(
    facts: Iterable[Fact], state: JobState | None = None
) -> Iterator[tuple[Fact, JobState, Batches | None]]:
    """Each fact with the state before it and, for a StepCommitted, every rank's batch.

    The global batch of a committed step is the union of its ranks' batches: what a
    single process training on the same data would have used at that step.
    """
    state = JobState() if state is None else state
    for fact in facts:
        batches = None
        if isinstance(fact, StepCommitted) and state.config is not None:
            config, shards = state.config, state.shards
            batches = tuple(
                batch(config, shards, rank, state.base_step, fact.step)
                for rank in range(len(shards))
            )
        yield fact, state, batches
        state = evolve(state, fact)


@dataclass
class _Lineage:
    """What the lineage the final model descends from holds so far, as the journal is read.

    A rewind takes the steps after its target off it: their samples count as unused again.
    """

    used: dict[int, tuple[int, list[Range]]] = field(default_factory=dict)
    """step -> (epoch, ranges its ranks trained on)"""
    finished: dict[int, int] = field(default_factory=dict)
    """epoch -> the step that finished it"""
    digests: dict[int, str | None] = field(default_factory=dict)
    """step -> the agreed weights digest"""

    def commit(self, step: int, epoch: int, batches: Batches, digest: str | None) -> None:
        self.used[step] = (epoch, [r for rank in batches for r in rank])
        self.digests[step] = digest

    def rewind(self, to_step: int) -> None:
        for step in [s for s in self.used if s > to_step]:
            del self.used[step]
            self.digests.pop(step, None)
        for epoch in [e for e, step in self.finished.items() if step > to_step]:
            del self.finished[epoch]

    def by_epoch(self) -> tuple[dict[int, list[Range]], Counter[int]]:
        """Each epoch's used ranges and how many committed steps used them."""
        ranges: dict[int, list[Range]] = defaultdict(list)
        steps: Counter[int] = Counter()
        for epoch, used in self.used.values():
            ranges[epoch].extend(used)
            steps[epoch] += 1
        return ranges, steps


def audit(
    facts: Iterable[Fact],
    start: JobState | None = None,
    order_of: Callable[[JobState, int], Order] = JobState.order,
) -> Audit:
    """Check invariants 2, 3 and 9 of docs/design.md over `facts` (from the journal's start).

    Exactly-once is checked in sample space, each epoch's positions mapped through
    `order_of(state, epoch)` (the job's own orders; a test passes a broken one), on the
    lineage the final model descends from: a rewind takes the steps after its target off
    it (they are listed in `rewinds`, not hidden), and their samples count as unused
    again. Every world must start from the weights of the last committed step (a
    surviving holder's), or a rewind's checkpoint, or the initial weights before any
    commit.
    """
    report = Audit()
    lineage, launcher = _Lineage(), LauncherAudit()
    state = JobState() if start is None else start
    for fact, before, batches in committed_batches(facts, start):
        report.problems.extend(_follow(lineage, report, fact, before, batches))
        state = evolve(before, fact)
        launcher.follow(fact, before, state)
    _audit_epochs(report, lineage, state, order_of)
    agents = [w for w, m in state.members.items() if m.role == "agent"]
    if not state.started and (agents or launcher.rounds or launcher.ended):
        launcher.running = sorted(agents)
        report.launcher = launcher
        report.problems.extend(launcher.problems())
    return report


def _follow(
    lineage: _Lineage, report: Audit, fact: Fact, before: JobState, batches: Batches | None
) -> list[str]:
    """Take `fact` into `lineage` (a rewind also into `report`); what it shows wrong."""
    match fact:
        case StepCommitted() if batches is not None:
            lineage.commit(fact.step, before.epoch, batches, fact.digest)
        case EpochFinished():
            lineage.finished[fact.epoch] = fact.step
        case WorldChanged():
            return _world_problems(fact, before)
        case CheckpointSaved():
            return _checkpoint_problems(fact, lineage.digests.get(fact.step))
        case Rewound():
            report.rewinds.append((fact.from_step, fact.to_step, fact.source))
            lineage.rewind(fact.to_step)
        case CommandsRefused():
            report.refused.add(fact)
        case InboxRepaired():
            report.repairs.append(fact)
    return []


def _world_problems(world: WorldChanged, before: JobState) -> list[str]:
    """Why `world` breaks the order of worlds and epochs, or its weights' lineage."""
    problems = []
    if world.version <= before.world_version:
        problems.append(f"world version went from {before.world_version} to {world.version}")
    if world.epoch < before.epoch:
        problems.append(f"epoch went back from {before.epoch} to {world.epoch}")
    return problems + _lineage_problems(world, before)


def _checkpoint_problems(saved: CheckpointSaved, committed: str | None) -> list[str]:
    """Why `saved` does not hold the weights its step committed (empty if it does)."""
    if saved.digest and committed and saved.digest != committed:
        return [
            f"checkpoint of step {saved.step} has weights {saved.digest}, but the "
            f"step committed {committed}"
        ]
    return []


def _audit_epochs(
    report: Audit,
    lineage: _Lineage,
    state: JobState,
    order_of: Callable[[JobState, int], Order],
) -> None:
    """Fill `report.epochs` from the lineage: what each epoch used, and exactly-once."""
    by_epoch, steps = lineage.by_epoch()
    for epoch in sorted(set(by_epoch) | set(lineage.finished)):
        entry = report.epochs.setdefault(epoch, EpochAudit(epoch))
        entry.finished = epoch in lineage.finished
        entry.steps = steps[epoch]
        joined = merge(sorted(by_epoch[epoch]))  # overlaps stay: merge joins touching ones
        entry.used = sum(stop - start for start, stop in joined)
        if state.config is None or state.dataset is None:
            continue
        order = order_of(state, epoch)
        entry.duplicates, entry.missing, outside = _exactly_once(order, joined, entry.finished)
        if outside:
            report.problems.append(
                f"epoch {epoch}: {outside} positions fall outside it or map outside the "
                f"data set [0, {order.size})"
            )


def _lineage_problems(world: WorldChanged, before: JobState) -> list[str]:
    """Why `world` does not start from the last committed weights (empty if it does)."""
    weights = world.weights
    if weights is None or not world.ranks:
        return []  # a v1 world says nothing of its weights; a world of no rank trains nothing
    where = f"world {world.version}"
    if weights.step != before.last_committed:
        return [
            f"{where} starts from the weights of step {weights.step}, but step "
            f"{before.last_committed} was the last committed"
        ]
    if weights.source == "rank":
        if world.ranks[0] not in before.holders:
            return [f"{where}: its rank 0 {world.ranks[0]!r} does not hold the weights"]
        if weights.digest != before.last_digest:
            return [f"{where} starts from weights {weights.digest}, not {before.last_digest}"]
        return []
    if weights.source == "initial" and before.restart is None:
        return []  # before any commit (the step check above holds it to -1)
    if before.restart is None or before.restart.source != weights.source:
        return [f"{where} starts from {weights.source} weights without a rewind to them"]
    if before.restart.uri != weights.uri:
        return [f"{where} loads {weights.uri}, but the rewind named {before.restart.uri}"]
    return []
