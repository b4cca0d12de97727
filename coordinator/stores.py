"""The seam between the coordinator's loop and Redis: the lease and the job's log.

`service.Coordinator` talks to storage only through these two Protocols. Redis
implements them (`election.RedisLease`, `joblog.RedisJobLog`, one fenced Function
call per write); the unit tests implement them in memory, so every turn of the
loop (a refused append, a lost lease, an outage in the middle of a write) can be
driven without a server. The contract tests run the Redis side on fakeredis and on
a real redis-server.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from cohort.coordinator.errors import CoordinatorError
from cohort.events.identity import Trust
from cohort.events.streams import Entry


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """An inbox entry the leader rejected, with why; `raw` is the entry's bytes as received."""

    inbox_id: str
    reason: str
    raw: bytes


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
        """Journal entries after `after`, a page at a time; the first may wait `block_ms`."""
        ...

    def holds(self, entry_id: str) -> bool:
        """Whether the journal still holds `entry_id` (a failover can lose acknowledged ones)."""
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
