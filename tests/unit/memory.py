"""The coordinator's storage seam in memory: a lease and a job log that behave as Redis's do.

`MemoryLease` and `MemoryLog` implement `cohort.coordinator.stores.Lease` and `JobLog`
with the same refusals (Fenced, Conflict) as the fenced Function library, and let a test
break a write the way a network does: refuse it, or let it land and lose the reply.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import redis

from cohort.coordinator.errors import Conflict, Fenced
from cohort.coordinator.stores import Acked, DeadLetter, InboxMarks
from cohort.events.clock import ManualClock
from cohort.events.codec import FIELD, decode_fact, encode
from cohort.events.identity import Trust
from cohort.events.models import Command, Fact
from cohort.events.streams import ZERO, Entry, id_key

PAGE = 3  # small, so that reading a journal takes several pages


class MemoryLease:
    def __init__(self, clock: ManualClock, lease_ms: int = 3000) -> None:
        self.clock = clock
        self.lease_ms = lease_ms
        self.epoch = 0
        self.token: str | None = None
        self.until = 0.0

    def holder(self) -> str | None:
        if self.token is not None and self.clock.monotonic() >= self.until:
            self.token = None  # expired, as a PX key would
        return self.token

    def acquire(self, nonce: str) -> str | None:
        if self.holder() is not None:
            return None
        self.epoch += 1
        self.token = f"{self.epoch}:{nonce}"
        self.until = self.clock.monotonic() + self.lease_ms / 1000
        return self.token

    def renew(self, token: str) -> bool:
        if self.holder() != token:
            return False
        self.until = self.clock.monotonic() + self.lease_ms / 1000
        return True

    def release(self, token: str) -> bool:
        if self.holder() != token:
            return False
        self.token = None
        return True


@dataclass
class MemoryLog:
    """One job's inbox and journal in lists; entry IDs follow the clock, as Redis's do."""

    clock: ManualClock
    lease: MemoryLease
    journal: list[Entry] = field(default_factory=list)
    inbox: list[Entry] = field(default_factory=list)
    subscribed: set[str] = field(default_factory=set)
    """Workers whose presence channel has a subscriber (`connected`)."""
    server: str = "memory-1"
    dead: list[DeadLetter] = field(default_factory=list)
    cursor_id: str = ZERO
    snapshot: bytes | None = None
    status: bytes | None = None
    prepared: bool = False
    appends: int = 0
    fail_next: str | None = None
    """'refuse': the next append raises ConnectionError and writes nothing; 'lose reply': it
    writes everything, then raises ConnectionError (the caller cannot know it landed)."""
    after_read: Callable[[], None] | None = None
    """Runs once, as the next inbox read returns: what happens while the leader holds it."""
    trusted: Trust | None = None
    """The job key and revoked workers (None: no identity mode)."""
    max_deleted: str = ZERO
    """The inbox's max-deleted-entry-id, as Redis keeps it."""
    archived: list[Entry] = field(default_factory=list)
    """Journal entries a trim dropped, as the archive's segments hold them."""
    index: bytes | None = None
    _last_ms: int = 0
    _seq: int = 0

    # ------------------------------------------------------------ test side
    def new_journal_id(self) -> str:
        """The journal is a stream of its own: its IDs never follow the inbox's."""
        ms = int(self.clock.now() * 1000)
        last = id_key(self.journal[-1].id) if self.journal else (0, 0)
        return f"{ms}-0" if (ms, 0) > last else f"{last[0]}-{last[1] + 1}"

    def new_id(self) -> str:
        ms = int(self.clock.now() * 1000)
        if (self._last_ms, self._seq) == (MAX_ID, MAX_ID):
            raise redis.ResponseError(
                "The stream has exhausted the last possible ID, unable to add more items"
            )
        if ms <= self._last_ms:
            ms, self._seq = self._last_ms, self._seq + 1
        else:
            self._seq = 0
        self._last_ms = ms
        return f"{ms}-{self._seq}"

    def send_at(self, entry_id: str, fields: dict[bytes, bytes]) -> str:
        """XADD with an explicit ID, as anyone who may append to the inbox can."""
        if id_key(entry_id) <= (self._last_ms, self._seq):
            raise redis.ResponseError("The ID specified in XADD is equal or smaller")
        self._last_ms, self._seq = id_key(entry_id)
        self.inbox.append(Entry(entry_id, fields))
        return entry_id

    def delete_unread(self, count: int) -> None:
        """Delete the newest `count` inbox entries, as XADD ... MAXLEN or XDEL would."""
        gone, self.inbox = (
            self.inbox[len(self.inbox) - count :],
            self.inbox[: len(self.inbox) - count],
        )
        self.max_deleted = max((e.id for e in gone), key=id_key, default=self.max_deleted)

    def send(self, command: Command) -> str:
        return self.send_raw(encode(command))

    def send_raw(self, raw: bytes) -> str:
        return self.send_fields({FIELD: raw})

    def send_fields(self, fields: dict[bytes, bytes]) -> str:
        entry = Entry(self.new_id(), fields)
        self.inbox.append(entry)
        return entry.id

    def write(self, fact: Fact) -> str:
        """A fact written past the fence (another writer, as a Conflict test needs)."""
        entry = Entry(self.new_journal_id(), {FIELD: encode(fact)})
        self.journal.append(entry)
        return entry.id

    def facts(self) -> list[Fact]:
        return [decode_fact(entry.fields[FIELD]) for entry in self.journal]

    # ------------------------------------------------------------ JobLog
    @property
    def acked(self) -> Acked | None:
        return None

    def prepare(self) -> None:
        self.prepared = True

    def pages(self, after: str, block_ms: int = 0) -> Iterator[list[Entry]]:
        rows = _after(self.archived + self.journal, after)
        for start in range(0, len(rows), PAGE):
            yield rows[start : start + PAGE]

    def holds(self, entry_id: str) -> bool:
        held = self.archived + self.journal
        return entry_id == ZERO or any(entry.id == entry_id for entry in held)

    def entries(self, after: str, until: str) -> list[Entry]:
        return [e for e in _after(self.journal, after) if id_key(e.id) <= id_key(until)]

    def trim_journal(self, token: str, keep: str, index: bytes) -> int:
        if self.lease.holder() != token:
            raise Fenced(token, self.lease.holder())
        dropped = [e for e in self.journal if id_key(e.id) < id_key(keep)]
        self.archived += dropped
        self.journal = self.journal[len(dropped) :]
        self.index = index
        return len(dropped)

    def archived_state(self) -> bytes | None:
        return None  # the unit tests' journal has no storage: a lost snapshot folds from zero

    def append(
        self,
        token: str,
        expected_last: str,
        facts: Sequence[bytes],
        cursor: str | None,
        dead: Sequence[DeadLetter],
    ) -> list[str]:
        failure, self.fail_next = self.fail_next, None
        if failure == "refuse":
            raise redis.ConnectionError("connection refused (injected)")
        holder = self.lease.holder()
        if holder != token:
            raise Fenced(token, holder)
        last = self.journal[-1].id if self.journal else ZERO
        if last != expected_last:
            raise Conflict(expected_last, last)
        self.appends += 1
        ids = []
        for raw in facts:
            entry = Entry(self.new_journal_id(), {FIELD: raw})
            self.journal.append(entry)
            ids.append(entry.id)
        if cursor:
            self.cursor_id = cursor
        self.dead.extend(dead)
        if failure == "lose reply":
            raise redis.ConnectionError("connection reset while reading the reply (injected)")
        return ids

    def cursor(self) -> str:
        return self.cursor_id

    def load_snapshot(self) -> bytes | None:
        return self.snapshot

    def save_snapshot(self, token: str, blob: bytes) -> None:
        if self.lease.holder() != token:
            raise Fenced(token, self.lease.holder())
        self.snapshot = blob

    def commands(self, after: str, block_ms: int, count: int) -> list[Entry]:
        entries = _after(self.inbox, after)[:count]
        meanwhile, self.after_read = self.after_read, None
        if meanwhile is not None:
            meanwhile()
        return entries

    def commands_between(self, after: str, until: str, count: int) -> list[Entry]:
        return [e for e in _after(self.inbox, after) if id_key(e.id) <= id_key(until)][:count]

    def inbox_end(self) -> str:
        return self.inbox[-1].id if self.inbox else ZERO

    def trim_inbox(self, before: str) -> None:
        self.inbox = [e for e in self.inbox if id_key(e.id) >= id_key(before)]

    def repair_inbox(self, token: str, cursor: str, limit: str) -> tuple[str, int, int]:
        """fencing.lua's cohort_repair_inbox, on lists."""
        if self.lease.holder() != token:
            raise Fenced(token, self.lease.holder())
        last = (self._last_ms, self._seq)
        if last < id_key(cursor):
            cursor = ZERO
        moved: list[Entry] = []
        dropped = 0
        if last > id_key(limit):
            moved = _after(self.inbox, cursor)
            stale = [e for e in self.inbox if id_key(limit) < id_key(e.id) <= id_key(cursor)]
            self.inbox = [e for e in self.inbox if e not in moved and e not in stale]
            dropped = len(stale)
            cursor = self.inbox[-1].id if self.inbox else "0-1"
            self._last_ms, self._seq = id_key(cursor)
        if id_key(self.max_deleted) > id_key(cursor) or moved or dropped:
            self.max_deleted = cursor
        for entry in moved:
            self.send_fields({**entry.fields, b"o": entry.id.encode()})
        self.cursor_id = cursor
        return cursor, len(moved), dropped

    def inbox_marks(self, cursor: str) -> InboxMarks | None:
        first = self.inbox[0].id if self.inbox else ZERO
        held = any(entry.id == cursor for entry in self.inbox)
        return InboxMarks(f"{self._last_ms}-{self._seq}", self.max_deleted, first, held)

    def publish_status(self, blob: bytes, ttl_ms: int) -> None:
        self.status = blob

    def publish_memory(self, ttl_ms: int) -> None:
        pass

    def connected(self, workers: Sequence[str]) -> tuple[str, dict[str, int]]:
        """`subscribed` as a test set it: the workers with a live connection."""
        return self.server, {worker: int(worker in self.subscribed) for worker in workers}

    def trust(self) -> Trust | None:
        return self.trusted


MAX_ID = 2**64 - 1


def _after(entries: list[Entry], after: str) -> list[Entry]:
    return [e for e in entries if id_key(e.id) > id_key(after)]
