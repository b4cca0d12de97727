"""Each epoch's order (events/order.py): a keyed bijection of the samples, and exactly once
in sample space whatever the world did (invariant 3 of docs/design.md, shuffled)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from cohort.coordinator.audit import audit, committed_batches
from cohort.events.models import Fact, JobConfig, StepCommitted
from cohort.events.order import SCALAR_BELOW, Order, positions
from cohort.worker.membership import view as views
from tests.unit.job import Job

sizes = st.integers(1, 5000)
seeds = st.integers(0, 2**53)
epochs = st.integers(0, 10_000)


# ---------------------------------------------------------------- the permutation


@given(size=sizes, seed=seeds, epoch=epochs)
def test_an_epoch_s_order_is_a_permutation_of_the_samples(size: int, seed: int, epoch: int) -> None:
    samples = Order.shuffled(size, seed, epoch).take(np.arange(size))
    assert np.array_equal(np.sort(samples), np.arange(size))


@pytest.mark.parametrize("size", [2**20, 2**20 + 1, 999_983])
def test_a_large_order_is_a_permutation_too(size: int) -> None:
    samples = Order.shuffled(size, 7, 3).take(np.arange(size))
    assert np.array_equal(np.sort(samples), np.arange(size))


@given(size=sizes, seed=seeds, epoch=epochs, data=st.data())
def test_one_position_at_a_time_gives_what_a_batch_gives(
    size: int, seed: int, epoch: int, data: st.DataObject
) -> None:
    order = Order.shuffled(size, seed, epoch)
    at = data.draw(st.lists(st.integers(0, size - 1), min_size=SCALAR_BELOW + 1, max_size=200))
    assert order.take(at).tolist() == [order[p] for p in at]


@given(
    ranges=st.lists(st.tuples(st.integers(0, 500), st.integers(0, 50)), max_size=20),
    seed=seeds,
)
def test_samples_of_ranges_are_their_positions_in_order(
    ranges: list[tuple[int, int]], seed: int
) -> None:
    ranges = [(start, start + length) for start, length in ranges]
    expanded = [p for start, stop in ranges for p in range(start, stop)]
    assert positions(ranges).tolist() == expanded
    order = Order.shuffled(600, seed, 1)
    assert order.samples(ranges).tolist() == [order[p] for p in expanded]


parts_of = st.lists(
    st.lists(st.tuples(st.integers(0, 4000), st.integers(0, 70)), max_size=4), max_size=40
)


@settings(deadline=None)
@given(size=st.integers(4071, 6000), seed=seeds, epoch=epochs, parts=parts_of)
def test_many_batches_mapped_at_once_give_each_index_s_sample(
    size: int, seed: int, epoch: int, parts: list[list[tuple[int, int]]]
) -> None:
    """`samples_of` (one vectorised pass over many batches, as the loader maps the steps
    ahead) gives every position the sample the per-index network gives it."""
    batches = [[(start, start + length) for start, length in part] for part in parts]
    for order in (Order.shuffled(size, seed, epoch), Order.identity(size)):
        got = order.samples_of(batches)
        assert len(got) == len(batches)
        for part, samples in zip(batches, got, strict=True):
            assert samples.tolist() == [order[p] for a, b in part for p in range(a, b)]


@settings(deadline=None, max_examples=30)
@given(seed=seeds, epoch=epochs, files=st.lists(st.integers(1, 100), min_size=1, max_size=12))
def test_many_batches_of_a_dataset_of_files_mapped_at_once_give_each_index_s_sample(
    seed: int, epoch: int, files: list[int]
) -> None:
    size = sum(files)
    order = Order.of(size, tuple(files), seed, epoch)
    batches = [((a, min(a + 64, size)),) for a in range(0, size, 64)]
    each = order.take(np.arange(size)).tolist()  # FileOrder's per-index path is this one
    for part, samples in zip(batches, order.samples_of(batches), strict=True):
        assert samples.tolist() == [each[p] for a, b in part for p in range(a, b)]


def test_no_batches_map_to_no_samples() -> None:
    assert Order.shuffled(100, 1, 2).samples_of([]) == []
    assert [s.tolist() for s in Order.shuffled(100, 1, 2).samples_of([(), ()])] == [[], []]


@given(size=st.integers(50, 100_000), seed=seeds, epoch=epochs)
def test_orders_differ_across_epochs_and_seeds(size: int, seed: int, epoch: int) -> None:
    first = Order.shuffled(size, seed, epoch).take(np.arange(50))
    assert not np.array_equal(first, Order.shuffled(size, seed, epoch + 1).take(np.arange(50)))
    assert not np.array_equal(first, Order.shuffled(size, seed + 1, epoch).take(np.arange(50)))
    assert np.array_equal(first, Order.shuffled(size, seed, epoch).take(np.arange(50)))


def test_the_order_is_pinned_across_versions_and_platforms() -> None:
    """The orders are part of what a journal means: a job replayed by a later cohort, on
    any machine, must find the samples it trained on. Changing these numbers changes it."""
    assert Order.shuffled(20, 0, 0).take(np.arange(20)).tolist() == [
        12, 3, 11, 16, 1, 2, 6, 17, 18, 7, 5, 10, 4, 0, 13, 14, 9, 15, 8, 19,
    ]  # fmt: skip
    assert [Order.shuffled(60_000, 42, 3)[p] for p in (0, 1, 59_999)] == [15925, 13091, 21770]


@pytest.mark.parametrize("seed, epoch", [(0, 0), (1, 0), (0, 1), (12345, 7)])
def test_a_shuffled_order_keeps_no_trace_of_index_order(seed: int, epoch: int) -> None:
    size = 10_000
    samples = Order.shuffled(size, seed, epoch).take(np.arange(size))
    assert abs(np.corrcoef(np.arange(size), samples)[0, 1]) < 0.05
    assert np.count_nonzero(samples == np.arange(size)) < 10  # fixed points: 1 expected
    assert np.count_nonzero(np.abs(np.diff(samples)) == 1) < 20  # neighbours: 2 expected
    halves = np.bincount(samples[: size // 10] * 10 // size, minlength=10)
    assert halves.min() > 0.7 * size // 100  # the first tenth draws from every tenth


def test_a_job_that_does_not_shuffle_uses_positions_as_samples() -> None:
    order = JobConfig(shuffle=False, dataset_size=100).order(5)
    assert order.samples(((3, 6), (90, 92))).tolist() == [3, 4, 5, 90, 91]
    shuffled = JobConfig(dataset_size=100, seed=9).order(5)
    assert shuffled == Order.shuffled(100, 9, 5)


def test_a_position_outside_the_epoch_is_refused() -> None:
    with pytest.raises(IndexError, match="outside"):
        Order.shuffled(10, 0, 0)[10]
    with pytest.raises(IndexError, match=r"\[10\]"):
        Order.shuffled(10, 0, 0).take(np.arange(11))


# ---------------------------------------------------------------- through the job

ACTIONS = st.lists(st.sampled_from(["step", "step", "join", "join", "leave", "fail"]), max_size=60)


def run(job: Job, actions: list[str]) -> None:
    """The actions, then steps until the job's length: joiners get fresh names, a leave or
    a failure takes a rank that is not the last holder of the weights (else the job would
    wait for an operator's resume)."""
    joined = 0
    for action in actions:
        if job.state.finished:
            return
        spare = [w for w in job.state.ranks if job.state.holders - {w}]
        if action == "step":
            job.step()
        elif action == "join":
            joined += 1
            job.start(f"j{joined}")
        elif action == "leave" and spare:
            job.leave(spare[-1])
        elif action == "fail" and spare:
            fail(job, spare[0])
    for _ in range(2000):
        if job.state.finished:
            return
        job.step()
    raise AssertionError("the job did not reach its length")


def fail(job: Job, worker: str) -> None:
    """`worker` falls silent while the others heartbeat, until the leader fails it."""
    while worker in job.state.members:
        job.now += 1
        job.alive(*(w for w in job.state.members if w != worker))
        job.advance(0)


def trained(journal: list[Fact]) -> dict[int, dict[int, int]]:
    """epoch -> {position: sample} of every committed step, as each rank computed its own
    samples from its view of the journal (views.batch and views.order_for)."""
    workers = {w for f in journal if isinstance(w := getattr(f, "worker", None), str)}
    seen = {w: views.View(worker=w) for w in workers}
    used: dict[int, dict[int, int]] = {}
    for fact, before, _ in committed_batches(journal):
        if isinstance(fact, StepCommitted):
            for rank in before.ranks:
                view = seen[rank]
                ranges = views.batch(view, fact.step)
                order = views.order_for(view, fact.step)
                epoch = views.plan_for(view, fact.step).epoch
                for position, sample in zip(
                    positions(ranges).tolist(), order.samples(ranges).tolist(), strict=True
                ):
                    assert position not in used.setdefault(epoch, {}), (epoch, position)
                    used[epoch][position] = sample
        seen = {w: views.evolve(view, fact) for w, view in seen.items()}
    return used


@settings(max_examples=100, deadline=None)
@given(
    size=st.integers(20, 120),
    batch=st.integers(1, 7),
    seed=seeds,
    actions=ACTIONS,
)
def test_each_epoch_s_samples_are_used_once_and_in_the_same_order_whatever_the_world_did(
    size: int, batch: int, seed: int, actions: list[str]
) -> None:
    settings_ = dict(dataset_size=size, batch_size=batch, seed=seed, epochs=2)
    job = Job(heartbeat_timeout=3, **settings_)
    job.start("a", "b")
    job.step()  # both hold the weights: either may go
    run(job, actions)
    calm = Job(heartbeat_timeout=3, **settings_)  # the same job, one worker, no changes
    calm.start("a")
    run(calm, [])

    counters = job.state.counters
    event(f"failures: {min(counters.failed, 2)}, leaves: {min(counters.left, 2)}")
    event(f"world changes > 3: {counters.world_changes > 3}")
    report = audit(job.journal)
    assert report.ok, (report.problems, report.epochs)
    used, reference = trained(job.journal), trained(calm.journal)
    assert sorted(used) == [0, 1]
    for epoch, samples in used.items():
        assert sorted(samples.values()) == list(range(size))  # each sample exactly once
        # the same order, whatever the world did: position p holds the same sample
        assert samples == reference[epoch]
    assert used[0] != used[1]  # and each epoch has its own


def test_the_audit_catches_an_order_that_is_not_a_bijection() -> None:
    job = Job(dataset_size=40, batch_size=4, epochs=1, seed=3)
    job.start("a", "b")
    run(job, [])
    assert audit(job.journal).ok

    class Collides(Order):
        """Position 1 holds position 0's sample: one sample used twice, one never."""

        def take(self, at):  # type: ignore[no-untyped-def]
            samples = Order.take(self, at)
            samples[np.asarray(at) == 1] = Order.__getitem__(self, 0)
            return samples

    real = JobConfig(dataset_size=40, seed=3).order(0)
    report = audit(job.journal, order_of=lambda config, epoch: Collides(40, real.keys))
    assert not report.ok
    assert report.epochs[0].duplicates == [(real[0], real[0] + 1)]
    assert report.epochs[0].missing == [(real[1], real[1] + 1)]

    class Escapes(Order):
        def take(self, at):  # type: ignore[no-untyped-def]
            return Order.take(self, at) + 1  # sample 39 becomes 40: outside the data set

    report = audit(job.journal, order_of=lambda config, epoch: Escapes(40, real.keys))
    assert "map outside the data set [0, 40)" in " ".join(report.problems)
