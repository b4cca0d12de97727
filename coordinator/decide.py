"""decide(state, seen, command, now) -> Decision: every rule of the protocol, and nothing else.

Pure: the state, the leader's volatile view (`Liveness`, read only) and the
time come in; the facts come out, with the state after them. A decision that
takes several facts (a commit that activates a joiner and changes the world) is
built by a `_DecisionPlan` that folds each fact as it is emitted, so every later rule
sees the state the journal will hold at that point, and the caller adopts the
plan's state instead of folding the facts again.

The rules (docs/design.md "Membership", "Data shards and the epoch order"):
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
- tick: a member silent for `heartbeat_timeout` (time the inbox could take no honest
  entry not counted: `Liveness.silence`), or whose connections closed and
  stayed closed for `disconnect_grace` → WorkerFailed (with its cause); a launcher's
  ProcessExited fails the member at once, the same way; if it held a
  rank the running step is aborted unless a rank already finished it (then all
  ranks contributed, so it commits), and a new world starts at the next step.
- The world below `min_workers` → TrainingPaused; enough ready again → TrainingResumed.
  The first world also waits for `start_workers` ready trainers, at most `start_wait` s
  after the first was ready (a tick ends the wait); its reason names any missing.
- Weight lineage (coordinator/lineage.py): every WorldChanged names the weights it starts
  from. When none of its ranks holds the last committed weights, the leader rewinds to the
  latest checkpoint (Rewound, with the data position of that step), or, with none,
  journals WeightsLost and pauses until an operator's Resume (from scratch, or from a
  checkpoint file).
- Checkpoints: after every `checkpoint_every` committed steps a holder of the weights is
  asked to write them (CheckpointRequested, with the data position); its CheckpointWritten
  → CheckpointSaved, and the oldest beyond `checkpoint_keep` → CheckpointExpired.
- The job's length (`max_steps`, `epochs`): the commit that reaches it ends the job with
  the last checkpoint's request and JobFinished; then no step commits, joins are refused,
  leavers leave at once and silent members fail, without new worlds.
- Spares (coordinator/spares.py): a member that joined as a spare syncs like any joiner
  but is never activated at a step boundary and counts toward no world. When the world
  loses ranks (failed, left, drained, removed), the same decision promotes one ready spare
  per lost rank (SparePromoted: one on the lost rank's machine first, then the one ready
  longest, then by name) before the new world ranks it after the survivors (with shard
  groups, `shard_group`, in the lost rank's place: a rank's place is its shard); a job paused
  below `min_workers` after it started promotes as many as make up the numbers. A spare
  that fails or leaves changes no world; after the end nothing is promoted.
- Roles: an evaluator joins as a member "evaluating": it is never synced, activated or
  ranked, so it counts toward no world and no `min_workers`, and its failure changes no
  world; its EvalDone of a committed step → EvalReported (also after the end), as is a
  trainer's (the figures it recorded after its last step).
- RegisterWorkload of a member, new or changed → WorkloadRegistered; TransfersWaiting is
  telemetry (observed only).
- RoundStarted of an agent member (torchrun's), of a round after the last journaled →
  RendezvousRound: the launcher's rounds, each a restart of every worker but a run's first.
- GpuReading of a member: the GPU rules (journaled in the config) with hysteresis and
  priorities → GpuAdviceCleared / GpuAdviceIssued (coordinator/gpu_rules.py).
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

from cohort.coordinator import gpu_rules, lineage, spares, stragglers
from cohort.coordinator.fold import evolve
from cohort.coordinator.liveness import Liveness
from cohort.coordinator.state import JobState, Member
from cohort.events import deal, storage
from cohort.events.models import (
    CheckpointExpired,
    CheckpointRequested,
    CheckpointSaved,
    CheckpointWritten,
    Command,
    DataPosition,
    DataRefused,
    Dataset,
    DatasetDeclared,
    EpochDone,
    EpochFinished,
    EpochStarted,
    EvalDone,
    EvalReported,
    Fact,
    GpuReading,
    Heartbeat,
    JobConfig,
    JobConfigured,
    JobFinished,
    Join,
    JoinRefused,
    LeaderElected,
    Leave,
    ProcessExited,
    RegisterWorkload,
    RendezvousRound,
    Resume,
    Rewound,
    RoundStarted,
    SparePromoted,
    StepCommitted,
    StepDone,
    StragglerCleared,
    StragglerDetected,
    TrainingPaused,
    TrainingResumed,
    TransfersWaiting,
    Weights,
    WeightsDiverged,
    WeightsLoaded,
    WeightsLost,
    WorkerActivated,
    WorkerFailed,
    WorkerJoined,
    WorkerLeaving,
    WorkerLeft,
    WorkerSynced,
    WorkloadRegistered,
    WorldChanged,
    finished_refusal,
)
from cohort.events.shards import Shard


def _bounded_list(items: list[str], sep: str = ", ", most: int = 8) -> str:
    """A list for a reason text: bounded, however many workers a decision concerns."""
    shown = sep.join(items[:most])
    return shown if len(items) <= most else f"{shown}{sep}and {len(items) - most} more"


class Decision(NamedTuple):
    """The facts of one decision and the state after them (folded as they were made)."""

    facts: tuple[Fact, ...]
    state: JobState


class _DecisionPlan:
    """Facts of one decision, each folded as it is emitted."""

    __slots__ = ("state", "now", "facts")  # one per command decided: the leader's hot path

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
        if self.facts:
            return Decision(tuple(self.facts), self.state)
        return _unchanged(self.state)


_UNCHANGED = [Decision((), JobState())]


def _unchanged(state: JobState) -> Decision:
    """No facts, and `state` as it was: one object per state, not one per command (nearly
    every command decides nothing, and the state changes about once a step)."""
    last = _UNCHANGED[0]
    if last.state is not state:
        last = _UNCHANGED[0] = Decision((), state)
    return last


# ---------------------------------------------------------------- leadership


def take_over(
    state: JobState, job: str, config: JobConfig, coordinator: str, epoch: int, now: float
) -> Decision:
    """A new leader's first facts: the job's config if the journal has none yet (the
    journal's first fact; a configured job keeps its journaled config), then itself."""
    plan = _DecisionPlan(state, now)
    if not state.configured:
        plan.record(JobConfigured(at=now, job=job, config=config))
    plan.emit(LeaderElected, coordinator=coordinator, epoch=epoch)
    return plan.decision()


# ---------------------------------------------------------------- commands


def decide(state: JobState, seen: Liveness, command: Command, now: float) -> Decision:
    """Facts that follow from `command` (already observed into `seen`)."""
    plan = _DecisionPlan(state, now)
    if state.config is None:  # (not configured)
        return plan.decision()
    if state.finished:
        _after_end(plan, seen, command)
    else:
        _during_training(plan, seen, command)
    return plan.decision()


def _during_training(plan: _DecisionPlan, seen: Liveness, command: Command) -> None:
    """The rule for `command` while the job runs: one branch per command type."""
    match command:
        case StepDone() | Heartbeat():  # first: nearly every command is one of these
            _maybe_commit(plan, seen)
        case Join():
            _join(plan, command)
        case WeightsLoaded():
            _synced(plan, command)
        case Leave():
            _leave(plan, command)
        case GpuReading():
            _gpu(plan, command)
        case CheckpointWritten():
            _checkpoint_written(plan, command)
        case Resume():
            _resume(plan, command)
        case EvalDone() | RegisterWorkload() | RoundStarted():
            _reported(plan, command)
        case DataRefused():
            _refused_data(plan, seen, command)
        case ProcessExited():
            _exited(plan, seen, command)
        case EpochDone() | TransfersWaiting():
            pass  # observed only


def _reported(plan: _DecisionPlan, command: EvalDone | RegisterWorkload | RoundStarted) -> None:
    """What a member reports of itself that the journal keeps as reported: an evaluation, a
    GPU workload, a launcher's round."""
    match command:
        case EvalDone():
            _evaluated(plan, command)
        case RegisterWorkload():
            _workload(plan, command)
        case RoundStarted():
            _round_started(plan, command)


def _join(plan: _DecisionPlan, command: Join) -> None:
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
    dataset, refusal = _dataset_of(plan.state, plan.config, command)
    if refusal is not None:
        plan.emit(JoinRefused, worker=command.worker, reason=refusal)
        return
    if dataset is not None and dataset != state.dataset:
        plan.emit(DatasetDeclared, worker=command.worker, dataset=dataset)
    plan.emit(
        WorkerJoined,
        worker=command.worker,
        host=command.host,
        pid=command.pid,
        node=command.node,
        role=command.role,
        spare=command.spare,
    )


def _workload(plan: _DecisionPlan, command: RegisterWorkload) -> None:
    """A member's GPU workload is journaled when it is new or changed (a resend is not)."""
    member = plan.state.members.get(command.worker)
    if member is None or command.workload in member.workloads:
        return
    plan.emit(WorkloadRegistered, worker=command.worker, workload=command.workload)


def _round_started(plan: _DecisionPlan, command: RoundStarted) -> None:
    """A launcher's round is journaled once, as the first of its agents reports it; a
    trainer cannot report rounds, and a report of an older round is late."""
    member, last = plan.state.members.get(command.worker), plan.state.rendezvous
    if member is None or member.role != "agent" or (last and command.round <= last.round):
        return
    plan.emit(RendezvousRound, worker=command.worker, round=command.round, agents=command.agents)


def _evaluated(plan: _DecisionPlan, command: EvalDone) -> None:
    """An evaluator's metrics of committed weights are journaled, and so are a trainer's
    figures recorded after its last step (they ride on no next step's report); an agent's,
    or metrics of a step that never committed, are not evaluations of this job's lineage."""
    member = plan.state.members.get(command.worker)
    if member is None or member.role == "agent" or command.step > plan.state.last_committed:
        return
    plan.emit(EvalReported, worker=command.worker, step=command.step, metrics=command.metrics)


def _dataset_of(
    state: JobState, config: JobConfig, command: Join
) -> tuple[Dataset | None, str | None]:
    """The job's dataset once `command` joins, or why its dataset keeps it out.

    The first declaration is journaled (DatasetDeclared); until training starts a later
    one may add a fingerprint or files to what is known (a size the config gave). A
    declaration that differs from the job's dataset is refused, by what differs."""
    known, declared, job = state.dataset, command.dataset, state.job
    if command.role != "trainer" and declared is None:
        return known, None  # deals no data to it: nothing to check
    if declared is not None and declared.adapts and known is not None:
        declared = None  # it makes its data to the job's size
    if declared is not None and known is not None:
        differs = known.mismatch(declared)
        if differs is not None:
            return known, (
                f"worker {command.worker!r} declares a dataset of {differs}: job {job!r} "
                f"trains on {_described(known)}; point the worker at that data, or train "
                "this data as another job"
            )
    if declared is not None and (known is None or not state.started):
        known = Dataset(
            size=declared.size,
            fingerprint=declared.fingerprint or (known.fingerprint if known else ""),
            files=declared.files or (known.files if known else ()),
        )
    if known is None:
        return None, (
            f"job {job!r} does not know its dataset yet and worker {command.worker!r} "
            "declares none: declare it in the worker (ElasticJob(dataset=...)) or start the "
            "coordinators with --dataset-size N"
        )
    if config.placement in ("hash", "locality") and not known.files:
        return known, (
            f"job {job!r} places data by {config.placement}, which deals files, but its "
            f"dataset of {known.size} samples names no files: declare them "
            "(cohort.Dataset(files=[...])) or use --placement contiguous or strided"
        )
    return known, None


def _described(dataset: Dataset) -> str:
    words = f"{dataset.size} samples"
    if dataset.files:
        words += f" in {len(dataset.files)} files"
    if dataset.fingerprint:
        words += f" (fingerprint {dataset.fingerprint!r})"
    return words


def _synced(plan: _DecisionPlan, command: WeightsLoaded) -> None:
    member = plan.state.members.get(command.worker)
    if member is None or member.status != "syncing":
        return
    plan.emit(WorkerSynced, worker=command.worker, step=command.step)
    if plan.state.paused:
        _pace(plan)


def _leave(plan: _DecisionPlan, command: Leave) -> None:
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
    _new_world(plan, f"{command.worker} left" + _promote(plan, [member]))


def _refused_data(plan: _DecisionPlan, seen: Liveness, command: DataRefused) -> None:
    """A rank's collective data failed verification where another rank of its world read
    it. Any rank may say so, so it takes a majority of the accused's peers (one of one in
    a world of two) to remove it: a WorkerLeft saying why, and a new world without it."""
    state = plan.state
    accused = command.accused
    if command.world != state.world_version or accused == command.worker:
        return
    if accused not in state.ranks or command.worker not in state.ranks:
        return
    accusers = sorted(seen.refused.get((command.world, accused), set()) & set(state.ranks))
    if 2 * len(accusers) <= len(state.ranks) - 1:
        return
    why = f"its data for step {command.step} failed verification by {_bounded_list(accusers)}"
    lost = [m for m in (state.members.get(accused),) if m is not None]
    plan.emit(WorkerLeft, worker=accused, reason=f"removed: {why} ({command.reason})"[:1024])
    _new_world(plan, f"{accused} removed: {why}" + _promote(plan, lost))


def _gpu(plan: _DecisionPlan, reading: GpuReading) -> None:
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
    """Facts that follow from time passing: members silent too long, or whose connections
    closed and stayed closed for the grace, have failed; the first world's wait for
    `start_workers` ran out."""
    plan = _DecisionPlan(state, now)
    if not state.configured:
        return plan.decision()
    lost = _lost(state, plan.config, seen, now)
    if lost:
        _fail(plan, seen, lost)
    if not plan.state.started and plan.state.paused and plan.config.start_workers:
        _pace(plan)  # the first world's wait for start_workers may have run out
    return plan.decision()


def _exited(plan: _DecisionPlan, seen: Liveness, command: ProcessExited) -> None:
    """A member's launcher saw its process end: it is failed now, as time would fail it."""
    member = plan.state.members.get(command.worker)
    if member is None:
        return
    failed = WorkerFailed(
        at=plan.now, job=plan.state.job, worker=command.worker,
        last_seen=seen.last_seen.get(command.worker, member.joined_at),
        timeout=plan.config.heartbeat_timeout, cause="exited", how=command.how or None,
    )  # fmt: skip
    _fail(plan, seen, [failed])


def _fail(plan: _DecisionPlan, seen: Liveness, lost: list[WorkerFailed]) -> None:
    """Members taken for dead. If one held a rank, the running step stands when a rank
    already finished it (every rank contributed to it), else it is abandoned; a new world
    starts at the next step, a ready spare in each lost rank's place."""
    state = plan.state
    ranks_lost = [state.members[f.worker] for f in lost if f.worker in state.ranks]
    held_rank = not state.finished and bool(ranks_lost)
    running = held_rank and not state.paused
    if running and seen.any_reported(state.ranks, state.world_version, state.next_step):
        step = state.next_step
        _commit(plan, seen, step)
        _ended(plan, step, _epoch_done(plan.state, step))
    for failed in lost:
        plan.record(failed)
    if held_rank and not plan.state.finished:
        names = _bounded_list([failed.worker for failed in lost])
        _new_world(plan, f"{names} failed" + _promote(plan, ranks_lost))


def _lost(state: JobState, config: JobConfig, seen: Liveness, now: float) -> list[WorkerFailed]:
    """The members taken for dead as of `now`, each with its evidence: without any
    connection since a reading at least the disconnect grace ago (and not heard from since
    that reading), or silent for longer than the heartbeat timeout while the inbox could
    have heard them (`Liveness.silence`)."""
    timeout, grace = config.heartbeat_timeout, config.disconnect_grace
    lost = []
    for worker, member in state.members.items():
        last_seen = seen.last_seen.get(worker, member.joined_at)
        closed_at = seen.closed.get(worker) if grace > 0 else None
        if closed_at is not None and now - closed_at >= grace and last_seen <= closed_at:
            evidence: dict[str, Any] = {"cause": "disconnected", "closed_at": closed_at}
            evidence["grace"] = grace
        elif now - last_seen > timeout and seen.silence(last_seen, now) > timeout:
            evidence = {}
        else:
            continue  # (the hot path: nothing is built for a member that is fine)
        lost.append(
            WorkerFailed(
                at=now, job=state.job, worker=worker, last_seen=last_seen, timeout=timeout,
                **evidence,
            )
        )  # fmt: skip
    return lost


# ---------------------------------------------------------------- steps and worlds


def _maybe_commit(plan: _DecisionPlan, seen: Liveness) -> None:
    state = plan.state
    if state.paused or not state.ranks:
        return
    step = state.next_step
    if not seen.all_reported(state.ranks, state.world_version, step):
        return
    _commit(plan, seen, step)
    epoch_done = _epoch_done(plan.state, step)
    if _ended(plan, step, epoch_done):
        return
    _boundary(plan, seen, step, epoch_done)
    if lineage.due(plan.state, step):
        _request_checkpoint(plan, step)


def _commit(plan: _DecisionPlan, seen: Liveness, step: int) -> None:
    """`step` stands, with the weights digest its ranks agree on (WeightsDiverged if not)."""
    state = plan.state
    groups = seen.digest_groups(state.ranks, step)
    agreed = next(iter(groups)) if len(groups) == 1 else None
    plan.emit(StepCommitted, step=step, world=state.world_version, digest=agreed)
    if len(groups) > 1:
        plan.emit(WeightsDiverged, step=step, world=state.world_version, groups=groups)


def _boundary(plan: _DecisionPlan, seen: Liveness, step: int, epoch_done: bool) -> None:
    """What happens between two steps: stragglers, leavers, joiners, epochs, a new world.
    `epoch_done`: `step` used the epoch's last samples."""
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
    changed, drained = [], []
    for member in plan.state.with_status("draining"):
        if member.leave_after is not None and member.leave_after <= step:
            plan.emit(WorkerLeft, worker=member.worker, reason="drained")
            changed.append(f"{member.worker} left")
            drained.append(member)
    promoted = _promote(plan, drained)
    for member in plan.state.joiners("ready"):  # a spare waits for a rank the world loses
        plan.emit(WorkerActivated, worker=member.worker)
        changed.append(f"{member.worker} joined")
    state = plan.state
    if epoch_done:
        plan.emit(EpochFinished, epoch=state.epoch, step=step)
        if not changed:
            plan.emit(
                EpochStarted,
                epoch=state.epoch + 1,
                start_step=step + 1,
                shards=_deal(plan, state.epoch + 1, _whole(state), state.ranks),
            )
            return
    if changed:
        _new_world(plan, _bounded_list(changed, sep="; ") + promoted)


def _new_world(plan: _DecisionPlan, reason: str) -> None:
    """A new world from the next step: survivors keep their order, newcomers follow (with
    shard groups, in the places lost ranks left: `_ranked`).

    What is left of the epoch is split again over the new ranks; when nothing
    is left (or training never started) a fresh epoch begins. The world starts from
    the last committed weights, which a surviving rank 0 holds; when no rank holds
    them, from the latest checkpoint after a rewind to it; with none, no rank trains
    and the job pauses until an operator resumes it.
    """
    state = plan.state
    ranks = _ranked(plan)
    weights = lineage.world_weights(state, ranks)
    if ranks and weights is None:
        latest = state.latest_checkpoint
        if latest is not None:
            _rewind(
                plan,
                latest.step,
                "checkpoint",
                latest.position,
                f"no rank holds the weights of step {state.last_committed}",
                uri=latest.uri,
                digest=latest.digest,
                sha256=latest.sha256,
            )
            weights = lineage.world_weights(plan.state, ranks)
        else:
            plan.emit(WeightsLost, step=state.last_committed, digest=state.last_digest)
            why = lineage.lost_reason(plan.state)
            _start_world(plan, (), None, f"{reason}; {why}")
            plan.emit(TrainingPaused, reason=why, active=0, min_workers=plan.config.min_workers)
            return
    _start_world(plan, ranks, weights, reason)


def _ranked(plan: _DecisionPlan) -> tuple[str, ...]:
    """The next world's ranks: those of the last that stay, then the newcomers. Without
    shard groups the stayers close up in their order. With them (`shard_group`), a rank's
    place in its group is its shard of that group's copy: every stayer keeps it, a spare
    promoted in this decision takes the place of the rank it replaces, other newcomers
    fill the places still empty in rank order, and empty places close up. Where the first
    copy's first place is not a holder of the weights, the first whole copy led by one goes
    first instead (rank 0 starts the world from them: lineage.world_weights); where none
    is, the stayers close up as without groups."""
    state = plan.state
    newcomers = [m.worker for m in state.with_status("active") if m.worker not in state.ranks]
    closed = tuple(w for w in state.ranks if w in state.members) + tuple(newcomers)
    size = plan.config.shard_group
    if size is None:
        return closed
    into = {f.replaces: f.worker for f in plan.facts if isinstance(f, SparePromoted)}
    places = [w if w in state.members else into.get(w) for w in state.ranks]
    rest = [w for w in newcomers if w not in places]
    places = [w if w is not None else (rest.pop(0) if rest else None) for w in places]
    groups = [places[at : at + size] for at in range(0, len(places), size)]
    led = [g for g in groups if len(g) == size and g[0] in state.holders]  # whole copies
    if led and groups[0] is not led[0]:
        groups.remove(led[0])
        groups.insert(0, led[0])  # the others keep their order
    ranked = tuple(w for group in groups for w in group if w is not None) + tuple(rest)
    if ranked and ranked[0] not in state.holders and closed and closed[0] in state.holders:
        return closed
    return ranked


def _start_world(
    plan: _DecisionPlan, ranks: tuple[str, ...], weights: Weights | None, reason: str
) -> None:
    state, config = plan.state, plan.config
    start, epoch = state.next_step, state.epoch
    rest = deal.leftover(config, state.shards, state.base_step, start, state.unassigned)
    if not state.started or not rest:
        epoch, rest = (epoch + 1 if state.started else 0), _whole(state)
    plan.emit(
        WorldChanged,
        version=state.world_version + 1,
        start_step=start,
        epoch=epoch,
        ranks=ranks,
        shards=_deal(plan, epoch, rest, ranks),
        reason=reason,
        unassigned=Shard() if ranks else Shard(ranges=rest),
        weights=weights if ranks else None,
    )
    _pace(plan)


def _promote(plan: _DecisionPlan, lost: list[Member]) -> str:
    """One ready spare takes the place of each of the `lost` ranks (before the new world is
    built, which ranks it after the survivors); what the world's reason adds to say so."""
    chosen = spares.replacing(plan.state, lost)
    for spare, rank in chosen:
        plan.emit(SparePromoted, worker=spare, replaces=rank)
    if not chosen:
        return ""
    return "; " + _bounded_list([f"spare {spare} for {rank}" for spare, rank in chosen])


def _whole(state: JobState) -> tuple[tuple[int, int], ...]:
    """Every position of an epoch."""
    assert state.dataset is not None, "no world starts before the dataset is known"
    return ((0, state.dataset.size),)


def _deal(
    plan: _DecisionPlan, epoch: int, rest: tuple[tuple[int, int], ...], ranks: tuple[str, ...]
) -> tuple[Shard, ...]:
    """`rest` of data epoch `epoch` dealt to `ranks` by the job's placement."""
    state = plan.state
    return deal.split(plan.config, rest, ranks, state.order(epoch), state.nodes)


def _pace(plan: _DecisionPlan) -> None:
    """Pause below `min_workers` (or while the weights are lost); while paused, once enough
    are ready, activate them and resume."""
    state, config = plan.state, plan.config
    active = len(state.ranks)
    if state.weights_lost is not None:
        return  # paused, with the reason, when the weights were found lost
    if not state.paused:
        if active >= config.min_workers:
            return
        plan.emit(
            TrainingPaused,
            reason=f"{active} active workers, fewer than min_workers={config.min_workers}",
            active=active,
            min_workers=config.min_workers,
        )
        state = plan.state  # paused now; ready workers may make up the numbers at once
    if active + len(state.members) < config.min_workers:
        return  # too few even if every member were ready (skips a look at each member)
    ready = state.joiners("ready")
    unranked = [m.worker for m in state.with_status("active") if m.worker not in state.ranks]
    missing = config.min_workers - (active + len(unranked) + len(ready))
    # Spares make up the numbers of a job that lost ranks; before its first world, the
    # trainers it waits for are still on their way, and the spares wait for them.
    standby = spares.making_up(state, missing) if state.started else ()
    if missing > len(standby):
        return
    short = 0 if state.started else _short_of_start(plan, len(ready) + len(unranked))
    if short is None:
        return
    for worker in standby:
        plan.emit(SparePromoted, worker=worker, replaces=None)
    if ready or unranked or standby:
        for member in ready:
            plan.emit(WorkerActivated, worker=member.worker)
        joined = [m.worker for m in ready] + unranked + list(standby)
        said = (
            f" ({short} of start_workers={config.start_workers} did not come within "
            f"start_wait={config.start_wait:g} s)"
            if short
            else ""
        )
        _new_world(plan, _bounded_list(joined) + " joined" + said)
        return
    plan.emit(TrainingResumed, active=active)


def _short_of_start(plan: _DecisionPlan, ready: int) -> int | None:
    """Before the first world, with `ready` trainers ready: how many of `start_workers` it
    starts without (0: none missing), or None while it still waits for them. It waits at
    most `start_wait` s after the first became ready, so a rank that cannot start delays
    the job by that much and no more; the world's reason then says how many are missing."""
    config = plan.config
    missing = (config.start_workers or 0) - ready
    if missing <= 0:
        return 0
    since = [m.synced_at for m in plan.state.joiners("ready") if m.synced_at is not None]
    if since and plan.now - min(since) >= config.start_wait:
        return missing
    return None


# ---------------------------------------------------------------- the end


def _epoch_done(state: JobState, step: int) -> bool:
    """Whether `step` used the last samples of its epoch."""
    assert state.config is not None
    return not state.unassigned.size and deal.exhausted(
        state.config, state.shards, state.base_step, step + 1
    )


def _ended(plan: _DecisionPlan, step: int, epoch_done: bool) -> bool:
    """If committing `step` reached the job's length, finish it (and say so)."""
    reason = plan.config.end_reason(step, plan.state.epoch, epoch_done)
    if reason is not None:
        _finish(plan, step, epoch_done, reason)
    return reason is not None


def _finish(plan: _DecisionPlan, step: int, epoch_done: bool, reason: str) -> None:
    """`step` is the job's last: its epoch may end, a holder is asked for the last
    checkpoint (when the job checkpoints at all), members draining away leave now (no
    boundary comes for them), and the job is finished."""
    if epoch_done:
        plan.emit(EpochFinished, epoch=plan.state.epoch, step=step)
    if plan.config.checkpoint_uri is not None:
        _request_checkpoint(plan, step)
    for member in plan.state.with_status("draining"):
        plan.emit(WorkerLeft, worker=member.worker, reason="drained")
    state = plan.state
    plan.emit(JobFinished, step=step, epoch=state.epoch, digest=state.last_digest, reason=reason)


def _after_end(plan: _DecisionPlan, seen: Liveness, command: Command) -> None:
    """A finished job trains no more: a joiner is refused, a leaver leaves at once, a member
    whose process exited fails, and the last checkpoint still enters the index; every other
    command changes nothing."""
    state = plan.state
    match command:
        case Join() if command.worker not in state.members:
            plan.emit(
                JoinRefused,
                worker=command.worker,
                reason=finished_refusal(state.job, state.last_committed, state.finished or ""),
            )
        case Leave() if command.worker in state.members:
            plan.emit(WorkerLeft, worker=command.worker, reason=command.reason or "left")
        case ProcessExited():
            _exited(plan, seen, command)
        case CheckpointWritten():
            _checkpoint_written(plan, command)
        case EvalDone():
            _evaluated(plan, command)  # the final weights are evaluated after the end


# ---------------------------------------------------------------- checkpoints and lineage


def _request_checkpoint(plan: _DecisionPlan, step: int) -> None:
    """Ask a holder of the weights of `step` (rank 0 of the world, a survivor) to write them;
    the request carries the data position after `step`, for a rewind to it."""
    state = plan.state
    writer = next((w for w in state.ranks if w in state.holders), None)
    if writer is None or state.config is None or state.config.checkpoint_uri is None:
        return
    plan.emit(
        CheckpointRequested,
        worker=writer,
        step=step,
        uri=storage.checkpoint_uri(state.config.checkpoint_uri, step),
        position=lineage.position(state),
    )


def _checkpoint_written(plan: _DecisionPlan, command: CheckpointWritten) -> None:
    """A requested checkpoint is whole: it joins the index; the oldest beyond
    `checkpoint_keep` leave it. Anything not requested (late, forged, repeated) is ignored."""
    state = plan.state
    request = next(
        (
            r
            for r in state.requested
            if (r.step, r.uri, r.worker) == (command.step, command.uri, command.worker)
        ),
        None,
    )
    if request is None:
        return
    plan.emit(
        CheckpointSaved,
        worker=command.worker,
        step=command.step,
        uri=command.uri,
        digest=command.digest,
        sha256=command.sha256,
        bytes=command.bytes,
        position=request.position,
    )
    keep = plan.config.checkpoint_keep
    for old in plan.state.checkpoints[: max(0, len(plan.state.checkpoints) - keep)]:
        plan.emit(CheckpointExpired, step=old.step, uri=old.uri, worker=command.worker)


def _rewind(
    plan: _DecisionPlan,
    to_step: int,
    source: Literal["checkpoint", "scratch"],
    position: DataPosition,
    reason: str,
    uri: str | None = None,
    digest: str | None = None,
    sha256: str | None = None,
) -> None:
    """Back to the weights after `to_step`: later steps leave the lineage, their samples go
    back to their epochs, and checkpoints of those steps leave the index."""
    state = plan.state
    for old in state.checkpoints:
        if old.step > to_step:
            plan.emit(CheckpointExpired, step=old.step, uri=old.uri, worker=None)
    plan.emit(
        Rewound,
        from_step=state.last_committed,
        to_step=to_step,
        source=source,
        uri=uri,
        digest=digest,
        sha256=sha256,
        position=position,
        reason=reason,
    )


def _resume(plan: _DecisionPlan, command: Resume) -> None:
    """An operator continues a job whose weights are lost, from scratch or a checkpoint."""
    state = plan.state
    if state.weights_lost is None:
        return  # nothing is lost: a resume would discard committed training
    if command.uri is None or command.position is None:
        _rewind(plan, -1, "scratch", lineage.beginning(state), command.reason or "from scratch")
    else:
        _rewind(
            plan,
            command.step,
            "checkpoint",
            command.position,
            command.reason or f"resumed from {command.uri}",
            uri=command.uri,
            digest=command.digest,
            sha256=command.sha256,
        )
    _pace(plan)
