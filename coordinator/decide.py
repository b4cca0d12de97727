"""decide(state, seen, command, now) -> Decision: every rule of the protocol, and nothing else.

Pure: the state, the leader's volatile view (`Liveness`, read only) and the
time come in; the facts come out, with the state after them. A decision that
takes several facts (a commit that activates a joiner and changes the world) is
built by a `_Plan` that folds each fact as it is emitted, so every later rule
sees the state the journal will hold at that point, and the caller adopts the
plan's state instead of folding the facts again.

The rules (DESIGN.md "Membership", "Data shards"):
- Join: a member already → nothing; `max_workers` reached → JoinRefused; else WorkerJoined.
- WeightsLoaded by a syncing member → WorkerSynced; it is activated at the next
  step boundary, or at once while training is paused.
- StepDone / Heartbeat progress: when every rank of the current world has
  finished the next step → StepCommitted (and WeightsDiverged if their weight
  digests differ), then the step boundary: stragglers,
  drained leavers leave, ready joiners are activated, the epoch may end, and
  the world changes if its membership did.
- Leave: not in the world → WorkerLeft now; in it and `after_step` still to
  commit → WorkerLeaving (left at that boundary); else WorkerLeft and a new world now.
- tick: a member silent for `heartbeat_timeout` → WorkerFailed; if it held a
  rank the running step is aborted unless a rank already finished it (then all
  ranks contributed, so it commits), and a new world starts at the next step.
- The world below `min_workers` → TrainingPaused; enough ready again → TrainingResumed.
- GpuReading of a member: the GPU rules (journaled in the config) with hysteresis and
  priorities → GpuAdviceCleared / GpuAdviceIssued (coordinator/gpu_rules.py).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from cohort.events.models import (
    Command,
    EpochDone,
    EpochFinished,
    EpochStarted,
    Fact,
    GpuReading,
    Heartbeat,
    JobConfig,
    JobConfigured,
    Join,
    JoinRefused,
    LeaderElected,
    Leave,
    StepCommitted,
    StepDone,
    StragglerCleared,
    StragglerDetected,
    TrainingPaused,
    TrainingResumed,
    WeightsDiverged,
    WeightsLoaded,
    WorkerActivated,
    WorkerFailed,
    WorkerJoined,
    WorkerLeaving,
    WorkerLeft,
    WorkerSynced,
    WorldChanged,
)
from cohort.events.shards import Shard

from . import gpu_rules, shards, stragglers
from .fold import evolve
from .liveness import Liveness
from .state import JobState


def _some(items: list[str], sep: str = ", ", most: int = 8) -> str:
    """A list for a reason text: bounded, however many workers a decision concerns."""
    shown = sep.join(items[:most])
    return shown if len(items) <= most else f"{shown}{sep}and {len(items) - most} more"


class Decision(NamedTuple):
    """The facts of one decision and the state after them (folded as they were made)."""

    facts: tuple[Fact, ...]
    state: JobState


class _Plan:
    """Facts of one decision, each folded as it is emitted."""

    def __init__(self, state: JobState, now: float) -> None:
        self.state = state
        self.now = now
        self.facts: list[Fact] = []

    def emit(self, cls: Any, **body: Any) -> None:
        self.record(cls(at=self.now, job=self.state.job, **body))

    def record(self, fact: Fact) -> None:
        self.facts.append(fact)
        self.state = evolve(self.state, fact)

    @property
    def config(self) -> JobConfig:
        assert self.state.config is not None, "decide needs a configured job"
        return self.state.config

    def decision(self) -> Decision:
        return Decision(tuple(self.facts), self.state)


# ---------------------------------------------------------------- leadership


def take_over(
    state: JobState, job: str, config: JobConfig, coordinator: str, epoch: int, now: float
) -> Decision:
    """A new leader's first facts: the job's config if the journal has none yet (the
    journal's first fact; a configured job keeps its journaled config), then itself."""
    plan = _Plan(state, now)
    if not state.configured:
        plan.record(JobConfigured(at=now, job=job, config=config))
    plan.emit(LeaderElected, coordinator=coordinator, epoch=epoch)
    return plan.decision()


# ---------------------------------------------------------------- commands


def decide(state: JobState, seen: Liveness, command: Command, now: float) -> Decision:
    """Facts that follow from `command` (already observed into `seen`)."""
    plan = _Plan(state, now)
    if not state.configured:
        return plan.decision()
    match command:
        case Join():
            _join(plan, command)
        case WeightsLoaded():
            _synced(plan, command)
        case StepDone() | Heartbeat():
            _maybe_commit(plan, seen)
        case Leave():
            _leave(plan, command)
        case GpuReading():
            _gpu(plan, command)
        case EpochDone():
            pass  # observed only
    return plan.decision()


def _join(plan: _Plan, command: Join) -> None:
    state = plan.state
    if command.worker in state.members:
        return  # a repeated Join (a retried send) changes nothing
    if len(state.members) >= plan.config.max_workers:
        plan.emit(
            JoinRefused,
            worker=command.worker,
            reason=f"job {state.job!r} already has max_workers={plan.config.max_workers} "
            "members; retry when one leaves or raise --max-workers",
        )
        return
    plan.emit(WorkerJoined, worker=command.worker, host=command.host, pid=command.pid)


def _synced(plan: _Plan, command: WeightsLoaded) -> None:
    member = plan.state.members.get(command.worker)
    if member is None or member.status != "syncing":
        return
    plan.emit(WorkerSynced, worker=command.worker, step=command.step)
    if plan.state.paused:
        _pace(plan)


def _leave(plan: _Plan, command: Leave) -> None:
    state = plan.state
    member = state.members.get(command.worker)
    if member is None or member.status == "draining":
        return
    reason = command.reason or "left"
    in_world = command.worker in state.ranks
    if not in_world:
        plan.emit(WorkerLeft, worker=command.worker, reason=reason)
        return
    later = command.after_step is not None and command.after_step > state.last_committed
    if later and not state.paused:
        plan.emit(WorkerLeaving, worker=command.worker, after_step=command.after_step)
        return
    plan.emit(WorkerLeft, worker=command.worker, reason=reason)
    _new_world(plan, f"{command.worker} left")


def _gpu(plan: _Plan, reading: GpuReading) -> None:
    """GPU rules with hysteresis: advice starts and ends as facts, clears first."""
    if reading.worker not in plan.state.members:
        return
    issues, clears = gpu_rules.evaluate(plan.state.gpu_rules, plan.state.advice, reading)
    for clear in clears:
        plan.record(clear.fact(plan.now, plan.state.job))
    for issue in issues:
        plan.record(issue.fact(plan.now, plan.state.job))


# ---------------------------------------------------------------- time


def tick(state: JobState, seen: Liveness, now: float) -> Decision:
    """Facts that follow from time passing: members silent too long have failed."""
    plan = _Plan(state, now)
    if not state.configured:
        return plan.decision()
    timeout = plan.config.heartbeat_timeout
    lost = [
        (worker, seen.last_seen.get(worker, member.joined_at))
        for worker, member in state.members.items()
        if now - seen.last_seen.get(worker, member.joined_at) > timeout
    ]
    if not lost:
        return plan.decision()
    held_rank = any(worker in state.ranks for worker, _ in lost)
    running = held_rank and not state.paused
    if running and seen.any_reported(state.ranks, state.world_version, state.next_step):
        # A rank finished the step, so every rank contributed to it: it stands.
        plan.emit(StepCommitted, step=state.next_step, world=state.world_version)
    for worker, last_seen in lost:
        plan.emit(WorkerFailed, worker=worker, last_seen=last_seen, timeout=timeout)
    if held_rank:
        names = _some([w for w, _ in lost])
        _new_world(plan, f"{names} failed")
    return plan.decision()


# ---------------------------------------------------------------- steps and worlds


def _maybe_commit(plan: _Plan, seen: Liveness) -> None:
    state = plan.state
    if state.paused or not state.ranks:
        return
    step = state.next_step
    if not seen.all_reported(state.ranks, state.world_version, step):
        return
    plan.emit(StepCommitted, step=step, world=state.world_version)
    groups = seen.digest_groups(state.ranks, step)
    if len(groups) > 1:
        plan.emit(WeightsDiverged, step=step, world=state.world_version, groups=groups)
    _boundary(plan, seen, step)


def _boundary(plan: _Plan, seen: Liveness, step: int) -> None:
    """What happens between two steps: stragglers, leavers, joiners, epochs, a new world."""
    config = plan.config
    for worker, slow, mine, middle in stragglers.changes(plan.state, seen, step, config):
        if slow:
            plan.emit(
                StragglerDetected,
                worker=worker,
                step_time=mine,
                median=middle,
                steps=config.straggler_steps,
            )
        else:
            plan.emit(StragglerCleared, worker=worker, step_time=mine, median=middle)
    changed = []
    for member in plan.state.with_status("draining"):
        if member.leave_after is not None and member.leave_after <= step:
            plan.emit(WorkerLeft, worker=member.worker, reason="drained")
            changed.append(f"{member.worker} left")
    for member in plan.state.with_status("ready"):
        plan.emit(WorkerActivated, worker=member.worker)
        changed.append(f"{member.worker} joined")
    state = plan.state
    done = shards.exhausted(state.shards, state.base_step, step + 1, config.batch_size)
    if done and not state.unassigned.size:
        plan.emit(EpochFinished, epoch=state.epoch, step=step)
        if not changed:
            plan.emit(
                EpochStarted,
                epoch=state.epoch + 1,
                start_step=step + 1,
                shards=shards.full(config.dataset_size, len(state.ranks)),
            )
            return
    if changed:
        _new_world(plan, _some(changed, sep="; "))


def _new_world(plan: _Plan, reason: str) -> None:
    """A new world from the next step: survivors keep their order, newcomers follow.

    What is left of the epoch is split again over the new ranks; when nothing
    is left (or training never started) a fresh epoch begins.
    """
    state, config = plan.state, plan.config
    ranks = tuple(w for w in state.ranks if w in state.members)
    ranks += tuple(m.worker for m in state.with_status("active") if m.worker not in ranks)
    start, epoch = state.next_step, state.epoch
    rest = shards.leftover(
        state.shards, state.base_step, start, config.batch_size, state.unassigned
    )
    if not state.started or not rest:
        epoch, rest = (epoch + 1 if state.started else 0), ((0, config.dataset_size),)
    plan.emit(
        WorldChanged,
        version=state.world_version + 1,
        start_step=start,
        epoch=epoch,
        ranks=ranks,
        shards=shards.split(rest, len(ranks)),
        reason=reason,
        unassigned=Shard() if ranks else Shard(ranges=rest),
    )
    _pace(plan)


def _pace(plan: _Plan) -> None:
    """Pause below `min_workers`; while paused, once enough are ready, activate them and resume."""
    state, config = plan.state, plan.config
    active = len(state.ranks)
    if not state.paused:
        if active < config.min_workers:
            plan.emit(
                TrainingPaused,
                reason=f"{active} active workers, fewer than min_workers={config.min_workers}",
                active=active,
                min_workers=config.min_workers,
            )
        return
    ready = state.with_status("ready")
    if active + len(ready) < config.min_workers:
        return
    if ready:
        for member in ready:
            plan.emit(WorkerActivated, worker=member.worker)
        _new_world(plan, _some([m.worker for m in ready]) + " joined")
        return
    plan.emit(TrainingResumed, active=active)
