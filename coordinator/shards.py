"""Splitting an epoch's sample indices over ranks so every sample is used exactly once.

Pure helpers. An epoch starts as [0, dataset_size) split contiguously, the
remainder spread one each over the first ranks. When the world changes at step
S, each old rank's shard loses the samples of the steps it committed
(`(S - base_step) * batch_size` of them, in order) and the leftovers, in rank
order, are split again the same way over the new ranks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from cohort.events.shards import Range, Shard, consumed, range_count


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


def split(ranges: Sequence[Range], n: int) -> tuple[Shard, ...]:
    """`ranges` cut into `n` contiguous shards whose sizes differ by at most one."""
    if n <= 0:
        return ()
    whole = Shard(ranges=merge(ranges))
    total = range_count(whole.ranges)
    size, extra = divmod(total, n)
    shards, offset = [], 0
    for rank in range(n):
        count = size + (1 if rank < extra else 0)
        shards.append(Shard(ranges=merge(whole.take(offset, count))))
        offset += count
    return tuple(shards)


def full(dataset_size: int, n: int) -> tuple[Shard, ...]:
    """A fresh epoch over `n` ranks."""
    return split(((0, dataset_size),), n)


def leftover(
    shards: Sequence[Shard], base_step: int, next_step: int, batch_size: int, unassigned: Shard
) -> tuple[Range, ...]:
    """What is left of the epoch when `next_step` is the first uncommitted step."""
    used = consumed(base_step, next_step, batch_size)
    rest: list[Range] = []
    for shard in shards:
        rest.extend(shard.skip(used).ranges)
    rest.extend(unassigned.ranges)
    return merge(rest)


def batch(shard: Shard, base_step: int, step: int, batch_size: int) -> tuple[Range, ...]:
    """The sample ranges a rank holding `shard` (from `base_step`) uses at `step`."""
    return shard.take(consumed(base_step, step, batch_size), batch_size)
