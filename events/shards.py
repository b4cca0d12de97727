"""A rank's share of an epoch's sample indices, as it travels inside facts.

A shard is an ordered tuple of half-open index ranges. After a world change a
rank may hold several ranges (the leftovers of old ranks), so a shard is read
as the concatenation of its ranges; `take` cuts a batch out of that sequence.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from pydantic import BaseModel, ConfigDict, Field, model_validator

Range = tuple[int, int]


class Shard(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    ranges: tuple[tuple[int, int], ...] = Field(default=(), max_length=100_000)

    @model_validator(mode="after")
    def _ranges_are_ordered_and_non_empty(self) -> Shard:
        for start, stop in self.ranges:
            if not 0 <= start < stop:
                raise ValueError(f"shard range ({start}, {stop}) must satisfy 0 <= start < stop")
        return self

    @property
    def size(self) -> int:
        return sum(stop - start for start, stop in self.ranges)

    def take(self, offset: int, count: int) -> tuple[Range, ...]:
        """The ranges holding items [offset, offset + count) of this shard's sequence."""
        return _slice(self.ranges, offset, count)

    def skip(self, offset: int) -> Shard:
        """This shard without its first `offset` items."""
        return Shard(ranges=_slice(self.ranges, offset, self.size))

    def indices(self) -> Iterator[int]:
        for start, stop in self.ranges:
            yield from range(start, stop)


def _slice(ranges: Iterable[Range], offset: int, count: int) -> tuple[Range, ...]:
    out: list[Range] = []
    if count <= 0:
        return ()
    end = offset + count
    pos = 0
    for start, stop in ranges:
        length = stop - start
        lo, hi = max(offset, pos), min(end, pos + length)
        if lo < hi:
            out.append((start + lo - pos, start + hi - pos))
        pos += length
        if pos >= end:
            break
    return tuple(out)


def range_count(ranges: Iterable[Range]) -> int:
    return sum(stop - start for start, stop in ranges)
