"""evolve(state, fact) -> state: the one place state changes, one branch per fact type."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from events.models import (
    EpochFinished,
    EpochStarted,
    Fact,
    GpuAdviceCleared,
    GpuAdviceIssued,
    JobConfigured,
    JoinRefused,
    LeaderElected,
    StepCommitted,
    StragglerCleared,
    StragglerDetected,
    TrainingPaused,
    TrainingResumed,
    WeightsDiverged,
    WorkerActivated,
    WorkerFailed,
    WorkerJoined,
    WorkerLeaving,
    WorkerLeft,
    WorkerSynced,
    WorldChanged,
)
from events.shards import Shard

from .state import Counters, JobState, Member


def _member(state: JobState, worker: str, **changes: object) -> JobState:
    old = state.members.get(worker)
    if old is None:  # a fact about a worker that already left: nothing to change
        return state
    return replace(state, members={**state.members, worker: replace(old, **changes)})  # type: ignore[arg-type]


def _gone(state: JobState, worker: str, **count: int) -> JobState:
    """A member left or failed: it goes, with its GPU advice."""
    return replace(
        state,
        members={w: m for w, m in state.members.items() if w != worker},
        advice=frozenset(key for key in state.advice if key[0] != worker),
        counters=_count(state.counters, **count),
    )


def _count(counters: Counters, **inc: int) -> Counters:
    return replace(counters, **{k: getattr(counters, k) + v for k, v in inc.items()})


def evolve(state: JobState, fact: Fact) -> JobState:
    """The state after `fact`. Pure; unknown facts cannot reach here (the codec rejects them)."""
    state = replace(state, facts=state.facts + 1)
    match fact:
        case JobConfigured():
            return replace(state, job=fact.job, config=fact.config)
        case LeaderElected():
            return replace(
                state,
                leader=fact.coordinator,
                leader_epoch=fact.epoch,
                counters=_count(state.counters, elections=1),
            )
        case WorkerJoined():
            member = Member(fact.worker, "syncing", fact.at, fact.host, fact.pid)
            return replace(
                state,
                members={**state.members, fact.worker: member},
                counters=_count(state.counters, joined=1),
            )
        case JoinRefused():
            return replace(state, counters=_count(state.counters, refused=1))
        case WorkerSynced():
            return _member(state, fact.worker, status="ready", synced_step=fact.step)
        case WorkerActivated():
            return _member(state, fact.worker, status="active")
        case WorkerLeaving():
            return _member(state, fact.worker, status="draining", leave_after=fact.after_step)
        case WorkerLeft():
            return _gone(state, fact.worker, left=1)
        case WorkerFailed():
            return _gone(state, fact.worker, failed=1)
        case WorldChanged():
            return replace(
                state,
                world_version=fact.version,
                ranks=fact.ranks,
                shards=fact.shards,
                unassigned=fact.unassigned,
                base_step=fact.start_step,
                epoch=fact.epoch,
                started=True,
                counters=_count(state.counters, world_changes=1),
            )
        case StepCommitted():
            return replace(
                state,
                last_committed=fact.step,
                counters=_count(state.counters, steps_committed=1),
            )
        case WeightsDiverged():
            return replace(state, counters=_count(state.counters, divergences=1))
        case EpochFinished():
            return replace(state, counters=_count(state.counters, epochs_finished=1))
        case EpochStarted():
            return replace(
                state,
                epoch=fact.epoch,
                base_step=fact.start_step,
                shards=fact.shards,
                unassigned=Shard(),
            )
        case StragglerDetected():
            return _member(state, fact.worker, straggler=True)
        case StragglerCleared():
            return _member(state, fact.worker, straggler=False)
        case GpuAdviceIssued():
            return replace(state, advice=state.advice | {(fact.worker, fact.device, fact.rule)})
        case GpuAdviceCleared():
            return replace(state, advice=state.advice - {(fact.worker, fact.device, fact.rule)})
        case TrainingPaused():
            return replace(state, paused=True)
        case TrainingResumed():
            return replace(state, paused=False)
    raise TypeError(f"evolve has no branch for {type(fact).__name__}")  # pragma: no cover


def fold(facts: Iterable[Fact], state: JobState | None = None) -> JobState:
    """Replay: the state after every fact, from `state` (a snapshot) or from nothing."""
    state = JobState() if state is None else state
    for fact in facts:
        state = evolve(state, fact)
    return state
