"""Gradient compression, the pure part: int8 blocks and low-rank (PowerSGD) factors.

Nothing here keeps state or touches Redis; the error feedback that makes these lossy codes
converge lives in `worker/collective/compressors.py`, and the int8 transport of an allreduce in
`worker/collective/layout.py` uses `quantise`/`dequantise` on each chunk.

int8: a float vector is cut into blocks of `BLOCK` values from its first element; each block
keeps one float32 scale (its largest magnitude / 127) and 127 levels each side, rounded to the
nearest level. Round to nearest rather than stochastic rounding: the code is a deterministic
function of its input (so the owner of a chunk and a rank re-deriving it agree, and a rerun
gives the same bytes), and error feedback corrects its bias over steps, which is what
stochastic rounding would buy. Decoding is one float32 multiply per value, so every IEEE
machine decodes the same bytes to the same bits.

Low rank: a gradient matrix M (rows x cols) is approximated as P Q^T with P = M Q, P made
orthonormal, Q = M^T P (rank r columns). A tensor of one dimension, or one whose factors
would not be at least twice smaller than itself, is sent exactly, as PowerSGD does.
"""

from __future__ import annotations

import hashlib

import numpy as np

from cohort.events.errors import InvalidValueError

BLOCK = 256
"""Values per int8 block: one float32 scale per 256 bytes adds 1.6%."""
LEVELS = 127
"""Levels each side of zero: int8 without -128, so the code is symmetric."""


def blocks_of(size: int, block: int = BLOCK) -> int:
    """How many blocks (and scales) a vector of `size` values has."""
    return -(-size // block)


def int8_bytes(size: int, block: int = BLOCK) -> int:
    """Bytes of `size` values as int8 blocks: one per value plus a float32 scale per block."""
    return size + 4 * blocks_of(size, block)


def _grid(x: np.ndarray, block: int) -> np.ndarray:
    """`x` as rows of `block` values (zero-padded at the end: a copy only if it must be)."""
    n = x.size
    count = blocks_of(n, block)
    if n == count * block:
        return x.reshape(count, block)
    padded = np.zeros(count * block, dtype=x.dtype)
    padded[:n] = x
    return padded.reshape(count, block)


def quantise(values: np.ndarray, block: int = BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """`values` (1-D, float) as int8 levels and one float32 scale per block of `block`.

    Raises ValueError for a value that is not finite (no scale could carry it)."""
    x = np.asarray(values, dtype=np.float32).reshape(-1)
    grid = _grid(x, block)
    biggest = np.maximum(grid.max(axis=1, initial=0.0), -grid.min(axis=1, initial=0.0))
    if not np.isfinite(biggest).all():
        bad = int(np.flatnonzero(~np.isfinite(biggest))[0])
        raise InvalidValueError(f"cannot quantise block {bad}: it holds a value that is inf or nan")
    scales = biggest / np.float32(LEVELS)
    # divide, not multiply by 127 / biggest: that overflows for blocks of tiny values
    safe = np.where(scales > 0, scales, np.float32(1))
    levels = grid / safe[:, None]
    np.rint(levels, out=levels)
    np.clip(levels, -LEVELS, LEVELS, out=levels)  # a subnormal scale may round below 1/127
    return levels.astype(np.int8).reshape(-1)[: x.size], scales.astype(np.float32)


def dequantise(levels: np.ndarray, scales: np.ndarray, block: int = BLOCK) -> np.ndarray:
    """The float32 values `quantise` encoded (ValueError if the sizes do not match)."""
    n = levels.size
    count = blocks_of(n, block)
    if scales.size != count:
        raise InvalidValueError(
            f"{n} int8 values in blocks of {block} need {count} scales, not {scales.size}"
        )
    grid = _grid(np.asarray(levels).reshape(-1), block)
    column = np.asarray(scales, dtype=np.float32)[:, None]
    return np.multiply(grid, column, dtype=np.float32).reshape(-1)[:n]


def int8_round_trip(values: np.ndarray, block: int = BLOCK) -> np.ndarray:
    """What `values` decode to after travelling as int8 blocks."""
    return dequantise(*quantise(values, block), block)


# ------------------------------------------------------------------ low rank
def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int] | None:
    """(rows, cols) a tensor of `shape` is compressed as (first dimension x the rest), or None
    for a tensor of fewer than two dimensions."""
    if len(shape) < 2:
        return None
    rows = int(shape[0])
    return rows, int(np.prod(shape[1:]))


def compressible(shape: tuple[int, ...], rank: int) -> bool:
    """True if rank-`rank` factors of a tensor of `shape` take at most half its values."""
    matrix = matrix_shape(shape)
    if matrix is None:
        return False
    rows, cols = matrix
    return 2 * rank * (rows + cols) <= rows * cols


def orthonormalise(p: np.ndarray) -> np.ndarray:
    """The columns of `p` (rows x r) made orthonormal by modified Gram-Schmidt in float64,
    returned as float32. A column that is (numerically) in the span of the ones before it
    becomes zero instead of noise: the factors then carry fewer directions, and error
    feedback keeps what they miss."""
    q = np.array(p, dtype=np.float64)
    scale = float(np.max(np.abs(q))) if q.size else 0.0
    tiny = max(scale, 1e-300) * 1e-10
    for j in range(q.shape[1]):
        column = q[:, j]
        for k in range(j):
            column -= np.dot(q[:, k], column) * q[:, k]
        norm = float(np.sqrt(np.dot(column, column)))
        if norm > tiny:
            column /= norm
        else:
            column[:] = 0.0
    return q.astype(np.float32)


def initial_q(name: str, cols: int, rank: int, seed: int) -> np.ndarray:
    """The starting Q (cols x rank, float32) of tensor `name`: standard normal values from a
    generator keyed by (`seed`, name), so every rank that starts a world at the same `seed`
    (the world's first step) starts from the same Q."""
    key = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
    rng = np.random.default_rng([seed & 0xFFFFFFFFFFFFFFFF, key])
    return rng.standard_normal((cols, rank)).astype(np.float32)


def low_rank_factors(m: np.ndarray, q: np.ndarray) -> np.ndarray:
    """P = M Q, the first factor a rank contributes (its mean is orthonormalised next)."""
    return np.asarray(m @ q, dtype=np.float32)


def low_rank_second(m: np.ndarray, p: np.ndarray) -> np.ndarray:
    """Q = M^T P for the orthonormal P every rank agreed on."""
    return np.asarray(m.T @ p, dtype=np.float32)


def low_rank_decode(p: np.ndarray, q: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """The approximation P Q^T (float32), into `out` if given (float32, rows x cols)."""
    if out is not None:
        return np.matmul(
            p.astype(np.float32, copy=False), q.astype(np.float32, copy=False).T, out=out
        )
    return np.asarray(p @ q.T, dtype=np.float32)
