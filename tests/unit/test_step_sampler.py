"""The loader's batch sampler follows the journal's plan: a step's micro-batches in order,
and after a rewind exactly the rest of the epoch's order (worker/pytorch/loader.py)."""

from __future__ import annotations

from typing import Any

import pytest

from cohort.events import deal
from cohort.events import models as m
from cohort.events.shards import Shard
from cohort.worker.membership import view as views
from cohort.worker.membership.view import View, fold
from cohort.worker.pytorch.loader import StepSampler

JOB = "unit"


def fact(cls: Any, **body: Any) -> Any:
    return cls(at=1.0, job=JOB, **body)


class _Member:
    def __init__(self, view: View) -> None:
        self.view = view


def sampler(facts: list[m.Fact], me: str = "me") -> StepSampler:
    return StepSampler(_Member(fold(facts, View(worker=me))))  # type: ignore[arg-type]


def test_a_rewound_world_reads_exactly_the_rest_of_the_epoch_s_order() -> None:
    config = m.JobConfig(
        dataset_size=40, batch_size=3, global_batch=6, seed=11, placement="strided"
    )
    rest = ((13, 20), (25, 40))  # what a checkpoint's data position left of epoch 2
    facts = [
        fact(m.JobConfigured, config=config),
        fact(
            m.WorldChanged, version=4, start_step=50, epoch=2, ranks=("me", "peer"),
            shards=(Shard(ranges=rest), Shard(ranges=rest)),
        ),
    ]  # fmt: skip
    mine = sampler(facts, "me")
    theirs = sampler(facts, "peer")
    mine.start = theirs.start = (50, 0)
    got = [list(b) for b in mine], [list(b) for b in theirs]
    order = config.order(2)
    expected = order.samples(rest).tolist()  # 22 positions: steps of 6, the last of 4
    by_step = []
    for step in range(4):
        by_step += got[0][step] + got[1][step]
    assert sorted(by_step) == sorted(expected)
    span = expected[:6]
    assert sorted(got[0][0] + got[1][0]) == sorted(span)  # the world reads the rest in turn
    assert [t[1] for t in mine.tags] == [50, 51, 52, 53]


def test_micro_batches_and_a_start_inside_a_step() -> None:
    config = m.JobConfig(dataset_size=30, batch_size=4, global_batch=10, shuffle=False)
    facts = [
        fact(m.JobConfigured, config=config),
        fact(
            m.WorldChanged, version=1, start_step=0, epoch=0, ranks=("me",),
            shards=(Shard(ranges=((0, 30),)),),
        ),
    ]  # fmt: skip
    steps = sampler(facts)
    steps.start = (1, 1)  # step 1's second micro-batch: the first one was trained
    batches = [list(b) for b in steps]
    assert batches[0] == [14, 15, 16, 17]
    assert batches[1] == [18, 19]
    assert [tag[1:] for tag in steps.tags][:4] == [(1, 1), (1, 2), (2, 0), (2, 1)]
    assert sum(len(b) for b in batches) == 30 - 14


def test_a_worker_outside_the_world_samples_nothing() -> None:
    config = m.JobConfig(dataset_size=8, batch_size=4)
    facts = [
        fact(m.JobConfigured, config=config),
        fact(
            m.WorldChanged, version=1, start_step=0, epoch=0, ranks=("other",),
            shards=(Shard(ranges=((0, 8),)),),
        ),
    ]  # fmt: skip
    assert list(sampler(facts)) == []


def test_the_steps_ahead_mapped_at_once_are_each_micro_batch_s_own_samples() -> None:
    """The sampler maps a growing window of steps through the order in one pass: every
    micro-batch gets the samples the per-index order gives its positions, tagged in order,
    across windows, a start inside a step and an epoch's ragged end."""
    config = m.JobConfig(dataset_size=5000, batch_size=7, global_batch=20, seed=3)
    shards = (Shard(ranges=((0, 2500),)), Shard(ranges=((2500, 5000),)))
    facts = [
        fact(m.JobConfigured, config=config),
        fact(
            m.WorldChanged, version=2, start_step=10, epoch=1, ranks=("me", "peer"),
            shards=shards,
        ),
    ]  # fmt: skip
    steps = sampler(facts)
    steps.start = (11, 1)
    got = [list(b) for b in steps]
    order = config.order(1)
    expected, tags = [], []
    view = steps.worker.view
    for step in range(11, 10 + 250):
        for index, part in enumerate(deal.micro_batches(config, views.batch(view, step))):
            if (step, index) >= (11, 1):
                expected.append([order[p] for a, b in part for p in range(a, b)])
                tags.append((2, step, index))
    assert got == expected
    assert list(steps.tags) == tags


class _Squares:
    """A map-style dataset: sample i is i squared."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> int:
        return i * i


def test_a_warmed_loader_starts_its_workers_outside_the_world_and_trains_with_them() -> None:
    """A spare warms its loader while it waits: the workers start then, with no batch to
    load, and the first step after its promotion reads its samples with the same ones."""
    pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from cohort.worker.pytorch.loader import StepLoader

    config = m.JobConfig(dataset_size=16, batch_size=4, shuffle=False)
    waiting = [
        fact(m.JobConfigured, config=config),
        fact(
            m.WorldChanged, version=1, start_step=0, epoch=0, ranks=("a", "b"),
            shards=(Shard(ranges=((0, 8),)), Shard(ranges=((8, 16),))),
        ),
    ]  # fmt: skip
    member = _Member(fold(waiting, View(worker="s")))
    loader = DataLoader(_Squares(), batch_size=4, num_workers=2, persistent_workers=True)
    twin = StepLoader(loader, member)  # type: ignore[arg-type]
    assert twin.warm()
    started = twin.loader._iterator
    assert started is not None
    pids = sorted(w.pid for w in started._workers)
    assert all(w.is_alive() for w in started._workers) and not twin.sampler.tags
    promoted = [
        *waiting,
        fact(
            m.WorldChanged, version=2, start_step=1, epoch=0, ranks=("a", "s"),
            shards=(Shard(ranges=((4, 8),)), Shard(ranges=((8, 16),))),
        ),
    ]  # fmt: skip
    member.view = fold(promoted, View(worker="s"))
    try:
        batch = twin.fetch((2, 1, 0))
        assert batch.tolist() == [i * i for i in range(8, 12)]  # the first batch of its shard
        assert twin.loader._iterator is started
        assert sorted(w.pid for w in started._workers) == pids  # the warmed ones, not new
    finally:
        started._shutdown_workers()


def test_a_loader_that_keeps_no_workers_has_nothing_to_warm() -> None:
    pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from cohort.worker.pytorch.loader import StepLoader

    member = _Member(View(worker="s"))
    for options in ({"num_workers": 0}, {"num_workers": 2, "persistent_workers": False}):
        twin = StepLoader(DataLoader(_Squares(), batch_size=4, **options), member)  # type: ignore[arg-type]
        assert not twin.warm()
        assert twin.loader._iterator is None  # nothing was started


def test_warm_tells_the_script_when_its_loader_cannot_keep_workers_started_ahead() -> None:
    pytest.importorskip("torch")
    import warnings

    from torch.utils.data import DataLoader

    from cohort.worker.pytorch.elastic import ElasticJob

    job = object.__new__(ElasticJob)  # warm() alone: no job to join
    job._loaders, job.worker = {}, _Member(View(worker="s"))  # type: ignore[assignment]
    with pytest.warns(UserWarning, match="persistent_workers=True"):
        job.warm(DataLoader(_Squares(), batch_size=4, num_workers=2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        job.warm(DataLoader(_Squares(), batch_size=4))  # no workers: nothing to say
