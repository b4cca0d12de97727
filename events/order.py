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
from collections.abc import Iterable, Sequence
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

    def _permute_many(self, x: np.ndarray) -> np.ndarray:
        """`_permute` over an array of uint64, a numpy call per operation."""
        mix1, mix2, by27, by32 = _numpy_constants()
        for key, rows, columns in _numpy_rounds(self.keys, self.grid):
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
