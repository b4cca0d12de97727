"""The tensor blob: round trips, zero-copy decoding, hostile headers, pieces per value."""

from __future__ import annotations

import contextlib
import struct

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from cohort.worker.collective.tensors import (
    DTYPES,
    MAX_HEADER_BYTES,
    MAX_TENSORS,
    join,
    nbytes,
    pack,
    pieces,
    unpack,
)
from cohort.worker.errors import BlobError

SHAPES = [(), (0,), (3,), (2, 0, 5), (4, 5), (2, 3, 4)]


def _blob(header: dict, data: bytes = b"", pad: bool = True) -> bytes:
    raw = msgpack.packb(header, use_bin_type=True)
    head = struct.pack("<I", len(raw)) + raw
    if pad:
        head += bytes(-len(head) % 64)
    return head + data


def _header(**overrides: object) -> dict:
    header: dict = {
        "v": 1,
        "names": ["x"],
        "dtypes": ["<f4"],
        "shapes": [[2]],
        "offsets": [[0, 8]],
    }
    header.update(overrides)
    return header


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("shape", SHAPES)
def test_every_dtype_and_shape_round_trips(dtype: str, shape: tuple[int, ...]) -> None:
    array = (np.arange(int(np.prod(shape))) % 100).astype(dtype).reshape(shape)
    got = unpack(join(pack({"a": array})))["a"]
    assert got.dtype == np.dtype(dtype) and got.shape == shape
    np.testing.assert_array_equal(got, array)


def test_unpack_views_the_received_buffer_without_copying() -> None:
    blob = join(pack({"a": np.arange(10, dtype="<f4"), "b": np.ones((3, 3))}))
    whole = np.frombuffer(blob, dtype=np.uint8)
    for array in unpack(blob).values():
        assert np.shares_memory(array, whole)
        assert not array.flags.writeable


def test_pack_hands_over_array_memory_instead_of_copying_it() -> None:
    array = np.arange(100_000, dtype="<f4")
    parts = pack({"a": array})
    assert any(np.shares_memory(np.frombuffer(p, dtype=np.uint8), array) for p in parts[1:])
    assert nbytes(parts) == len(join(parts))


def test_big_endian_and_strided_inputs_arrive_as_their_values() -> None:
    strided = np.arange(24, dtype="<f8").reshape(4, 6)[:, ::2]
    swapped = np.arange(5, dtype=">i4")
    got = unpack(join(pack({"s": strided, "b": swapped})))
    np.testing.assert_array_equal(got["s"], strided)
    np.testing.assert_array_equal(got["b"], swapped)
    assert got["b"].dtype.str == "<i4"


def test_data_starts_aligned() -> None:
    got = unpack(join(pack({"a": np.ones(3, "u1"), "b": np.ones(3, "<f8")})))
    assert got["b"].ctypes.data % 8 == got["a"].ctypes.data % 8


@pytest.mark.parametrize(
    "tensors,problem",
    [
        ({"a": np.ones(2, dtype=np.complex64)}, "dtype"),
        ({"a": np.ones(2, dtype=bool)}, "dtype"),
        ({"": np.ones(2)}, "name"),
    ],
)
def test_pack_refuses_what_a_blob_cannot_carry(tensors: dict, problem: str) -> None:
    with pytest.raises(BlobError, match=problem):
        pack(tensors)


@pytest.mark.parametrize(
    "blob,problem",
    [
        (b"", "shorter than its"),
        (struct.pack("<I", MAX_HEADER_BYTES + 1), "limit"),
        (struct.pack("<I", 100) + b"\x80", "only"),
        (struct.pack("<I", 2) + b"\xc1\xc1", "not msgpack"),
        (_blob([1, 2]), "not a map"),  # type: ignore[arg-type]
        (_blob(_header(v=2), bytes(8)), "version"),
        (_blob(_header(dtypes=["<c8"]), bytes(8)), "dtype"),
        (_blob(_header(dtypes=[">f4"]), bytes(8)), "dtype"),
        (_blob(_header(dtypes=["|O"]), bytes(8)), "dtype"),
        (_blob(_header(shapes=[[-2]]), bytes(8)), "non-negative"),
        (_blob(_header(shapes=[[2.0]]), bytes(8)), "non-negative"),
        (_blob(_header(shapes=[[3]]), bytes(8)), "needs 12 bytes"),
        (_blob(_header(shapes=[[2**40, 2**40]]), bytes(8)), "needs"),
        (_blob(_header(shapes=[[1] * 33], offsets=[[0, 4]]), bytes(8)), "shape"),
        (_blob(_header(offsets=[[0, 8]]), bytes(4)), "ends at byte 8"),
        (_blob(_header(offsets=[[8, 16]]), bytes(8)), "ends at byte 16"),
        (_blob(_header(offsets=[[-8, 0]]), bytes(8)), "non-negative"),
        (_blob(_header(offsets=[[0]]), bytes(8)), "byte range"),
        (_blob(_header(names=["x", "y"]), bytes(8)), "2 names but 1"),
        (_blob(_header(names=[3]), bytes(8)), "name"),
        (_blob(_header(names="x"), bytes(8)), "not a list"),
        (
            _blob(
                _header(
                    names=["x", "x"],
                    dtypes=["<f4"] * 2,
                    shapes=[[2]] * 2,
                    offsets=[[0, 8]] * 2,
                ),
                bytes(8),
            ),
            "repeated",
        ),
        (_blob(_header(), b"", pad=False), "header padding"),
        (_blob(_header(names=["x"] * (MAX_TENSORS + 1))), "not msgpack"),
        (
            struct.pack("<I", 4) + b"\xc7\x01\x05\x00",  # an ext type
            "extension",
        ),
    ],
)
def test_hostile_blobs_raise_blob_error_naming_the_problem(blob: bytes, problem: str) -> None:
    with pytest.raises(BlobError, match=problem):
        unpack(blob)


@given(st.binary(max_size=512))
def test_random_bytes_only_ever_raise_blob_error(blob: bytes) -> None:
    with contextlib.suppress(BlobError):
        unpack(blob)


arrays = st.sampled_from(sorted(DTYPES)).flatmap(
    lambda dtype: hnp.arrays(
        dtype=np.dtype(dtype),
        shape=hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5),
    )
)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(min_size=1, max_size=20), arrays, max_size=6))
def test_any_dict_of_arrays_round_trips(tensors: dict[str, np.ndarray]) -> None:
    got = unpack(join(pack(tensors)))
    assert list(got) == list(tensors)
    for name, array in tensors.items():
        assert got[name].dtype == array.dtype and got[name].shape == array.shape
        np.testing.assert_array_equal(got[name], array)


def test_pieces_keep_every_value_under_the_limit() -> None:
    limit = 256 * 1024 * 1024
    assert pieces(1000, limit) == 1
    assert pieces(limit, limit) == 2  # the header needs room too
    assert pieces(3 * limit, limit) == 4
    with pytest.raises(ValueError, match="no room"):
        pieces(10, 1000)
