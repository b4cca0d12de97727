"""The coordinator's one I/O loop: follow the journal, win the lease, lead, step down.

Every coordinator of a job runs this loop. A follower tails the journal so its
state is hot and tries for the lease whenever nobody holds it. A leader's turn
reads as load, decide, save, account: it loads a batch of inbox commands after
the cursor, decides them with the pure `Core` (each fact folded once, as it is
decided), saves facts, dead letters and the new cursor in one fenced write, and
accounts for what it did. If the write is refused (another leader, a moved
journal) or its outcome is unknown (Redis went away), the core rolls back to
what the journal holds and the journal is folded again: it is the only truth.

Storage is behind two Protocols (`stores.JobLog`, `stores.Lease`): Redis in
production (`Coordinator.on_redis`), memory in the unit tests.

Time: a command is decided as of its inbox entry's ID (the Redis server's
clock); silence is judged against the clock the coordinator is given (Redis's
own, `ServerClock`, in production), only once the inbox is drained, and as of
the drained read, so a leader working through a backlog (workers that started
before any coordinator, a long leaderless gap) never fails a worker whose
heartbeats are still in the queue or arrived while it decided.

The inbox is untrusted (docs/identity.md): anyone who may XADD to it may choose an
entry's ID. No ID moves the leader's clock: an entry is decided as of its ID only up
to the server's time of the read, and an entry further ahead than `SKEW` stops the
read there; the leader moves every unread entry behind the server's clock in the same
turn (fencing.lua's cohort_repair_inbox) and journals `InboxRepaired` (rate-limited,
the rest counted), so a worker's XADD with an explicit ID, even the largest a stream
allows, costs a turn; and the time from the earliest the entry can have come (the last
read that found the inbox in order, or the entry before it) to the repair is nobody's
silence (`Liveness.blind`): no worker could be heard meanwhile.
Unread entries deleted by someone else are found the same way (once a second) and
journaled. A dead letter is a bounded record, tallied by sender and journaled
(`refusals.py`); a command the core cannot decide is a dead letter too, never a crash.
"""

from __future__ import annotations

import logging
import os
import random
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import redis

from cohort.coordinator import archiving, snapshot
from cohort.coordinator.core import Core
from cohort.coordinator.election import RedisLease
from cohort.coordinator.errors import ConfigConflictError, Conflict, CoordinatorError, Fenced
from cohort.coordinator.joblog import Durability, RedisJobLog
from cohort.coordinator.liveness import Liveness
from cohort.coordinator.metrics import Metrics
from cohort.coordinator.refusals import Refusals, claimed_sender
from cohort.coordinator.replay import fact_details
from cohort.coordinator.state import JobState, state_hash
from cohort.coordinator.stores import DeadLetter, InboxMarks, JobLog, Lease, epoch_of
from cohort.events import identity
from cohort.events.archive import ArchiveError
from cohort.events.clock import Clock, ServerClock
from cohort.events.codec import decode_commands, encode, gc_paused
from cohort.events.connection import UNAVAILABLE, Client
from cohort.events.errors import DecodeError, ForgedCommandError
from cohort.events.keys import Keys
from cohort.events.models import (
    Command,
    Fact,
    InboxRepaired,
    JobConfig,
    JournalArchived,
    RefusalKind,
    StepCommitted,
    StepDone,
    TransfersWaiting,
)
from cohort.events.streams import ZERO, Entry, Journal, elects, id_key, id_ms

log = logging.getLogger("cohort.coordinator")

WINDOW_PAGE = 10_000
"""Inbox entries read per round trip when a new leader looks at who was alive."""
TRUST_REFRESH = 1.0
"""Seconds between reads of the job key and revoked workers while leading."""
SKEW = 1.0
"""Seconds an inbox entry's ID may run ahead of the server's clock at the read (past the
read's own blocking time) before the leader treats the inbox as out of order."""
MAX_ENTRY_BYTES = 1 << 20
"""An inbox entry larger than this (its fields' bytes) is dead-lettered undecoded: every
command cohort sends is far smaller (a Join with 10,000 file ranges is ~100 KB)."""
MAX_SEQ = 2**64 - 1
WATCH_EVERY = 0.05
"""Seconds between readings of the members' connections (a job with a disconnect grace):
while it watches them, the leader's turn waits on the inbox no longer than this, and no
longer than until a closed member's grace ends."""
WATCH_REFUSED_RETRY = 60.0
"""Seconds between readings while Redis refuses them (an ACL applied again later)."""
TROUBLE_EVERY = 5.0
"""Seconds between InboxRepaired facts: a worker that runs the inbox ahead every turn gets
it repaired every turn, and journaled once per this, so it cannot grow the journal fast."""


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
    allow_eviction: bool = False
    """Lead even when Redis may evict keys (`maxmemory-policy` other than noeviction)."""
    wait_aof: bool = False
    """After each append, wait until the AOF is fsynced locally (WAITAOF, Redis >= 7.2)."""
    wait_replicas: int = 0
    """After each append, WAIT until this many replicas have it (Sentinel/Cluster failover
    then cannot lose an acknowledged fact while one of them is promoted)."""
    wait_ms: int = 5000
    """How long each WAIT / WAITAOF may block before the leader logs a shortfall."""
    display_url: str = "redis"
    given: frozenset[str] = frozenset()
    """The `config` fields the operator set (flags, config file): a journaled config that
    differs in any of them is refused, not silently kept."""
    stay: bool = False
    """Keep running once the job finished (default: exit when no member is left)."""
    journal_hot: int = archiving.DEFAULT_HOT
    """Facts the journal keeps in Redis, about, where it has storage to archive the rest."""
    archive_uri: str | None = None
    """Where the journal's archived segments go (None: the job's checkpoint URI; neither:
    the journal stays whole in Redis)."""


@dataclass
class ServiceCounters:
    """What this coordinator process did (the job's own counts are in `JobState.counters`)."""

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
    forged: int = 0
    """Of `dead`, the entries whose signature did not prove their worker (identity mode)."""


@dataclass
class Turn:
    """One leader turn: the inbox entries it loaded and what it decided of them."""

    cursor: str | None = None
    """The last inbox entry loaded (None: the inbox had nothing new)."""
    drained: bool = True
    """Fewer entries than a full batch came: the backlog is read."""
    read_at: float = 0.0
    """Server time (s) by which every inbox entry was loaded, if `drained`: silence is
    judged as of then, not as of a later clock reading that entries since would belie."""
    commands: list[tuple[float, Command, str]] = field(default_factory=list)
    """Each valid command with the server time (s) it arrived at and its inbox ID."""
    ahead: Entry | None = None
    """The first entry whose ID ran ahead of the server's clock: the read stopped before it."""
    limit: str = ZERO
    """The newest inbox ID the server's clock allowed at the read."""
    repair: bool = False
    """Put the inbox back in order (`_repair`) in this turn, after saving what it writes."""
    tallied: bool = False
    """`facts` holds the refusals' tally (`refusals.Refusals.fact`)."""
    dead: list[DeadLetter] = field(default_factory=list)
    forged: int = 0
    """Of `dead`, how many were refused for their signature (events/identity.py)."""
    facts: list[Fact] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    """The journal IDs `facts` were appended at, once saved."""
    saved: bool = False

    @property
    def entries(self) -> int:
        return len(self.commands) + len(self.dead)

    @property
    def writes(self) -> bool:
        return bool(self.facts or self.dead or self.cursor)


class Coordinator:
    def __init__(
        self,
        joblog: JobLog,
        lease: Lease,
        settings: ServiceSettings,
        clock: Clock,
        metrics: Metrics | None = None,
    ) -> None:
        self.joblog = joblog
        self.lease = lease
        self.settings = settings
        self.clock = clock
        self.metrics = metrics
        self.core = Core()
        self.journal_id = ZERO  # the last journal entry `core.committed` includes
        self.cursor = ZERO
        self.token: str | None = None
        self.counters = ServiceCounters()
        self._lag = 0.0
        self._renewed_at = 0.0
        self._status_at = -1e9
        self._trimmed_at = 0.0
        self._facts_since_snapshot = 0
        self._down_since: float | None = None
        self._oom = False  # the last housekeeping found Redis over maxmemory
        self._trust: identity.Trust | None = None  # None: commands need no signature
        self._trusted_at = -1e9
        self._nonce = f"{settings.coordinator}:{random.getrandbits(32):08x}"
        self.refusals = Refusals()
        self._trouble: InboxRepaired | None = None  # found by housekeeping, not journaled yet
        self._reported: set[str] = set()  # inbox entries an InboxRepaired named
        self._troubled_at = -1e18  # server time of the last InboxRepaired journaled
        self._unjournaled: list[InboxRepaired] = []  # found since, waiting for TROUBLE_EVERY
        self._clean_at = 0.0  # server time of the last read that found the inbox in order
        self._repair_refused = False  # Redis refused the last repair (said once)
        self._marks: InboxMarks | None = None  # the inbox's marks at the last look
        self._marks_refused: str | None = None  # why Redis refused the look, once said
        self.archiving = archiving.Archiving(settings.journal_hot, joblog.entries)
        self._watched_at = -1e9  # monotonic time of the last reading of connections
        self._watch_refused: str | None = None  # why Redis refused the reading, once said

    @classmethod
    def on_redis(
        cls,
        conn: Client,
        settings: ServiceSettings,
        clock: Clock | None = None,
        metrics: Metrics | None = None,
    ) -> Coordinator:
        """A coordinator whose journal, inbox and lease live in Redis, judging time by
        Redis's own clock unless given another."""
        durability = Durability(
            allow_volatile=settings.allow_volatile,
            allow_eviction=settings.allow_eviction,
            wait_aof=settings.wait_aof,
            wait_replicas=settings.wait_replicas,
            wait_ms=settings.wait_ms,
            dead_maxlen=settings.dead_maxlen,
        )
        return cls(
            RedisJobLog(conn, settings.job, durability, settings.display_url),
            RedisLease(conn, Keys(settings.job), settings.lease_ms),
            settings,
            clock or ServerClock(conn),
            metrics,
        )

    @property
    def state(self) -> JobState:
        return self.core.state

    @property
    def leading(self) -> bool:
        return self.token is not None

    @property
    def done(self) -> bool:
        """The job finished and every member has left (or failed): nothing is left to
        decide, unless told to stay."""
        return self.state.finished is not None and not self.state.members and not self.settings.stay

    # ------------------------------------------------------------ the loop
    def run(self, stop: threading.Event) -> None:
        """Follow or lead until `stop` is set or the job is done; Redis outages are waited
        out, never fatal."""
        backoff = 0.1
        started = False
        while not stop.is_set() and not (started and self.done):
            try:
                if not started:
                    self.start()
                    started = True
                self.step()
                if self._down_since is not None:
                    self._back()
                backoff = 0.1
            except UNAVAILABLE as exc:
                if self._down_since is None:
                    self._down_since = self.clock.monotonic()
                    log.error("Redis unreachable (%s); retrying with backoff, nothing is lost", exc)
                self._lost_redis()
                stop.wait(backoff * (0.5 + random.random()))
                backoff = min(backoff * 2, 5.0)
        if self.done:
            log.info(
                "job %r finished at step %d (%s); %s exits",
                self.settings.job,
                self.state.last_committed,
                self.state.finished,
                self.settings.coordinator,
            )
        self.close()

    def start(self) -> None:
        self.joblog.prepare()
        self._load_snapshot()
        self.catch_up()
        self._check_config()

    def _check_config(self) -> None:
        """Raise ConfigConflictError if the journaled config differs from what the operator gave."""
        settings = self.settings
        conflict = ConfigConflictError.between(
            settings.job, self.state.config, settings.config, settings.given
        )
        if conflict is not None:
            raise conflict

    def step(self) -> None:
        """One turn of the loop: lead a batch, or follow the journal and try for the lease."""
        if self.leading:
            self._lead_once()
        else:
            self._follow_once()

    def close(self) -> None:
        """Give the lease back at once so a follower takes over without waiting it out."""
        self.archiving.close()
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
        for entries in self.joblog.pages(self.journal_id, block_ms=block_ms):
            read = Journal.read_page(entries)
            if self.journal_id != ZERO and elects(read) and not self.joblog.holds(self.journal_id):
                # A new leader after a failover that lost what this coordinator folded.
                self._rolled_back()
                return count
            self._fold_page(entries, read)
            count += len(entries)
        return count

    def _fold_page(self, entries: list[Entry], read: Sequence[Fact | DecodeError]) -> None:
        facts = [item for item in read if not isinstance(item, DecodeError)]
        if len(facts) < len(read):
            exc = next(item for item in read if isinstance(item, DecodeError))
            bad = entries[exc.index or 0].id
            raise CoordinatorError(
                f"journal entry {bad} of job {self.settings.job!r} cannot be read "
                f"({exc.reason}); it was written by a newer cohort: upgrade this coordinator"
            )
        self.core.fold(facts)
        self.journal_id = entries[-1].id
        self.archiving.points.record(self.journal_id, self.state)

    def _follow_once(self) -> None:
        self.catch_up(block_ms=min(self.settings.block_ms, 500))
        self._check_config()  # a leader that started with us may have journaled its own
        if self.metrics is not None:
            self.metrics.update(self.state, False, 0.0, self.clock.now())
        if self.lease.holder() is None and not self.done:  # a finished job needs no leader
            token = self.lease.acquire(self._nonce)
            if token is not None:
                self._take_over(token)

    def _take_over(self, token: str) -> None:
        """Lead from the journal's end and the inbox cursor: config (if new) and election
        are the first facts; then `_lead_once` runs every turn."""
        self.token = token
        self._renewed_at = self.clock.monotonic()
        self.archiving.lead()
        self.counters.elections_won += 1
        if self.metrics is not None:
            self.metrics.failovers.inc()
        self.catch_up()
        self.cursor = self.joblog.cursor()
        self._refresh_trust(force=True)
        now = self.clock.now()
        self._rebuild_liveness(now)
        self._clean_at = now  # how the inbox was before this leader read it is not known
        epoch = epoch_of(token)
        settings = self.settings
        facts = self.core.take_over(settings.job, settings.config, settings.coordinator, epoch, now)
        turn = Turn(facts=list(facts))
        self._save(turn)
        self._account(turn)
        if turn.saved:
            log.info(
                "%s leads job %r (epoch %d) from journal %s, inbox cursor %s",
                settings.coordinator,
                settings.job,
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
            for page in self._inbox_between(start, self.cursor):
                for entry, command in zip(page, self._commands_of(page), strict=True):
                    if not isinstance(command, DecodeError):  # no ID is later than now:
                        seen.observe(command, min(entry.ms / 1000, now))
        since = min(cursor_ms / 1000, now) if self.cursor != ZERO else now
        seen.grace(list(self.state.members), since)

    def _inbox_between(self, after: str, until: str) -> Iterator[list[Entry]]:
        """Inbox entries with after < ID <= until, a page at a time: all of them, since a
        worker's latest sign of life is the one that counts."""
        while True:
            page = self.joblog.commands_between(after, until, count=WINDOW_PAGE)
            if page:
                yield page
            if len(page) < WINDOW_PAGE:
                return
            after = page[-1].id

    # ------------------------------------------------------------ leading
    def _lead_once(self) -> None:
        """One leader turn: load, decide, save, account."""
        if not self._renew_if_due():
            return
        with gc_paused():  # a batch of commands lives one turn: collecting mid-turn only
            turn = self._load()  # promotes them, and sets off full collections of the heap
            self._decide(turn)
            self._save(turn)
        self._account(turn)
        if turn.repair and (turn.saved or not turn.writes):  # never waits for a fact
            self._repair(turn)
        self._housekeeping()

    def _load(self) -> Turn:
        """The inbox after the cursor: this job's valid commands, dead letters for the rest,
        up to the first entry whose ID runs ahead of the server's clock."""
        self._refresh_trust()
        block_ms = self._watch_connections()
        batch = self.settings.batch
        asked_at = self.clock.now()  # entries added after this have IDs from it on
        entries = self.joblog.commands(self.cursor, block_ms, batch)
        newest = asked_at + block_ms / 1000  # no honest entry is newer
        limit_ms = int((newest + SKEW) * 1000)
        turn = Turn(drained=len(entries) < batch, limit=f"{limit_ms}-{MAX_SEQ}")
        for index, entry in enumerate(entries if entries and entries[-1].ms > limit_ms else ()):
            if entry.ms > limit_ms:  # (IDs only grow: none is ahead if the last is not)
                turn.ahead, turn.drained, entries = entry, False, entries[:index]
                break
        if turn.drained:  # anything ahead from now on arrived after this read began
            self._clean_at = asked_at
        elif turn.ahead is not None and entries:  # it came after the entries before it
            self._clean_at = max(self._clean_at, min(entries[-1].ms / 1000, asked_at))
        turn.cursor = entries[-1].id if entries else None
        turn.read_at = max(asked_at, min(entries[-1].ms / 1000, newest)) if entries else asked_at
        for entry, command in zip(entries, self._commands_of(entries), strict=True):
            if isinstance(command, DecodeError):
                turn.dead.append(_letter(entry, command))
                turn.forged += isinstance(command, ForgedCommandError)
            else:
                turn.commands.append((min(id_ms(entry.id) / 1000, newest), command, entry.id))
        return turn

    def _watch_connections(self) -> int:
        """Read which members still hold a connection (every WATCH_EVERY s, where the job has
        a disconnect grace), before the inbox: a member found without one is judged against
        every command it sent before the reading. Returns how long the turn may wait on the
        inbox: no longer than the next reading is due."""
        config, members = self.state.config, self.state.members
        if config is None or config.disconnect_grace <= 0 or not members:
            return self.settings.block_ms
        now = self.clock.monotonic()
        if self._watch_refused is not None and now - self._watched_at < WATCH_REFUSED_RETRY:
            return self.settings.block_ms
        block_ms = min(self.settings.block_ms, int(WATCH_EVERY * 1000))
        if now - self._watched_at < WATCH_EVERY:
            return block_ms
        self._watched_at = now
        try:
            server, counts = self.joblog.connected(list(members))
        except redis.ResponseError as exc:  # an ACL from before cohort watched connections
            if self._watch_refused is None:
                log.warning(
                    "Redis refused PUBSUB SHARDNUMSUB (%s): members are failed by their "
                    "silence alone; run `cohort acl --apply` again to let coordinators watch "
                    "connections (asked again every %g s)",
                    exc, WATCH_REFUSED_RETRY,
                )  # fmt: skip
            self._watch_refused = str(exc)
            return self.settings.block_ms
        self._watch_refused = None
        seen, at = self.core.seen, self.clock.now()
        seen.connected(server, counts, at)
        # judge a closed member as its grace ends, not a turn later (one heard from since it
        # closed is judged by its silence: no grace of its own to wait for)
        pending = [
            end for t in seen.closed.values() if (end := t + config.disconnect_grace - at) > 0
        ]
        if pending:
            block_ms = max(1, min(block_ms, int(min(pending) * 1000) + 1))
        return block_ms

    def _refresh_trust(self, force: bool = False) -> None:
        """Identity mode is on iff the job has a key; the revoked set may grow any time."""
        now = self.clock.monotonic()
        if force or now - self._trusted_at >= TRUST_REFRESH:
            self._trust = self.joblog.trust()
            self._trusted_at = now

    def _commands_of(self, entries: Sequence[Entry]) -> list[Command | DecodeError]:
        """Each entry's command if valid, for this job and (in identity mode) for its signer,
        else why not: the checks of one entry at a time, in the same order, with the
        decoding done for the whole batch at once (`codec.decode_commands`)."""
        admitted = [self._admitted(entry) for entry in entries]
        decoded = iter(decode_commands([raw for raw in admitted if isinstance(raw, bytes)]))
        return [
            raw if isinstance(raw, DecodeError) else self._claimed(entry, next(decoded))
            for entry, raw in zip(entries, admitted, strict=True)
        ]

    def _admitted(self, entry: Entry) -> bytes | DecodeError:
        """The entry's command bytes, if its size and (in identity mode) signature pass."""
        size = _size(entry)
        if size > MAX_ENTRY_BYTES:
            return _Refused(
                f"entry of {size} bytes is over the leader's limit of {MAX_ENTRY_BYTES} "
                "(no command is that large); dead-lettered undecoded",
                "oversized",
            )
        trust = self._trust
        if trust is not None:
            reason = identity.verify(trust, entry.fields)
            if reason is not None:
                return ForgedCommandError(reason, _raw_of(entry))
        raw = entry.raw
        return _no_field(entry) if raw is None else raw

    def _claimed(self, entry: Entry, command: Command | DecodeError) -> Command | DecodeError:
        """The decoded command, if it is for this job and (in identity mode) its signer."""
        if isinstance(command, DecodeError):
            return command
        if command.job != self.settings.job:
            return _Refused(
                f"command is for job {command.job!r} "
                f"but sits in the inbox of {self.settings.job!r}",
                "foreign",
            )
        if self._trust is not None:
            signer = entry.fields[identity.SIGNER].decode()
            reason = identity.claims(command.worker, signer)
            if reason is not None:
                forged = ForgedCommandError(reason, _raw_of(entry), event_type=command.type)
                forged.signer = signer  # proven by its MAC
                return forged
        return command

    def _decide(self, turn: Turn) -> None:
        """Each command decided as of its arrival; silence judged once the backlog is read,
        as of the read; the inbox's troubles and refusals journaled as they are found."""
        for received_at, command, entry_id in turn.commands:
            try:
                turn.facts.extend(self.core.handle(command, received_at, received_at))
            except Exception as exc:  # noqa: BLE001 - one command must not stop the job
                log.exception("could not decide %s (inbox %s)", command.type, entry_id)
                why = f"the leader could not decide this {command.type}: {exc}"
                sender = (command.worker, False)
                turn.dead.append(DeadLetter.of(entry_id, why, b"", "undecidable", sender))
        if turn.drained and self._down_since is None:  # after an outage: see `_back` first
            try:
                turn.facts.extend(self.core.tick(turn.read_at))
            except Exception:  # noqa: BLE001 - a bug of ours: logged, and time is judged again
                log.exception("could not judge silence as of %.3f", turn.read_at)
        self._note_trouble(turn)
        if self.refusals.due(turn.read_at):
            turn.tallied = True
            self._note(turn, self.refusals.fact(self.settings.job, turn.read_at))

    def _note_trouble(self, turn: Turn) -> None:
        """An inbox out of order (this turn's read) or losing entries (housekeeping's look)
        is repaired in this turn, every time, and journaled once per entry that shows it,
        at most once per TROUBLE_EVERY s (the first waits; the rest are counted in it)."""
        found, self._trouble = self._trouble, None
        if turn.ahead is not None:
            found = InboxRepaired(
                at=turn.read_at,
                job=self.settings.job,
                trouble="ahead",
                entry=turn.ahead.id,
                ahead_s=min(max(0.0, turn.ahead.ms / 1000 - turn.read_at), 1e10),
                sender=claimed_sender(turn.ahead),
                reason="an inbox entry's ID ran ahead of the server's clock",
            )
        if found is not None:
            turn.repair = True
            if found.entry not in self._reported:
                if len(self._reported) >= 1024:
                    self._reported.clear()
                self._reported.add(found.entry)
                self._unjournaled.append(found)
        if self._unjournaled and turn.read_at - self._troubled_at >= TROUBLE_EVERY:
            first, more = self._unjournaled[0], len(self._unjournaled) - 1
            if more:
                why = f"{first.reason}; and {more} more troubles since, repaired alike"
                first = first.model_copy(update={"reason": why[:1024], "more": more})
            self._unjournaled.clear()
            self._troubled_at = turn.read_at
            self._note(turn, first)

    def _note(self, turn: Turn, fact: Fact) -> None:
        """A fact the leader journals as evidence, not as a decision about a command."""
        self.core.note(fact)
        turn.facts.append(fact)

    def _save(self, turn: Turn) -> None:
        """Append what the core decided, with the cursor and dead letters, in one fenced
        write; on a refusal or an unknown outcome, back to what the journal holds."""
        if not turn.writes:
            return
        assert self.token is not None
        try:
            ids = self.joblog.append(
                self.token, self.journal_id, [encode(f) for f in turn.facts], turn.cursor, turn.dead
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
            self.core.rollback()  # the outcome is unknown: _resync decides once Redis is back
            raise
        self.core.commit()
        turn.saved = True
        turn.ids = ids
        if ids:
            self.journal_id = ids[-1]
            self.archiving.points.record(self.journal_id, self.state)
        if turn.cursor is not None:
            self.cursor = turn.cursor
        self._check_acked()

    def _account(self, turn: Turn) -> None:
        """Counters, metrics and log lines for a turn."""
        self.counters.commands += turn.entries
        if self.metrics is not None:
            self.metrics.commands.inc(turn.entries)
            for _, command, _ in turn.commands:
                if isinstance(command, StepDone):
                    self.metrics.step_time.observe(command.step_time)
        if not turn.saved:
            return
        self.counters.facts += len(turn.facts)
        self.counters.dead += len(turn.dead)
        self.counters.forged += turn.forged
        self.counters.batches += 1
        self._facts_since_snapshot += len(turn.facts)
        if self.metrics is not None:
            self.metrics.facts.inc(len(turn.facts))
            self.metrics.dead.inc(len(turn.dead))
            self.metrics.forged.inc(turn.forged)
        if turn.tallied:
            self.refusals.journaled(turn.read_at)
        self.refusals.add(turn.dead, turn.read_at)
        for entry_id, fact in zip(turn.ids, turn.facts, strict=False):
            self._say(entry_id, fact)

    def _say(self, entry_id: str, fact: Fact) -> None:
        """One log line per journaled fact: INFO, but DEBUG for the one commit per step."""
        name = type(fact).__name__
        log.log(
            logging.DEBUG if isinstance(fact, StepCommitted) else logging.INFO,
            "%s %s (journal %s)",
            name,
            fact_details(fact),
            entry_id,
            extra={"job": self.settings.job, "fact": name, "journal_id": entry_id},
        )

    def _check_acked(self) -> None:
        """Log (and count) an append that fewer replicas or no fsync confirmed in time: it
        is in the journal and acted on, but a failover or power cut now could lose it."""
        acked = self.joblog.acked
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

    def _repair(self, turn: Turn) -> None:
        """Put the inbox back in order behind `turn.limit` (the trouble is journaled, or
        counted to be); from the last read that found it in order until now, no worker
        could be heard: that time is not counted as their silence."""
        assert self.token is not None
        try:
            cursor, moved, dropped = self.joblog.repair_inbox(self.token, self.cursor, turn.limit)
        except Fenced:
            self.token = None
            self._resync()
            return
        except redis.ResponseError as exc:  # no XSETID (fakeredis), an older coordinator user
            if not self._repair_refused:  # tried every turn: said once until one works
                log.error(
                    "could not repair the inbox of job %r (%s): until it is, commands wait "
                    "behind the entry ahead; on Redis >= 7 apply the coordinator role again "
                    "(cohort acl --job %s --role coordinator --apply)",
                    self.settings.job,
                    exc,
                    self.settings.job,
                )
            self._repair_refused = True
            return
        self._repair_refused = False
        log.warning(
            "inbox of job %r repaired: %d unread entries moved behind the server's clock, "
            "%d read ones ahead of it dropped; cursor %s -> %s",
            self.settings.job,
            moved,
            dropped,
            self.cursor,
            cursor,
        )
        self.cursor = cursor
        self._marks = None
        self._reported.clear()  # repaired: an entry at the same ID again is a new trouble
        if turn.ahead is not None:
            repaired_at = self.clock.now()
            self.core.seen.blind(self._clean_at, repaired_at)
            self._clean_at = repaired_at

    def _look_at_inbox(self) -> None:
        """Find unread entries someone else deleted: the inbox gone, recreated below the
        cursor, trimmed past it or XDELed (`stores.InboxMarks.lost`)."""
        try:
            marks, before = self.joblog.inbox_marks(self.cursor), self._marks
        except redis.ResponseError as exc:  # e.g. a coordinator user applied by an older cohort
            if self._marks_refused is None:
                log.error(
                    "cannot look at the inbox of job %r for lost entries (%s): apply the "
                    "coordinator role again (cohort acl --job %s --role coordinator --apply)",
                    self.settings.job,
                    exc,
                    self.settings.job,
                )
            self._marks_refused = str(exc)
            return
        self._marks = marks
        if marks is None:
            why = "the inbox was deleted" if before is not None else None
        else:
            why = marks.lost(self.cursor, before)
        if why is None:
            return
        log.error("job %r: %s; unread commands are lost (senders retry)", self.settings.job, why)
        self._trouble = InboxRepaired(
            at=self.clock.now(),
            job=self.settings.job,
            trouble="lost",
            entry=self.cursor if marks is None else max(marks.deleted, marks.first, key=id_key),
            reason=why,
        )

    # ------------------------------------------------------------ going back to the journal
    def _resync(self) -> None:
        """Forget what was decided and fold what the journal holds."""
        self.counters.resyncs += 1
        self.core.rollback()
        if not self.joblog.holds(self.journal_id):
            self._rolled_back()
            return
        self.catch_up()
        self.cursor = self.joblog.cursor()

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
        self.journal_id = ZERO
        self.archiving.points.clear()
        self._load_snapshot()
        self.catch_up()
        self.cursor = self.joblog.cursor()

    def _back(self) -> None:
        """Redis answers again: fold what the journal holds, and give every member a full
        heartbeat timeout from now, since nobody could heartbeat while Redis was away."""
        assert self._down_since is not None
        log.warning(
            "Redis is reachable again after %.1f s; %s resumes",
            self.clock.monotonic() - self._down_since,
            self.settings.coordinator,
        )
        self._resync()
        self.core.seen.excuse(list(self.state.members), self.clock.now())
        self._down_since = None

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

    # ------------------------------------------------------------ housekeeping
    def _housekeeping(self) -> None:
        """Snapshot, status, memory figures, inbox trimming: caches and views, so a server
        out of memory (which refuses them) only costs a warning."""
        try:
            if self.token is not None:
                self._archive()  # first: over maxmemory, trimming is what frees memory
            self._keep_house()
            self._oom = False
        except redis.OutOfMemoryError as exc:
            if self._oom:
                return
            self._oom = True  # one line per episode, not one per turn
            log.warning(
                "Redis is over its maxmemory (%s): the snapshot and status wait; the journal "
                "still takes facts (allow-oom). Raise maxmemory or free memory",
                exc,
            )

    def _keep_house(self) -> None:
        now = self.clock.monotonic()
        if self.token and self._facts_since_snapshot >= self.settings.snapshot_every:
            self.joblog.save_snapshot(self.token, snapshot.encode(self.state, self.journal_id))
            self._facts_since_snapshot = 0
        if now - self._status_at >= self.settings.status_interval:
            self._status_at = now
            self._publish_status()
            if self.token is not None:
                self._look_at_inbox()
        if now - self._trimmed_at >= 10.0 and self.cursor != ZERO:
            self._trimmed_at = now
            keep_ms = int((self.clock.now() - self.settings.inbox_retention) * 1000)
            self.joblog.trim_inbox(f"{min(keep_ms, id_ms(self.cursor))}-0")

    def _publish_status(self) -> None:
        """The leader's volatile view for `cohort status`; expires if the leader dies."""
        seen = self.core.seen
        last = self.joblog.inbox_end()
        lag_ms = max(0, id_ms(last) - id_ms(self.cursor)) if last != self.cursor else 0
        self._lag = lag_ms / 1000
        if self.metrics is not None:
            self.metrics.update(self.state, True, self._lag, self.clock.now())
            self.metrics.transfers(seen.transfers.values())
        body: dict[str, Any] = {
            "coordinator": self.settings.coordinator,
            "epoch": epoch_of(self.token) if self.token else 0,
            "journal_id": self.journal_id,
            "cursor": self.cursor,
            "inbox_lag_ms": lag_ms,
            "identity": self._trust is not None,
            "state_hash": state_hash(self.state),
            "at": self.clock.now(),
            "counters": {  # this process's, but the job's own refusals (journaled + tallied)
                **self.counters.__dict__,
                "forged": self.state.counters.forged + self.refusals.pending("forged"),
                "dead_letters": self.state.counters.dead_letters + self.refusals.pending(),
                "inbox_repairs": self.state.counters.inbox_repairs,
            },
            "workers": {
                w: {
                    "last_seen": seen.last_seen.get(w),
                    "progress": list(seen.progress.get(w, (-1, -1))),
                    "loss": seen.losses.get(w),
                    "figures": seen.figures.get(w, {}),
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
                    "transfers": _transfers(seen.transfers.get(w)),
                    "connections": _connections(seen, w),
                    "closed_at": seen.closed.get(w),
                }
                for w in self.state.members
            },
        }
        ttl = int(max(self.settings.status_interval * 5, 3) * 1000)
        self.joblog.publish_status(msgpack.packb(body, use_bin_type=True), ttl)
        self.joblog.publish_memory(ttl)

    def _load_snapshot(self) -> None:
        """Start from the snapshot in Redis, else from the state kept with the newest
        archived segment, else from zero: each is a cache, and a bad one is skipped."""
        for where, load in (
            ("the snapshot", self.joblog.load_snapshot),
            ("the archived state", self.joblog.archived_state),
        ):
            try:
                blob = load()
                if blob and self._restore(where, blob):
                    return
            except ArchiveError as exc:
                log.warning("ignoring %s of job %r: %s", where, self.settings.job, exc)

    def _restore(self, where: str, blob: bytes) -> bool:
        try:
            state, journal_id = snapshot.decode(blob)
        except snapshot.SnapshotUnusable as exc:
            log.warning("ignoring %s of job %r: %s", where, self.settings.job, exc)
            return False
        if not self.joblog.holds(journal_id):
            log.warning(
                "%s covers journal entry %s, which the journal does not hold; not using it",
                where,
                journal_id,
            )
            return False
        self.core.restore(state)
        self.journal_id = journal_id
        self.archiving.points.record(journal_id, state)
        return True

    # ------------------------------------------------------------ archiving
    def _archive(self) -> None:
        """One step of moving the journal's cold part to storage (coordinator/archiving.py):
        journal a segment written, or trim what journaled segments hold."""
        assert self.token is not None
        config = self.state.config
        base = self.settings.archive_uri or (config.checkpoint_uri if config else None)
        clock = self.clock
        step = self.archiving.next(self.state, self.token, base, clock.monotonic(), clock.now())
        if isinstance(step, JournalArchived):
            turn = Turn()
            self._note(turn, step)
            self._save(turn)
            self._account(turn)
        elif step is not None:
            self._trim(step)

    def _trim(self, trim: archiving.Trim) -> None:
        """Drop from Redis what the journaled segments hold, and set the archive index."""
        assert self.token is not None
        try:
            dropped = self.joblog.trim_journal(self.token, trim.keep, trim.index)
        except Fenced:
            self.token = None
            self._resync()
            return
        except redis.ResponseError as exc:
            self.archiving.trimmed(trim.keep, self.state.facts)  # said once; the next tries
            log.error("could not trim the journal of job %r: %s", self.settings.job, exc)
            return
        self.archiving.trimmed(trim.keep, self.state.facts)
        log.info(
            "journal of job %r: %d entries before %s dropped from Redis (%d archived facts "
            "in %d segments)",
            self.settings.job,
            dropped,
            trim.keep,
            self.state.archived_facts,
            len(self.state.archived),
        )


def _connections(seen: Liveness, worker: str) -> str:
    """What the leader's last reading said of `worker`'s connections: "open", "closed" (none
    since `closed_at`: it is failed once the grace passes) or "unwatched" (never seen with
    one: judged by its silence alone)."""
    if worker in seen.closed:
        return "closed"
    return "open" if worker in seen.connected_once else "unwatched"


def _transfers(waiting: TransfersWaiting | None) -> dict[str, float] | None:
    """A worker's transfer queue as it last said (None: it never did)."""
    if waiting is None:
        return None
    return {"pending": waiting.pending, "staged": waiting.staged, "delayed": waiting.delayed}


def _raw_of(entry: Entry) -> bytes:
    if entry.raw is not None:
        return entry.raw
    return msgpack.packb({k: v for k, v in entry.fields.items()}, use_bin_type=True)


def _size(entry: Entry) -> int:
    return sum(map(len, entry.fields)) + sum(map(len, entry.fields.values()))


class _Refused(DecodeError):
    """Control flow inside the leader's read: an entry refused for a reason of `kind` (the
    tally's, `CommandsRefused`), which becomes its dead letter; never raised to a caller."""

    def __init__(self, reason: str, kind: RefusalKind) -> None:
        super().__init__(reason)
        self.kind: RefusalKind = kind


def _letter(entry: Entry, exc: DecodeError) -> DeadLetter:
    """The bounded dead letter of an entry refused with `exc`."""
    signer = exc.signer if isinstance(exc, ForgedCommandError) else None
    kind: RefusalKind = "forged" if isinstance(exc, ForgedCommandError) else "malformed"
    if isinstance(exc, _Refused):
        kind = exc.kind
    sender = (signer, True) if signer is not None else (claimed_sender(entry), False)
    raw = b"" if kind == "oversized" else _raw_of(entry)
    return DeadLetter.of(entry.id, exc.reason, raw, kind, sender, _size(entry))


def _no_field(entry: Entry) -> DecodeError:
    names = sorted(k.decode(errors="replace") for k in entry.fields)[:8]
    return DecodeError(f"entry has no 'e' field (fields: {names})")
