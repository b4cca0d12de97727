"""The lease and the fenced writes on Redis, on top of the `cohort` Redis Functions library.

Only code holding the current token can append to the journal, move the inbox
cursor, dead-letter entries or save a snapshot: the check happens inside Redis,
in the same atomic function as the write (see fencing.lua). The connection is
always passed in; this module never creates a client.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Sequence
from functools import cache
from importlib import resources
from typing import Any

import redis

from cohort.coordinator.errors import Conflict, CoordinatorError, Fenced
from cohort.coordinator.stores import Acked, DeadLetter, InboxMarks
from cohort.events.connection import Client, primaries, server_for, text
from cohort.events.keys import Keys
from cohort.events.streams import ZERO

LIBRARY = "cohort"
MIN_REDIS = "7.0"
_VERSION_LINE = re.compile(r"^local VERSION = (\d+)\s*$", re.MULTILINE)
_CONFLICT = re.compile(r"^CONFLICT last=(\S+)")
_FENCED = "FENCED held by "
_LOAD_ATTEMPTS = 5


@cache
def library_source() -> str:
    """The text of fencing.lua, as shipped in the `cohort.coordinator` package."""
    return resources.files("cohort.coordinator").joinpath("fencing.lua").read_text(encoding="utf-8")


def library_version() -> int:
    """The VERSION this package's fencing.lua declares."""
    match = _VERSION_LINE.search(library_source())
    if match is None:
        raise CoordinatorError("fencing.lua declares no 'local VERSION = <n>' line")
    return int(match.group(1))


def _lacks_functions(exc: redis.ResponseError) -> bool:
    return "unknown command" in str(exc).lower()


def _function_missing(exc: redis.ResponseError) -> bool:
    return "function not found" in str(exc).lower()


def _too_old(conn: Client, exc: redis.ResponseError) -> CoordinatorError:
    try:
        version = conn.info("server").get("redis_version", "unknown")
    except redis.RedisError:
        version = "unknown"
    return CoordinatorError(
        f"the Redis server (version {version!s}) has no FUNCTION/FCALL support "
        f"({exc}); cohort needs Redis >= {MIN_REDIS}"
    )


def installed_version(conn: Client) -> int | None:
    """The version of the `cohort` library on the server, or None if it has none (or an old one
    without `cohort_version`)."""
    try:
        return int(conn.fcall_ro("cohort_version", 0))  # type: ignore[arg-type]
    except redis.ResponseError as exc:
        if _lacks_functions(exc):
            raise _too_old(conn, exc) from exc
        if _function_missing(exc):
            return None
        raise


def load_library(conn: Client) -> int:
    """Make sure every primary runs this package's library (or a newer one); return the
    oldest version found.

    On Redis Cluster a function lives on each node separately (a replica gets its primary's
    through replication, and so keeps it when promoted), so the library is loaded on every
    primary the client's slot map names now. A primary added later is loaded when an FCALL
    there first answers "function not found" (see `_fcall`).
    """
    return min(_load_on(server) for _, server in primaries(conn))


def _load_on(conn: redis.Redis) -> int:
    """Load the library on one server, unless it runs this version or a newer one.

    Loads with FUNCTION LOAD REPLACE only when the installed version is missing or older.
    Several coordinators may race here: REPLACE is atomic, and each re-checks after loading,
    so an older coordinator that loaded last is overwritten by the newer one's next pass
    and the server converges on the newest version. An older coordinator never downgrades.
    """
    want = library_version()
    for _ in range(_LOAD_ATTEMPTS):
        have = installed_version(conn)
        if have is not None and have >= want:
            return have
        try:
            conn.function_load(library_source(), replace=True)
        except redis.ResponseError as exc:
            if _lacks_functions(exc):
                raise _too_old(conn, exc) from exc
            raise CoordinatorError(f"FUNCTION LOAD of library {LIBRARY!r} failed: {exc}") from exc
    raise CoordinatorError(
        f"library {LIBRARY!r} v{want} kept being replaced by an older version "
        f"({installed_version(conn)}) after {_LOAD_ATTEMPTS} loads; is an old coordinator running?"
    )


def _fcall(conn: Client, function: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
    """FCALL, loading the library first if the server lost it (fresh or flushed server)."""
    for attempt in (1, 2):
        try:
            return conn.fcall(function, len(keys), *keys, *args)
        except redis.ResponseError as exc:
            if _lacks_functions(exc):
                raise _too_old(conn, exc) from exc
            if attempt == 1 and _function_missing(exc):
                load_library(conn)  # nothing ran, so calling again is safe
                continue
            raise
    raise AssertionError("unreachable")  # pragma: no cover


def new_nonce() -> str:
    """A random nonce: makes each token unique even if two coordinators share a host and pid."""
    return secrets.token_hex(8)


class RedisLease:
    """The leader lease: a PX key holding `epoch:nonce`, the epoch counted up on every election."""

    def __init__(self, conn: Client, keys: Keys, lease_ms: int) -> None:
        if lease_ms <= 0:
            raise CoordinatorError(f"lease_ms must be a positive number of ms, not {lease_ms!r}")
        self.conn = conn
        self.keys = keys
        self.lease_ms = lease_ms

    def acquire(self, nonce: str | None = None) -> str | None:
        """Our new token if the lease was free (the epoch grows by exactly one), else None."""
        nonce = new_nonce() if nonce is None else nonce
        if not nonce or any(c.isspace() for c in nonce):
            raise CoordinatorError(f"nonce {nonce!r} must be non-empty and without whitespace")
        reply = _fcall(
            self.conn, "cohort_acquire", [self.keys.leader, self.keys.epoch], [nonce, self.lease_ms]
        )
        # nil from Lua is None on RESP2 and RESP3; guard against a boolean too
        return text(reply) if reply else None

    def renew(self, token: str) -> bool:
        """Extend the lease by lease_ms if `token` still holds it. False means: stop leading."""
        return bool(_fcall(self.conn, "cohort_renew", [self.keys.leader], [token, self.lease_ms]))

    def release(self, token: str) -> bool:
        """Give the lease up if `token` holds it (compare-and-delete); a follower takes over now."""
        return bool(_fcall(self.conn, "cohort_release", [self.keys.leader], [token]))

    def holder(self) -> str | None:
        """The current token, or None if no one leads."""
        value = self.conn.get(self.keys.leader)
        return text(value) if value is not None else None  # type: ignore[arg-type]


class FencedJournal:
    """The leader's writes: facts, the inbox cursor and dead letters in one fenced, atomic call."""

    def __init__(
        self,
        conn: Client,
        keys: Keys,
        dead_maxlen: int = 10_000,
        wait_replicas: int = 0,
        wait_aof: bool = False,
        wait_ms: int = 5000,
    ) -> None:
        if dead_maxlen <= 0:
            raise CoordinatorError(f"dead_maxlen must be positive, not {dead_maxlen!r}")
        if wait_replicas < 0 or wait_ms <= 0:
            raise CoordinatorError(
                f"wait_replicas ({wait_replicas!r}) must be >= 0 and wait_ms ({wait_ms!r}) > 0"
            )
        self.conn = conn
        self.keys = keys
        self.dead_maxlen = dead_maxlen
        self.wait_replicas = wait_replicas
        """After each append, WAIT until this many replicas have it (0: do not wait)."""
        self.wait_aof = wait_aof
        """After each append, WAITAOF until the primary's AOF has it fsynced (Redis >= 7.2)."""
        self.wait_ms = wait_ms
        self.acked: Acked | None = None
        """What the last append's waits confirmed (None: nothing was waited for)."""

    def append(
        self,
        token: str,
        expected_last: str,
        facts: Sequence[bytes],
        cursor: str | None,
        dead: Sequence[DeadLetter] = (),
    ) -> list[str]:
        """Append `facts` (encoded) and set the cursor, only if `token` leads and the journal
        still ends at `expected_last`. Returns the new journal IDs.

        Raises Fenced if the token is stale and Conflict if the journal moved; in both cases
        nothing was written. After a lost reply, retrying the same call raises Conflict with
        `actual_last` naming what the first attempt wrote, so a retry never appends twice.
        """
        args: list[Any] = [token, expected_last, cursor or "", len(facts), self.dead_maxlen]
        args.extend(facts)
        for letter in dead:
            args.extend(letter.fields())
        keys = [self.keys.leader, self.keys.journal, self.keys.cursor, self.keys.dead]
        self.acked = None
        try:
            if self.wait_replicas or self.wait_aof:
                ids = self._append_and_wait(keys, args)
            else:
                ids = _fcall(self.conn, "cohort_append", keys, args)
        except redis.ResponseError as exc:
            self._raise_translated(exc, token, expected_last)
            raise
        return [text(i) for i in ids or ()]

    def _append_and_wait(self, keys: list[str], args: list[Any]) -> Any:
        """FCALL cohort_append, then WAIT / WAITAOF on the same connection of the primary
        holding the journal: both wait for *this connection's* writes, so they must follow
        the append on the connection that made it (one pipeline guarantees that)."""
        server = server_for(self.conn, self.keys.journal)
        for attempt in (1, 2):
            pipe = server.pipeline(transaction=False)
            pipe.fcall("cohort_append", len(keys), *keys, *args)
            if self.wait_replicas:
                pipe.execute_command("WAIT", self.wait_replicas, self.wait_ms)
            if self.wait_aof:
                pipe.execute_command("WAITAOF", 1, 0, self.wait_ms)
            replies = pipe.execute(raise_on_error=False)
            first = replies[0]
            if isinstance(first, redis.ResponseError):
                if attempt == 1 and _function_missing(first):
                    load_library(self.conn)  # nothing ran, so calling again is safe
                    continue
                if isinstance(first, redis.exceptions.AskError):
                    # The slot moved (failover, resharding): redis-py follows it and learns
                    # the new owner; the wait then goes to that node's pooled connection,
                    # the one the append just used in this single-threaded leader.
                    ids = _fcall(self.conn, "cohort_append", keys, args)
                    self._wait_after_redirect()
                    return ids
                raise first
            self._record(replies[1:])
            return first
        raise AssertionError("unreachable")  # pragma: no cover

    def _wait_after_redirect(self) -> None:
        server = server_for(self.conn, self.keys.journal)
        replies: list[Any] = []
        if self.wait_replicas:
            replies.append(server.execute_command("WAIT", self.wait_replicas, self.wait_ms))
        if self.wait_aof:
            replies.append(server.execute_command("WAITAOF", 1, 0, self.wait_ms))
        self._record(replies)

    def _record(self, replies: list[Any]) -> None:
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        at = iter(replies)
        replicas = int(next(at)) if self.wait_replicas else None
        aof = bool(int(next(at)[0])) if self.wait_aof else None
        self.acked = Acked(replicas=replicas, aof=aof)

    def save_snapshot(self, token: str, blob: bytes) -> None:
        """Store a snapshot blob, only if `token` leads (else Fenced)."""
        try:
            keys = [self.keys.leader, self.keys.snapshot]
            _fcall(self.conn, "cohort_snapshot", keys, [token, blob])
        except redis.ResponseError as exc:
            self._raise_translated(exc, token, "")
            raise

    def trim_journal(self, token: str, keep: str, index: bytes) -> int:
        """fencing.lua's cohort_trim_journal: the journal's entries before `keep` dropped and
        the archive index set to `index`, only if `token` leads (else Fenced). Returns the
        entries dropped."""
        keys = [self.keys.leader, self.keys.journal, self.keys.archive]
        try:
            return int(_fcall(self.conn, "cohort_trim_journal", keys, [token, keep, index]))
        except redis.ResponseError as exc:
            self._raise_translated(exc, token, "")
            raise

    def repair_inbox(self, token: str, cursor: str, limit: str) -> tuple[str, int, int]:
        """fencing.lua's cohort_repair_inbox: (new cursor, entries moved, entries dropped)."""
        keys = [self.keys.leader, self.keys.inbox, self.keys.cursor]
        try:
            found = _fcall(self.conn, "cohort_repair_inbox", keys, [token, cursor, limit])
        except redis.ResponseError as exc:
            self._raise_translated(exc, token, "")
            raise
        return text(found[0]), int(found[1]), int(found[2])

    def inbox_marks(self, cursor: str) -> InboxMarks | None:
        """fencing.lua's cohort_inbox_marks (None: there is no inbox)."""
        found = _fcall(self.conn, "cohort_inbox_marks", [self.keys.inbox], [cursor])
        if not found:
            return None
        last, deleted, first, held = found
        return InboxMarks(text(last), text(deleted), text(first), bool(int(held)))

    def cursor(self) -> str:
        """The inbox ID consumed up to ("0-0" before the first append that moved it)."""
        value = self.conn.get(self.keys.cursor)
        return text(value) if value is not None else ZERO  # type: ignore[arg-type]

    def load_snapshot(self) -> bytes | None:
        value: Any = self.conn.get(self.keys.snapshot)
        return bytes(value) if value is not None else None

    @staticmethod
    def _raise_translated(exc: redis.ResponseError, token: str, expected_last: str) -> None:
        """Raise Fenced/Conflict for the library's refusals; return for any other error."""
        message = str(exc)
        if message.startswith(_FENCED):
            holder = message[len(_FENCED) :].strip()
            raise Fenced(token, None if holder == "none" else holder) from exc
        match = _CONFLICT.match(message)
        if match:
            raise Conflict(expected_last, match.group(1)) from exc
