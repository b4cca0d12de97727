"""A job's log on Redis: the `JobLog` the coordinator's loop reads and writes.

The journal and the inbox are streams under the job's hash tag; every write the
leader makes (facts, cursor, dead letters, snapshot) goes through the fenced
Function library (`election.FencedJournal`), so a coordinator that lost the lease
is refused by Redis itself.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from cohort.coordinator import durability
from cohort.coordinator.election import FencedJournal, load_library
from cohort.coordinator.errors import CoordinatorError
from cohort.coordinator.stores import Acked, DeadLetter, InboxMarks
from cohort.events import budget
from cohort.events.archive import History
from cohort.events.connection import Client, primaries, server_for, text
from cohort.events.identity import Trust
from cohort.events.keys import Keys
from cohort.events.streams import Entry, Inbox, Journal

log = logging.getLogger("cohort.coordinator")


@dataclass(frozen=True)
class Durability:
    """What the leader asks of Redis before it acts on an append."""

    allow_volatile: bool = False
    """Lead even when Redis keeps no AOF (a restart would lose the journal)."""
    allow_eviction: bool = False
    """Lead even when Redis may evict keys (`maxmemory-policy` other than noeviction)."""
    wait_aof: bool = False
    """After each append, wait until the AOF is fsynced locally (WAITAOF, Redis >= 7.2)."""
    wait_replicas: int = 0
    """After each append, WAIT until this many replicas have it."""
    wait_ms: int = 5000
    """How long each WAIT / WAITAOF may block before the leader logs a shortfall."""
    dead_maxlen: int = 10_000
    """Dead letters kept (oldest trimmed first)."""


class RedisJobLog:
    """`stores.JobLog` on a Redis server, Sentinel-managed primary or Cluster."""

    def __init__(
        self, conn: Client, job: str, durability: Durability, display_url: str = "redis"
    ) -> None:
        self.conn = conn
        self.keys = Keys(job)
        self.durability = durability
        self.display_url = display_url
        self.journal = Journal(conn, self.keys.journal)
        self.history = History(self.journal, self.keys)
        self.inbox = Inbox(conn, self.keys.inbox)
        self.fenced = FencedJournal(
            conn,
            self.keys,
            dead_maxlen=durability.dead_maxlen,
            wait_replicas=durability.wait_replicas,
            wait_ms=durability.wait_ms,
        )

    @property
    def acked(self) -> Acked | None:
        return self.fenced.acked

    def prepare(self) -> None:
        """Refuse a Redis that would lose the journal on a restart (unless allowed), and load
        the fencing library on every primary."""
        wanted = self.durability
        persistence = durability.require(
            self.conn, self.display_url, wanted.allow_volatile, wanted.allow_eviction
        )
        if not persistence.aof:
            log.warning(
                "leading without persistence (--allow-volatile): a Redis restart "
                "loses the journal of job %r",
                self.keys.job,
            )
        if persistence.policy != durability.SAFE_POLICY:
            log.warning(
                "leading on a Redis that may evict keys (--allow-eviction, maxmemory-policy "
                "%s): memory pressure may silently drop the journal of job %r",
                persistence.policy or "unknown",
                self.keys.job,
            )
        if wanted.wait_aof and not persistence.waitaof:
            log.warning(
                "--wait-aof: Redis %s has no WAITAOF (needs >= 7.2); relying on appendfsync",
                persistence.version,
            )
        self.fenced.wait_aof = wanted.wait_aof and persistence.waitaof
        load_library(self.conn)

    # ------------------------------------------------------------ the journal
    def pages(self, after: str, block_ms: int = 0) -> Iterator[list[Entry]]:
        return self.history.pages(after, block_ms=block_ms)

    def holds(self, entry_id: str) -> bool:
        # Redis drops archived entries only (the segments hold them); otherwise only a Redis
        # that lost acknowledged writes (a failover to a lagging replica) loses an entry.
        return self.history.holds(entry_id)

    def entries(self, after: str, until: str) -> list[Entry]:
        return [entry for page in self.journal.pages(after, until) for entry in page]

    def trim_journal(self, token: str, keep: str, index: bytes) -> int:
        return self.fenced.trim_journal(token, keep, index)

    def archived_state(self) -> bytes | None:
        return self.history.base()

    def append(
        self,
        token: str,
        expected_last: str,
        facts: Sequence[bytes],
        cursor: str | None,
        dead: Sequence[DeadLetter],
    ) -> list[str]:
        return self.fenced.append(token, expected_last, facts, cursor, dead)

    def cursor(self) -> str:
        return self.fenced.cursor()

    def load_snapshot(self) -> bytes | None:
        return self.fenced.load_snapshot()

    def save_snapshot(self, token: str, blob: bytes) -> None:
        self.fenced.save_snapshot(token, blob)

    # ------------------------------------------------------------ the inbox
    def commands(self, after: str, block_ms: int, count: int) -> list[Entry]:
        return self.inbox.tail(after, block_ms, count=count)

    def commands_between(self, after: str, until: str, count: int) -> list[Entry]:
        return self.inbox.range(after, until, count=count)

    def inbox_end(self) -> str:
        return self.inbox.last_id()

    def trim_inbox(self, before: str) -> None:
        self.conn.xtrim(self.keys.inbox, minid=before, approximate=True)

    def repair_inbox(self, token: str, cursor: str, limit: str) -> tuple[str, int, int]:
        return self.fenced.repair_inbox(token, cursor, limit)

    def inbox_marks(self, cursor: str) -> InboxMarks | None:
        return self.fenced.inbox_marks(cursor)

    def publish_status(self, blob: bytes, ttl_ms: int) -> None:
        self.conn.set(self.keys.status, blob, px=ttl_ms)

    def trust(self) -> Trust | None:
        job_key: Any = self.conn.get(self.keys.identity)
        if not job_key:
            return None
        try:
            revoked: Any = self.conn.smembers(self.keys.revoked)
        except redis.exceptions.NoPermissionError as exc:
            raise CoordinatorError(
                f"job {self.keys.job!r} requires signed commands, but this coordinator's Redis "
                f"user may not read its revoked workers ({exc}): its ACL rules predate "
                f"per-worker credentials; apply them again with "
                f"cohort acl --job {self.keys.job} --role coordinator --apply"
            ) from exc
        # read after the job key: `cohort acl --rotate` writes it before the new key
        previous: Any = self.conn.get(self.keys.identity_previous)
        workers = frozenset(text(w) for w in revoked)
        return Trust(bytes(job_key), workers, bytes(previous) if previous else None)

    def connected(self, workers: Sequence[str]) -> tuple[str, dict[str, int]]:
        server = server_for(self.conn, self.keys.inbox)
        pipe = server.pipeline(transaction=False)
        pipe.execute_command("PUBSUB", "SHARDNUMSUB", *map(self.keys.presence, workers))
        pipe.info("server")
        flat, info = pipe.execute(raise_on_error=False)
        if isinstance(flat, Exception):
            raise flat
        # a server without INFO (fakeredis) cannot say it restarted: its clients cannot either
        run_id = "" if isinstance(info, Exception) else str(info.get("run_id", ""))
        numbers = [int(count) for count in flat[1::2]]
        return run_id, dict(zip(workers, numbers, strict=True))

    def publish_memory(self, ttl_ms: int) -> None:
        # The tightest primary: a step's chunks spread over all of them (docs/redis-ha.md).
        tightest: budget.Memory | None = None
        for _, server in primaries(self.conn):
            try:
                info = server.info("memory")
            except redis.ResponseError:
                return  # INFO refused: collectives write without a budget
            found = budget.Memory.of_info(info)
            if found.limited and (tightest is None or found.free < tightest.free):
                tightest = found
        if tightest is None:
            self.conn.delete(self.keys.memory)
        else:
            self.conn.set(self.keys.memory, tightest.encode(), px=ttl_ms)
