"""The worker's pure fold: membership, worlds, epochs and the batch of every step."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cohort.events import models as m
from cohort.events.deal import batch as deal_batch
from cohort.events.shards import Range, Shard
from cohort.worker.errors import NotAssignedError
from cohort.worker.membership.view import KEEP_PLANS, View, batch, evolve, fold

JOB = "unit"
ME = "me"


def fact(cls: type[Any], **body: Any) -> Any:
    return cls(at=1.0, job=JOB, **body)


def split(ranges: tuple[Range, ...], n: int) -> tuple[Shard, ...]:
    """Contiguous split of the concatenated `ranges` into n shards, remainder one each."""
    whole = Shard(ranges=ranges)
    size, out, offset = whole.size, [], 0
    for r in range(n):
        count = size // n + (1 if r < size % n else 0)
        out.append(Shard(ranges=whole.take(offset, count)))
        offset += count
    return tuple(out)


def world(version: int, start: int, ranks: tuple[str, ...], shards: tuple[Shard, ...], epoch=0):
    return fact(
        m.WorldChanged, version=version, start_step=start, epoch=epoch, ranks=ranks, shards=shards
    )


def configured(**config: Any) -> View:
    return evolve(
        View(worker=ME),
        fact(m.JobConfigured, config=m.JobConfig(**{"dataset_size": 60_000, **config})),
    )


def indices(ranges: tuple[Range, ...]) -> list[int]:
    return [i for start, stop in ranges for i in range(start, stop)]


def test_job_configured_sets_the_config() -> None:
    view = configured(batch_size=7)
    assert view.config is not None and view.config.batch_size == 7
    assert view.world_version == 0 and view.last_committed == -1 and not view.member


def test_membership_path_from_join_to_active() -> None:
    view = fold(
        [
            fact(m.WorkerJoined, worker=ME),
            fact(m.WorkerJoined, worker="other"),
        ],
        configured(),
    )
    assert view.member and view.status == "syncing" and view.joins == 1
    assert view.members == {ME, "other"}
    view = evolve(view, fact(m.WorkerSynced, worker=ME, step=0))
    assert view.status == "ready"
    view = evolve(view, fact(m.WorkerActivated, worker="other"))
    assert view.status == "ready"
    view = evolve(view, fact(m.WorkerActivated, worker=ME))
    assert view.status == "active"
    assert not view.active  # active status, but no world holds it yet
    view = evolve(view, world(1, 0, ("other", ME), split(((0, 10),), 2)))
    assert view.active
    assignment = view.assignment
    assert assignment is not None
    assert (assignment.rank, assignment.world_size, assignment.world_version) == (1, 2, 1)
    assert assignment.shard == Shard(ranges=((5, 10),))


def test_a_spare_waits_ready_outside_the_world_until_promoted_then_trains_like_a_joiner() -> None:
    view = fold(
        [
            fact(m.WorkerJoined, worker=ME, spare=True),
            fact(m.WorldChanged, version=1, start_step=0, epoch=0, ranks=("a", "b"),
                 shards=split(((0, 10),), 2)),
            fact(m.WorkerSynced, worker=ME, step=0),
            fact(m.SparePromoted, worker="other", replaces="a"),  # another spare's promotion
        ],
        configured(),
    )  # fmt: skip
    assert (view.status, view.spare, view.active, view.assignment) == ("ready", True, False, None)
    view = evolve(view, fact(m.SparePromoted, worker=ME, replaces="b"))
    assert (view.status, view.spare, view.active) == ("active", False, False)
    view = evolve(view, world(2, 3, ("a", ME), split(((6, 10),), 2)))
    assignment = view.assignment
    assert view.active and assignment is not None
    assert (assignment.rank, assignment.world_size, assignment.start_step) == (1, 2, 3)


def test_join_refused_for_this_worker_records_the_reason() -> None:
    view = fold(
        [
            fact(m.JoinRefused, worker="other", reason="not me"),
            fact(m.JoinRefused, worker=ME, reason="job is full"),
        ],
        configured(),
    )
    assert view.refusals == 1 and view.refused == "job is full"
    assert not view.member and view.joins == 0


@pytest.mark.parametrize(
    "gone, reason",
    [
        (fact(m.WorkerFailed, worker=ME, last_seen=1.0, timeout=5.0), "failed: silent 5 s"),
        (fact(m.WorkerLeft, worker=ME, reason="drained"), "drained"),
    ],
)
def test_worker_removed_when_it_fails_or_leaves_and_rejoin_clears_it(gone, reason) -> None:
    view = fold([fact(m.WorkerJoined, worker=ME), gone], configured())
    assert view.removed and not view.member and view.status == "outside"
    assert reason in view.removed_reason
    view = evolve(view, fact(m.WorkerJoined, worker=ME))
    assert not view.removed and view.member and view.joins == 2


def test_other_workers_leaving_does_not_remove_this_one() -> None:
    view = fold(
        [
            fact(m.WorkerJoined, worker=ME),
            fact(m.WorkerJoined, worker="x"),
            fact(m.WorkerFailed, worker="x", last_seen=0.0, timeout=5.0),
        ],
        configured(),
    )
    assert not view.removed and view.members == {ME}


def test_pause_makes_a_rank_inactive_until_resumed() -> None:
    view = fold(
        [
            fact(m.WorkerJoined, worker=ME),
            world(1, 0, (ME,), split(((0, 10),), 1)),
            fact(m.TrainingPaused, reason="few", active=1, min_workers=2),
        ],
        configured(),
    )
    assert view.paused and not view.active and view.assignment is not None
    assert evolve(view, fact(m.TrainingResumed, active=2)).active


def test_batches_walk_the_shard_from_the_world_start() -> None:
    view = fold([world(1, 10, ("a", ME), split(((0, 20),), 2))], configured(batch_size=4))
    assert batch(view, 10) == ((10, 14),)
    assert batch(view, 11) == ((14, 18),)
    assert batch(view, 12) == ((18, 20),)  # the last batch of the shard is short
    assert batch(view, 13) == ()
    with pytest.raises(NotAssignedError):
        batch(view, 9)  # before any plan this worker knows


def test_batch_of_a_step_uses_the_plan_it_ran_under() -> None:
    view = fold(
        [
            world(1, 0, (ME,), (Shard(ranges=((0, 10),)),)),
            world(2, 3, ("b", ME), (Shard(ranges=((6, 8),)), Shard(ranges=((8, 10),)))),
        ],
        configured(batch_size=2),
    )
    assert batch(view, 2) == ((4, 6),)  # step 2 ran in world 1
    assert batch(view, 3) == ((8, 10),)  # world 2 from step 3
    assert view.assignment is not None and view.assignment.start_step == 3


def test_epoch_started_restarts_the_shards_but_keeps_the_world() -> None:
    view = fold(
        [
            world(1, 0, (ME,), (Shard(ranges=((0, 10),)),)),
            fact(m.StepCommitted, step=1, world=1),
            fact(m.EpochFinished, epoch=0, step=1),
            fact(m.EpochStarted, epoch=1, start_step=2, shards=(Shard(ranges=((0, 10),)),)),
        ],
        configured(batch_size=5),
    )
    assert view.epoch == 1 and view.base_step == 2 and view.world_version == 1
    assert batch(view, 1) == ((5, 10),)
    assert batch(view, 2) == ((0, 5),)
    assert view.assignment is not None
    assert view.assignment.start_step == 0  # the world's start, not the epoch's
    assert view.next_step == 2


def test_step_committed_never_goes_back_and_plans_are_bounded() -> None:
    view = configured()
    for v in range(1, KEEP_PLANS + 5):
        view = evolve(view, world(v, v, (ME,), (Shard(ranges=((0, 10),)),)))
    assert len(view.plans) == KEEP_PLANS and view.world_version == KEEP_PLANS + 4
    view = fold(
        [fact(m.StepCommitted, step=5, world=1), fact(m.StepCommitted, step=3, world=1)], view
    )
    assert view.last_committed == 5


def test_batch_needs_a_configured_job() -> None:
    view = evolve(View(worker=ME), world(1, 0, (ME,), (Shard(ranges=((0, 10),)),)))
    with pytest.raises(NotAssignedError, match="not configured"):
        batch(view, 0)


def test_a_batch_before_its_world_s_base_step_is_refused() -> None:
    with pytest.raises(ValueError, match="precedes"):
        deal_batch(m.JobConfig(batch_size=2), (Shard(ranges=((0, 4),)),), 0, 5, 4)


@settings(max_examples=150, deadline=None)
@given(
    size=st.integers(1, 300),
    batch_size=st.integers(1, 17),
    before=st.integers(1, 6),
    after=st.integers(1, 6),
    change_at=st.integers(0, 40),
)
def test_every_sample_is_used_exactly_once_across_a_world_change(
    size: int, batch_size: int, before: int, after: int, change_at: int
) -> None:
    """Steps before the change read the old plan; the leftover, re-split, covers the rest."""
    old_ranks = tuple(f"w{i}" for i in range(before))
    new_ranks = tuple(f"n{i}" for i in range(after))
    old = split(((0, size),), before)
    leftover = tuple(r for s in old for r in s.skip(change_at * batch_size).ranges)
    facts = [world(1, 0, old_ranks, old)]
    if leftover:
        facts.append(world(2, change_at, new_ranks, split(leftover, after)))
    base = configured(batch_size=batch_size, dataset_size=size)
    used: list[int] = []
    last_step = change_at + size // batch_size + 2
    for worker in old_ranks + new_ranks:
        view = fold(facts, View(worker=worker, config=base.config))
        for step in range(last_step):
            try:
                used += indices(batch(view, step))
            except NotAssignedError:
                continue  # not a rank in the plan of that step
    assert sorted(used) == list(range(size))


def test_a_fact_the_worker_has_no_use_for_leaves_the_view_unchanged() -> None:
    view = configured()
    newer = m.LeaderElected.model_construct(at=1.0, job=JOB, coordinator="c", epoch=1)
    assert evolve(view, object()) is view  # type: ignore[arg-type]
    assert evolve(view, newer) is view


def test_gpu_advice_combines_to_the_smallest_factor_and_longest_delay() -> None:
    from cohort.events.models import GpuAdviceCleared, GpuAdviceIssued
    from cohort.worker.membership.view import View, evolve, gpu_advice

    def issued(device: int, rule: str, action: str, **kw: float) -> GpuAdviceIssued:
        return GpuAdviceIssued(
            at=0,
            job="j",
            worker="me",
            device=device,
            rule=rule,
            action=action,
            metric="memory_pct",
            value=95,
            threshold=85,
            **kw,
        )

    view = View(worker="me")
    view = evolve(view, issued(0, "mem", "reduce_prefetch", factor=0.5))
    view = evolve(view, issued(1, "mem2", "reduce_prefetch", factor=0.25))
    view = evolve(view, issued(0, "hot", "delay_transfers", seconds=30))
    advice = gpu_advice(view)
    assert (advice.prefetch_factor, advice.delay_seconds) == (0.25, 30)
    view = evolve(
        view,
        GpuAdviceCleared(
            at=0, job="j", worker="me", device=1, rule="mem2", metric="memory_pct", value=40
        ),
    )
    assert gpu_advice(view).prefetch_factor == 0.5
    other = evolve(
        view, issued(0, "x", "prioritise_model_files").model_copy(update={"worker": "someone-else"})
    )
    assert not gpu_advice(other).prioritise_model_files


def test_the_world_s_weights_and_this_worker_s_checkpoint_work_reach_the_view() -> None:
    position = m.DataPosition(epoch=0, rest=Shard(ranges=((20, 100),)))
    weights = m.Weights(step=3, source="checkpoint", uri="file:///c/3", sha256="ab" * 32)
    view = fold(
        [
            fact(m.WorkerJoined, worker=ME),
            world(1, 4, (ME,), (Shard(ranges=((20, 100),)),)).model_copy(
                update={"weights": weights}
            ),
            fact(m.CheckpointRequested, worker=ME, step=5, uri="file:///c/5", position=position),
            fact(
                m.CheckpointRequested, worker="other", step=5, uri="file:///c/x", position=position
            ),
        ],
        configured(),
    )
    assert view.assignment is not None and view.assignment.weights == weights
    assert [r.uri for r in view.requested] == ["file:///c/5"]  # only what this worker writes
    saved = fact(
        m.CheckpointSaved, worker=ME, step=5, uri="file:///c/5", sha256="cd" * 32, bytes=9,
        position=position,
    )  # fmt: skip
    view = evolve(view, saved)
    assert view.requested == () and [c.step for c in view.checkpoints] == [5]
    view = evolve(view, fact(m.CheckpointExpired, step=5, uri="file:///c/5", worker=ME))
    assert view.checkpoints == () and [e.uri for e in view.expired] == ["file:///c/5"]
    view = evolve(view, fact(m.WeightsLost, step=7))
    assert view.weights_lost == 7
    rewound = fact(
        m.Rewound, from_step=7, to_step=-1, source="scratch",
        position=m.DataPosition(epoch=0, rest=Shard(ranges=((0, 100),))),
    )  # fmt: skip
    view = evolve(view, rewound)
    assert view.weights_lost is None and view.last_committed == -1
