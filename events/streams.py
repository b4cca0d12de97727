"""The storage seam: a handful of stream operations, the same on fakeredis and Redis."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

from cohort.events.codec import FIELD, decode_fact, decode_facts, encode, gc_paused
from cohort.events.connection import Client, is_cluster, text
from cohort.events.errors import DecodeError
from cohort.events.identity import Signer
from cohort.events.models import Command, Fact, LeaderElected

ZERO = "0-0"
PAGE = 4096
"""Entries read per round trip when a whole stream is read a page at a time."""


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
        return id_ms(self.id)


def id_ms(entry_id: str) -> int:
    """The milliseconds part of a stream entry ID: the server's clock when it was added."""
    return int(entry_id.partition("-")[0])


def id_key(entry_id: str) -> tuple[int, int]:
    """A stream entry ID as (ms, seq), which sorts as Redis orders entries."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def id_after(a: str, b: str) -> bool:
    """True if stream ID `a` sorts after `b`."""
    return id_key(a) > id_key(b)


def entries(rows: Any) -> list[Entry]:
    """XRANGE rows (or one stream's XREAD rows) as entries."""
    # redis-py hands each entry's fields over as a fresh dict (RESP2 and RESP3 alike);
    # anything else (a pair list) is made into one
    with gc_paused():
        return [Entry(text(i), f if type(f) is dict else dict(f)) for i, f in rows or ()]


def read_reply(reply: Any) -> dict[str, list[Entry]]:
    """XREAD's answer as {stream key: entries}, on RESP2 (a list of pairs) and RESP3 (a map)."""
    if not reply:
        return {}
    pairs = reply.items() if isinstance(reply, dict) else reply
    out = {}
    for key, rows in pairs:
        if rows and isinstance(rows[0], list) and rows[0] and isinstance(rows[0][0], list):
            rows = rows[0]  # RESP3 wraps the rows once more
        out[text(key)] = entries(rows)
    return out


class Stream:
    def __init__(self, conn: Client, key: str) -> None:
        self.conn = conn
        self.key = key

    def append_raw(self, raw: bytes, maxlen: int | None = None) -> str:
        return text(self.conn.xadd(self.key, {FIELD: raw}, maxlen=maxlen, approximate=True))

    def range(self, after: str = ZERO, until: str = "+", count: int | None = None) -> list[Entry]:
        """Entries with after < ID <= until, oldest first."""
        start = "-" if after == ZERO else f"({after}"
        return entries(self.conn.xrange(self.key, start, until, count=count))

    def tail(self, after: str, block_ms: int, count: int = 512) -> list[Entry]:
        """Entries after `after`, waiting up to `block_ms` for the first one (XREAD BLOCK)."""
        reply: Any = self.conn.xread({self.key: after}, count=count, block=max(block_ms, 1))
        return read_reply(reply).get(self.key, [])

    def reader(self) -> StreamReader | None:
        """`tail` on a connection of its own, for one thread that follows the stream; None
        on Redis Cluster (a key's server is found per command there)."""
        pool = getattr(self.conn, "connection_pool", None)
        if is_cluster(self.conn) or pool is None:
            return None
        return StreamReader(self.key, pool)

    def pages(
        self,
        after: str = ZERO,
        until: str = "+",
        count: int = PAGE,
        block_ms: int = 0,
        attempt: Callable[[Callable[[], list[Entry]]], list[Entry]] | None = None,
    ) -> Iterator[list[Entry]]:
        """The entries after `after` (up to `until`), a page of at most `count` at a time.

        With `block_ms` the first page waits that long for an entry (XREAD BLOCK); later
        pages never wait. `attempt` runs each read (a retry policy, say).
        """
        waited = block_ms <= 0  # only the first page may wait; a short page after it ends
        while True:
            if waited:
                read = functools.partial(self.range, after, until, count)
            else:
                read = functools.partial(self.tail, after, block_ms, count)
            rows = read() if attempt is None else attempt(read)
            if rows:
                yield rows
            if not rows or (waited and len(rows) < count):
                return
            waited, after = True, rows[-1].id

    def last_id(self) -> str:
        rows: Any = self.conn.xrevrange(self.key, "+", "-", count=1)
        return text(rows[0][0]) if rows else ZERO

    def length(self) -> int:
        return int(self.conn.xlen(self.key))


class Inbox(Stream):
    """Where workers say what happens to them. Untrusted: the leader validates each entry.

    With a `signer` every entry carries its signer and MAC beside the command
    (events/identity.py), as a job in identity mode requires.
    """

    def __init__(self, conn: Client, key: str, signer: Signer | None = None) -> None:
        super().__init__(conn, key)
        self.signer = signer

    def send(self, command: Command, maxlen: int | None = None) -> str:
        fields: Any = self.fields(command)
        return text(self.conn.xadd(self.key, fields, maxlen=maxlen, approximate=True))

    def fields(self, command: Command) -> dict[bytes, bytes]:
        """The entry's fields for `command`: its bytes, and with a signer its signature."""
        raw = encode(command)
        return {FIELD: raw} if self.signer is None else self.signer.fields(raw)

    def wire(self) -> InboxWire | None:
        """A connection of its own that writes commands without waiting for each reply;
        None on Redis Cluster (a key's server is found per command there)."""
        pool = getattr(self.conn, "connection_pool", None)
        if is_cluster(self.conn) or pool is None:
            return None
        return InboxWire(self, pool)


class _Held:
    """A connection taken from `pool` on first use and kept by the one thread that uses it,
    until `close`."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self._connection: Any = None

    def _connected(self) -> Any:
        if self._connection is None:
            self._connection = self.pool.get_connection()
        return self._connection

    def close(self, drop: bool = False) -> None:
        """Give the connection back to its pool (`drop`: closed first, since a reply may
        still be on its way on it)."""
        connection, self._connection = self._connection, None
        if connection is None:
            return
        if drop:
            connection.disconnect()
        self.pool.release(connection)


class StreamReader(_Held):
    """XREAD BLOCK of one stream on a connection taken from `pool` and kept, for the one
    thread that follows the stream (a worker's journal tail): a read per journal entry
    without the client's per-command pool and retry bookkeeping, which cost more than the
    read. A failure drops the connection and is raised as the client raises it."""

    def __init__(self, key: str, pool: Any) -> None:
        super().__init__(pool)
        self.key = key

    def tail(self, after: str, block_ms: int, count: int = 512) -> list[Entry]:
        """`Stream.tail`: entries after `after`, waiting up to `block_ms` for the first."""
        block = max(block_ms, 1)
        try:
            connection = self._connected()
            connection.send_command(
                "XREAD", "COUNT", count, "BLOCK", block, "STREAMS", self.key, after
            )
            reply = connection.read_response()
        except BaseException:
            self.close(drop=True)
            raise
        return _raw_entries(reply)


def _raw_entries(reply: Any) -> list[Entry]:
    """One stream's XREAD reply as the server sent it (RESP2: [[key, rows]], RESP3: {key:
    rows}; nil after the block time), each row [id, [field, value, ...]], as entries."""
    if not reply:
        return []
    [rows] = reply.values() if isinstance(reply, dict) else [pair[1] for pair in reply]
    with gc_paused():
        return [
            Entry(text(i), dict(zip(f[::2], f[1::2], strict=True)) if f else {}) for i, f in rows
        ]


class InboxWire(_Held):
    """XADDs to one inbox on a connection taken from `pool` and kept: `write` sends one and
    returns at once, `landed` reads its reply later (by then it has nearly always come).
    What the caller may not rely on (a failure, a reply that does not come in time) the
    wire says with False, and drops the connection: the caller sends the command again
    the retrying way (an XADD that landed after all is then in the inbox twice, as after
    any lost reply)."""

    def __init__(self, inbox: Inbox, pool: Any) -> None:
        super().__init__(pool)
        self.inbox = inbox

    def write(self, command: Command) -> bool:
        """Send `command`'s XADD without reading its reply; False if it could not be sent."""
        fields = self.inbox.fields(command)
        try:
            self._connected().send_command("XADD", self.inbox.key, "*", *_flat(fields))
        except Exception:  # noqa: BLE001 - any failure: the caller retries its way
            self.close(drop=True)
            return False
        return True

    def landed(self, wait: float) -> bool:
        """Whether the XADD written last was appended, its reply read within `wait` s."""
        connection = self._connection
        try:
            if connection is None or not connection.can_read(timeout=wait):
                raise TimeoutError(f"no reply within {wait} s")
            connection.read_response()  # raises the error Redis answered with
        except Exception:  # noqa: BLE001 - refused, lost or late: the caller retries its way
            self.close(drop=True)
            return False
        return True


def _flat(fields: dict[bytes, bytes]) -> list[bytes]:
    return [item for pair in fields.items() for item in pair]


class Journal(Stream):
    """The facts. Read by anyone; appended to only by the fenced leader function."""

    def facts(
        self, after: str = ZERO, until: str = "+", batch: int = PAGE
    ) -> Iterator[tuple[str, Fact]]:
        for rows in self.pages(after, until, batch):
            yield from zip((entry.id for entry in rows), self.decode_page(rows), strict=True)

    @staticmethod
    def decode(entry: Entry) -> Fact:
        return decode_fact(entry.raw or b"")

    @staticmethod
    def decode_page(entries: Sequence[Entry]) -> list[Fact]:
        """The facts of `entries`, decoded in one batch; a DecodeError's `index` names the
        bad entry."""
        return decode_facts([entry.raw or b"" for entry in entries])

    @staticmethod
    def read_page(entries: Sequence[Entry]) -> Sequence[Fact | DecodeError]:
        """Each entry's fact, or the DecodeError saying why it has none (its `index` the
        entry's place in `entries`): one batch while all decode, one at a time once one
        does not, so a reader can skip what it cannot read and keep the rest."""
        try:
            return Journal.decode_page(entries)
        except DecodeError:
            pass
        read: list[Fact | DecodeError] = []
        for index, entry in enumerate(entries):
            try:
                read.append(Journal.decode(entry))
            except DecodeError as exc:
                exc.index = index
                read.append(exc)
        return read


def elects(read: Iterable[Fact | DecodeError]) -> bool:
    """True if a LeaderElected is among entries as `Journal.read_page` read them: one that
    decodes to it, or one that does not decode but whose envelope names it."""
    return any(
        item.event_type == "LeaderElected"
        if isinstance(item, DecodeError)
        else isinstance(item, LeaderElected)
        for item in read
    )
