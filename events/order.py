"""Each epoch's order of the samples: a keyed bijection of [0, size), computed per position.

The journal's shards are ranges of *positions* in an epoch; position p of epoch e holds
sample `Order.shuffled(size, seed, e)[p]`. So the leader splits positions as it always
did (exactly once per epoch, across any world change), and the order lives in two
journaled numbers, the job's `seed` and the epoch, instead of an array of `size` indices.

The bijection is a Feistel network on a grid of rows x columns (both about sqrt(size),
their product at or above `size` by less than a row), the numeric kind format-preserving
encryption uses: a round adds a keyed mix of the column to the row, modulo the rows, and
the two swap. An image outside [0, size) goes through the network again until it lands
inside (cycle walking), which keeps the map a bijection of [0, size); fewer than one
position in sqrt(size) needs that. So one index costs `ROUNDS` rounds, each a 64-bit
multiply-xorshift mix (splitmix64's) and a divmod, whose round keys come from blake2b of
(seed, epoch): the order is the same on every process and platform. A batch of positions
is mapped in one vectorised numpy pass. The orders are pseudorandom, not drawn uniformly
from all size! of them: plenty for SGD, not for cryptography.
"""

from __future__ import annotations

import functools
import hashlib
import math
import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # numpy loads on first vectorised use: `import cohort` stays quick
    import numpy as np
    import numpy.typing as npt

    Indices = npt.NDArray[np.int64]

ROUNDS = 4
"""Feistel rounds per pass: 4 make a strong pseudorandom permutation from a good round
function (Luby-Rackoff)."""
SCALAR_BELOW = 32
"""Up to this many positions, Python's ints beat a numpy pass (about 50 calls)."""
MASK = 2**64 - 1
MIX1, MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
"""splitmix64's finaliser, less its first xorshift (a column is under 2^27, so that shift
would only xor in key bits): (c ^ key) * MIX1, xorshift 27, * MIX2, of which the round
keeps the high 32 bits, the ones every input bit reaches."""


@functools.lru_cache(maxsize=64)
def _key_schedule(seed: int, epoch: int) -> tuple[int, ...]:
    digest = hashlib.blake2b(
        f"{seed}:{epoch}".encode(), digest_size=8 * ROUNDS, person=b"cohort.order"
    ).digest()
    return struct.unpack(f"<{ROUNDS}Q", digest)


def _grid(size: int) -> tuple[int, int]:
    """(rows, columns): both at least 2, about sqrt(size), and rows * columns >= size with
    fewer than `columns` to spare."""
    columns = max(2, math.isqrt(max(size - 1, 0)) + 1)
    return max(2, -(-size // columns)), columns


@dataclass(frozen=True, slots=True)
class Order:
    """An epoch's order of the samples [0, size): position p holds sample `order[p]`.

    `keys` empty: the identity (positions are samples, as in a job that does not shuffle).
    """

    size: int
    keys: tuple[int, ...] = ()
    grid: tuple[int, int] = field(init=False)
    """(rows, columns) the Feistel network turns over."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "grid", _grid(self.size))

    @classmethod
    def shuffled(cls, size: int, seed: int, epoch: int) -> Order:
        """The pseudorandom order of epoch `epoch` of a job with `seed`."""
        return cls(size, _key_schedule(seed, epoch))

    @classmethod
    def identity(cls, size: int) -> Order:
        return cls(size)

    @staticmethod
    def of(size: int, files: Sequence[int], seed: int | None, epoch: int) -> Order:
        """Epoch `epoch`'s order of a dataset of `size` samples: shuffled with `seed` (None:
        in index order), file by file when it is made of `files` (their sample counts)."""
        if files:
            return _file_order(size, files, seed, epoch)
        return Order.identity(size) if seed is None else Order.shuffled(size, seed, epoch)

    def pieces(self, ranges: Iterable[tuple[int, int]]) -> Iterator[tuple[int, int, int]]:
        """`ranges` of positions cut where a file ends, each piece with its file's index
        (-1 here: a dataset without files is one whole)."""
        for start, stop in ranges:
            yield start, stop, -1

    def __len__(self) -> int:
        return self.size

    # ------------------------------------------------------------ one position
    def __getitem__(self, position: int) -> int:
        """The sample at `position`: ROUNDS mixes, rarely twice (cycle walking)."""
        if not 0 <= position < self.size:
            raise IndexError(f"position {position} is outside [0, {self.size})")
        if not self.keys:
            return position
        sample = self._permute(position)
        while sample >= self.size:  # cycle walking: comes back into [0, size)
            sample = self._permute(sample)
        return sample

    def _permute(self, x: int) -> int:
        """One pass of the Feistel network: a bijection of [0, rows * columns)."""
        rows, columns = self.grid
        for key in self.keys:
            row, column = divmod(x, columns)
            z = ((column ^ key) * MIX1) & MASK  # mixed as `MIX1, MIX2` say
            z = ((z ^ (z >> 27)) * MIX2) & MASK
            x = column * rows + (row + (z >> 32)) % rows  # the column becomes the row
            rows, columns = columns, rows
        return x

    # ------------------------------------------------------------ many positions
    def take(self, positions: npt.ArrayLike) -> Indices:
        """The samples at `positions` (ints in [0, size)), in one vectorised pass."""
        import numpy as np

        at = np.asarray(positions, dtype=np.int64)
        if at.size and (at.min() < 0 or at.max() >= self.size):
            outside = at[(at < 0) | (at >= self.size)]
            raise IndexError(f"positions outside [0, {self.size}): {outside[:5].tolist()}")
        if not self.keys:
            return at.copy()
        if at.size <= SCALAR_BELOW:
            return np.fromiter((self[p] for p in at.tolist()), np.int64, at.size)
        x = self._permute_many(at.astype(np.uint64))
        walking = np.flatnonzero(x >= self.size)
        while walking.size:
            x[walking] = self._permute_many(x[walking])
            walking = walking[x[walking] >= self.size]
        return x.astype(np.int64)

    def samples(self, ranges: Iterable[tuple[int, int]]) -> Indices:
        """The samples at the positions of `ranges` (a shard's or a batch's), in order."""
        return self.take(positions(ranges))

    def samples_of(self, parts: Iterable[Iterable[tuple[int, int]]]) -> list[Indices]:
        """`samples` of each of `parts` (a batch's ranges each), all in one vectorised pass:
        a pass costs about as much for 64 positions as for thousands (its numpy calls, not
        its numbers), so a loader maps the batches of many steps at once."""
        import numpy as np

        held = [tuple(part) for part in parts]
        lengths = [sum(stop - start for start, stop in part) for part in held]
        taken = self.take(positions([r for part in held for r in part]))
        return np.split(taken, np.cumsum(lengths[:-1])) if held else []

    def _permute_many(self, x: np.ndarray) -> np.ndarray:
        """`_permute` over an array of uint64, a numpy call per operation."""
        return _feistel(x, _numpy_rounds(self.keys, self.grid))


def _feistel(x: np.ndarray, rounds: Iterable[tuple[Any, Any, Any]]) -> np.ndarray:
    """One pass of the network over uint64 `x`; each round's (key, rows, columns) are numpy
    scalars (one order) or arrays as long as `x` (each position its own file's order)."""
    mix1, mix2, by27, by32 = _numpy_constants()
    for key, rows, columns in rounds:
        row, column = divmod(x, columns)
        z = column ^ key
        z *= mix1
        z ^= z >> by27
        z *= mix2
        z >>= by32
        z += row
        z %= rows
        column *= rows
        x = column + z
    return x


class FileOrder(Order):
    """The order of a dataset made of files: the files in a shuffled order, and the samples
    of each file in its own shuffled order (the same network, keyed per file). So a range
    of positions covers whole files, or runs of one file: a rank given a file's positions
    reads only that file, which is what the locality placement needs.

    An index costs a binary search over the files (log2 of their count) and the rounds of
    its file's network; the file order itself, computed once per epoch, is O(files)."""

    __slots__ = ("files", "file_starts", "slots", "slot_starts", "file_keys", "file_grids")
    files: Any
    """Each file's sample count (int64 array)."""
    file_starts: Any
    slots: Any
    """Slot k of the epoch holds file `slots[k]`..."""
    slot_starts: Any
    """...from position `slot_starts[k]` (one more entry: the end)."""
    file_keys: list[Any]
    file_grids: tuple[Any, Any]

    def __init__(self, size: int, files: Sequence[int], seed: int | None, epoch: int) -> None:
        import numpy as np

        super().__init__(size, () if seed is None else _key_schedule(seed, epoch))
        sizes = np.asarray(files, dtype=np.int64)
        starts = np.zeros(sizes.size, dtype=np.int64)
        np.cumsum(sizes[:-1], out=starts[1:])
        slots = Order.of(sizes.size, (), seed, epoch).take(np.arange(sizes.size))
        slot_starts = np.zeros(sizes.size + 1, dtype=np.int64)
        np.cumsum(sizes[slots], out=slot_starts[1:])
        set_ = object.__setattr__
        set_(self, "files", sizes)
        set_(self, "file_starts", starts)
        set_(self, "slots", slots)  # slot k of the epoch holds file slots[k]
        set_(self, "slot_starts", slot_starts)  # ... from position slot_starts[k]
        if self.keys:
            # each file's round keys: the epoch's, mixed with the file's index
            index = np.arange(sizes.size, dtype=np.uint64) + np.uint64(1)
            mixed = [_mix_many(np.uint64(k) ^ (index * np.uint64(GOLDEN))) for k in self.keys]
            distinct, which = np.unique(sizes, return_inverse=True)
            grids = np.array([_grid(int(n)) for n in distinct], dtype=np.int64).reshape(-1, 2)
            rows, columns = grids[which, 0], grids[which, 1]
            set_(self, "file_keys", mixed)
            set_(self, "file_grids", (rows.astype(np.uint64), columns.astype(np.uint64)))

    def __getitem__(self, position: int) -> int:
        if not 0 <= position < self.size:
            raise IndexError(f"position {position} is outside [0, {self.size})")
        return int(self.take((position,))[0])

    def take(self, positions: npt.ArrayLike) -> Indices:
        import numpy as np

        at = np.asarray(positions, dtype=np.int64)
        if at.size and (at.min() < 0 or at.max() >= self.size):
            outside = at[(at < 0) | (at >= self.size)]
            raise IndexError(f"positions outside [0, {self.size}): {outside[:5].tolist()}")
        slot = np.searchsorted(self.slot_starts, at, side="right") - 1
        file = self.slots[slot]
        offset = at - self.slot_starts[slot]
        if self.keys:
            offset = self._within(offset.astype(np.uint64), file)
        return self.file_starts[file] + offset

    def _within(self, x: np.ndarray, file: np.ndarray) -> Indices:
        """Each offset through its own file's network, cycle walking into the file."""
        import numpy as np

        sizes = self.files[file].astype(np.uint64)
        x = self._pass(x, file)
        walking = np.flatnonzero(x >= sizes)
        while walking.size:
            x[walking] = self._pass(x[walking], file[walking])
            walking = walking[x[walking] >= sizes[walking]]
        return x.astype(np.int64)

    def _pass(self, x: np.ndarray, file: np.ndarray) -> np.ndarray:
        rows, columns = self.file_grids[0][file], self.file_grids[1][file]
        rounds = []
        for key in self.file_keys:
            rounds.append((key[file], rows, columns))
            rows, columns = columns, rows
        return _feistel(x, rounds)

    def pieces(self, ranges: Iterable[tuple[int, int]]) -> Iterator[tuple[int, int, int]]:
        import numpy as np

        for start, stop in ranges:
            slot = int(np.searchsorted(self.slot_starts, [start], side="right")[0]) - 1
            while start < stop:
                end = min(stop, int(self.slot_starts[slot + 1]))
                yield start, end, int(self.slots[slot])
                start, slot = end, slot + 1


GOLDEN = 0x9E3779B97F4A7C15


def _mix_many(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over uint64s: spreads a file index into a round key."""
    import numpy as np

    z = z.copy()
    z ^= z >> np.uint64(30)
    z *= np.uint64(MIX1)
    z ^= z >> np.uint64(27)
    z *= np.uint64(MIX2)
    z ^= z >> np.uint64(31)
    return z


_FILE_ORDERS: dict[tuple[int, int | None, int], tuple[Sequence[int], FileOrder]] = {}


def _file_order(size: int, files: Sequence[int], seed: int | None, epoch: int) -> FileOrder:
    """One FileOrder per (files, seed, epoch) in use, found by the files' identity (hashing
    100,000 file sizes at every step would cost more than the order)."""
    key = (id(files), seed, epoch)
    hit = _FILE_ORDERS.get(key)
    if hit is not None and hit[0] is files:
        return hit[1]
    order = FileOrder(size, files, seed, epoch)
    if len(_FILE_ORDERS) >= 16:
        _FILE_ORDERS.pop(next(iter(_FILE_ORDERS)))
    _FILE_ORDERS[key] = (files, order)
    return order


@functools.cache
def _numpy_constants() -> tuple[Any, ...]:
    """The mix's constants as numpy scalars, made once (each costs about a numpy call)."""
    import numpy as np

    return np.uint64(MIX1), np.uint64(MIX2), np.uint64(27), np.uint64(32)


@functools.lru_cache(maxsize=64)
def _numpy_rounds(keys: tuple[int, ...], grid: tuple[int, int]) -> tuple[tuple[Any, ...], ...]:
    """(key, rows, columns) of each round as numpy scalars, for the orders in use."""
    import numpy as np

    rows, columns = grid
    rounds = []
    for key in keys:
        rounds.append((np.uint64(key), np.uint64(rows), np.uint64(columns)))
        rows, columns = columns, rows
    return tuple(rounds)


def positions(ranges: Iterable[tuple[int, int]]) -> Indices:
    """The positions of half-open `ranges`, concatenated (vectorised over the ranges)."""
    import numpy as np

    pairs = np.asarray(ranges if isinstance(ranges, Sequence) else tuple(ranges), dtype=np.int64)
    if pairs.size == 0:
        return np.zeros(0, dtype=np.int64)
    starts, lengths = pairs[:, 0], pairs[:, 1] - pairs[:, 0]
    ends = np.cumsum(lengths)
    # each output i of range r is starts[r] + (i - (ends[r] - lengths[r]))
    return np.arange(ends[-1], dtype=np.int64) + np.repeat(starts - ends + lengths, lengths)
