"""Moving the journal's cold part out of Redis: when, up to where, and the writing thread.

A job's journal gains a fact per step, for months. With `--journal-hot FACTS` and a storage
URI (`--archive-uri`, else the job's checkpoint URI) the leader keeps at most about FACTS
facts in Redis, in three steps, each after the one before is durable:

1. a segment file in storage holds the facts after the last archived one up to a point P
   (and the state as of P), written whole under a name fixed by its first entry;
2. a `JournalArchived` fact names it, with its sha256, in the journal (an ordinary fenced
   append, so `--wait-replicas` covers it);
3. one fenced call drops the journal's entries before P (XTRIM MINID P) and sets the job's
   archive index (events/archive.py), which names every segment.

A crash before 2 leaves a file nothing names (the next attempt writes the same name again);
between 2 and 3 the next leader finds the last archived entry still in Redis and trims;
nothing is ever trimmed that a journaled segment does not hold. P is a point the leader
folded (`Points`), chosen so that at least half of FACTS stay in Redis: a follower that falls
that far behind finds what it missed in the segments (`archive.History`).

The file is written on a thread of its own, so a slow object store never holds up a turn.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from cohort.coordinator import snapshot
from cohort.coordinator.state import JobState
from cohort.events import archive
from cohort.events.models import JournalArchived
from cohort.events.streams import ZERO, Entry, id_after

log = logging.getLogger("cohort.coordinator")

DEFAULT_HOT = 100_000
MIN_HOT = 2 * archive.HOLE_AT
"""The smallest --journal-hot: half of it stays in Redis after a trim, and readers rely on
at least `archive.HOLE_AT` entries there."""
POINTS_PER_HOT = 20
"""States remembered per --journal-hot facts: the trim point is chosen among them."""
RETRY_S = 30.0
"""Seconds before a segment that could not be written is tried again."""


@dataclass(frozen=True, slots=True)
class Point:
    """The state as of journal entry `journal_id`: where a segment may end."""

    journal_id: str
    state: JobState


class Points:
    """States the coordinator folded, one every `hot // POINTS_PER_HOT` facts."""

    def __init__(self, hot: int) -> None:
        self.grain = max(1, hot // POINTS_PER_HOT)
        self._kept: deque[Point] = deque(maxlen=4 * POINTS_PER_HOT)

    def record(self, journal_id: str, state: JobState) -> None:
        if journal_id == ZERO:
            return
        if self._kept and state.facts - self._kept[-1].state.facts < self.grain:
            return
        self._kept.append(Point(journal_id, state))

    def clear(self) -> None:
        """Forget every point (the journal lost entries they include)."""
        self._kept.clear()

    def choose(self, state: JobState, hot: int, early: int = 0) -> Point | None:
        """Where the next segment ends: the newest point past the last archived entry that
        leaves at least half of `hot` facts after it; None if archiving is not due yet (fewer
        than `hot` facts in Redis, less `early`: what the job appends while a segment is
        written, journaled and trimmed) or no point qualifies."""
        if state.facts - state.archived_facts < hot - min(early, hot // 2):
            return None
        last = state.archived[-1].last if state.archived else ZERO
        keep = max(hot // 2, archive.HOLE_AT)
        chosen = None
        for point in self._kept:
            if id_after(point.journal_id, last) and state.facts - point.state.facts >= keep:
                chosen = point
        return chosen


@dataclass(frozen=True, slots=True)
class Plan:
    """A segment to write: the entries after `since` up to `point`, `facts` of them."""

    job: str
    base: str
    since: str
    point: Point
    facts: int
    token: str
    at: float


class Archiver:
    """Writes one segment at a time on a thread of its own; the leader's loop submits a plan
    and later takes the fact that journals it (or the error that stopped it)."""

    def __init__(self, read: Callable[[str, str], list[Entry]]) -> None:
        self.read = read
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cohort-archive")
        self._running: tuple[Plan, Future[JournalArchived]] | None = None

    @property
    def busy(self) -> bool:
        return self._running is not None

    def submit(self, plan: Plan) -> None:
        assert self._running is None
        self._running = (plan, self._pool.submit(self._write, plan))

    def take(self) -> tuple[Plan, JournalArchived | BaseException] | None:
        """The plan that finished and its fact (or error); None while one still runs."""
        if self._running is None or not self._running[1].done():
            return None
        (plan, future), self._running = self._running, None
        error = future.exception()
        return plan, error if error is not None else future.result()

    def _write(self, plan: Plan) -> JournalArchived:
        point = plan.point
        entries = self.read(plan.since, point.journal_id)
        if len(entries) != plan.facts or not entries or entries[-1].id != point.journal_id:
            raise archive.ArchiveError(
                f"the journal of job {plan.job!r} holds {len(entries)} entries after "
                f"{plan.since} up to {point.journal_id}, not the {plan.facts} folded; "
                "not archiving them"
            )
        state = snapshot.encode(point.state, point.journal_id)
        return archive.write_segment(plan.base, plan.job, entries, state, plan.at)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass(frozen=True, slots=True)
class Trim:
    """Drop the journal's entries before `keep` (it stays) and set the archive index."""

    keep: str
    index: bytes


class Archiving:
    """The leader's side of archiving, one step per turn (`next`): the fact that journals a
    segment just written, the trim that journaled segments allow, or nothing (and maybe a
    segment started on the writing thread). The coordinator's loop does the journal's I/O
    and says how a trim went (`trimmed`)."""

    def __init__(self, hot: int, read: Callable[[str, str], list[Entry]]) -> None:
        self.hot = hot
        self.points = Points(hot)
        self._read = read
        self._archiver: Archiver | None = None  # started once there is storage
        self._trimmed_to: str | None = None  # the archived entry Redis was trimmed to
        self._retry_at = 0.0  # monotonic time before which no segment is tried again
        self._started_at = 0  # the facts folded when the last segment was started
        self.early = 0
        """Facts the job appended between starting the last segment and trimming it: the
        next one starts that much before Redis holds `hot`, so it stays under `hot`."""

    def next(
        self, state: JobState, token: str, base: str | None, monotonic: float, now: float
    ) -> JournalArchived | Trim | None:
        """What the leader holding `token` does next, with storage at `base` (None: none)."""
        if base is None:
            return None
        archiver = self._archiver = self._archiver or Archiver(self._read)
        taken = archiver.take()
        if taken is not None:
            written = self._written(state, token, *taken, monotonic)
            if written is not None:
                return written
        if state.archived and self._trimmed_to != state.archived[-1].last:
            return Trim(state.archived[-1].last, archive.encode_index(state.archived))
        if not archiver.busy and monotonic >= self._retry_at:
            self._start(state, token, base, now)
        return None

    def trimmed(self, keep: str, facts: int) -> None:
        """Redis was trimmed to `keep` with `facts` folded (or the trim failed, and waits for
        the next segment)."""
        if self._trimmed_to != keep and self._started_at:
            self.early = max(0, facts - self._started_at)
        self._trimmed_to = keep

    def lead(self) -> None:
        """A new lease: a leader before may have journaled a segment and not trimmed."""
        self._trimmed_to = None

    def _written(
        self,
        state: JobState,
        token: str,
        plan: Plan,
        written: JournalArchived | BaseException,
        monotonic: float,
    ) -> JournalArchived | None:
        """The fact for a segment written, if it still follows the last archived one and
        this lease wrote it; an error is logged and the segment tried again later."""
        if isinstance(written, BaseException):
            self._retry_at = monotonic + RETRY_S
            log.error(
                "could not archive the journal of job %r up to %s (%s); it stays in Redis, "
                "and archiving is tried again in %.0f s",
                plan.job,
                plan.point.journal_id,
                written,
                RETRY_S,
            )
            return None
        last = state.archived[-1].last if state.archived else ZERO
        if plan.token != token or plan.since != last:
            return None  # written under another lease or before a resync: written again
        return written

    def _start(self, state: JobState, token: str, base: str, now: float) -> None:
        point = self.points.choose(state, self.hot, self.early)
        if point is None or self._archiver is None:
            return
        self._started_at = state.facts
        since = state.archived[-1].last if state.archived else ZERO
        facts = point.state.facts - state.archived_facts
        self._archiver.submit(Plan(state.job, base, since, point, facts, token, now))

    def close(self) -> None:
        if self._archiver is not None:
            self._archiver.close()
            self._archiver = None
