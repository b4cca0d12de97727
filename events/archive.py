"""The journal's cold part, kept in storage: segment files, their index, and the journal read
whole (`History`).

The leader keeps a hot tail of the journal in Redis and moves what is older into segment
files through fsspec (coordinator/archiving.py has the protocol). Each segment is journaled
as a `JournalArchived` fact before Redis drops its entries, and the leader keeps an index of
every segment in the job's `archive` key, set together with that trim. So whoever reads the
journal sees one sequence of entries: the segments, oldest first, each checked against its
journaled sha256, then what Redis holds after the last of them.

A segment file is ``MAGIC | u32 header length | msgpack header | msgpack entries``: the
header names the job, the first and last entry ID, the number of entries and carries the
state as of the last one (a coordinator snapshot, `coordinator/snapshot.py`); the entries
are ``[id, {field: value}]`` pairs, byte for byte as Redis held them.

A reader that fell behind a trim must never skip what was dropped: XREAD after an ID Redis
no longer holds answers with what follows the trim, silently. Since the leader leaves at
least `HOLE_AT` entries after each trim point, a read that skipped a trim returns at least
`min(count, HOLE_AT)` entries; after such a read the reader asks whether the entry it read
after is still held (`History.intact`), and if not, reads the segments first.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import msgpack

from cohort.events import storage
from cohort.events.connection import text
from cohort.events.errors import EventsError
from cohort.events.keys import Keys
from cohort.events.models import JournalArchived
from cohort.events.streams import PAGE, ZERO, Entry, Journal, id_after

log = logging.getLogger("cohort.archive")

MAGIC = b"COHORT-JOURNAL\n"
FORMAT = 1
_LENGTH = struct.Struct("<I")
HOLE_AT = 100
"""Entries the leader leaves in Redis after every trim point, at least: a read of this many
entries (or of a full page, if smaller) is checked for a trim it may have skipped."""

READ_RETRIES = (0.5, 1.0, 2.0)
"""Seconds paused before each new attempt to read a segment that storage failed to give."""

Attempt = Callable[[Callable[[], Any]], Any]
"""Runs one read (a retry policy, say): `attempt(read)` returns what `read()` returns."""


class ArchiveError(EventsError):
    """An archived segment is missing, unreadable or not what the journal says it is; the
    message names its URI and the journal entries it holds."""


def segment_uri(base: str, job: str, first: str) -> str:
    """Where the segment starting at journal entry `first` goes, under storage URI `base`."""
    return f"{base.rstrip('/')}/journal/{job}/{first}.segment"


def encode_segment(job: str, entries: Sequence[Entry], state: bytes) -> bytes:
    """A segment file's bytes: `entries` and the state as of the last of them."""
    header = msgpack.packb(
        {
            "format": FORMAT,
            "job": job,
            "first": entries[0].id,
            "last": entries[-1].id,
            "facts": len(entries),
            "state": state,
        },
        use_bin_type=True,
    )
    body = msgpack.packb([[e.id, e.fields] for e in entries], use_bin_type=True)
    return b"".join((MAGIC, _LENGTH.pack(len(header)), header, body))


def read_segment(segment: JournalArchived) -> tuple[list[Entry], bytes]:
    """The entries of the segment `segment` journaled, and the state as of its last one;
    ArchiveError naming it if the file is missing, changed, cut short or another one."""
    where = f"archived segment {segment.uri!r} (journal entries {segment.first}..{segment.last})"
    raw = _read(segment.uri, where)
    digest = hashlib.sha256(raw).hexdigest()
    if digest != segment.sha256:
        raise ArchiveError(
            f"{where} has sha256 {digest}, not the journaled {segment.sha256}: it was changed "
            "or cut short since it was written; restore it from a copy"
        )
    header, entries = _parse(raw, where)
    expected = (segment.job, segment.first, segment.last, segment.facts)
    found = (header.get("job"), header.get("first"), header.get("last"), header.get("facts"))
    ids = (entries[0].id, entries[-1].id, len(entries)) if entries else None
    if found != expected or ids != expected[1:]:
        raise ArchiveError(f"{where} holds {found}, not the journaled {expected}")
    return entries, bytes(header.get("state") or b"")


def _read(uri: str, where: str) -> bytes:
    """The file's bytes, read again after READ_RETRIES pauses where storage fails for a while
    (a missing file is named at once)."""
    for pause in (*READ_RETRIES, None):
        try:
            return storage.read_whole(uri, "archived segment")
        except storage.StorageError as exc:
            if pause is None or isinstance(exc.__cause__, FileNotFoundError):
                raise ArchiveError(f"{where} cannot be read: {exc}") from exc
            log.warning("%s: %s; reading it again in %.1f s", where, exc, pause)
            time.sleep(pause)  # backoff before the next attempt: nothing to wait on instead
    raise AssertionError("unreachable")  # pragma: no cover


def _parse(raw: bytes, where: str) -> tuple[dict[str, Any], list[Entry]]:
    if not raw.startswith(MAGIC) or len(raw) < len(MAGIC) + _LENGTH.size:
        raise ArchiveError(f"{where} is not a cohort journal segment (no {MAGIC!r} header)")
    at = len(MAGIC)
    (length,) = _LENGTH.unpack_from(raw, at)
    at += _LENGTH.size
    try:
        header = msgpack.unpackb(raw[at : at + length], raw=False)
        rows = msgpack.unpackb(raw[at + length :], raw=True, strict_map_key=False)
        entries = [Entry(i.decode(), fields) for i, fields in rows]
    except Exception as exc:
        raise ArchiveError(f"{where} cannot be parsed: {exc}") from exc
    if header.get("format") != FORMAT:
        raise ArchiveError(
            f"{where} has format {header.get('format')!r}; this cohort reads {FORMAT}"
        )
    return header, entries


def write_segment(
    base: str, job: str, entries: Sequence[Entry], state: bytes, at: float
) -> JournalArchived:
    """Write `entries` (and the state as of the last) to a segment file under `base`, whole;
    the fact that journals it. StorageError if it cannot be written."""
    data = encode_segment(job, entries, state)
    uri = segment_uri(base, job, entries[0].id)
    storage.write_whole(uri, (data,), "archived segment")
    return JournalArchived(
        at=at,
        job=job,
        first=entries[0].id,
        last=entries[-1].id,
        facts=len(entries),
        uri=uri,
        sha256=hashlib.sha256(data).hexdigest(),
        bytes=len(data),
    )


def encode_index(segments: Sequence[JournalArchived]) -> bytes:
    return msgpack.packb([s.model_dump(mode="json") for s in segments], use_bin_type=True)


def decode_index(blob: bytes | None, key: str) -> tuple[JournalArchived, ...]:
    if not blob:
        return ()
    try:
        return tuple(JournalArchived.model_validate(s) for s in msgpack.unpackb(blob, raw=False))
    except Exception as exc:
        raise ArchiveError(
            f"the archive index {key!r} cannot be read ({exc}); the leader writes it again "
            "at its next trim"
        ) from exc


def _beyond(entry_id: str, until: str) -> bool:
    return until != "+" and id_after(entry_id, until)


def _call(read: Callable[[], Any]) -> Any:
    return read()


class History:
    """A job's journal read whole: its archived segments, then the entries Redis holds."""

    def __init__(self, journal: Journal, keys: Keys) -> None:
        self.journal = journal
        self.key = keys.archive

    @classmethod
    def of(cls, conn: Any, job: str) -> History:
        keys = Keys(job)
        return cls(Journal(conn, keys.journal), keys)

    def index(self) -> tuple[JournalArchived, ...]:
        """The archived segments, oldest first (none: the journal is whole in Redis)."""
        blob: Any = self.journal.conn.get(self.key)
        return decode_index(blob, self.key)

    def pages(
        self,
        after: str = ZERO,
        until: str = "+",
        count: int = PAGE,
        block_ms: int = 0,
        attempt: Attempt | None = None,
    ) -> Iterator[list[Entry]]:
        """The journal's entries after `after` (up to `until`), a page at a time, the
        archived ones first; only the first page read from Redis may wait `block_ms`. Each
        page long enough to have skipped a trim is checked, and what was trimmed is read
        from the segments first."""
        run = attempt or _call
        if after == ZERO:
            archived = run(self.index)
            if archived:
                yield from self._archived(archived, after, until)
                after = archived[-1].last
        while True:
            for page in self.journal.pages(after, until, count, block_ms, run):
                if len(page) >= min(count, HOLE_AT) and not run(partial(self.intact, after)):
                    archived = run(self.index)
                    if archived and id_after(archived[-1].last, after):
                        yield from self._archived(archived, after, until)
                        after, block_ms = archived[-1].last, 0
                        break  # read Redis again from the last archived entry on
                yield page
                after = page[-1].id
            else:
                return

    def _archived(
        self, archived: Sequence[JournalArchived], after: str, until: str
    ) -> Iterator[list[Entry]]:
        for segment in archived:
            if not id_after(segment.last, after):
                continue
            entries, _ = read_segment(segment)
            if id_after(segment.first, after) and not _beyond(segment.last, until):
                yield entries
                continue
            page = [e for e in entries if id_after(e.id, after) and not _beyond(e.id, until)]
            if page:
                yield page
            if _beyond(segment.last, until):
                return

    def intact(self, after: str) -> bool:
        """Whether reading Redis after `after` misses nothing: Redis still holds `after`
        (for ZERO: nothing was ever archived), so no trim has dropped what follows it."""
        if after == ZERO:
            return not self.journal.conn.exists(self.key)
        return bool(self.journal.conn.xrange(self.journal.key, after, after, count=1))

    def holds(self, entry_id: str) -> bool:
        """Whether the journal, archived or in Redis, still holds `entry_id`."""
        if entry_id == ZERO or self.intact(entry_id):
            return True
        archived = self.index()
        return (
            bool(archived)
            and not id_after(entry_id, archived[-1].last)
            and not id_after(archived[0].first, entry_id)
        )

    def base(self) -> bytes | None:
        """The state kept with the newest segment (a coordinator snapshot's bytes, as of the
        segment's last entry); None when nothing is archived."""
        archived = self.index()
        if not archived:
            return None
        return read_segment(archived[-1])[1]

    def floor(self) -> str:
        """The oldest entry Redis holds of the journal (ZERO: none)."""
        rows: Any = self.journal.conn.xrange(self.journal.key, "-", "+", count=1)
        return text(rows[0][0]) if rows else ZERO
