"""The tree sum (worker/pytorch/tree.py): a step's units dealt in runs to any number of
ranks, their tensors made in any order, sum to one tree's bits, the same at any world size.
The world's collectives run in process (`World`), each rank's k-th call meeting the others'."""

from __future__ import annotations

import random
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cohort.events.deal import units_of  # noqa: E402
from cohort.worker.pytorch import tree  # noqa: E402
from cohort.worker.pytorch.exact import float32  # noqa: E402
from cohort.worker.pytorch.tree import TreeSum  # noqa: E402
from tests.unit.test_exact import same_bits  # noqa: E402

SHAPES = [(7, 5), (5,), (3, 4, 2), (6,)]
BUCKET_BYTES = 4 * 30  # a few buckets, tensors across slices


class World:
    """`size` ranks' all-to-alls, completed together by `run`."""

    def __init__(self, size: int) -> None:
        self.calls: list[list[tuple[Any, ...]]] = [[] for _ in range(size)]

    def ops(self, rank: int) -> Any:
        world = self

        class Ops:
            def all_to_all(self, received: Any, send: Any, outs: list[int], ins: list[int]) -> None:
                world.calls[rank].append(("a2a", received, send, outs, ins))

        return Ops()

    def run(self) -> None:
        calls, self.calls = self.calls, [[] for _ in self.calls]
        assert len({len(mine) for mine in calls}) == 1, "every rank makes the same calls"
        for step in zip(*calls, strict=True):
            assert len({call[0] for call in step}) == 1, "in the same order"
            for dst, (_, received, _, outs, _) in enumerate(step):
                at = 0
                for src, (_, _, send, _, ins) in enumerate(step):
                    start = sum(ins[:dst])
                    assert ins[dst] == outs[src]
                    received[at : at + outs[src]].copy_(send[start : start + ins[dst]])
                    at += outs[src]


def units_of_grads(seed: int, count: int) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    scales = [10 ** (6 * (2 * torch.rand((), generator=gen).item() - 1)) for _ in SHAPES]
    return [
        [torch.randn(s, generator=gen) * k for s, k in zip(SHAPES, scales, strict=True)]
        for _ in range(count)
    ]


def spec(units: list[list[torch.Tensor]], weights: list[float], equal: bool) -> list[torch.Tensor]:
    """The tree's sum, written as its definition: a leaf is its unit's gradient added into
    zeros (weighed where units differ in size), node (l, i) its halves' sum, or its left
    half where the right one is past the last unit."""
    count = len(units)

    def node(level: int, index: int) -> list[torch.Tensor]:
        if level == 0:
            leaves = [torch.zeros_like(g) + g for g in units[index]]  # -0.0 becomes 0.0
            return leaves if equal else [g * float32(weights[index]) for g in leaves]
        left = node(level - 1, 2 * index)
        if (2 * index + 1) << (level - 1) >= count:
            return left
        return [a + b for a, b in zip(left, node(level - 1, 2 * index + 1), strict=True)]

    root = node(tree.height(count), 0)
    return [r / count for r in root] if equal else root


def world_sum(
    units: list[list[torch.Tensor]],
    weights: list[float],
    size: int,
    equal: bool,
    rng: random.Random,
    idle: frozenset[int] = frozenset(),
) -> list[list[torch.Tensor]]:
    """Each rank's run of units through its TreeSum, the last unit's tensors taken in a
    random order (some left to `add`, as a backward may not reach them), the units in
    `idle` running no backward at all; every rank's sum."""
    world = World(size)
    ranks = []
    for rank in range(size):
        params = [torch.zeros(s, requires_grad=True) for s in SHAPES]
        sums = TreeSum()
        sums.world(lambda start: start(), rank, size, BUCKET_BYTES, ops=world.ops(rank))
        sums.begin(params, len(units), equal)
        run = units_of(len(units), size, rank)
        for index, unit in enumerate(run):
            if unit in idle:
                continue
            for param, grad in zip(params, units[unit], strict=True):
                param.grad = grad.clone()
            if index == len(run) - 1:
                order = list(range(len(SHAPES)))
                rng.shuffle(order)
                for i in order[: rng.randint(0, len(order))]:
                    sums.take(i, params[i].grad, weights[unit])
            sums.add([p.grad for p in params], weights[unit], index)
            if index < len(run) - 1:
                for p in params:
                    p.grad.zero_()
        ranks.append((params, sums))
    for _, sums in ranks:
        sums.send_rest()
    world.run()
    for _, sums in ranks:
        sums.gather()
    world.run()
    for _, sums in ranks:
        sums.decode()
    return [[p.grad for p in params] for params, _ in ranks]


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**16), count=st.integers(1, 24), size=st.integers(1, 8),
       short=st.booleans(), order=st.integers(0, 2**16),
       idle=st.frozensets(st.integers(0, 23), max_size=3))  # fmt: skip
def test_any_world_size_from_1_to_8_sums_a_steps_units_to_the_trees_bits(
    seed: int, count: int, size: int, short: bool, order: int, idle: frozenset[int]
) -> None:
    """Random gradients of 10**-6 to 10**6, signed zeros among them, some units running no
    backward (they count as zeros)."""
    units = units_of_grads(seed, count)
    for unit in units[::3]:
        unit[1][0] = -0.0
    spec_units = [[torch.zeros(s) for s in SHAPES] if u in idle else g for u, g in enumerate(units)]
    sizes = [4] * count
    if short:
        sizes[-1] = 3  # an epoch's last step: its last unit is short, each unit weighed
    weights = [s / sum(sizes) for s in sizes]
    want = spec(spec_units, weights, equal=not short)
    for got in world_sum(units, weights, size, not short, random.Random(order), idle):
        assert same_bits(got, want)


def test_a_rank_holding_a_subtree_sends_one_node_and_a_split_run_the_fewest() -> None:
    assert tree.frontier(8, 2, 0) == ((2, 0),)  # units 0-3: one subtree
    assert tree.frontier(6, 2, 0) == ((1, 0), (0, 2))  # units 0-2: 0-1, then 2
    # units 3-5: 3, then 4-5, which stands for its parent (2, 1): no unit 6 or 7
    assert tree.frontier(6, 2, 1) == ((0, 3), (2, 1))
    assert tree.frontier(3, 4, 3) == ()  # more ranks than units: the last ones have none
    assert tree.frontier(5, 1, 0) == ((3, 0),)
    assert [len(tree.owner_slices(10, 4)[j]) for j in range(4)] == [3, 3, 3, 1]


def test_the_last_backward_sends_each_bucket_as_it_is_made_in_the_order_an_idle_rank_sends():
    """gloo/NCCL: the step's last backward hands each bucket to its owners as soon as its
    tensors are made (from the model's end, as backward runs, in hooks); a rank with no
    unit sends the same calls in the same order after the step; every rank ends with the
    unit's gradient."""
    from cohort.worker.pytorch.micro import MicroBatches

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(4)))
    batch = torch.randn(3, 8)
    world = World(2)
    during: list[bool] = []
    micro = MicroBatches(model, lambda: None, TreeSum())
    busy = micro.exact
    assert isinstance(busy, TreeSum)

    def launch(start: Any) -> None:
        during.append(not micro.backward_done)
        start()

    busy.world(launch, 0, 2, 4 * 80, ops=world.ops(0))  # one unit: rank 0's, rank 1 has none
    busy.begin(micro.trained, 1, equal=True)
    micro.begin_step((3,), 3)
    micro.begin(0)
    model(batch).square().sum().backward()
    micro.end_step()
    want = [p.grad.clone() for p in model.parameters()]
    assert len(during) >= 2 and all(during)  # each bucket as backward made it

    params = [torch.zeros_like(p) for p in model.parameters()]
    idle = TreeSum()
    idle.world(lambda start: pytest.fail("no unit: nothing to send in a backward"), 1, 2, 4 * 80,
               ops=world.ops(1))  # fmt: skip
    idle.begin(params, 1, equal=True)
    idle.launch = lambda start: start()
    for sums in (idle, busy):
        sums.send_rest()
    world.run()  # the same calls in the same order, or it fails
    for sums in (idle, busy):
        sums.gather()
    world.run()
    for sums in (idle, busy):
        sums.decode()
    assert same_bits([p.grad for p in model.parameters()], want)
    assert same_bits([p.grad for p in params], want)


def test_gradients_live_in_the_buckets_memory_and_leave_it_when_a_step_is_cut_short() -> None:
    """The gradients are views of the buckets' memory, which the collectives write the sum
    into; after a step whose collectives did not finish, the next takes new memory, and no
    gradient is left where a late write of theirs could land."""
    params = [torch.zeros(s, requires_grad=True) for s in SHAPES]
    sums = TreeSum()
    sums.world(lambda start: start(), 0, 1, BUCKET_BYTES, ops=World(1).ops(0))
    sums.begin(params, 1, equal=True)
    old = {p.grad.data_ptr() for p in params}
    regions = {r.data_ptr(): r.numel() * r.element_size() for r in sums._regions}
    assert all(any(a <= ptr < a + n for a, n in regions.items()) for ptr in old)

    held = list(sums._regions)  # as an abandoned collective holds them
    sums.discard()
    assert all(p.grad is None for p in params)
    sums.begin(params, 1, equal=True)
    assert not old & {p.grad.data_ptr() for p in params}
    assert all(not p.grad.any() for p in params) and held
