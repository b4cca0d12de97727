"""The exact sum (worker/pytorch/exact.py): a step's units dealt to any number of ranks, in
any order, sum to the same bits; within the precision docs/guarantees.md states."""

from __future__ import annotations

import math
import random

import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cohort.worker.pytorch import exact  # noqa: E402
from cohort.worker.pytorch.exact import ExactSum  # noqa: E402

SHAPES = [(7, 5), (5,), (3, 4, 2)]


def same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Equal to the bit (NaN too)."""
    return all(
        torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a, b, strict=True)
    )


def units_of(seed: int, count: int, spread: float = 6.0) -> list[list[torch.Tensor]]:
    """`count` units' gradients: each tensor of its own magnitude, spanning 10**±spread."""
    gen = torch.Generator().manual_seed(seed)
    scales = [10 ** (spread * (2 * torch.rand((), generator=gen).item() - 1)) for _ in SHAPES]
    return [
        [torch.randn(s, generator=gen) * scale for s, scale in zip(SHAPES, scales, strict=True)]
        for _ in range(count)
    ]


def world_sum(
    units: list[list[torch.Tensor]],
    weights: list[float],
    ranks: list[list[int]],
    state: dict[str, object] | None = None,
) -> tuple[list[torch.Tensor], ExactSum]:
    """Each rank adds its units (indices into `units`, in the order given); the world sums
    the payloads as integers (any order: exact); rank 0's decode, with its sum object."""
    params = [torch.empty(s) for s in SHAPES]
    sums = []
    for mine in ranks:
        rank = ExactSum()
        if state is not None:
            rank.load_state_dict(state)
        rank.begin(params, len(units))
        for u in mine:
            rank.add(units[u], weights[u])
        sums.append(rank)
    payloads = [s.payload() for s in sums]
    random.shuffle(payloads)
    total = torch.zeros_like(payloads[0])
    for p in payloads:
        total += p
    decoded = []
    for rank in sums:
        into = [torch.empty(s) for s in SHAPES]
        rank.decode(total.clone(), into)
        decoded.append(into)
    for other in decoded[1:]:  # every rank decodes the same
        assert same_bits(decoded[0], other)
    return decoded[0], sums[0]


def dealt(count: int, n: int, rng: random.Random) -> list[list[int]]:
    """The units 0..count-1 dealt to `n` ranks at random (a rank may get none), each rank's
    in a random order."""
    ranks: list[list[int]] = [[] for _ in range(n)]
    for u in range(count):
        ranks[rng.randrange(n)].append(u)
    for mine in ranks:
        rng.shuffle(mine)
    return ranks


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    count=st.integers(1, 24),
    n=st.integers(1, 8),
    deal_seed=st.integers(0, 2**16),
)
def test_any_assignment_of_the_units_to_1_to_8_ranks_in_any_order_sums_to_the_same_bits(
    seed: int, count: int, n: int, deal_seed: int
) -> None:
    units = units_of(seed, count)
    weights = [1 / count] * count
    alone, _ = world_sum(units, weights, [list(range(count))])  # one rank, in order
    spread, _ = world_sum(units, weights, dealt(count, n, random.Random(deal_seed)))
    assert same_bits(alone, spread)


def test_the_sum_is_the_mean_within_the_stated_precision() -> None:
    """Against float64's mean of the same units: within a unit's quantum per unit, at the
    first step's range and at the range the sum before it sets."""
    units = units_of(3, 12)
    weights = [1 / 12] * 12
    want = [torch.stack([u[i].double() for u in units]).mean(0) for i in range(len(SHAPES))]
    got, sums = world_sum(units, weights, [[0, 1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11]])
    first = exact.first_exponent(12)
    for g, w in zip(got, want, strict=True):  # quantum 2**-e per unit, float32's rounding
        assert (g.double() - w).abs().max() <= 12 * 2.0**-first + w.abs().max() * 2**-23
    sums.commit()
    got, _ = world_sum(units, weights, [list(range(12))], sums.state_dict())
    for g, w, e in zip(got, want, sums.exponents or [], strict=True):
        top = w.abs().max().item()
        assert e > first or top > 1  # the scale followed the data where it is small
        assert (g.double() - w).abs().max() <= 12 * 2.0**-e + top * 2**-23
        assert 12 * 2.0**-e <= top * 2.0 ** -(exact.SUM_BITS - 2 * 4 - exact.HEADROOM)


def test_a_value_beyond_the_range_is_clamped_alike_and_counted() -> None:
    units = units_of(5, 6, spread=0)
    units[4][1][2] = 1e30  # far past 2**FIRST_RANGE
    weights = [1 / 6] * 6
    a, sums = world_sum(units, weights, [list(range(6))])
    b, _ = world_sum(units, weights, [[5, 3], [4], [0, 2, 1]])
    assert same_bits(a, b)
    assert sums.saturated == 1
    limit = exact.bound(6) * 2.0 ** -exact.first_exponent(6)
    assert a[1][2].item() == pytest.approx(limit, rel=1e-6)  # clamped to the range's top
    sums.commit()
    assert sums.exponents is not None and sums.exponents[1] < exact.first_exponent(6)


def test_a_nonfinite_value_makes_its_tensor_nan_and_leaves_the_others() -> None:
    units = units_of(9, 4, spread=0)
    units[2][0][1, 1] = math.inf
    a, sums = world_sum(units, [0.25] * 4, [[0, 1], [2, 3]])
    assert torch.isnan(a[0]).all() and torch.isfinite(a[1]).all() and torch.isfinite(a[2]).all()
    before = list(sums.exponents or [])
    sums.commit()
    assert sums.exponents is not None and sums.exponents[0] == before[0]  # kept


def test_the_exponents_move_only_when_a_step_commits_and_travel_as_state() -> None:
    units = units_of(11, 3)
    _, sums = world_sum(units, [1 / 3] * 3, [[0, 1, 2]])
    first = list(sums.exponents or [])
    assert sums.state_dict() == {"exponents": first}  # decoded, not committed: unchanged
    sums.commit()
    moved = sums.state_dict()
    assert moved != {"exponents": first}
    again = ExactSum()
    again.load_state_dict(moved)
    assert again.exponents == moved["exponents"]


def test_a_rank_with_no_unit_sends_zeros_of_the_same_shape() -> None:
    params = [torch.empty(s) for s in SHAPES]
    idle, busy = ExactSum(), ExactSum()
    idle.begin(params, 2)
    busy.begin(params, 2)
    busy.add(units_of(1, 1)[0], 0.5)
    assert idle.payload().shape == busy.payload().shape
    assert not idle.payload().any()


def test_compression_is_refused_by_name_where_the_sums_are_exact() -> None:
    from cohort.events.errors import InvalidValueError
    from cohort.worker.pytorch.elastic import refuse_compressed_exact_sums

    with pytest.raises(InvalidValueError, match="--reduction float"):
        refuse_compressed_exact_sums(exact=True, compressed=True)
    for exact_sums, compressed in ((True, False), (False, True), (False, False)):
        refuse_compressed_exact_sums(exact_sums, compressed)  # nothing to refuse
