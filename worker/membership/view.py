"""What one worker knows of its job: a pure fold of journal facts into a frozen View.

`evolve(view, fact)` has one branch per fact type and never does I/O, so the
client's tail thread, replays and tests all share it. `batch` answers "which
positions of its epoch does this worker train on at step S" from the same data, and
`order_for` which sample each position holds.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Literal

from cohort.events import deal
from cohort.events import models as m
from cohort.events.order import Order
from cohort.events.shards import Range, Shard
from cohort.worker.errors import NotAssignedError

Status = Literal["outside", "syncing", "ready", "active", "draining", "evaluating"]

KEEP_PLANS = 8
"""Plans kept for `batch` of recent steps; a training loop is at most a step or two behind."""
KEEP_EXPIRED = 64
"""Expired checkpoints this worker was asked to delete, kept until it has."""


@dataclass(frozen=True, slots=True)
class WorldPlan:
    """Who trains on what from `base_step` on: a WorldChanged, or an EpochStarted within it."""

    world_version: int
    world_start: int
    base_step: int
    epoch: int
    ranks: tuple[str, ...]
    shards: tuple[Shard, ...]
    weights: m.Weights | None = None
    """The weights the world starts from (None: a journal older than weight lineage)."""

    @classmethod
    def of(cls, world: m.WorldChanged) -> WorldPlan:
        """The plan a new world starts with."""
        return cls(
            world_version=world.version,
            world_start=world.start_step,
            base_step=world.start_step,
            epoch=world.epoch,
            ranks=world.ranks,
            shards=world.shards,
            weights=world.weights,
        )

    def assignment_of(self, worker: str) -> Assignment | None:
        """`worker`'s place in this plan's world (None: it holds no rank)."""
        if worker not in self.ranks:
            return None
        rank = self.ranks.index(worker)
        return Assignment(
            rank=rank,
            world_size=len(self.ranks),
            world_version=self.world_version,
            epoch=self.epoch,
            start_step=self.world_start,
            shard=self.shards[rank],
            weights=self.weights,
        )


@dataclass(frozen=True, slots=True)
class Assignment:
    """This worker's place in the current world."""

    rank: int
    world_size: int
    world_version: int
    epoch: int
    start_step: int
    shard: Shard
    weights: m.Weights | None = None
    """What the world starts from: rank 0's weights (a survivor's, or the initial ones), or
    a checkpoint rank 0 loads first (`weights.source == "checkpoint"`)."""


@dataclass(frozen=True, slots=True)
class View:
    worker: str
    config: m.JobConfig | None = None
    dataset: m.Dataset | None = None
    """What the job trains on (its config's size, or the dataset a worker declared)."""
    members: frozenset[str] = frozenset()
    hosts: tuple[tuple[str, str], ...] = ()
    """(worker, host) of every member that named its host when it joined."""
    gone: frozenset[str] = frozenset()
    """Workers the journal removed (left or failed) that have not joined again (torchrun's
    agents re-rendezvous without the ones gone: cohort/worker/pytorch/torchrun/handler.py)."""
    status: Status = "outside"
    spare: bool = False
    """This worker joined as a spare and waits for a rank the job loses (until promoted)."""
    joins: int = 0
    """WorkerJoined facts for this worker; join() waits for this count to grow."""
    refusals: int = 0
    refused: str | None = None
    left: bool = False
    failed: bool = False
    removed_reason: str = ""
    leaving_after: int | None = None
    plans: tuple[WorldPlan, ...] = ()
    last_committed: int = -1
    paused: bool = False
    advice: tuple[m.GpuAdviceIssued, ...] = ()
    """This worker's active GPU advice, oldest first."""
    requested: tuple[m.CheckpointRequested, ...] = ()
    """Checkpoints this worker is asked to write and that are not saved yet."""
    checkpoints: tuple[m.CheckpointSaved, ...] = ()
    """The job's checkpoint index, oldest first."""
    expired: tuple[m.CheckpointExpired, ...] = ()
    """Expired checkpoints whose files this worker is asked to delete."""
    weights_lost: int | None = None
    """The step whose weights nobody holds: the job waits for an operator's `cohort resume`."""
    finished: str | None = None
    """Why the job ended (its JobFinished's reason): no step trains after `last_committed`."""

    # ------------------------------------------------------------ the current plan
    @property
    def plan(self) -> WorldPlan | None:
        return self.plans[-1] if self.plans else None

    @property
    def world_version(self) -> int:
        return self.plans[-1].world_version if self.plans else 0

    @property
    def ranks(self) -> tuple[str, ...]:
        return self.plans[-1].ranks if self.plans else ()

    @property
    def shards(self) -> tuple[Shard, ...]:
        return self.plans[-1].shards if self.plans else ()

    @property
    def base_step(self) -> int:
        return self.plans[-1].base_step if self.plans else 0

    @property
    def epoch(self) -> int:
        return self.plans[-1].epoch if self.plans else 0

    @property
    def next_step(self) -> int:
        return self.last_committed + 1

    # ------------------------------------------------------------ this worker
    @property
    def member(self) -> bool:
        return self.worker in self.members

    @property
    def removed(self) -> bool:
        return self.left or self.failed

    @property
    def active(self) -> bool:
        """A rank of the current world, and training is not paused."""
        return self.worker in self.ranks and not self.paused

    def rank_hosts(self) -> tuple[str, ...]:
        """The host of each rank of the current world (a rank that named none: its id, so
        it is a host of its own)."""
        hosts = dict(self.hosts)
        return tuple(hosts.get(worker) or worker for worker in self.ranks)

    @property
    def assignment(self) -> Assignment | None:
        plan = self.plan
        return plan.assignment_of(self.worker) if plan is not None else None


@dataclass(frozen=True, slots=True)
class GpuAdvice:
    """What this worker's data loader should do now, all its active GPU advice combined.

    The smallest reduce_prefetch factor (two hot GPUs do not quarter the prefetch depth),
    the longest transfer delay, and whether any rule asks to load model files first.
    """

    prefetch_factor: float = 1.0
    delay_seconds: float = 0.0
    prioritise_model_files: bool = False
    rules: tuple[str, ...] = ()


def gpu_advice(view: View) -> GpuAdvice:
    factors = [a.factor for a in view.advice if a.action == "reduce_prefetch" and a.factor]
    delays = [a.seconds for a in view.advice if a.action == "delay_transfers" and a.seconds]
    return GpuAdvice(
        prefetch_factor=min(factors, default=1.0),
        delay_seconds=max(delays, default=0.0),
        prioritise_model_files=any(a.action == "prioritise_model_files" for a in view.advice),
        rules=tuple(dict.fromkeys(a.rule for a in view.advice)),
    )


def evolve(view: View, fact: m.Fact) -> View:  # noqa: C901 - the fact dispatcher: one branch per fact type
    """The view after `fact`. Facts about other workers only change the member set."""
    me = view.worker
    match fact:
        case m.JobConfigured():
            size = fact.config.dataset_size
            dataset = view.dataset if size is None else m.Dataset(size=size)
            return replace(view, config=fact.config, dataset=dataset)
        case m.DatasetDeclared():
            return replace(view, dataset=fact.dataset)
        case m.LeaderElected():
            return view
        case m.WorkerJoined():
            host = (fact.node.host if fact.node is not None else "") or fact.host
            others = tuple(pair for pair in view.hosts if pair[0] != fact.worker)
            view = replace(
                view,
                members=view.members | {fact.worker},
                gone=view.gone - {fact.worker},
                hosts=(*others, (fact.worker, host)) if host else others,
            )
            if fact.worker != me:
                return view
            return replace(
                view,
                status="evaluating" if fact.role == "evaluator" else "syncing",
                spare=fact.spare,
                joins=view.joins + 1,
                left=False,
                failed=False,
                removed_reason="",
                leaving_after=None,
            )
        case m.JoinRefused():
            if fact.worker != me:
                return view
            return replace(view, refusals=view.refusals + 1, refused=fact.reason)
        case m.WorkerSynced():
            return replace(view, status="ready") if fact.worker == me else view
        case m.WorkerActivated():
            return replace(view, status="active") if fact.worker == me else view
        case m.SparePromoted():  # a spare takes a lost rank's place: active, as if activated
            return replace(view, status="active", spare=False) if fact.worker == me else view
        case m.WorkerLeaving():
            if fact.worker != me:
                return view
            return replace(view, status="draining", leaving_after=fact.after_step)
        case m.WorkerLeft():
            return _removed(view, fact.worker, f"left ({fact.reason or 'left'})", left=True)
        case m.WorkerFailed():
            return _removed(view, fact.worker, f"declared failed: {fact.reason}", failed=True)
        case m.WorldChanged():
            return replace(view, plans=(*view.plans, WorldPlan.of(fact))[-KEEP_PLANS:])
        case m.EpochStarted():
            current = view.plan
            if current is None:
                return view  # an epoch without a world: nothing to train on
            plan = replace(current, base_step=fact.start_step, epoch=fact.epoch, shards=fact.shards)
            return replace(view, plans=(*view.plans, plan)[-KEEP_PLANS:])
        case m.StepCommitted():
            return replace(view, last_committed=max(view.last_committed, fact.step))
        case m.EpochFinished():
            return view
        case m.StragglerDetected() | m.StragglerCleared() | m.WeightsDiverged():
            return view
        case m.JournalArchived():  # where old facts went: the tail thread needs none of them
            return view
        case m.GpuAdviceIssued():
            if fact.worker != me:
                return view
            kept = tuple(a for a in view.advice if (a.device, a.rule) != (fact.device, fact.rule))
            return replace(view, advice=(*kept, fact))
        case m.GpuAdviceCleared():
            if fact.worker != me:
                return view
            kept = tuple(a for a in view.advice if (a.device, a.rule) != (fact.device, fact.rule))
            return replace(view, advice=kept)
        case m.TrainingPaused():
            return replace(view, paused=True)
        case m.TrainingResumed():
            return replace(view, paused=False)
        case m.CheckpointRequested():
            if fact.worker != me:
                return view
            return replace(view, requested=(*view.requested, fact)[-m.KEEP_REQUESTS :])
        case m.CheckpointSaved():
            return replace(
                view,
                checkpoints=(*view.checkpoints, fact),
                requested=tuple(r for r in view.requested if r.step > fact.step),
            )
        case m.CheckpointExpired():
            index = tuple(c for c in view.checkpoints if c.uri != fact.uri)
            if fact.worker != me:
                return replace(view, checkpoints=index)
            return replace(view, checkpoints=index, expired=(*view.expired, fact)[-KEEP_EXPIRED:])
        case m.WeightsLost():
            return replace(view, weights_lost=fact.step)
        case m.Rewound():
            return replace(view, last_committed=fact.to_step, requested=(), weights_lost=None)
        case m.JobFinished():
            return replace(view, finished=fact.reason or "finished", paused=True)
    # A fact this worker has no use for yet (e.g. one a newer coordinator writes): the
    # view stays as it is, so a worker keeps training through a coordinator upgrade.
    return view


def _removed(
    view: View, worker: str, reason: str, left: bool = False, failed: bool = False
) -> View:
    """`worker` is no longer a member; if that is this worker, it is outside, for `reason`."""
    view = replace(view, members=view.members - {worker}, gone=view.gone | {worker})
    if worker != view.worker:
        return view
    return replace(
        view,
        status="outside",
        advice=(),
        removed_reason=reason,
        left=view.left or left,
        failed=view.failed or failed,
    )


def fold(facts: Iterable[m.Fact], view: View) -> View:
    """`view` after `facts`, evolved in order (as `coordinator.fold.fold` folds a JobState)."""
    for fact in facts:
        view = evolve(view, fact)
    return view


def plan_for(view: View, step: int) -> WorldPlan:
    """The latest plan with base_step <= `step` (the one `step` trains under)."""
    for plan in reversed(view.plans):
        if plan.base_step <= step:
            return plan
    raise NotAssignedError(
        f"no plan covers step {step} (known plans start at "
        f"{[p.base_step for p in view.plans]}); it is older than this worker's memory"
    )


def batch(view: View, step: int) -> tuple[Range, ...]:
    """The ranges of positions (in its epoch's order) this worker trains on at `step`."""
    config = _configured(view)
    plan = plan_for(view, step)
    if view.worker not in plan.ranks:
        raise NotAssignedError(
            f"worker {view.worker!r} holds no rank at step {step} "
            f"(world {plan.world_version} ranks: {list(plan.ranks)})"
        )
    return deal.batch(config, plan.shards, plan.ranks.index(view.worker), plan.base_step, step)


def weight(view: View, step: int) -> float:
    """This worker's gradient weight at `step` (events/deal.py `weight`)."""
    config = _configured(view)
    plan = plan_for(view, step)
    rank = plan.ranks.index(view.worker)
    return deal.weight(config, plan.shards, rank, plan.base_step, step)


def order_for(view: View, step: int) -> Order:
    """The order of the data epoch `step` trains in: the sample at each of its positions."""
    return _configured(view).order(plan_for(view, step).epoch, view.dataset)


def _configured(view: View) -> m.JobConfig:
    if view.config is None:
        raise NotAssignedError("the job is not configured yet (no JobConfigured in the journal)")
    return view.config
