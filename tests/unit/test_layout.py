"""The allreduce layout without Redis: flat vectors per dtype, chunk bounds, float16 transport."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from cohort.worker.collective.layout import (
    FLOATS,
    HALF_MAX,
    bounds,
    chunks,
    cuts,
    flatten,
    piece,
    transported,
    unflatten,
)
from cohort.worker.errors import CollectiveError

float_arrays = st.sampled_from([*FLOATS, ">f4", ">f8"]).flatmap(
    lambda dtype: hnp.arrays(
        dtype=np.dtype(dtype),
        shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5),
        elements={"allow_nan": False},
    )
)
names = st.text(min_size=1, max_size=8)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(names, float_arrays, max_size=6))
def test_unflatten_gives_back_what_flatten_took(tensors: dict[str, np.ndarray]) -> None:
    layout, flats = flatten(tensors)
    assert layout.sizes() == {g: f.size for g, f in flats.items()}
    got = unflatten(layout, flats)
    assert set(got) == set(tensors)
    for name, array in tensors.items():
        assert got[name].dtype == array.dtype.newbyteorder("<")
        assert got[name].shape == array.shape
        np.testing.assert_array_equal(got[name], array)


@given(st.dictionaries(names, float_arrays, min_size=1, max_size=6), st.randoms())
def test_the_layout_does_not_depend_on_the_order_of_the_dict(
    tensors: dict[str, np.ndarray], random: object
) -> None:
    shuffled = list(tensors.items())
    random.shuffle(shuffled)  # type: ignore[attr-defined]
    assert flatten(dict(shuffled))[0] == flatten(tensors)[0]
    assert flatten(dict(shuffled))[0].digest == flatten(tensors)[0].digest


def test_the_digest_tells_layouts_apart() -> None:
    digests = {
        flatten(t)[0].digest
        for t in (
            {"x": np.ones((3, 4), "<f4")},
            {"x": np.ones((2, 6), "<f4")},
            {"x": np.ones((3, 4), "<f8")},
            {"y": np.ones((3, 4), "<f4")},
        )
    }
    assert len(digests) == 4


def test_a_dtype_with_one_tensor_is_flattened_without_a_copy() -> None:
    alone = np.arange(12, dtype="<f4").reshape(3, 4)
    _, flats = flatten({"w": alone, "d": np.ones(3)})
    assert np.shares_memory(flats["<f4"], alone)


@pytest.mark.parametrize("dtype", ["<i4", "|u1", "|b1", "<c8"])
def test_flatten_refuses_what_allreduce_cannot_average_naming_it(dtype: str) -> None:
    with pytest.raises(CollectiveError, match=f"'n' has dtype '{dtype}'"):
        flatten({"x": np.ones(2, "<f4"), "n": np.zeros(2, dtype)})


@given(st.integers(0, 1000), st.integers(1, 40))
def test_chunks_cut_a_vector_into_near_equal_consecutive_views(size: int, n: int) -> None:
    flat = np.arange(size, dtype="<f4")
    parts = chunks(flat, n)
    assert len(parts) == n
    assert max(p.size for p in parts) - min(p.size for p in parts) <= 1
    np.testing.assert_array_equal(np.concatenate(parts), flat)
    assert all(p.base is flat or p.size == 0 or np.shares_memory(p, flat) for p in parts)


def test_chunks_refuses_zero_parts() -> None:
    with pytest.raises(ValueError, match="0 chunks"):
        chunks(np.ones(3), 0)
    with pytest.raises(ValueError, match="0 chunks"):
        cuts(3, 0)


@given(
    st.dictionaries(st.sampled_from(FLOATS), st.integers(0, 500), min_size=1), st.integers(1, 40)
)
def test_bounds_cover_every_element_exactly_once(sizes: dict[str, int], k: int) -> None:
    where = bounds(sizes, k)
    assert set(where) == set(sizes)
    for g, size in sizes.items():
        assert len(where[g]) == k
        covered = [e for cut in where[g] for e in range(size)[cut]]
        assert covered == list(range(size))  # each once, in order
        counts = [cut.stop - cut.start for cut in where[g]]
        assert max(counts) - min(counts) <= 1


def test_piece_i_is_chunk_i_of_every_vector_as_a_view() -> None:
    vectors = {"<f4": np.arange(10, dtype="<f4"), "<f8": np.arange(3, dtype="<f8")}
    where = bounds({g: v.size for g, v in vectors.items()}, 4)
    pieces = [piece(where, i, vectors) for i in range(4)]
    for g, vector in vectors.items():
        np.testing.assert_array_equal(np.concatenate([p[g] for p in pieces]), vector)
        assert all(np.shares_memory(p[g], vector) for p in pieces if p[g].size)


def test_float32_transport_sends_the_chunk_as_it_is() -> None:
    chunk = {"<f4": np.full(3, 1e6, "<f4"), "<f8": np.ones(2)}
    assert transported(chunk, "float32", "call") is chunk


@given(hnp.arrays(np.float32, st.integers(0, 50), elements=st.floats(-HALF_MAX, HALF_MAX)))
def test_float16_transport_rounds_float32_values_and_leaves_other_dtypes(a: np.ndarray) -> None:
    other = {"<f8": np.linspace(0, 1e6, 4), "<f2": np.ones(2, "<f2")}
    got = transported({"<f4": a, **other}, "float16", "call")
    assert got["<f4"].dtype == np.float16
    np.testing.assert_array_equal(got["<f4"], a.astype("<f2"))
    assert all(got[g] is array for g, array in other.items())


def test_float16_transport_also_rounds_float64_sums_of_float32_values() -> None:
    sums = {"<f4": np.array([0.1, 1e-3, 3e4], dtype=np.float64)}
    got = transported(sums, "float16", "call")["<f4"]
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, sums["<f4"].astype(np.float16))


@pytest.mark.parametrize(
    "values, named",
    [([1.0, 1e6, -3.0], "1e+06"), ([np.inf, 7e4, 1.0], "7e+04"), ([-2e5, np.nan], "2e+05")],
)
def test_float16_transport_refuses_a_value_beyond_its_range_naming_it(
    values: list[float], named: str
) -> None:
    pattern = rf"^allreduce of step 3: .*magnitude {re.escape(named)} exceeds float16's range"
    with pytest.raises(CollectiveError, match=pattern):
        transported({"<f4": np.array(values, "<f4")}, "float16", "allreduce of step 3")


def test_float16_transport_lets_infinities_and_nans_through_as_they_are() -> None:
    a = np.array([np.inf, -np.inf, np.nan, 1.0], "<f4")
    got = transported({"<f4": a}, "float16", "call")["<f4"]
    np.testing.assert_array_equal(got, a.astype("<f2"))
