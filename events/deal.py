"""How each epoch's positions are dealt to ranks, so every sample is used exactly once.

Pure, and shared: the leader deals a world's shards, every worker cuts its batches from
them, the audit and the lineage read them back. An epoch is a sequence of positions
(events/order.py maps each to a sample); a world starts with `rest`, the positions no
committed step has used, and a rank uses `counts(config, n)[rank]` of them per step:
`batch_size` each, or its share of a constant `global_batch` (sizes differ by at most one).
When the world changes at step S, what its ranks did not use by S is dealt again.

The placements (the job config's `placement`):

- contiguous: rank r holds the r-th run of `rest`, in proportion to its share, and reads
  it front to back.
- strided: every rank holds all of `rest`; step j's span of it (the global batch) is
  dealt item by item, rank r taking items r, r + n, r + 2n ... So the world uses `rest`
  strictly in order: the global batches follow the epoch's order whatever the world
  size, and with a constant global batch they are the same batches whatever the world did.
  With exact sums (the config's `exact`) the span is dealt in units of `batch_size`
  (the micro-batches) instead, rank r taking the r-th of n runs of consecutive units
  (`units_of`): every unit holds the same samples, in the same order, at any world size
  (a rank may get one unit more than another, or none), and a rank's units are neighbours
  in the tree that sums them (worker/pytorch/tree.py).
- hash: a dataset of files; each file goes to the rank that ranks highest for it
  (rendezvous hashing of worker and file), up to the rank's share: a worker keeps most
  of its files from one epoch and one world to the next, and a leaver's files move.
- locality: a dataset of files; first each file goes to a rank whose node holds it (the
  nodes say so in their Join), while that rank's share has room; what is left goes to the
  rank scoring highest by the seed's best-node score: locality 0.5 (the node's declared
  score for the dataset), load 0.3 (how much of its share is still free), hardware 0.2
  (GPUs and their memory, against the best in the world); ties by the hash. Among
  several holders of a file, the same score chooses.

Every placement but strided leaves a rank with runs of positions it reads in order, so
one bookkeeping serves them ("runs"); strided has its own ("dealt").
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from cohort.events.models import JobConfig, Node
from cohort.events.order import Order
from cohort.events.shards import Range, Shard, range_count

if TYPE_CHECKING:
    import numpy as np

LOCALITY, LOAD, HARDWARE = 0.5, 0.3, 0.2
"""The weights of the best-node score (the SeaweedFS coordinator seed's)."""


def counts(config: JobConfig, n: int) -> tuple[int, ...]:
    """Samples each of `n` ranks uses per step."""
    if config.global_batch is None:
        return (config.batch_size,) * n
    size, extra = divmod(config.global_batch, n) if n else (0, 0)
    return tuple(size + (1 if rank < extra else 0) for rank in range(n))


def merge(ranges: Iterable[Range]) -> tuple[Range, ...]:
    """Join ranges that touch, keeping order (fewer ranges in every fact)."""
    out: list[Range] = []
    for start, stop in ranges:
        if start >= stop:
            continue
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], stop)
        else:
            out.append((start, stop))
    return tuple(out)


# ---------------------------------------------------------------- dealing a world


def split(
    config: JobConfig,
    rest: Sequence[Range],
    ranks: Sequence[str],
    order: Order,
    nodes: Mapping[str, Node | None],
) -> tuple[Shard, ...]:
    """`rest` dealt to `ranks` by the config's placement; `order` is the epoch's (its
    files), `nodes` what each worker said of its machine."""
    n = len(ranks)
    if n == 0:
        return ()
    rest = merge(rest)
    match config.placement:
        case "strided":
            return (Shard(ranges=rest),) * n
        case "hash" | "locality":
            return _by_file(config, rest, ranks, order, nodes)
        case _:
            return _runs(rest, _shares(range_count(rest), counts(config, n)))


def _shares(total: int, weights: Sequence[int]) -> list[int]:
    """`total` in proportion to `weights`, whole, the remainder one each to the first."""
    whole = sum(weights)
    if whole == 0:
        return [0] * len(weights)
    shares = [total * w // whole for w in weights]
    for rank in range(total - sum(shares)):
        shares[rank % len(shares)] += 1
    return shares


def _runs(rest: Sequence[Range], shares: Sequence[int]) -> tuple[Shard, ...]:
    """`rest` cut front to back into consecutive runs of `shares` positions."""
    whole = Shard(ranges=tuple(rest))
    out, offset = [], 0
    for share in shares:
        out.append(Shard(ranges=merge(whole.take(offset, share))))
        offset += share
    return tuple(out)


def _by_file(
    config: JobConfig,
    rest: Sequence[Range],
    ranks: Sequence[str],
    order: Order,
    nodes: Mapping[str, Node | None],
) -> tuple[Shard, ...]:
    """The hash and locality placements: `rest` cut into pieces of one file each, every
    piece to the best rank with room left (pieces split where a rank's share runs out).

    At a world change this runs in the leader's decision, so it is kept to a few numpy
    calls per piece: each piece's first choice is found for all pieces at once, and the
    ranks' scores are updated where a share fills, not recomputed."""
    import numpy as np

    n = len(ranks)
    room = np.array(_shares(range_count(rest), counts(config, n)), dtype=np.int64)
    given: list[list[Range]] = [[] for _ in ranks]
    pieces = list(order.pieces(rest))
    files = np.fromiter((f for _, _, f in pieces), dtype=np.int64, count=len(pieces))
    deal = _Dealer(ranks, room, given, files)
    if config.placement == "locality":
        described = [nodes.get(w) or Node() for w in ranks]
        score = _Locality(described, room.astype(np.float64), int(files.max(initial=-1)) + 1)
        left = []  # first each piece to a node that holds its file, while room lasts
        for i, (start, stop, file) in enumerate(pieces):
            start = deal.among(i, start, stop, score.holders(file), score)
            if start < stop:
                left.append(i)
        for i in left:  # then the rest, to the best score over every rank
            start, stop, _ = pieces[i]
            start += sum(b - a for a, b in deal.taken.get(i, ()))
            deal.anywhere(i, start, stop, score)
    else:
        first = deal.first_choices()
        for i, (start, stop, _) in enumerate(pieces):
            best = int(first[i])
            if room[best] >= stop - start:  # nearly always: its first choice has room
                deal.give(i, best, start, stop - start)
            else:
                deal.anywhere(i, start, stop, None)
    return tuple(Shard(ranges=merge(sorted(runs))) for runs in given)


class _Dealer:
    """Pieces handed to ranks, tracking each rank's room."""

    CHUNK = 1 << 22  # hash cells computed at once (pieces x ranks)

    def __init__(
        self, ranks: Sequence[str], room: np.ndarray, given: list[list[Range]], files: np.ndarray
    ) -> None:
        self.workers = _worker_hashes(ranks)
        self.worker_ints: list[int] = self.workers.tolist()
        self.room, self.given, self.files = room, given, files
        self.taken: dict[int, list[Range]] = {}

    def tie(self, piece: int) -> np.ndarray:
        """Each rank's rendezvous hash for the piece's file (the hash placement's choice,
        the tie-break of the others)."""
        import numpy as np

        return _mix(self.workers ^ _mix(np.uint64(self.files[piece] + 1)))

    def first_choices(self) -> np.ndarray:
        """Each piece's highest-hashing rank, all pieces at once (in chunks)."""
        import numpy as np

        out = np.empty(self.files.size, dtype=np.int64)
        step = max(1, self.CHUNK // max(1, self.workers.size))
        for at in range(0, self.files.size, step):
            keys = _mix((self.files[at : at + step] + 1).astype(np.uint64))
            out[at : at + step] = np.argmax(_mix(keys[:, None] ^ self.workers[None, :]), axis=1)
        return out

    def give(self, piece: int, rank: int, start: int, take: int) -> None:
        self.given[rank].append((start, start + take))
        self.taken.setdefault(piece, []).append((start, start + take))
        self.room[rank] -= take

    def among(self, piece: int, start: int, stop: int, ranks: np.ndarray, score: _Locality) -> int:
        """The piece to the best of `ranks` with room, cut as their room runs out; returns
        where what none of them could take starts. `ranks` are a file's holders, a few:
        plain Python beats numpy's per-call cost here."""
        if not ranks.size:
            return start
        holders = ranks.tolist()
        key = _mix_int(int(self.files[piece]) + 1)
        tie = {r: _mix_int(self.worker_ints[r] ^ key) for r in holders}
        room = self.room
        while start < stop:
            open_ = [r for r in holders if room[r] > 0]
            if not open_:
                break
            best = max(open_, key=lambda r: (score.local_of(r, int(room[r])), tie[r]))
            take = min(stop - start, int(room[best]))
            self.give(piece, best, start, take)
            start += take
        return start

    def anywhere(self, piece: int, start: int, stop: int, score: _Locality | None) -> None:
        """The piece to the best ranks with room over the whole world."""
        import numpy as np

        tie = self.tie(piece)
        while start < stop:
            open_ = self.room > 0
            values = open_.astype(np.float64) if score is None else score.remote(self.room)
            best = _best(np.where(open_, values, -np.inf), tie)
            take = min(stop - start, int(self.room[best]))
            self.give(piece, best, start, take)
            start += take


def _best(scores: np.ndarray, tie: np.ndarray) -> int:
    """The index of the highest score; among equals, of the highest hash."""
    import numpy as np

    top = np.flatnonzero(scores == scores.max())
    return int(top[np.argmax(tie[top])]) if top.size > 1 else int(top[0])


class _Locality:
    """The best-node score of every rank, as its share fills: the load term is the part of
    its share still free. Which nodes hold which file is indexed once, from the nodes' file
    ranges (its size is the number of (file, node) pairs they declare)."""

    def __init__(self, nodes: Sequence[Node], shares: np.ndarray, files: int) -> None:
        import numpy as np

        self.shares = np.where(shares > 0, shares, 1.0)
        declared = np.array([node.locality for node in nodes])
        gpus = np.array([node.gpus for node in nodes], dtype=np.float64)
        memory = np.array([node.gpu_memory for node in nodes], dtype=np.float64)
        hardware = 0.5 * _against_best(gpus) + 0.5 * _against_best(memory)
        self.fixed_local = LOCALITY * 1.0 + HARDWARE * hardware
        self.fixed_remote = LOCALITY * declared + HARDWARE * hardware
        self._local, self._shares = self.fixed_local.tolist(), self.shares.tolist()
        held, by = [], []
        for rank, node in enumerate(nodes):
            for start, stop in node.files:
                if start < files:
                    held.append(np.arange(start, min(stop, files)))
                    by.append(np.full(min(stop, files) - start, rank))
        file_of = np.concatenate(held) if held else np.zeros(0, dtype=np.int64)
        rank_of = np.concatenate(by) if by else np.zeros(0, dtype=np.int64)
        sort = np.argsort(file_of, kind="stable")
        self.rank_of = rank_of[sort]
        self.bounds = np.searchsorted(file_of[sort], np.arange(files + 1))

    def holders(self, file: int) -> np.ndarray:
        """The ranks whose nodes hold `file`."""
        return self.rank_of[self.bounds[file] : self.bounds[file + 1]]  # type: ignore[no-any-return]

    def local_of(self, rank: int, room: int) -> float:
        """The score of `rank`, a holder of the file, with `room` left."""
        return self._local[rank] + LOAD * room / self._shares[rank]

    def remote(self, room: np.ndarray) -> np.ndarray:
        """The score of every rank for a file none with room holds."""
        return self.fixed_remote + LOAD * room / self.shares  # type: ignore[no-any-return]


def _against_best(values: np.ndarray) -> np.ndarray:
    import numpy as np

    top = values.max() if values.size else 0.0
    return values / top if top > 0 else np.zeros_like(values)


def _worker_hashes(ranks: Sequence[str]) -> np.ndarray:
    import numpy as np

    digests = (hashlib.blake2b(w.encode(), digest_size=8).digest() for w in ranks)
    return np.array([int.from_bytes(d, "little") for d in digests], dtype=np.uint64)


MASK64 = (1 << 64) - 1


def _mix_int(z: int) -> int:
    """`_mix` of one Python int (numpy's scalars cost more than the arithmetic)."""
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & MASK64
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def _mix(z: Any) -> np.ndarray:
    """splitmix64's finaliser: a well-spread 64-bit hash of each value."""
    import numpy as np

    z = np.array(z, dtype=np.uint64)
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return z


# ---------------------------------------------------------------- reading a world


def batch(
    config: JobConfig, shards: Sequence[Shard], rank: int, base_step: int, step: int
) -> tuple[Range, ...]:
    """The positions rank `rank` uses at `step`, in a world dealt `shards` from `base_step`."""
    if step < base_step:
        raise ValueError(f"step {step} precedes the world's base step {base_step}")
    n, done = len(shards), step - base_step
    count = counts(config, n)[rank]
    shard = shards[rank]
    if config.placement != "strided":
        return shard.take(done * count, count)
    span = sum(counts(config, n))
    start, stop = done * span, min((done + 1) * span, shard.size)
    if config.exact:  # whole units of `batch_size`: the rank's run of them
        unit = config.batch_size
        mine = units_of(-(-(stop - start) // unit), n, rank)
        first, last = start + mine.start * unit, min(start + mine.stop * unit, stop)
        return shard.take(first, last - first) if last > first else ()
    items = range(start + rank, stop, n)
    return merge(r for item in items for r in shard.take(item, 1))


def units_of(units: int, n: int, rank: int) -> range:
    """The units (of a step's `units`, dealt whole with exact sums) rank `rank` of `n`
    computes: the rank-th of n runs of consecutive units, the first `units % n` runs one
    longer than the rest. So where the world has more ranks than the step has units, the
    ranks left without one are the last (never the chief, rank 0)."""
    each, more = divmod(units, n)
    start = rank * each + min(rank, more)
    return range(start, start + each + (rank < more))


def used(config: JobConfig, shards: Sequence[Shard], base_step: int, next_step: int) -> int:
    """Positions the world's steps [base_step, next_step) used, over all ranks."""
    done = max(0, next_step - base_step)
    n = len(shards)
    if config.placement == "strided":
        return min(done * sum(counts(config, n)), shards[0].size) if n else 0
    return sum(min(done * c, s.size) for c, s in zip(counts(config, n), shards, strict=True))


def step_total(config: JobConfig, shards: Sequence[Shard], base_step: int, step: int) -> int:
    """Positions the whole world uses at `step` (fewer than a full step's only at an
    epoch's end)."""
    return used(config, shards, base_step, step + 1) - used(config, shards, base_step, step)


def weight(
    config: JobConfig, shards: Sequence[Shard], rank: int, base_step: int, step: int
) -> float:
    """What rank `rank`'s mean gradient at `step` is multiplied by before the ranks' mean,
    so that the update weighs every sample of the global batch alike: its share of the
    step's samples times the world size. 1 without a `global_batch`: each rank's batch
    counts the same, as under DDP."""
    if config.global_batch is None:
        return 1.0
    total = step_total(config, shards, base_step, step)
    if total == 0:
        return 0.0
    mine = range_count(batch(config, shards, rank, base_step, step))
    return mine * len(shards) / total


def leftover(
    config: JobConfig,
    shards: Sequence[Shard],
    base_step: int,
    next_step: int,
    unassigned: Shard | None = None,
) -> tuple[Range, ...]:
    """What is left of the epoch when `next_step` is the first uncommitted step."""
    done = max(0, next_step - base_step)
    rest: list[Range] = []
    if config.placement == "strided":
        if shards:
            rest.extend(shards[0].skip(used(config, shards, base_step, next_step)).ranges)
    else:
        for count, shard in zip(counts(config, len(shards)), shards, strict=True):
            rest.extend(shard.skip(done * count).ranges)
    if unassigned is not None:
        rest.extend(unassigned.ranges)
    return merge(rest)


def exhausted(config: JobConfig, shards: Sequence[Shard], base_step: int, next_step: int) -> bool:
    """True when no rank has a position left for `next_step` (`used` reached every position).

    Rank by rank, stopping at the first with positions left: the leader asks after every
    commit, and mid-epoch the first rank answers."""
    done = max(0, next_step - base_step)
    steps = counts(config, len(shards))
    if config.placement == "strided":
        return not shards or done * sum(steps) >= shards[0].size
    return all(done * count >= shard.size for count, shard in zip(steps, shards, strict=True))


def micro_batches(config: JobConfig, ranges: Sequence[Range]) -> tuple[tuple[Range, ...], ...]:
    """A rank's batch cut into pieces of at most `batch_size` (one forward and backward
    each): several only with a `global_batch` bigger than the world's `batch_size`s."""
    whole = Shard(ranges=tuple(ranges))
    size = config.batch_size
    return tuple(whole.take(at, size) for at in range(0, whole.size, size)) or ((),)
