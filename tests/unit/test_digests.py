"""The weights digest (worker/pytorch/digests.py): computed where the weights are, exact on
any device, and it changes with any change of the weights."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cohort.worker.pytorch.digests import (  # noqa: E402
    ROW,
    _mix_columns,
    bytes_digest,
    row_sums,
    weights_digest,
)

INT32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)


def exact_row_sums(words: list[int]) -> list[list[int]]:
    """The specification in Python integers: each row of ROW words (the last padded with
    zeros) times each column of the mix."""
    columns = [[int(v) for v in column] for column in _mix_columns()]
    words = words + [0] * (-len(words) % ROW)
    rows = [words[i : i + ROW] for i in range(0, len(words), ROW)]
    return [[sum(w * c for w, c in zip(row, column, strict=True)) for column in columns]
            for row in rows]  # fmt: skip


@settings(max_examples=30, deadline=None)
@given(st.lists(INT32, min_size=1, max_size=3 * ROW))
def test_the_row_sums_are_the_exact_integers_whatever_the_words(words: list[int]) -> None:
    tensor = torch.tensor(words, dtype=torch.int32)
    assert row_sums(tensor).tolist() == exact_row_sums(words)


@pytest.mark.parametrize("extreme", [-(2**31), 2**31 - 1])
def test_the_largest_words_in_every_place_still_sum_exactly(extreme: int) -> None:
    """The bound the float64 arithmetic rests on: a row of the largest words."""
    words = [extreme] * (2 * ROW)
    assert row_sums(torch.tensor(words, dtype=torch.int32)).tolist() == exact_row_sums(words)


def model_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(40, 70), torch.nn.BatchNorm1d(70), torch.nn.Linear(70, 3)
    )
    return dict(model.state_dict())


def test_equal_weights_have_equal_digests_and_a_strided_view_digests_as_its_copy() -> None:
    state = model_state()
    assert weights_digest(state) == weights_digest(copy.deepcopy(state))
    matrix = torch.randn(33, 65)
    assert weights_digest({"w": matrix.T}) == weights_digest({"w": matrix.T.contiguous()})


@settings(max_examples=40, deadline=None)
@given(place=st.integers(min_value=0, max_value=40 * 70 - 1), up=st.booleans())
def test_one_weight_one_ulp_away_changes_the_digest(place: int, up: bool) -> None:
    state = model_state()
    before = weights_digest(state)
    flat = state["0.weight"].view(-1)
    toward = torch.tensor(float("inf") if up else float("-inf"))
    flat[place] = torch.nextafter(flat[place], toward)
    assert weights_digest(state) != before


def test_two_weights_swapped_change_the_digest() -> None:
    state = model_state()
    before = weights_digest(state)
    flat = state["2.weight"].view(-1)
    flat[[3, 200]] = flat[[200, 3]].clone()
    assert weights_digest(state) != before


def test_names_dtypes_and_shapes_are_part_of_the_digest() -> None:
    weights = torch.arange(8, dtype=torch.float32)
    base = weights_digest({"w": weights})
    assert weights_digest({"v": weights}) != base
    assert weights_digest({"w": weights.view(torch.int32)}) != base  # the same bytes
    assert weights_digest({"w": weights.view(2, 4)}) != base
    assert weights_digest({"w": torch.cat([weights, torch.zeros(1)])}) != base  # the padding


def test_every_kind_of_buffer_is_digested() -> None:
    """0-dim, empty, bool and odd-sized half-precision tensors (BatchNorm's
    num_batches_tracked is a 0-dim int64)."""
    state = {
        "count": torch.tensor(7),
        "empty": torch.empty(0),
        "mask": torch.tensor([True, False, True]),
        "half": torch.ones(5, dtype=torch.bfloat16),
    }
    before = weights_digest(state)
    for name, changed in [
        ("count", torch.tensor(8)),
        ("mask", torch.tensor([True, True, True])),
        ("half", torch.full((5,), 2.0, dtype=torch.bfloat16)),
    ]:
        assert weights_digest({**state, name: changed}) != before


def test_values_that_are_not_tensors_are_left_out() -> None:
    weights = {"w": torch.ones(3)}
    assert weights_digest({**weights, "_extra_state": {"any": 1}}) == weights_digest(weights)


def test_the_bytes_digest_of_earlier_versions_is_kept_for_their_checkpoints() -> None:
    """The sha256 of each tensor's bytes, as journaled before the digest moved to the
    device: its value for a known state is fixed."""
    state = {"b": torch.arange(3, dtype=torch.int64), "a": torch.tensor([1.5, -2.0])}
    assert bytes_digest(state) == "7c9b16de7c863e9c43298c405f499fac"  # cohort 1d2920b's
    assert weights_digest(state) != bytes_digest(state)


def test_a_state_holds_the_weights_of_its_digest_or_of_an_earlier_versions() -> None:
    from cohort.worker.pytorch.elastic import TorchState

    model = torch.nn.Linear(4, 2)
    state = TorchState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert state.holds(state.digest())
    assert state.holds(bytes_digest(model.state_dict()))  # a checkpoint journaled before
    assert not state.holds("0" * 32)
