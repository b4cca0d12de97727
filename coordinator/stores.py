"""The seam between the coordinator's loop and Redis: the lease and the job's log.

`service.Coordinator` talks to storage only through these two Protocols. Redis
implements them (`election.RedisLease`, `joblog.RedisJobLog`, one fenced Function
call per write); the unit tests implement them in memory, so every turn of the
loop (a refused append, a lost lease, an outage in the middle of a write) can be
driven without a server. The contract tests run the Redis side on fakeredis and on
a real redis-server.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

from cohort.coordinator.errors import CoordinatorError
from cohort.events.identity import Trust
from cohort.events.models import RefusalKind
from cohort.events.streams import ZERO, Entry, id_after


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """An inbox entry the leader rejected, with why, as a bounded record: who it claims to
    be from, its size and hash, and the first HEAD_BYTES of its command (a 50 MB entry
    costs the dead-letter stream a few hundred bytes, not 50 MB)."""

    inbox_id: str
    reason: str
    raw: bytes
    """At most HEAD_BYTES of the entry's command (or of its fields, packed)."""
    kind: RefusalKind = "malformed"
    sender: str = "unknown"
    """The worker its signature proved (`verified`), else the name it claimed."""
    verified: bool = False
    size: int = 0
    """The entry's fields' bytes in all."""
    sha256: str = ""
    """Of the whole command (or fields), so two copies of one entry are recognised."""

    HEAD_BYTES: ClassVar[int] = 256
    REASON_CHARS: ClassVar[int] = 500

    @classmethod
    def of(
        cls,
        inbox_id: str,
        reason: str,
        raw: bytes,
        kind: RefusalKind,
        sender: tuple[str, bool] = ("unknown", False),
        size: int | None = None,
    ) -> DeadLetter:
        """The bounded record of an entry whose whole command (or packed fields) is `raw`."""
        return cls(
            inbox_id,
            reason[: cls.REASON_CHARS],
            raw[: cls.HEAD_BYTES],
            kind,
            sender[0],
            sender[1],
            len(raw) if size is None else size,
            hashlib.sha256(raw).hexdigest(),
        )

    def fields(self) -> tuple[str, str, str, str, str, str, bytes]:
        """The dead-letter stream entry's values, as fencing.lua's cohort_append takes them."""
        who = self.sender if self.verified else f"{self.sender} (claimed)"
        return (
            self.inbox_id, self.reason, self.kind, who, str(self.size), self.sha256, self.raw
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class InboxMarks:
    """Where the inbox stands, as the leader looks for entries someone else deleted."""

    last: str
    """The last ID the stream generated (XINFO STREAM last-generated-id)."""
    deleted: str
    """The newest ID deleted by XDEL (max-deleted-entry-id; trimming does not move it)."""
    first: str
    """The oldest entry's ID ("0-0": none)."""
    holds_cursor: bool
    """The entry at the cursor is still there."""

    def lost(self, cursor: str, before: InboxMarks | None = None) -> str | None:
        """Why unread entries after `cursor` may be gone, or None; `before`: the marks at
        the leader's previous look (a deletion since then may have taken entries the
        leader has read past since)."""
        if id_after(cursor, self.last):
            return f"the inbox was recreated below the cursor (its last ID is {self.last})"
        if id_after(self.deleted, cursor):
            return f"unread inbox entries up to {self.deleted} were deleted"
        if before is not None and id_after(self.deleted, before.deleted):
            return (
                f"inbox entries up to {self.deleted} were deleted by someone else since the "
                "last look; unread ones among them are lost"
            )
        if cursor not in (ZERO, FLOOR) and not self.holds_cursor and id_after(self.first, cursor):
            return f"inbox entries before {self.first}, unread ones among them, were trimmed"
        return None


FLOOR = "0-1"
"""The cursor of an inbox that a repair left empty (fencing.lua's cohort_repair_inbox)."""


@dataclass(frozen=True, slots=True)
class Acked:
    """What WAIT / WAITAOF confirmed after an append; None where nothing was asked."""

    replicas: int | None
    """Replicas that had the append when WAIT returned."""
    aof: bool | None
    """Whether the primary's AOF had it fsynced when WAITAOF returned."""


def epoch_of(token: str) -> int:
    """The leader epoch a token was issued for: tokens are `epoch:nonce`."""
    epoch, sep, _ = token.partition(":")
    if not sep or not epoch.isdigit():
        raise CoordinatorError(f"token {token!r} is not of the form 'epoch:nonce'")
    return int(epoch)


def coordinator_of(token: str) -> str:
    """The coordinator a token was issued to: tokens are `epoch:coordinator:random`."""
    _, _, nonce = token.partition(":")
    return nonce.rpartition(":")[0] or nonce


class Lease(Protocol):
    """Who leads: a token `epoch:nonce` held for a lease time, renewed by its holder."""

    def acquire(self, nonce: str) -> str | None:
        """A new token (the epoch grows by one) if nobody holds the lease, else None."""
        ...

    def renew(self, token: str) -> bool:
        """Extend the lease if `token` still holds it; False means: stop deciding."""
        ...

    def release(self, token: str) -> bool:
        """Give the lease up if `token` holds it, so a follower takes over at once."""
        ...

    def holder(self) -> str | None:
        """The current token, or None."""
        ...


class JobLog(Protocol):
    """One job's streams as the coordinator uses them.

    The journal is read by everyone and appended to only under the lease's token,
    together with the inbox cursor and dead letters, atomically (`append`). The inbox
    is read after the cursor. Beside them: a snapshot (a cache) and the leader's
    volatile status for `cohort status`.
    """

    @property
    def acked(self) -> Acked | None:
        """What the last append's waits confirmed (None: nothing was waited for)."""
        ...

    def prepare(self) -> None:
        """Check the store can keep what the leader writes; raise CoordinatorError if not."""
        ...

    # the journal
    def pages(self, after: str, block_ms: int = 0) -> Iterator[list[Entry]]:
        """Journal entries after `after`, a page at a time, the archived ones first; the first
        page of Redis's may wait `block_ms`."""
        ...

    def holds(self, entry_id: str) -> bool:
        """Whether the journal, archived or in Redis, still holds `entry_id` (a failover can
        lose acknowledged ones)."""
        ...

    def entries(self, after: str, until: str) -> list[Entry]:
        """The journal entries Redis holds with after < ID <= until (what a segment archives)."""
        ...

    def trim_journal(self, token: str, keep: str, index: bytes) -> int:
        """Drop the journal's entries before `keep` (which stays) and set the archive index,
        only if `token` leads (else Fenced); returns the entries dropped."""
        ...

    def archived_state(self) -> bytes | None:
        """The state (a snapshot's bytes) kept with the newest archived segment, if any."""
        ...

    def append(
        self,
        token: str,
        expected_last: str,
        facts: Sequence[bytes],
        cursor: str | None,
        dead: Sequence[DeadLetter],
    ) -> list[str]:
        """Append `facts`, move the cursor and dead-letter `dead`, all or nothing, only if
        `token` leads (else Fenced) and the journal ends at `expected_last` (else Conflict).
        Returns the new journal IDs."""
        ...

    def cursor(self) -> str:
        """The inbox ID consumed up to."""
        ...

    def load_snapshot(self) -> bytes | None: ...

    def save_snapshot(self, token: str, blob: bytes) -> None:
        """Store a snapshot, only if `token` leads (else Fenced)."""
        ...

    # the inbox
    def commands(self, after: str, block_ms: int, count: int) -> list[Entry]:
        """Inbox entries after `after`, waiting up to `block_ms` for the first."""
        ...

    def commands_between(self, after: str, until: str, count: int) -> list[Entry]:
        """Inbox entries with after < ID <= until, without waiting."""
        ...

    def inbox_end(self) -> str:
        """The newest inbox entry's ID."""
        ...

    def trim_inbox(self, before: str) -> None:
        """Let the inbox drop entries older than `before` (approximately)."""
        ...

    def repair_inbox(self, token: str, cursor: str, limit: str) -> tuple[str, int, int]:
        """Put the inbox back in order, only if `token` leads (else Fenced): entries after
        `limit` (ahead of the server's clock) are moved behind it, and the new cursor is
        set. Returns (cursor, entries moved, entries ahead before the cursor dropped)."""
        ...

    def inbox_marks(self, cursor: str) -> InboxMarks | None:
        """Where the inbox stands beside `cursor` (None: there is no inbox)."""
        ...

    def publish_status(self, blob: bytes, ttl_ms: int) -> None:
        """The leader's volatile view, for `cohort status`; it expires if the leader dies."""
        ...

    def trust(self) -> Trust | None:
        """The job key, the revoked workers and (during a rotation's grace) the previous key,
        or None if the job has no identity key (then commands need no signature)."""
        ...

    def publish_memory(self, ttl_ms: int) -> None:
        """Redis's maxmemory and used memory, for the collectives' gradient budget; expires
        if the leader dies (then collectives write without a budget)."""
        ...

    def connected(self, workers: Sequence[str]) -> tuple[str, dict[str, int]]:
        """Which server answers (an ID that changes when it restarts or another takes over)
        and how many subscriptions each of `workers` holds to its presence channel there:
        the server owning the job's slot, where a worker's own connection is what counts."""
        ...
