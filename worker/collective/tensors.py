"""The blob format for a dict of numpy arrays, and how many Redis values a chunk needs.

A blob is three sections, all little-endian::

    u32 header length H | msgpack header (H bytes) | zero padding to 64 | data

The header is ``{"v": 1, "names": [...], "dtypes": [...], "shapes": [...], "offsets": [...]}``
with one ``[start, stop]`` byte range per tensor, relative to the data section (each start
8-aligned). `pack` returns the sections as separate parts so a sender can write them to a
socket without concatenating; `unpack` returns read-only `np.frombuffer` views of the buffer
it was given, so decoding copies nothing. Every header field is checked before an array is
made, because blobs come from other processes: violations raise `BlobError`.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np

from cohort.events.errors import InvalidValueError
from cohort.worker.errors import BlobError

VERSION = 1
MAX_HEADER_BYTES = 1024 * 1024
MAX_TENSORS = 100_000
MAX_NAME_CHARS = 1024
MAX_NDIM = 32
DATA_ALIGN = 64
TENSOR_ALIGN = 8
DEFAULT_MAX_VALUE_BYTES = 256 * 1024 * 1024
"""Keep every Redis value below this (Redis refuses bulk strings over 512 MiB)."""

DTYPES = frozenset({"<f2", "<f4", "<f8", "<i4", "<i8", "|u1"})
"""What a blob may carry; bfloat16 travels as its uint16 bits is not supported (no flag)."""

_PREFIX = struct.Struct("<I")

Part = bytes | memoryview


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


def _wire(name: str, array: np.ndarray) -> np.ndarray:
    """`array` as the contiguous little-endian array that goes on the wire (a copy only if not)."""
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS:
        raise BlobError(f"tensor name {name!r} must be a non-empty string of <= {MAX_NAME_CHARS}")
    array = np.asarray(array)
    dtype = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
    if dtype.str not in DTYPES:
        raise BlobError(
            f"tensor {name!r} has dtype {array.dtype.str!r}; blobs carry {sorted(DTYPES)}"
        )
    return np.asarray(array, dtype=dtype, order="C")  # keeps 0-d (ascontiguousarray would not)


def pack(tensors: Mapping[str, np.ndarray]) -> list[Part]:
    """The blob of `tensors` as parts (prefix+header, then each array's memory): join to store."""
    if len(tensors) > MAX_TENSORS:
        raise BlobError(f"{len(tensors)} tensors; a blob holds at most {MAX_TENSORS}")
    arrays = [(name, _wire(name, a)) for name, a in tensors.items()]
    offsets: list[list[int]] = []
    at = 0
    for _, a in arrays:
        at = _align(at, TENSOR_ALIGN)
        offsets.append([at, at + a.nbytes])
        at += a.nbytes
    header = msgpack.packb(
        {
            "v": VERSION,
            "names": [name for name, _ in arrays],
            "dtypes": [a.dtype.str for _, a in arrays],
            "shapes": [list(a.shape) for _, a in arrays],
            "offsets": offsets,
        },
        use_bin_type=True,
    )
    if len(header) > MAX_HEADER_BYTES:
        raise BlobError(f"header is {len(header)} bytes; the limit is {MAX_HEADER_BYTES}")
    head = _PREFIX.pack(len(header)) + header
    parts: list[Part] = [head + bytes(_align(len(head), DATA_ALIGN) - len(head))]
    end = 0
    for (_, a), (start, stop) in zip(arrays, offsets, strict=True):
        if start > end:
            parts.append(bytes(start - end))
        if stop > start:
            parts.append(memoryview(a.reshape(-1)).cast("B"))  # type: ignore[arg-type]
        end = stop
    return parts


def nbytes(parts: list[Part]) -> int:
    return sum(memoryview(p).nbytes for p in parts)


def join(parts: list[Part]) -> bytes:
    """One bytes object of the blob (a copy: for stores that cannot take parts)."""
    return b"".join(parts)


def _reject_ext(code: int, data: bytes) -> Any:
    raise BlobError(f"blob header uses msgpack extension type {code}")


def _header(buf: memoryview) -> tuple[dict[str, Any], int]:
    if buf.nbytes < _PREFIX.size:
        raise BlobError(f"blob is {buf.nbytes} bytes, shorter than its {_PREFIX.size}-byte prefix")
    (size,) = _PREFIX.unpack_from(buf)
    if size > MAX_HEADER_BYTES:
        raise BlobError(f"header claims {size} bytes; the limit is {MAX_HEADER_BYTES}")
    if _PREFIX.size + size > buf.nbytes:
        raise BlobError(f"header claims {size} bytes but the blob has only {buf.nbytes}")
    try:
        header = msgpack.unpackb(
            buf[_PREFIX.size : _PREFIX.size + size],
            raw=False,
            strict_map_key=True,
            ext_hook=_reject_ext,
            max_str_len=MAX_NAME_CHARS * 4,
            max_bin_len=0,
            max_array_len=MAX_TENSORS,
            max_map_len=16,
        )
    except BlobError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types for bad bytes
        raise BlobError(f"blob header is not msgpack: {type(exc).__name__}: {exc}") from exc
    if not isinstance(header, dict):
        raise BlobError(f"blob header is a {type(header).__name__}, not a map")
    if header.get("v") != VERSION:
        raise BlobError(f"blob version {header.get('v')!r}; this reader knows {VERSION}")
    return header, _align(_PREFIX.size + size, DATA_ALIGN)


def _int(value: Any, what: str) -> int:
    if type(value) is not int or value < 0:
        raise BlobError(f"{what} is {value!r}, not a non-negative integer")
    return value


def _list(header: dict[str, Any], field: str, count: int | None) -> list[Any]:
    value = header.get(field)
    if not isinstance(value, list):
        raise BlobError(f"blob header field {field!r} is {type(value).__name__}, not a list")
    if count is not None and len(value) != count:
        raise BlobError(f"blob header has {count} names but {len(value)} {field}")
    return value


def unpack(buf: bytes | bytearray | memoryview) -> dict[str, np.ndarray]:
    """The tensors of a blob, as read-only views of `buf` (nothing is copied)."""
    view = memoryview(buf).cast("B") if not isinstance(buf, bytes) else memoryview(buf)
    header, data = _header(view)
    names = _list(header, "names", None)
    if len(names) > MAX_TENSORS:
        raise BlobError(f"{len(names)} tensors; a blob holds at most {MAX_TENSORS}")
    dtypes = _list(header, "dtypes", len(names))
    shapes = _list(header, "shapes", len(names))
    offsets = _list(header, "offsets", len(names))
    available = view.nbytes - data
    if available < 0:
        raise BlobError(f"blob of {view.nbytes} bytes ends inside its header padding")
    out: dict[str, np.ndarray] = {}
    for name, dtype, shape, span in zip(names, dtypes, shapes, offsets, strict=True):
        if not isinstance(name, str) or not name or name in out:
            raise BlobError(f"tensor name {name!r} is empty, not a string or repeated")
        if dtype not in DTYPES:
            raise BlobError(f"tensor {name!r} has dtype {dtype!r}; blobs carry {sorted(DTYPES)}")
        if not isinstance(shape, list) or len(shape) > MAX_NDIM:
            raise BlobError(f"tensor {name!r} has shape {shape!r}; want a list of <= {MAX_NDIM}")
        dims = [_int(d, f"a dimension of tensor {name!r}") for d in shape]
        if not isinstance(span, list) or len(span) != 2:
            raise BlobError(f"tensor {name!r} has byte range {span!r}; want [start, stop]")
        start = _int(span[0], f"the start of tensor {name!r}")
        stop = _int(span[1], f"the stop of tensor {name!r}")
        count = math.prod(dims)
        itemsize = np.dtype(dtype).itemsize
        if stop - start != count * itemsize:
            raise BlobError(
                f"tensor {name!r} of shape {dims} and dtype {dtype} needs {count * itemsize} "
                f"bytes but its byte range [{start}, {stop}] holds {stop - start}"
            )
        if stop > available:
            raise BlobError(
                f"tensor {name!r} ends at byte {stop} but the blob has {available} data bytes"
            )
        array = np.frombuffer(view, dtype=dtype, count=count, offset=data + start)
        array = array.reshape(dims)
        array.flags.writeable = False
        out[name] = array
    return out


def pieces(chunk_bytes: int, max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES) -> int:
    """How many Redis values a chunk of `chunk_bytes` needs so each stays under the limit.

    Leaves room for the header and per-tensor padding (a blob of a few tensors).
    """
    budget = max_value_bytes - 64 * 1024
    if budget <= 0:
        raise InvalidValueError(f"max_value_bytes {max_value_bytes} leaves no room for data")
    return max(1, -(-chunk_bytes // budget))
