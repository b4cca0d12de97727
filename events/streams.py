"""The storage seam: a handful of stream operations, the same on fakeredis and Redis."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

from .codec import FIELD, decode_fact, decode_facts, encode, gc_paused
from .connection import Client
from .models import Command, Fact

ZERO = "0-0"


class Entry(NamedTuple):
    """One stream entry as stored: its ID and its fields, bytes untouched.

    A tuple, not a dataclass: replay makes a million of these, and a frozen
    dataclass's __init__ costs a third more.
    """

    id: str
    fields: dict[bytes, bytes]

    @property
    def raw(self) -> bytes | None:
        return self.fields.get(FIELD)

    @property
    def ms(self) -> int:
        """The Redis server's clock (ms) when the entry was added."""
        return int(self.id.split("-", 1)[0])


def _entries(rows: Any) -> list[Entry]:
    # redis-py hands each entry's fields over as a fresh dict (RESP2 and RESP3 alike);
    # anything else (a pair list) is made into one
    with gc_paused():
        return [Entry(_s(i), f if type(f) is dict else dict(f)) for i, f in rows or ()]


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def id_after(a: str, b: str) -> bool:
    """True if stream ID `a` sorts after `b`."""
    am, _, asq = a.partition("-")
    bm, _, bsq = b.partition("-")
    return (int(am), int(asq or 0)) > (int(bm), int(bsq or 0))


class Stream:
    def __init__(self, conn: Client, key: str) -> None:
        self.conn = conn
        self.key = key

    def append_raw(self, raw: bytes, maxlen: int | None = None) -> str:
        return _s(self.conn.xadd(self.key, {FIELD: raw}, maxlen=maxlen, approximate=True))

    def range(self, after: str = ZERO, until: str = "+", count: int | None = None) -> list[Entry]:
        """Entries with after < ID <= until, oldest first."""
        start = "-" if after == ZERO else f"({after}"
        return _entries(self.conn.xrange(self.key, start, until, count=count))

    def tail(self, after: str, block_ms: int, count: int = 512) -> list[Entry]:
        """Entries after `after`, waiting up to `block_ms` for the first one (XREAD BLOCK)."""
        reply: Any = self.conn.xread({self.key: after}, count=count, block=max(block_ms, 1))
        if not reply:
            return []
        if isinstance(reply, dict):  # RESP3 answers with a map
            rows: Any = next(iter(reply.values()), [[]])
            rows = rows[0] if rows and isinstance(rows[0], list) else rows
            return _entries(rows)
        return _entries(reply[0][1])

    def last_id(self) -> str:
        rows: Any = self.conn.xrevrange(self.key, "+", "-", count=1)
        return _s(rows[0][0]) if rows else ZERO

    def length(self) -> int:
        return int(self.conn.xlen(self.key))


class Inbox(Stream):
    """Where workers say what happens to them. Untrusted: the leader validates each entry."""

    def send(self, command: Command, maxlen: int | None = None) -> str:
        return self.append_raw(encode(command), maxlen=maxlen)


class Journal(Stream):
    """The facts. Read by anyone; appended to only by the fenced leader function."""

    def facts(
        self, after: str = ZERO, until: str = "+", batch: int = 4096
    ) -> Iterator[tuple[str, Fact]]:
        while True:
            rows = self.range(after, until, count=batch)
            yield from zip((entry.id for entry in rows), self.decode_page(rows), strict=True)
            if len(rows) < batch:
                return
            after = rows[-1].id

    @staticmethod
    def decode(entry: Entry) -> Fact:
        return decode_fact(entry.raw or b"")

    @staticmethod
    def decode_page(entries: Sequence[Entry]) -> list[Fact]:
        """The facts of `entries`, decoded in one batch; a DecodeError's `index` names the
        bad entry."""
        return decode_facts([entry.raw or b"" for entry in entries])
