"""evolve(state, fact) -> state: the one place state changes, one branch per fact type."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

from cohort.coordinator.state import KEEP_EVALS, RATE_WINDOW, Counters, JobState, Member, Status
from cohort.events.models import (
    KEEP_REQUESTS,
    MAX_WORKLOADS,
    CheckpointExpired,
    CheckpointRequested,
    CheckpointSaved,
    CommandsRefused,
    Dataset,
    DatasetDeclared,
    EpochFinished,
    EpochStarted,
    EvalReported,
    Fact,
    GpuAdviceCleared,
    GpuAdviceIssued,
    InboxRepaired,
    JobConfigured,
    JobFinished,
    JoinRefused,
    JournalArchived,
    LeaderElected,
    RendezvousRound,
    Rewound,
    SparePromoted,
    StepCommitted,
    StragglerCleared,
    StragglerDetected,
    TrainingPaused,
    TrainingResumed,
    Weights,
    WeightsDiverged,
    WeightsLost,
    WorkerActivated,
    WorkerFailed,
    WorkerJoined,
    WorkerLeaving,
    WorkerLeft,
    WorkerSynced,
    WorkloadRegistered,
    WorldChanged,
)
from cohort.events.shards import Shard


def _member(state: JobState, worker: str, **changes: object) -> dict[str, object]:
    old = state.members.get(worker)
    if old is None:  # a fact about a worker that already left: nothing to change
        return {}
    return {"members": {**state.members, worker: replace(old, **changes)}}  # type: ignore[arg-type]


def _gone(state: JobState, worker: str, **count: int) -> dict[str, object]:
    """A member left or failed: it goes, with its GPU advice and the weights it held."""
    return {
        "members": {w: m for w, m in state.members.items() if w != worker},
        "advice": frozenset(key for key in state.advice if key[0] != worker),
        "holders": state.holders - {worker},
        "counters": _count(state.counters, **count),
    }


def _count(counters: Counters, **inc: int) -> Counters:
    return replace(counters, **{k: getattr(counters, k) + v for k, v in inc.items()})


def evolve(state: JobState, fact: Fact) -> JobState:
    """The state after `fact`. Pure; unknown facts cannot reach here (the codec rejects them)."""
    return replace(state, facts=state.facts + 1, **_changes(state, fact))  # type: ignore[arg-type]


def _changes(state: JobState, fact: Fact) -> dict[str, object]:  # noqa: C901 - the fact dispatcher: one branch per fact type
    """What `fact` changes, field by field (one new state per fact is built from it)."""
    match fact:
        case JobConfigured():
            size = fact.config.dataset_size
            declared = state.dataset if size is None else Dataset(size=size)
            return {"job": fact.job, "config": fact.config, "dataset": declared}
        case DatasetDeclared():
            return {"dataset": fact.dataset}
        case LeaderElected():
            return {
                "leader": fact.coordinator,
                "leader_epoch": fact.epoch,
                "counters": _count(state.counters, elections=1),
            }
        case WorkerJoined():
            status: Status = "evaluating" if fact.role == "evaluator" else "syncing"
            member = Member(
                fact.worker,
                status,
                fact.at,
                fact.host,
                fact.pid,
                node=fact.node,
                role=fact.role,
                spare=fact.spare,
            )
            return {
                "members": {**state.members, fact.worker: member},
                "counters": _count(state.counters, joined=1),
            }
        case JoinRefused():
            return {"counters": _count(state.counters, refused=1)}
        case WorkerSynced():
            return _member(
                state, fact.worker, status="ready", synced_step=fact.step, synced_at=fact.at
            )
        case WorkerActivated():
            return _member(state, fact.worker, status="active")
        case SparePromoted():
            changes = _member(state, fact.worker, status="active", spare=False)
            return {**changes, "counters": _count(state.counters, promotions=1)} if changes else {}
        case WorkerLeaving():
            return _member(state, fact.worker, status="draining", leave_after=fact.after_step)
        case WorkerLeft():
            return _gone(state, fact.worker, left=1)
        case WorkerFailed():
            by_cause = {} if fact.cause == "silent" else {fact.cause: 1}
            return _gone(state, fact.worker, failed=1, **by_cause)
        case WorldChanged():
            return {
                "world_version": fact.version,
                "ranks": fact.ranks,
                "shards": fact.shards,
                "unassigned": fact.unassigned,
                "base_step": fact.start_step,
                "epoch": fact.epoch,
                "started": True,
                "counters": _count(state.counters, world_changes=1),
            }
        case StepCommitted():
            return _committed(state, (fact,))
        case WeightsDiverged():
            return {"counters": _count(state.counters, divergences=1)}
        case EpochFinished():
            return {"counters": _count(state.counters, epochs_finished=1)}
        case EpochStarted():
            return {
                "epoch": fact.epoch,
                "base_step": fact.start_step,
                "shards": fact.shards,
                "unassigned": Shard(),
            }
        case StragglerDetected():
            return _member(state, fact.worker, straggler=True)
        case StragglerCleared():
            return _member(state, fact.worker, straggler=False)
        case GpuAdviceIssued():
            return {"advice": state.advice | {(fact.worker, fact.device, fact.rule)}}
        case GpuAdviceCleared():
            return {"advice": state.advice - {(fact.worker, fact.device, fact.rule)}}
        case TrainingPaused():
            return {"paused": True, "commits": ()}
        case TrainingResumed():
            return {"paused": False}
        case CheckpointRequested():
            return {"requested": (*state.requested, fact)[-KEEP_REQUESTS:]}
        case CheckpointSaved():
            return {
                "checkpoints": (*state.checkpoints, fact),
                "requested": tuple(r for r in state.requested if r.step > fact.step),
                "counters": _count(state.counters, checkpoints=1),
            }
        case CheckpointExpired():
            return {"checkpoints": tuple(c for c in state.checkpoints if c.uri != fact.uri)}
        case WeightsLost():
            return {"weights_lost": fact.step}
        case Rewound():
            return {
                "last_committed": fact.to_step,
                "last_digest": fact.digest,
                "holders": frozenset(),
                "epoch": fact.position.epoch,
                "base_step": fact.to_step + 1,
                "shards": (),
                "unassigned": fact.position.rest,
                "requested": (),
                "weights_lost": None,
                "commits": (),
                "restart": Weights(
                    step=fact.to_step,
                    source="checkpoint" if fact.source == "checkpoint" else "initial",
                    digest=fact.digest,
                    uri=fact.uri,
                    sha256=fact.sha256,
                ),
                "counters": _count(
                    state.counters, rewinds=1, discarded_steps=fact.from_step - fact.to_step
                ),
            }
        case WorkloadRegistered():
            return _workloads(state, fact)
        case EvalReported():
            return {"evals": (*state.evals, fact)[-KEEP_EVALS:]}
        case RendezvousRound():
            last = state.rendezvous
            run = last is None or not any(a in state.members for a in last.agents)
            return {"rendezvous": fact, "counters": _count(state.counters, rounds=1, runs=int(run))}
        case JobFinished():
            return {"finished": fact.reason or "finished", "paused": True}
        case CommandsRefused():
            forged = sum(r.count for r in fact.refusals if r.kind == "forged")
            total = sum(r.count for r in fact.refusals)
            return {"counters": _count(state.counters, dead_letters=total, forged=forged)}
        case InboxRepaired():
            return {"counters": _count(state.counters, inbox_repairs=1 + fact.more)}
        case JournalArchived():
            return {"archived": (*state.archived, fact)}
    raise TypeError(f"evolve has no branch for {type(fact).__name__}")  # pragma: no cover


def _workloads(state: JobState, fact: WorkloadRegistered) -> dict[str, object]:
    """The member's workloads with `fact`'s in place of any of its name, newest last."""
    owner = state.members.get(fact.worker)
    if owner is None:
        return {}
    kept = tuple(w for w in owner.workloads if w.name != fact.workload.name)
    return _member(state, fact.worker, workloads=(*kept, fact.workload)[-MAX_WORKLOADS:])


def _committed(state: JobState, run: Sequence[StepCommitted]) -> dict[str, object]:
    """The steps of `run` committed, in order: the ranks that committed the last hold its
    weights, and the last RATE_WINDOW commit times are kept for the rate."""
    last = run[-1]
    recent = tuple((fact.step, fact.at) for fact in run[-RATE_WINDOW:])
    return {
        "last_committed": last.step,
        "last_digest": last.digest,
        "holders": frozenset(state.ranks),
        "restart": None,
        "commits": (*state.commits, *recent)[-RATE_WINDOW:],
        "counters": _count(state.counters, steps_committed=len(run)),
    }


def _commits(state: JobState, run: Sequence[StepCommitted]) -> JobState:
    """StepCommitted facts in a row: what evolving each gives."""
    return replace(state, facts=state.facts + len(run), **_committed(state, run))  # type: ignore[arg-type]


def fold(facts: Iterable[Fact], state: JobState | None = None) -> JobState:
    """Replay: the state after every fact, from `state` (a snapshot) or from nothing.

    Equal to evolving each fact in turn (a test holds it to that); a run of
    StepCommitted facts, nearly all of a long journal, becomes one new state.
    """
    state = JobState() if state is None else state
    run: list[StepCommitted] = []  # a run of commits: most of a long journal, folded at once
    for fact in facts:
        if type(fact) is StepCommitted:
            run.append(fact)
            continue
        if run:
            state = _commits(state, run)
            run = []
        state = evolve(state, fact)
    return _commits(state, run) if run else state
