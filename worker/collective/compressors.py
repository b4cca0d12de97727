"""Compressed allreduce with error feedback: the per-rank state around `worker/collective/codes.py`.

A compressor averages a dict of float arrays over the ranks through a `Collective`, sending
fewer bytes, and keeps per tensor what its lossy code left out (the error) to add to the
next step's values, so that over steps the sum of what was applied tracks the sum of the
true means. Two codes:

- `Int8Feedback`: the values plus the error are rounded to int8 blocks here, on the grid the
  collective's int8 transport sends them on (`layout.received`), and the rest is kept as the
  error; each chunk's owner sums the ranks' decoded blocks in float64 and sends the mean as
  int8 blocks, one allreduce.
- `PowerSGD`: each matrix M (plus its error) is sent as P = M Q (allreduce 1), P's mean is
  made orthonormal, then Q = M^T P (allreduce 2); the update is P Q^T and Q is kept as the
  next step's start (warm start). Vectors and small matrices ride exactly with P.

Every rank applies the same update: what it returns is decoded from the bytes every rank
received (the means of the allreduces) by the same deterministic numpy code. The error is
each rank's own; Q is the same on every rank (it is a mean, or seeded).

`reset(step)` forgets the error and seeds Q from `step`: call it when a world starts (the
first step of the world, the same on every rank), so survivors, joiners and a rank that
rejoins all hold the same Q and no error from a world whose weights were replaced. A call
that raises (a world change mid-step) leaves the state as it was.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol

import numpy as np

from cohort.events.errors import InvalidValueError
from cohort.worker.collective import codes as compress
from cohort.worker.collective.layout import flatten, unflatten
from cohort.worker.collective.redis_collective import Collective

Compression = Literal["powersgd", "int8"]
COMPRESSIONS: tuple[Compression, ...] = ("powersgd", "int8")
DEFAULT_RANK = 4
CALLS = 2
"""Collective calls one compressed allreduce may make (PowerSGD: P, then Q)."""


class Compressor(Protocol):
    """What `sync_gradients` and `LocalSGD` need of a compressor."""

    def allreduce(
        self,
        collective: Collective,
        tensors: Mapping[str, np.ndarray],
        calls: Sequence[int],
        world: int | None = None,
        out: Mapping[str, np.ndarray] | None = None,
    ) -> dict[str, np.ndarray]:
        """The (approximate) mean of `tensors` over the world, identical on every rank;
        `calls`: CALLS distinct collective call ids for this reduction. `out`: arrays the
        results may be written into (and returned as), e.g. `tensors` themselves."""
        ...

    def reset(self, step: int) -> None:
        """Forget the error; restart Q from a seed of `step` (a world's first step)."""
        ...


def compressor(compression: str | None, rank: int = DEFAULT_RANK) -> Compressor | None:
    """The compressor named `compression` ("powersgd" with `rank`, "int8"), or None for None.

    ValueError names a bad value."""
    if compression is None:
        return None
    if compression == "powersgd":
        return PowerSGD(rank)
    if compression == "int8":
        return Int8Feedback()
    raise InvalidValueError(
        f"compression {compression!r} is not one of {', '.join(map(repr, COMPRESSIONS))} or None"
    )


class Int8Feedback:
    """int8 blocks with error feedback (see the module docstring)."""

    def __init__(self) -> None:
        self.error: dict[str, np.ndarray] = {}

    def reset(self, step: int) -> None:
        self.error = {}

    def allreduce(
        self,
        collective: Collective,
        tensors: Mapping[str, np.ndarray],
        calls: Sequence[int],
        world: int | None = None,
        out: Mapping[str, np.ndarray] | None = None,
    ) -> dict[str, np.ndarray]:
        """As `Compressor.allreduce` (results in new arrays: `out` is not used)."""
        corrected = {name: self._with_error(name, a) for name, a in tensors.items()}
        layout, flats = flatten(corrected)
        error: dict[str, np.ndarray] = {}
        if "<f4" in flats:
            # round on the transport's grid: blocks from the vector's start, as the
            # collective cuts int8 chunks at block boundaries
            grid = compress.int8_round_trip(flats["<f4"])
            rest = flats["<f4"] - grid
            flats = {**flats, "<f4": grid}
            error = {n: e for n, e in unflatten(layout, {"<f4": rest}).items() if e.size}
        # one vector per dtype, named by it: the collective flattens nothing again
        means = collective.allreduce(flats, calls[0], world=world, transport="int8")
        self.error.update(error)  # only once the step went through
        return unflatten(layout, means)

    def _with_error(self, name: str, array: np.ndarray) -> np.ndarray:
        a = np.asarray(array)
        error = self.error.get(name)
        if a.dtype != np.float32 or error is None or error.shape != a.shape:
            return a
        return a + error


class PowerSGD:
    """Rank-`rank` PowerSGD with error feedback and warm-started Q (module docstring)."""

    def __init__(self, rank: int = DEFAULT_RANK, seed: int = 0) -> None:
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise InvalidValueError(f"PowerSGD rank must be an integer >= 1, not {rank!r}")
        self.rank = rank
        self.error: dict[str, np.ndarray] = {}
        self.q: dict[str, np.ndarray] = {}
        self.seed = seed
        self._spare: dict[str, np.ndarray] = {}
        """Per matrix, the buffer M is built in, which becomes the error once a step went
        through (and the old error the next spare): memory the process already touched.
        Fresh arrays of this size cost more in page faults than the additions themselves."""

    def reset(self, step: int) -> None:
        self.error = {}
        self.q = {}
        self.seed = step

    def compressed(self, tensors: Mapping[str, np.ndarray]) -> list[str]:
        """The names of `tensors` sent as factors (the others go exactly), sorted."""
        return sorted(
            n for n, a in tensors.items() if compress.compressible(np.shape(a), self.rank)
        )

    def allreduce(
        self,
        collective: Collective,
        tensors: Mapping[str, np.ndarray],
        calls: Sequence[int],
        world: int | None = None,
        out: Mapping[str, np.ndarray] | None = None,
    ) -> dict[str, np.ndarray]:
        """As `Compressor.allreduce`; `out` (e.g. the gradients themselves): float32 arrays
        of the tensors' shapes the compressed tensors' results are written into and
        returned as, instead of new arrays."""
        names = self.compressed(tensors)
        matrices = {n: self._matrix(n, tensors[n]) for n in names}
        qs = {n: self._q(n, m.shape[1]) for n, m in matrices.items()}
        first = {n: compress.low_rank_factors(matrices[n], qs[n]) for n in names}
        exact = {n: a for n, a in tensors.items() if n not in matrices}
        sent = {**{f"{n}/P": p for n, p in first.items()}, **exact}
        means = collective.allreduce(sent, calls[0], world=world) if sent else {}
        result = {n: means[n] for n in exact}
        if not names:
            return result
        ps = {n: compress.orthonormalise(means[f"{n}/P"]) for n in names}
        second = {f"{n}/Q": compress.low_rank_second(matrices[n], ps[n]) for n in names}
        q_means = collective.allreduce(second, calls[1], world=world)
        error, warm = {}, {}
        for n in names:
            q = np.array(q_means[f"{n}/Q"])
            shape = np.shape(tensors[n])
            target = _target(out, n, shape)
            approx = compress.low_rank_decode(ps[n], q, None if target is None else
                                              target.reshape(matrices[n].shape))  # fmt: skip
            error[n] = np.subtract(matrices[n], approx, out=matrices[n])  # M is ours: reuse it
            warm[n] = q
            result[n] = approx.reshape(shape).astype(np.asarray(tensors[n]).dtype, copy=False)
        for n, e in error.items():  # only once both calls went through
            old = self.error.get(n)
            if old is not None and old.shape == e.shape:
                self._spare[n] = old
            self.error[n] = e
        self.q.update(warm)
        return result

    def _matrix(self, name: str, array: np.ndarray) -> np.ndarray:
        a = np.asarray(array)
        rows, cols = compress.matrix_shape(a.shape) or (a.size, 1)
        m = a.reshape(rows, cols)
        error = self.error.get(name)
        spare = self._spare.pop(name, None)
        if spare is None or spare.shape != m.shape:
            spare = np.empty(m.shape, np.float32)
        if error is not None and error.shape == m.shape:
            return np.add(m, error, out=spare, dtype=np.float32)  # it becomes the error
        np.copyto(spare, m, casting="same_kind")  # a copy, for the same reason
        return spare

    def _q(self, name: str, cols: int) -> np.ndarray:
        q = self.q.get(name)
        if q is None or q.shape != (cols, self.rank):
            q = compress.initial_q(name, cols, self.rank, self.seed)
        return q


def _target(out: Mapping[str, np.ndarray] | None, name: str, shape: tuple[int, ...]) -> Any:
    """`out[name]` if the caller gave a float32 array of `shape` to write into, else None."""
    if out is None or name not in out:
        return None
    target = out[name]
    if target.dtype != np.float32 or target.shape != shape or not target.flags.c_contiguous:
        raise InvalidValueError(
            f"out[{name!r}] must be a C-contiguous float32 array of shape {shape}, not "
            f"{target.dtype} {target.shape}"
        )
    return target
