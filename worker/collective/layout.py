"""How allreduce lays tensors out: one flat vector per dtype, cut into chunks, and the transport.

`flatten` puts the float tensors of a dict into one vector per dtype, in sorted name order,
so every rank builds the same `Layout` whatever order its dict has; `unflatten` views the
vectors as the tensors again. `bounds` says where chunk i of each vector lies when the
vectors are cut into K near-equal chunks (the first ones get one element more). A chunk
travels as it is (`float32` transport), with its float32 values rounded to float16
(`float16`: half the bytes; a value beyond float16's range is refused rather than turned
into inf), or as int8 blocks with a float32 scale each (`int8`: about a quarter of the bytes,
`worker/collective/codes.py`); `received` turns a chunk as it travelled back into float values.
Under int8 the chunks are cut at multiples of the block size, so the blocks of a vector are
the same whatever the number of ranks or chunks: a rank can round its own values to the
grid the collective will send them on (error feedback, `compressors.py`). Pure numpy:
nothing here touches Redis.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np

from cohort.events.errors import InvalidValueError
from cohort.worker.collective import codes as compress
from cohort.worker.errors import CollectiveError

FLOATS = ("<f2", "<f4", "<f8")
"""The dtypes allreduce averages."""

INTEGERS = ("<i8",)
"""The dtype allreduce sums, exactly (worker/pytorch/exact.py's integer sums)."""

Transport = Literal["float32", "float16", "int8"]
TRANSPORTS: tuple[Transport, ...] = ("float32", "float16", "int8")
SCALES = "/scales"
"""Under int8, the name suffix of a dtype's block scales beside its levels in a chunk."""
HALF_MAX = float(np.finfo(np.float16).max)

Chunk = dict[str, np.ndarray]
"""A chunk's slice of each dtype vector, by dtype: what one Redis value carries."""


@dataclass(frozen=True, slots=True)
class Layout:
    """Which tensors go in which dtype vector, in a rank-independent (sorted) order."""

    groups: tuple[tuple[str, tuple[tuple[str, tuple[int, ...]], ...]], ...]

    @property
    def digest(self) -> str:
        return hashlib.blake2b(repr(self.groups).encode(), digest_size=12).hexdigest()

    def sizes(self) -> dict[str, int]:
        return {g: sum(int(np.prod(s)) for _, s in members) for g, members in self.groups}


def flatten(tensors: Mapping[str, np.ndarray]) -> tuple[Layout, dict[str, np.ndarray]]:
    """One flat vector per dtype (a view, not a copy, when a dtype has one tensor)."""
    by_dtype: dict[str, list[tuple[str, np.ndarray]]] = {}
    for name in sorted(tensors):
        device = getattr(tensors[name], "device", None)  # a torch tensor's, without torch
        if getattr(device, "type", "cpu") != "cpu":
            raise CollectiveError(
                f"tensor {name!r} is on {device}: the collective averages host arrays; "
                "cohort.torch.allreduce(collective, tensors, step) takes tensors on any "
                "device (CUDA's through pinned memory) and gives the means back there"
            )
        array = np.asarray(tensors[name])
        dtype = array.dtype.newbyteorder("<").str if array.dtype.byteorder == ">" else None
        dtype = dtype or array.dtype.str
        if dtype not in FLOATS + INTEGERS:
            raise CollectiveError(
                f"tensor {name!r} has dtype {array.dtype.str!r}; allreduce averages "
                f"{list(FLOATS)} and sums {list(INTEGERS)} (cast other tensors first)"
            )
        by_dtype.setdefault(dtype, []).append((name, array))
    layout = Layout(
        tuple(
            (g, tuple((name, tuple(a.shape)) for name, a in members))
            for g, members in sorted(by_dtype.items())
        )
    )
    flats: dict[str, np.ndarray] = {}
    for g, members in sorted(by_dtype.items()):
        parts = [np.asarray(a, dtype=g).reshape(-1) for _, a in members]
        flats[g] = parts[0] if len(parts) == 1 else np.concatenate(parts)
    return layout, flats


def unflatten(layout: Layout, flats: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The tensors of `layout` as views of the flat vectors `flatten` made (or their results)."""
    out: dict[str, np.ndarray] = {}
    for g, members in layout.groups:
        at = 0
        for name, shape in members:
            count = int(np.prod(shape))
            out[name] = flats[g][at : at + count].reshape(shape)
            at += count
    return out


def cuts(size: int, n: int, align: int = 1) -> list[slice]:
    """A vector of `size` elements cut into `n` near-equal consecutive slices (the first
    size % n get one more), each starting at a multiple of `align` (the last may be short,
    and some empty if the vector has fewer than `n` units of `align`)."""
    if n < 1:
        raise InvalidValueError(f"cannot cut a vector into {n} chunks")
    units = -(-size // align)
    base, extra = divmod(units, n)
    at, out = 0, []
    for i in range(n):
        count = base + (1 if i < extra else 0)
        out.append(slice(min(at * align, size), min((at + count) * align, size)))
        at += count
    return out


def chunks(flat: np.ndarray, n: int) -> list[np.ndarray]:
    """`flat` cut into `n` near-equal consecutive views, as `cuts` says."""
    flat = flat.reshape(-1)
    return [flat[where] for where in cuts(flat.size, n)]


def bounds(sizes: Mapping[str, int], k: int, align: int = 1) -> dict[str, list[slice]]:
    """Where chunk i of each dtype vector lies, for vectors cut into `k` chunks starting at
    multiples of `align`."""
    return {g: cuts(size, k, align) for g, size in sizes.items()}


def alignment(transport: Transport) -> int:
    """Where chunks may start under `transport`: at block boundaries for int8."""
    return compress.BLOCK if transport == "int8" else 1


def wire_bytes(flats: Mapping[str, np.ndarray], transport: Transport) -> int:
    """Bytes the vectors take as they travel with `transport`."""
    total = 0
    for g, f in flats.items():
        if g == "<f4" and transport == "float16":
            total += 2 * f.size
        elif g == "<f4" and transport == "int8":
            total += compress.int8_bytes(f.size)
        else:
            total += f.nbytes
    return total


def piece(where: Mapping[str, list[slice]], i: int, vectors: Mapping[str, np.ndarray]) -> Chunk:
    """Chunk i of every dtype vector (views), by dtype; `where` comes from `bounds`."""
    return {g: vectors[g][where[g][i]] for g in where}


def transported(chunk: Chunk, transport: Transport, what: str) -> Chunk:
    """`chunk` as it travels with `transport`: under float16, float32 values (and the float64
    sums of float32 values) become float16, other dtypes go as they are.

    A finite value beyond float16's range would arrive as inf, so it is refused instead;
    `what` names the call in the message.

    Under int8, float32 values (and float64 sums of them) travel as int8 levels (as the
    bytes of a |u1 array) plus `<f4/scales`; other dtypes go as they are. A value that is
    inf or nan is refused."""
    if transport == "int8":
        return _as_int8(chunk, what)
    if transport != "float16":
        return chunk
    out = {}
    for g, a in chunk.items():
        if g != "<f4":
            out[g] = a
            continue
        with np.errstate(over="ignore"):  # an overflow is reported below, by value
            half = a.astype("<f2")
        if np.isinf(half).any() and not np.isinf(a[np.isinf(half)]).all():
            biggest = float(np.nanmax(np.abs(a[np.isfinite(a)])))
            raise CollectiveError(
                f"{what}: a float32 value of magnitude {biggest:.4g} exceeds float16's "
                f"range ({HALF_MAX:g}); scale the values down or use transport='float32'"
            )
        out[g] = half
    return out


def _as_int8(chunk: Chunk, what: str) -> Chunk:
    out: Chunk = {}
    for g, a in chunk.items():
        if g != "<f4":
            out[g] = a
            continue
        try:
            levels, out[g + SCALES] = compress.quantise(a)
        except ValueError as exc:
            raise CollectiveError(
                f"{what}: {exc}; int8 transport carries finite values only"
            ) from None
        out[g] = levels.view(np.uint8)  # blobs carry bytes (|u1), not int8: same bits
    return out


def received(chunk: Chunk, transport: Transport, what: str) -> Chunk:
    """A chunk as it travelled with `transport`, as float values again: int8 levels and
    their scales become float32 (CollectiveError if they do not fit together); float16
    stays float16 (the sums widen it). Every rank decodes the same bytes to the same bits."""
    if transport != "int8":
        return chunk
    out: Chunk = {}
    for g, a in chunk.items():
        if g.endswith(SCALES):
            continue
        if g != "<f4":
            out[g] = a
            continue
        scales = chunk.get(g + SCALES)
        if scales is None or a.dtype != np.uint8 or scales.dtype != np.float32:
            raise CollectiveError(f"{what}: an int8 chunk without int8 levels and float32 scales")
        try:
            out[g] = compress.dequantise(a.view(np.int8), scales)
        except ValueError as exc:
            raise CollectiveError(f"{what}: {exc}") from None
    return out
