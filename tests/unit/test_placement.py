"""How an epoch's positions are dealt to ranks (events/deal.py), and the dataset a job
trains on: declared by its workers, refused by what differs."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from cohort.coordinator.audit import audit, committed_batches
from cohort.events import deal
from cohort.events.models import (
    Dataset,
    DatasetDeclared,
    JobConfig,
    JoinRefused,
    Node,
    StepCommitted,
    WorkerJoined,
)
from cohort.events.order import Order
from cohort.events.shards import Shard, range_count
from tests.unit.job import Job, types

FILES = tuple([40, 25, 60, 10, 33, 47, 21, 52, 38, 14, 29, 31])
DATA = Dataset(size=sum(FILES), fingerprint="twelve-files", files=FILES)


def dealt(placement: str, ranks: list[str], nodes: dict[str, Node] | None = None, **config):  # type: ignore[no-untyped-def]
    job = JobConfig(placement=placement, batch_size=4, **config)
    order = Order.of(DATA.size, DATA.files, 7, 0)
    return deal.split(job, ((0, DATA.size),), ranks, order, nodes or {}), order, job


def files_of(shard: Shard, order: Order) -> dict[int, int]:
    """File -> positions of it in the shard."""
    held: dict[int, int] = {}
    for start, stop, file in order.pieces(shard.ranges):
        held[file] = held.get(file, 0) + stop - start
    return held


# ---------------------------------------------------------------- every placement


@settings(max_examples=60, deadline=None)
@given(
    placement=st.sampled_from(["contiguous", "strided", "hash", "locality"]),
    n=st.integers(1, 7),
    global_batch=st.one_of(st.none(), st.integers(1, 40)),
)
def test_each_placement_deals_every_position_once_in_shares_that_differ_by_one(
    placement: str, n: int, global_batch: int | None
) -> None:
    ranks = [f"w{i}" for i in range(n)]
    shards, _, config = dealt(placement, ranks, global_batch=global_batch)
    if placement == "strided":
        assert all(s == shards[0] for s in shards) and shards[0].ranges == ((0, DATA.size),)
        return
    positions = sorted(p for s in shards for p in s.indices())
    assert positions == list(range(DATA.size))
    per_step = deal.counts(config, n)
    for shard, count in zip(shards, per_step, strict=True):
        exact = DATA.size * count / sum(per_step)
        assert abs(shard.size - exact) <= 1  # each rank runs out of data at the same step


@settings(max_examples=200, deadline=None)
@given(
    placement=st.sampled_from(["contiguous", "strided"]),
    sizes=st.lists(st.integers(1, 40), max_size=5),
    global_batch=st.one_of(st.none(), st.integers(1, 40)),
    base_step=st.integers(0, 3),
    next_step=st.integers(0, 30),
)
def test_an_epoch_is_exhausted_exactly_when_its_steps_used_every_position(
    placement: str, sizes: list[int], global_batch: int | None, base_step: int, next_step: int
) -> None:
    config = JobConfig(placement=placement, batch_size=4, global_batch=global_batch)
    shards = [Shard(ranges=((0, size),)) for size in sizes]
    if placement == "strided":
        shards = shards[:1] * len(shards)
    total = shards[0].size if placement == "strided" and shards else sum(s.size for s in shards)
    used = deal.used(config, shards, base_step, next_step)
    assert deal.exhausted(config, shards, base_step, next_step) == (used >= total)


# ---------------------------------------------------------------- strided


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 6), steps=st.integers(0, 12), global_batch=st.integers(1, 30))
def test_strided_ranks_take_turns_within_each_step_s_span_of_the_order(
    n: int, steps: int, global_batch: int
) -> None:
    """Rank r takes items r, r + n, ... of step j's span [j G, (j + 1) G) of `rest`: the
    world uses `rest` strictly in order, whatever its size (floating-point sums)."""
    ranks = [f"w{i}" for i in range(n)]
    shards, _, config = dealt("strided", ranks, global_batch=global_batch, reduction="float")
    span = set()
    for rank in range(n):
        mine = [p for a, b in deal.batch(config, shards, rank, 0, steps) for p in range(a, b)]
        assert all((p - steps * global_batch) % n == rank for p in mine)
        span.update(mine)
    expected = set(range(steps * global_batch, min((steps + 1) * global_batch, DATA.size)))
    assert span == expected


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 9), steps=st.integers(0, 30), global_batch=st.integers(1, 30))
def test_exact_sums_deal_each_step_in_whole_units_the_same_at_any_world_size(
    n: int, steps: int, global_batch: int
) -> None:
    """With exact sums, step j's span is cut into units of `batch_size` (4) positions, rank
    r taking the r-th of n runs of consecutive units, whole (lengths differing by at most
    one): a rank's micro-batches are those units, so every unit holds the same positions
    in the same order whatever the world size."""
    ranks = [f"w{i}" for i in range(n)]
    shards, _, config = dealt("strided", ranks, global_batch=global_batch)
    assert config.exact
    start = steps * global_batch
    stop = min(start + global_batch, DATA.size)
    units = [tuple(range(a, min(a + 4, stop))) for a in range(start, stop, 4)]
    runs = []
    for rank in range(n):
        ranges = deal.batch(config, shards, rank, 0, steps)
        micro = deal.micro_batches(config, ranges)
        got = [tuple(p for a, b in m for p in range(a, b)) for m in micro if m]
        mine = deal.units_of(len(units), n, rank)
        assert got == units[mine.start : mine.stop]
        runs.append(len(got))
        weight = deal.weight(config, shards, rank, 0, steps)
        assert weight == (sum(map(len, got)) * n / (stop - start) if units else 0.0)
    assert sum(runs) == len(units) and max(runs) - min(runs) <= 1
    assert runs == sorted(runs, reverse=True)  # a rank left without a unit is never the chief


def test_exact_sums_need_a_constant_global_batch_dealt_strided() -> None:
    for bad in ({"placement": "strided"}, {"global_batch": 8}):
        try:
            JobConfig(reduction="exact", **bad)  # type: ignore[arg-type]
        except ValueError as error:
            assert "(--global-batch N) and placement 'strided'" in str(error)
        else:
            raise AssertionError(f"{bad} was taken")
    assert not JobConfig(global_batch=8).exact and not JobConfig(placement="strided").exact


def test_strided_with_a_global_batch_makes_the_same_batches_whatever_the_world_did() -> None:
    """Same seed, same global batch: a world that grows, shrinks and loses a rank mid-epoch
    trains on exactly the batches, step by step, of one that never changed."""

    def run(script: list[tuple[str, str]]) -> list[list[int]]:
        job = Job(dataset_size=50, placement="strided", global_batch=6, batch_size=2, seed=3)
        job.start("a", "b")
        for action, worker in script:
            if action == "join":
                job.join(worker)
                job.ready(worker, max(job.state.last_committed, 0))
            elif action == "leave":
                job.leave(worker)
            job.step()
        while job.state.counters.epochs_finished < 2:
            job.step()
        batches = []
        for fact, before, ranges in committed_batches(job.journal):
            if isinstance(fact, StepCommitted) and ranges is not None:
                used = [r for rank in ranges for r in rank]
                batches.append(sorted(before.order().samples(used).tolist()))
        assert audit(job.journal).ok
        return batches

    steady = run([("step", "")] * 3)
    changing = run([("join", "c"), ("step", ""), ("join", "d"), ("leave", "a"), ("leave", "c")])
    assert len(steady) == len(changing) == 2 * 9  # ceil(50 / 6) steps an epoch
    assert steady == changing


# ---------------------------------------------------------------- hash


def test_hash_keeps_a_worker_s_files_across_epochs_and_moves_only_a_leaver_s() -> None:
    ranks = [f"w{i}" for i in range(4)]
    config = JobConfig(placement="hash", batch_size=4)
    owners = []
    for epoch in range(3):
        order = Order.of(DATA.size, DATA.files, 7, epoch)
        shards = deal.split(config, ((0, DATA.size),), ranks, order, {})
        owners.append(
            {
                f: max(range(4), key=lambda r: files_of(shards[r], order).get(f, 0))
                for f in range(len(FILES))
            }
        )
    same = sum(owners[0][f] == owners[e][f] for e in (1, 2) for f in range(len(FILES)))
    assert same >= 0.6 * 2 * len(FILES)  # most files stay; shares cut a few differently
    contiguous = JobConfig(batch_size=4)
    moved = []
    for config_ in (config, contiguous):
        order = Order.of(DATA.size, DATA.files, 7, 0)
        before = deal.split(config_, ((0, DATA.size),), ranks, order, {})
        after = deal.split(config_, ((0, DATA.size),), ranks[:3], order, {})
        moved.append(
            sum(
                sum(
                    abs(files_of(before[r], order).get(f, 0) - files_of(after[r], order).get(f, 0))
                    for f in range(len(FILES))
                )
                for r in range(3)
            )
        )
    assert moved[0] < moved[1]  # fewer positions change hands than when cut in runs


# ---------------------------------------------------------------- locality


def test_locality_gives_each_node_its_own_files_when_their_sizes_allow() -> None:
    """Two nodes, each holding half the data by size: every file is read where it lies."""
    halves = Dataset(size=200, files=(50, 50, 50, 50))
    nodes = {"a": Node(files=((0, 1), (2, 3))), "b": Node(files=((1, 2), (3, 4)))}
    config = JobConfig(placement="locality", batch_size=4)
    for epoch in range(3):
        order = Order.of(halves.size, halves.files, 1, epoch)
        a, b = deal.split(config, ((0, 200),), ["a", "b"], order, nodes)
        assert set(files_of(a, order)) == {0, 2} and set(files_of(b, order)) == {1, 3}


def test_locality_prefers_holders_then_hardware_and_stays_exactly_once() -> None:
    nodes = {
        "gpu-big": Node(gpus=8, gpu_memory=8 * 80 << 30, files=((0, 3),)),
        "gpu-small": Node(gpus=1, gpu_memory=16 << 30),
        "cached": Node(locality=1.0),
    }
    shards, order, _ = dealt("locality", list(nodes), nodes)
    assert sorted(p for s in shards for p in s.indices()) == list(range(DATA.size))
    held = files_of(shards[0], order)
    # the holder reads its files (as much as its share lets it) ...
    assert sum(held.get(f, 0) for f in range(3)) >= min(sum(FILES[:3]), shards[0].size) - 1
    # ... and with no file of its own, a node that declares the data local beats one that
    # only has more hardware to the first pick: 0.5 of locality against 0.2 of hardware
    local, _, _ = dealt("locality", ["gpu-small", "cached"], nodes)
    pieces = list(order.pieces(((0, DATA.size),)))
    first = pieces[0]
    assert any(a <= first[0] < b for a, b in local[1].ranges)


# ---------------------------------------------------------------- the dataset


def test_the_first_declared_dataset_is_journaled_and_other_data_is_refused_by_name() -> None:
    job = Job(dataset=DATA)
    facts = job.join("a")
    assert types(facts) == ["DatasetDeclared", "WorkerJoined"]
    assert isinstance(facts[0], DatasetDeclared) and facts[0].dataset == DATA
    job.dataset = Dataset(size=DATA.size, fingerprint="other-data")
    (refusal,) = job.join("b")
    assert isinstance(refusal, JoinRefused)
    assert "fingerprint 'other-data', not 'twelve-files'" in refusal.reason
    job.dataset = Dataset(size=DATA.size + 1)
    (refusal,) = job.join("c")
    assert (
        isinstance(refusal, JoinRefused)
        and f"{DATA.size + 1} samples, not {DATA.size}" in refusal.reason
    )
    job.dataset = None  # a worker that declares nothing takes the job's
    assert types(job.join("d")) == ["WorkerJoined"]
    assert job.replayed().dataset == DATA


def test_a_worker_whose_data_adapts_takes_the_job_s_or_gives_its_own() -> None:
    """The example and simulated workers make their data to the job's size: they never
    meet a refusal for it, and a job that knows nothing takes their size."""
    synthetic = Dataset(size=60_000, adapts=True)
    job = Job(dataset=synthetic, dataset_size=2048)
    assert types(job.join("a")) == ["WorkerJoined"] and job.state.dataset == Dataset(size=2048)
    fresh = Job(dataset=synthetic, dataset_size=None)
    facts = fresh.join("a")
    assert types(facts) == ["DatasetDeclared", "WorkerJoined"]
    assert fresh.state.dataset == Dataset(size=60_000)  # journaled as plain data


def test_a_job_that_knows_no_dataset_refuses_a_worker_that_declares_none() -> None:
    job = Job(dataset=None, dataset_size=None)
    (refusal,) = job.join("a")
    assert isinstance(refusal, JoinRefused)
    assert "--dataset-size" in refusal.reason and "ElasticJob(dataset=" in refusal.reason


def test_a_launcher_agent_joins_a_job_that_knows_no_dataset() -> None:
    from cohort.events.models import Join

    job = Job(dataset=None, dataset_size=None)
    facts = job.send(Join(at=job.now, job="unit", worker="torchrun-1", role="agent"))
    assert types(facts) == ["WorkerJoined"] and job.state.dataset is None


def test_placing_by_file_needs_files() -> None:
    job = Job(placement="hash")  # the config's 60000 samples, no files
    (refusal,) = job.join("a")
    assert isinstance(refusal, JoinRefused) and "names no files" in refusal.reason
    job.dataset = Dataset(size=60_000, files=(30_000, 30_000))
    facts = job.join("a")
    assert types(facts) == ["DatasetDeclared", "WorkerJoined"]


def test_a_node_s_description_travels_into_the_state() -> None:
    node = Node(host="h1", zone="eu-1a", region="eu-1", gpus=2, gpu_memory=2 << 34)
    job = Job(nodes=lambda worker: node)
    (joined,) = job.join("a")
    assert isinstance(joined, WorkerJoined) and joined.node == node
    assert job.replayed().members["a"].node == node


def test_a_global_batch_weighs_each_rank_by_its_share_of_the_step() -> None:
    config = JobConfig(global_batch=10, batch_size=4)
    shards = deal.split(config, ((0, 23),), ["a", "b", "c"], Order.identity(23), {})
    assert deal.counts(config, 3) == (4, 3, 3)
    weights = [deal.weight(config, shards, r, 0, 0) for r in range(3)]
    assert np.isclose(sum(weights), 3) and weights[0] > weights[1]
    last = 2  # 23 positions: steps of 10, 10, then 3
    sizes = [range_count(deal.batch(config, shards, r, 0, last)) for r in range(3)]
    assert sum(sizes) == deal.step_total(config, shards, 0, last) == 3
    assert deal.micro_batches(config, deal.batch(config, shards, 0, 0, 0)) == (((0, 4),),)
    big = JobConfig(global_batch=20, batch_size=4)
    assert [range_count(m) for m in deal.micro_batches(big, ((0, 10),))] == [4, 4, 2]


def test_status_shows_each_worker_s_node_and_the_dataset() -> None:
    from rich.console import Console

    from cohort.coordinator.replay import view
    from cohort.render.terminal import status_view

    job = Job(
        dataset=DATA,
        placement="strided",
        global_batch=8,
        nodes=lambda w: Node(host=f"host-{w}", zone="eu-1a", gpus=2, gpu_memory=2 * 80 << 30),
    )
    job.start("a", "b")
    job.step()
    base = job.state.base_step
    job.step()
    body = view(job.state)
    assert body["dataset"] == {"size": DATA.size, "fingerprint": "twelve-files", "files": 12}
    assert body["members"]["a"]["node"]["zone"] == "eu-1a"
    console = Console(width=240, record=True)
    console.print(status_view(body))
    text = console.export_text()
    assert "host-a eu-1a 2 GPU 160 GiB" in text and "host-b eu-1a" in text
    rest = DATA.size - 8 * base
    assert f"8/{rest}" in text  # a strided rank's turn: the world's 8 of the rest
