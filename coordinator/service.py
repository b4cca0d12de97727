"""The coordinator's one I/O loop: follow the journal, win the lease, lead, step down.

Every coordinator of a job runs this loop. A follower tails the journal so its
state is hot and tries for the lease whenever nobody holds it. The leader reads
the inbox after the cursor in batches; each batch becomes facts through the
pure `Core`, and facts, dead letters and the new cursor go to Redis in one
fenced Function call. If that call is refused (another leader, a moved
journal) or its outcome is unknown (Redis went away), the leader forgets what
it decided and folds the journal again: the journal is the only truth.

Time: a command is decided as of its inbox entry's ID (the Redis server's
clock); silence is judged against the server's clock, and only once the inbox
is drained, so a leader working through a backlog never fails a worker whose
heartbeats are still in the queue.
"""

from __future__ import annotations

import logging
import os
import random
import threading
from dataclasses import dataclass, field
from typing import Any

import msgpack

from cohort.events.clock import Clock, SystemClock
from cohort.events.codec import decode_command, encode
from cohort.events.connection import UNAVAILABLE, Client
from cohort.events.errors import DecodeError
from cohort.events.keys import Keys
from cohort.events.models import Fact, JobConfig, StepDone
from cohort.events.streams import ZERO, Entry, Inbox, Journal, id_ms

from . import durability, snapshot
from .core import Core
from .decide import configure, elect
from .election import DeadLetter, FencedJournal, Lease, load_library
from .errors import Conflict, CoordinatorError, Fenced
from .fold import fold
from .metrics import Metrics
from .state import JobState, state_hash

log = logging.getLogger("cohort.coordinator")


@dataclass(frozen=True)
class ServiceSettings:
    job: str
    coordinator: str = field(default_factory=lambda: f"{os.uname().nodename}-{os.getpid()}")
    config: JobConfig = field(default_factory=JobConfig)
    lease_ms: int = 3000
    batch: int = 1024
    block_ms: int = 200
    snapshot_every: int = 1000
    status_interval: float = 1.0
    inbox_retention: float = 600.0
    dead_maxlen: int = 10_000
    allow_volatile: bool = False
    """Lead even when Redis keeps no AOF (a restart would lose the journal)."""
    wait_aof: bool = False
    """After each append, wait until the AOF is fsynced locally (WAITAOF, Redis >= 7.2)."""
    wait_replicas: int = 0
    """After each append, WAIT until this many replicas have it (Sentinel/Cluster failover
    then cannot lose an acknowledged fact while one of them is promoted)."""
    wait_ms: int = 5000
    """How long each WAIT / WAITAOF may block before the leader logs a shortfall."""
    display_url: str = "redis"


@dataclass
class Counters:
    commands: int = 0
    facts: int = 0
    dead: int = 0
    batches: int = 0
    elections_won: int = 0
    resyncs: int = 0
    unreplicated: int = 0
    """Appends that WAIT confirmed on fewer than --wait-replicas replicas in time."""
    rollbacks: int = 0
    """Times the journal was found to have lost entries this coordinator had folded."""


class Coordinator:
    def __init__(
        self,
        conn: Client,
        settings: ServiceSettings,
        clock: Clock | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.conn = conn
        self.metrics = metrics
        self._lag = 0.0
        self.settings = settings
        self.clock = clock or SystemClock()
        self.keys = Keys(settings.job)
        self.journal = Journal(conn, self.keys.journal)
        self.inbox = Inbox(conn, self.keys.inbox)
        self.lease = Lease(conn, self.keys, settings.lease_ms)
        self.store = FencedJournal(
            conn,
            self.keys,
            dead_maxlen=settings.dead_maxlen,
            wait_replicas=settings.wait_replicas,
            wait_ms=settings.wait_ms,
        )
        self.core = Core()
        self.committed = self.core.state  # the state as of journal_id: what Redis holds
        self.journal_id = ZERO  # the last journal entry folded into `committed`
        self.cursor = ZERO
        self.token: str | None = None
        self.counters = Counters()
        self._renewed_at = 0.0
        self._status_at = -1e9
        self._trimmed_at = 0.0
        self._facts_since_snapshot = 0
        self._down_since: float | None = None
        self.persistence = durability.Persistence(aof=None, waitaof=False, version="unknown")
        self._nonce = f"{settings.coordinator}:{random.getrandbits(32):08x}"

    # ------------------------------------------------------------ the loop
    @property
    def state(self) -> JobState:
        return self.core.state

    @property
    def leading(self) -> bool:
        return self.token is not None

    def run(self, stop: threading.Event) -> None:
        """Follow or lead until `stop` is set; Redis outages are waited out, never fatal."""
        backoff = 0.1
        started = False
        while not stop.is_set():
            try:
                if not started:
                    self.start()
                    started = True
                self.step()
                if self._down_since is not None:
                    log.warning("Redis is reachable again; %s resumes", self.settings.coordinator)
                    self._down_since = None
                    self._resync()
                backoff = 0.1
            except UNAVAILABLE as exc:
                if self._down_since is None:
                    self._down_since = self.clock.monotonic()
                    log.error("Redis unreachable (%s); retrying with backoff, nothing is lost", exc)
                self._lost_redis()
                stop.wait(backoff * (0.5 + random.random()))
                backoff = min(backoff * 2, 5.0)
        self.close()

    def start(self) -> None:
        self.persistence = durability.require(
            self.conn, self.settings.display_url, self.settings.allow_volatile
        )
        if not self.persistence.aof:
            log.warning(
                "leading without persistence (--allow-volatile): a Redis restart "
                "loses the journal of job %r",
                self.settings.job,
            )
        if self.settings.wait_aof and not self.persistence.waitaof:
            log.warning(
                "--wait-aof: Redis %s has no WAITAOF (needs >= 7.2); relying on appendfsync",
                self.persistence.version,
            )
        self.store.wait_aof = self.settings.wait_aof and self.persistence.waitaof
        load_library(self.conn)
        self._load_snapshot()
        self.catch_up()

    def step(self) -> None:
        """One turn of the loop: lead a batch, or follow the journal and try for the lease."""
        if self.leading:
            self._lead_once()
        else:
            self._follow_once()

    def close(self) -> None:
        """Give the lease back at once so a follower takes over without waiting it out."""
        if self.token is not None:
            try:
                self.lease.release(self.token)
                log.info("%s released the lease", self.settings.coordinator)
            except UNAVAILABLE:
                pass
            self.token = None

    # ------------------------------------------------------------ following
    def catch_up(self, block_ms: int = 0) -> int:
        """Fold journal facts after `journal_id`; returns how many."""
        count = 0
        for entries in self.journal.pages(self.journal_id, block_ms=block_ms):
            if self.journal_id != ZERO and _elects(entries) and not self._holds(self.journal_id):
                # A new leader after a failover that lost what this coordinator folded.
                self._rolled_back()
                return count
            self._fold_page(entries)
            count += len(entries)
        return count

    def _holds(self, entry_id: str) -> bool:
        """True if the journal still holds `entry_id` (it is never trimmed, so only a Redis
        that lost acknowledged writes, e.g. a failover to a lagging replica, loses one)."""
        return entry_id == ZERO or bool(self.conn.xrange(self.keys.journal, entry_id, entry_id))

    def _rolled_back(self) -> None:
        """The journal lost entries this coordinator folded: forget everything it knows,
        fold the journal as it is now, and give up the lease if it held it, so the next
        election appends a LeaderElected with a new token that every reader notices."""
        self.counters.rollbacks += 1
        log.error(
            "the journal of job %r no longer holds entry %s, which %s had folded: Redis lost "
            "acknowledged writes (a failover to a replica that had not received them?). "
            "Folding the journal again from the start%s. See docs/redis-ha.md",
            self.settings.job,
            self.journal_id,
            self.settings.coordinator,
            " and stepping down" if self.token is not None else "",
        )
        if self.token is not None:
            token, self.token = self.token, None
            self.lease.release(token)
        self.core = Core()
        self.committed = self.core.state
        self.journal_id = ZERO
        self._load_snapshot()
        self.catch_up()
        self.cursor = self.store.cursor()

    def _fold_page(self, entries: list[Entry]) -> None:
        try:
            facts = Journal.decode_page(entries)
        except DecodeError as exc:
            bad = entries[exc.index or 0].id
            raise CoordinatorError(
                f"journal entry {bad} of job {self.settings.job!r} cannot be read "
                f"({exc.reason}); it was written by a newer cohort: upgrade this coordinator"
            ) from None
        self.core.apply(facts)
        self.committed = self.core.state
        self.journal_id = entries[-1].id

    def _follow_once(self) -> None:
        self.catch_up(block_ms=min(self.settings.block_ms, 500))
        if self.metrics is not None:
            self.metrics.update(self.state, leading=False, lag_seconds=0.0)
        if self.lease.holder() is None:
            token = self.lease.acquire(self._nonce)
            if token is not None:
                self._take_over(token)

    def _take_over(self, token: str) -> None:
        self.token = token
        self._renewed_at = self.clock.monotonic()
        self.counters.elections_won += 1
        if self.metrics is not None:
            self.metrics.failovers.inc()
        self.catch_up()
        self.cursor = self.store.cursor()
        now = self._server_now()
        self._rebuild_liveness(now)
        epoch = Lease.epoch_of(token)
        facts = configure(self.state, self.settings.job, self.settings.config, now)
        facts += elect(fold(facts, self.state), self.settings.coordinator, epoch, now)
        self.core.apply(facts)
        if self.state.config is not None and self.state.config != self.settings.config:
            log.warning(
                "job %r keeps its journaled config %s; this coordinator's flags differ and are "
                "ignored",
                self.settings.job,
                self.state.config.model_dump(),
            )
        self._commit(list(facts), cursor=None, dead=[])
        log.info(
            "%s leads job %r (epoch %d) from journal %s, inbox cursor %s",
            self.settings.coordinator,
            self.settings.job,
            epoch,
            self.journal_id,
            self.cursor,
        )

    def _rebuild_liveness(self, now: float) -> None:
        """Observe (never decide) the inbox window before the cursor: who was alive when."""
        window = self.state.config.heartbeat_timeout if self.state.config else 30.0
        cursor_ms = id_ms(self.cursor)
        start = f"{max(0, cursor_ms - int((window + 1) * 1000))}-0"
        seen = self.core.seen
        if self.cursor != ZERO:
            for item in self.inbox.range(start, self.cursor, count=100_000):
                try:
                    command = decode_command(item.raw or b"")
                except DecodeError:
                    continue
                if command.job == self.settings.job:
                    seen.observe(command, item.ms / 1000)
        since = cursor_ms / 1000 if self.cursor != ZERO else now
        seen.grace(list(self.state.members), since)

    # ------------------------------------------------------------ leading
    def _lead_once(self) -> None:
        if not self._renew_if_due():
            return
        entries = self.inbox.tail(self.cursor, self.settings.block_ms, count=self.settings.batch)
        facts: list[Fact] = []
        dead: list[DeadLetter] = []
        for entry in entries:
            try:
                command = decode_command(entry.raw if entry.raw is not None else _no_field(entry))
            except DecodeError as exc:
                dead.append(DeadLetter(entry.id, exc.reason, _raw_of(entry)))
                continue
            if command.job != self.settings.job:
                reason = (
                    f"command is for job {command.job!r} but sits in the inbox of "
                    f"{self.settings.job!r}"
                )
                dead.append(DeadLetter(entry.id, reason, _raw_of(entry)))
                continue
            facts.extend(self.core.handle(command, entry.ms / 1000, entry.ms / 1000))
            if self.metrics is not None and isinstance(command, StepDone):
                self.metrics.step_time.observe(command.step_time)
        drained = len(entries) < self.settings.batch
        if drained:
            facts.extend(self.core.tick(self._server_now()))
        self.counters.commands += len(entries)
        if self.metrics is not None:
            self.metrics.commands.inc(len(entries))
        cursor = entries[-1].id if entries else None
        if facts or dead or cursor:
            self._commit(facts, cursor, dead)
        self._housekeeping()

    def _commit(self, facts: list[Fact], cursor: str | None, dead: list[DeadLetter]) -> None:
        """Append what `core.state` already folded; on refusal go back to what Redis holds."""
        assert self.token is not None
        try:
            ids = self.store.append(
                self.token, self.journal_id, [encode(f) for f in facts], cursor, dead
            )
        except Fenced as exc:
            log.warning(
                "%s is no longer the leader (lease held by %s); following again",
                self.settings.coordinator,
                exc.holder or "nobody",
            )
            self.token = None
            self._resync()
            return
        except Conflict:
            log.warning("journal moved under %s; folding it again", self.settings.coordinator)
            self._resync()
            return
        except BaseException:
            self.core.state = self.committed  # the outcome is unknown: _resync decides later
            raise
        if ids:
            self.journal_id = ids[-1]
        self._check_acked()
        self.committed = self.core.state
        if cursor is not None:
            self.cursor = cursor
        self.counters.facts += len(facts)
        self.counters.dead += len(dead)
        if self.metrics is not None:
            self.metrics.facts.inc(len(facts))
            self.metrics.dead.inc(len(dead))
        self.counters.batches += 1
        self._facts_since_snapshot += len(facts)
        for letter in dead:
            log.warning("dead letter %s: %s", letter.inbox_id, letter.reason)

    def _check_acked(self) -> None:
        """Log (and count) an append that fewer replicas or no fsync confirmed in time: it
        is in the journal and acted on, but a failover or power cut now could lose it."""
        acked = self.store.acked
        if acked is None:
            return
        wanted = self.settings.wait_replicas
        if acked.replicas is not None and acked.replicas < wanted:
            self.counters.unreplicated += 1
            log.warning(
                "WAIT: journal entry %s reached %d of %d replicas within %d ms; a failover "
                "now could lose it (are the replicas up? see docs/redis-ha.md)",
                self.journal_id,
                acked.replicas,
                wanted,
                self.settings.wait_ms,
            )
        if acked.aof is False:
            log.warning("WAITAOF: the AOF was not fsynced within %d ms", self.settings.wait_ms)

    def _resync(self) -> None:
        """Forget what was decided and fold what the journal holds."""
        self.counters.resyncs += 1
        self.core.state = self.committed
        if not self._holds(self.journal_id):
            self._rolled_back()
            return
        self.catch_up()
        self.cursor = self.store.cursor()

    def _lost_redis(self) -> None:
        """Redis went away mid-turn: whether the last append landed is unknown."""
        if self.token is not None and self.clock.monotonic() - self._renewed_at > (
            self.settings.lease_ms / 1000
        ):
            log.warning("%s lost its lease while Redis was away", self.settings.coordinator)
            self.token = None

    def _renew_if_due(self) -> bool:
        now = self.clock.monotonic()
        if now - self._renewed_at < self.settings.lease_ms / 3000:
            return True
        assert self.token is not None
        if self.lease.renew(self.token):
            self._renewed_at = now
            return True
        log.warning("%s failed to renew its lease; following again", self.settings.coordinator)
        self.token = None
        self._resync()
        return False

    def _housekeeping(self) -> None:
        now = self.clock.monotonic()
        if self.token and self._facts_since_snapshot >= self.settings.snapshot_every:
            self.store.save_snapshot(self.token, snapshot.encode(self.state, self.journal_id))
            self._facts_since_snapshot = 0
        if now - self._status_at >= self.settings.status_interval:
            self._status_at = now
            self._publish_status()
        if now - self._trimmed_at >= 10.0 and self.cursor != ZERO:
            self._trimmed_at = now
            keep_ms = int((self._server_now() - self.settings.inbox_retention) * 1000)
            cursor_ms = id_ms(self.cursor)
            self.conn.xtrim(self.keys.inbox, minid=f"{min(keep_ms, cursor_ms)}-0", approximate=True)

    def _publish_status(self) -> None:
        """The leader's volatile view for `cohort status`; expires if the leader dies."""
        seen = self.core.seen
        last = self.inbox.last_id()
        lag_ms = max(0, id_ms(last) - id_ms(self.cursor))
        self._lag = lag_ms / 1000 if last != self.cursor else 0.0
        if self.metrics is not None:
            self.metrics.update(self.state, leading=True, lag_seconds=self._lag)
        body: dict[str, Any] = {
            "coordinator": self.settings.coordinator,
            "epoch": Lease.epoch_of(self.token) if self.token else 0,
            "journal_id": self.journal_id,
            "cursor": self.cursor,
            "inbox_lag_ms": lag_ms if last != self.cursor else 0,
            "state_hash": state_hash(self.state),
            "at": self._server_now(),
            "counters": self.counters.__dict__,
            "workers": {
                w: {
                    "last_seen": seen.last_seen.get(w),
                    "progress": list(seen.progress.get(w, (-1, -1))),
                    "loss": seen.losses.get(w),
                    "step_time": seen.step_times.get(seen.progress.get(w, (-1, -1))[1], {}).get(w),
                    "gpu": [
                        {
                            "index": d.index,
                            "memory_pct": round(100 * d.memory_used / d.memory_total, 1)
                            if d.memory_total
                            else None,
                            "temperature": d.temperature,
                        }
                        for d in (seen.gpus[w].devices if w in seen.gpus else ())
                    ],
                }
                for w in self.state.members
            },
        }
        ttl = int(max(self.settings.status_interval * 5, 3) * 1000)
        self.conn.set(self.keys.status, msgpack.packb(body, use_bin_type=True), px=ttl)

    def _load_snapshot(self) -> None:
        blob = self.store.load_snapshot()
        if not blob:
            return
        try:
            state, journal_id = snapshot.decode(blob)
        except snapshot.SnapshotUnusable as exc:
            log.warning("ignoring the snapshot of job %r: %s", self.settings.job, exc)
            return
        if journal_id != ZERO and not self.conn.xrange(self.keys.journal, journal_id, journal_id):
            log.warning(
                "snapshot covers journal entry %s, which the journal does not hold; "
                "folding from zero",
                journal_id,
            )
            return
        self.core.state, self.journal_id = state, journal_id
        self.committed = state

    def _server_now(self) -> float:
        seconds, micros = self.conn.time()
        return seconds + micros / 1e6


def _elects(entries: list[Entry]) -> bool:
    """True if a LeaderElected is among `entries` (a cheap look at the raw bytes)."""
    return any(b"LeaderElected" in (entry.raw or b"") for entry in entries)


def _raw_of(entry: Entry) -> bytes:
    if entry.raw is not None:
        return entry.raw
    return msgpack.packb({k: v for k, v in entry.fields.items()}, use_bin_type=True)[:65536]


def _no_field(entry: Entry) -> bytes:
    names = sorted(k.decode(errors="replace") for k in entry.fields)[:8]
    raise DecodeError(f"entry has no 'e' field (fields: {names})")
