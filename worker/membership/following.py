"""Following the journal: a worker's tail thread folds every fact into a frozen View.

The view is published once per reply, because the facts of one coordinator decision arrive
together (StepCommitted, WorkerActivated, WorldChanged) and a waiter must never see half a
decision. The training loop's blocking calls wait on the follower's condition (`wait`),
never by sleeping. A fact this worker cannot read is logged and skipped; a journal that
lost what was folded (a Redis failover) is folded again from the start, and what the leader
archived while this worker lagged behind is read from the archive (events/archive.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from cohort.events.archive import HOLE_AT, History
from cohort.events.errors import DecodeError
from cohort.events.keys import Keys
from cohort.events.models import Fact
from cohort.events.streams import ZERO, Entry, Journal, StreamReader, elects
from cohort.worker.errors import RemovedError, Stopped
from cohort.worker.membership import view as views
from cohort.worker.membership.retry import Halt, Link, with_retry
from cohort.worker.membership.view import View

TAIL_BLOCK_MS = 500  # bounds how long stopping waits for the tail thread
HISTORY_BATCH = 2048
STOP_POLL = 0.1  # how often a wait that a signal may end looks at its stop event

Read = Sequence[Fact | DecodeError]  # a reply's entries as `Journal.read_page` reads them


class JournalFollower:
    """One worker's View of job `job`'s journal, kept current by the tail thread (`run`).

    Each published view sets `world_changed` when it brings a new world, `config_changed`
    when the job's config changed, and calls `advice_changed(view)` when this worker's GPU
    advice did. Everything ends once `stop` is set.
    """

    def __init__(
        self,
        journal: Journal,
        job: str,
        worker: str,
        link: Link,
        stop: threading.Event,
        log: logging.Logger,
        world_changed: threading.Event,
        config_changed: threading.Event,
        advice_changed: Callable[[View], None],
    ) -> None:
        self.journal = journal
        self.history = History(journal, Keys(job))  # the journal with its archived part
        self.job = job
        self.worker = worker
        self.link = link
        self.log = log
        self.world_changed = world_changed
        self._stop = stop
        self._config_changed = config_changed
        self._advice_changed = advice_changed
        self._cond = threading.Condition()
        self._view = View(worker=worker)
        self._position = ZERO  # journal ID folded up to
        self._undecodable: set[str] = set()  # kinds of entries already logged as unreadable

    @property
    def view(self) -> View:
        with self._cond:
            return self._view

    def catch_up(self, deadline: float | None, halt: Halt) -> None:
        """Fold the journal as it is now, each read retried through outages until `deadline`
        or `halt`; `run` follows it from there."""
        last = with_retry(
            self.journal.last_id, halt, self.link, "reading the journal", deadline=deadline
        )
        for rows in self._pages(ZERO, last, deadline, halt):
            self._fold(rows, Journal.read_page(rows))
        with self._cond:
            self._position = last

    def run(self) -> None:
        """The tail thread: follow the journal (XREAD BLOCK) until `stop` is set."""
        reader = self.journal.reader()  # a connection of its own (not on Redis Cluster)
        try:
            self._follow(reader or self.journal)
        finally:
            if reader is not None:
                reader.close()

    def _follow(self, reader: Journal | StreamReader) -> None:
        while not self._stop.is_set():
            try:
                rows = with_retry(
                    lambda: reader.tail(self._position, TAIL_BLOCK_MS),
                    self._stop,
                    self.link,
                    "following the journal",
                )
                if not rows:
                    continue
                if len(rows) >= HOLE_AT and self._skipped_a_trim():
                    continue
                read = Journal.read_page(rows)
                if self._rolled_back(read):
                    self._refold()
                    continue
                self._fold(rows, read)
            except Stopped:
                return
            except Exception:
                self.log.exception("worker %s could not follow the journal; retrying", self.worker)
                self._stop.wait(1.0)

    def wait(
        self,
        done: Callable[[View], bool],
        deadline: float,
        timeout_error: Callable[[], Exception],
        check_removed: bool = True,
        removed_first: bool = True,
        stop: threading.Event | None = None,
    ) -> View:
        """Block until `done(view)`; raise RemovedError (if asked), Stopped (also once `stop` is
        set), or the timeout error."""
        with self._cond:
            while True:
                view = self._view
                if check_removed and removed_first and view.removed:
                    raise RemovedError(self.worker, view.removed_reason)
                if done(view):
                    return view
                if check_removed and view.removed:
                    raise RemovedError(self.worker, view.removed_reason)
                if self._stop.is_set() or (stop is not None and stop.is_set()):
                    raise Stopped(f"worker {self.worker!r} was stopped")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise timeout_error()
                # `stop` is set by a signal handler, which must not take the condition's lock
                # (it may interrupt this very thread inside it): look at it every STOP_POLL s.
                self._cond.wait(remaining if stop is None else min(remaining, STOP_POLL))

    def wake_waiters(self) -> None:
        """Make every `wait` look again (at `stop`, say)."""
        with self._cond:
            self._cond.notify_all()

    def _fold(self, rows: list[Entry], read: Read) -> None:
        """Apply a reply's entries, then publish the view and wake waiters once."""
        with self._cond:
            before = self._view
            view = self._evolved(before, rows, read)
            self._view = view
            self._position = rows[-1].id
            if view.world_version > before.world_version:
                self.world_changed.set()
            if view.config is not before.config:
                self._config_changed.set()
            self._cond.notify_all()
        if view.advice != before.advice:
            self._advice_changed(view)

    def _evolved(self, view: View, rows: list[Entry], read: Read) -> View:
        """`view` after the facts of `rows`; an entry this worker cannot read is skipped."""
        for entry, fact in zip(rows, read, strict=True):
            if isinstance(fact, DecodeError):
                self._skip(entry, fact)
            else:
                view = views.evolve(view, fact)
        return view

    def _skip(self, entry: Entry, exc: DecodeError) -> None:
        """Log an entry this worker cannot read: a warning the first time for its kind (its
        event type, or for an entry that names none, why it cannot be read), then debug."""
        kind = exc.event_type if exc.event_type is not None else exc.reason
        level = logging.DEBUG if kind in self._undecodable else logging.WARNING
        self._undecodable.add(kind)
        self.log.log(
            level, "skipping journal entry %s this worker cannot read: %s", entry.id, exc.reason
        )

    def _rolled_back(self, read: Read) -> bool:
        """True if a new leader's entries arrive and the journal no longer holds the entry
        this worker folded up to: Redis lost acknowledged facts (a failover to a lagging
        replica), and the coordinators have folded the journal again (docs/redis-ha.md)."""
        position = self._position
        if position == ZERO or not elects(read):
            return False
        held = with_retry(
            lambda: self.history.intact(position), self._stop, self.link, "checking the journal"
        )
        return not held

    def _skipped_a_trim(self) -> bool:
        """After a reply long enough to have skipped a trim (events/archive.py): if Redis no
        longer holds the entry read after, fold what followed it from the archive and
        return True (the reply is read again after that)."""
        position = self._position
        intact = with_retry(
            lambda: self.history.intact(position), self._stop, self.link, "checking the journal"
        )
        if intact:
            return False
        self.log.warning(
            "worker %s fell behind the journal's trim at %s; reading the archived part",
            self.worker,
            position,
        )
        for rows in self._pages(position):
            self._fold(rows, Journal.read_page(rows))
        return True

    def _refold(self) -> None:
        """Rebuild the view from the journal as it is now and publish it at once."""
        self.log.error(
            "worker %s: the journal of job %r lost entry %s and later ones (a Redis failover "
            "with asynchronous replication?); folding it again from the start",
            self.worker,
            self.job,
            self._position,
        )
        view, after = View(worker=self.worker), ZERO
        for rows in self._pages(ZERO):
            view, after = self._evolved(view, rows, Journal.read_page(rows)), rows[-1].id
        with self._cond:
            self._view = view
            self._position = after
            self.world_changed.set()
            self._cond.notify_all()

    def _pages(
        self,
        after: str,
        until: str = "+",
        deadline: float | None = None,
        halt: Halt | None = None,
    ) -> Iterator[list[Entry]]:
        """The journal after `after`, a page at a time, each read retried through outages."""
        stop = self._stop if halt is None else halt

        def attempt(read: Callable[[], list[Entry]]) -> list[Entry]:
            return with_retry(read, stop, self.link, "reading the journal", deadline=deadline)

        return self.history.pages(after, until, HISTORY_BATCH, attempt=attempt)
