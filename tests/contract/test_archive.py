"""The journal's cold part in storage: the leader archives, journals, then trims; every reader
sees one journal; a crash between any two steps loses nothing (coordinator/archiving.py)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cohort.coordinator.audit import audit
from cohort.coordinator.fold import fold
from cohort.coordinator.replay import ReplayError, export, from_redis, rebuild
from cohort.coordinator.service import Coordinator, ServiceSettings
from cohort.events.archive import ArchiveError, History
from cohort.events.keys import Keys
from cohort.events.models import JobConfig, Join, JournalArchived, StepDone, WeightsLoaded
from cohort.events.streams import ZERO, Entry, Inbox, Journal
from cohort.worker.membership import view as views
from cohort.worker.membership.following import JournalFollower
from cohort.worker.membership.retry import Link
from cohort.worker.membership.view import View

JOB = "arch"
HOT = 200  # the smallest --journal-hot: a trim leaves at least 100 facts in Redis


class Crash(BaseException):
    """A coordinator process dying at this point (nothing after it runs)."""


def settings(name: str, storage: Path) -> ServiceSettings:
    return ServiceSettings(
        job=JOB,
        coordinator=name,
        config=JobConfig(min_workers=1, dataset_size=1_000_000, batch_size=1),
        lease_ms=2000,
        block_ms=5,
        snapshot_every=50,
        allow_volatile=True,
        allow_eviction=True,
        journal_hot=HOT,
        archive_uri=str(storage),
    )


class Job:
    """One worker's steps sent straight to the inbox, a coordinator deciding them, and a
    copy of every journal entry as it was appended (what an unarchived job would hold)."""

    def __init__(self, conn, storage: Path) -> None:  # type: ignore[no-untyped-def]
        self.conn = conn
        self.storage = storage
        self.keys = Keys(JOB)
        self.inbox = Inbox(conn, self.keys.inbox)
        self.journal = Journal(conn, self.keys.journal)
        self.copy: list[Entry] = []
        self.step = 0

    def lead(self, name: str) -> Coordinator:
        self.conn.delete(self.keys.leader)  # the previous leader's lease ran out
        coordinator = Coordinator.on_redis(self.conn, settings(name, self.storage))
        coordinator.start()
        self.until(coordinator, lambda: coordinator.leading, "takes the lease")
        return coordinator

    def train(self, coordinator: Coordinator, steps: int) -> None:
        if self.step == 0:
            self.inbox.send(Join(at=0, job=JOB, worker="a"))
            self.inbox.send(WeightsLoaded(at=0, job=JOB, worker="a"))
        for _ in range(steps):
            self.inbox.send(StepDone(at=0, job=JOB, worker="a", step=self.step, world=1))
            self.step += 1
            self.until(coordinator, lambda: coordinator.state.last_committed == self.step - 1)

    def until(self, coordinator: Coordinator, done: Callable[[], bool], what: str = "") -> None:
        deadline = time.monotonic() + 30
        while not done():
            assert time.monotonic() < deadline, f"{coordinator.settings.coordinator} {what}"
            coordinator.step()
            self.record()

    def record(self) -> None:
        after = self.copy[-1].id if self.copy else ZERO
        self.copy += [e for page in self.journal.pages(after) for e in page]

    def archived(self, coordinator: Coordinator, segments: int) -> None:
        """Lead until `segments` segments are journaled and trimmed."""
        self.until(
            coordinator,
            lambda: (
                len(coordinator.state.archived) >= segments
                and self.held()[0] == coordinator.state.archived[-1].last
            ),
            f"archives {segments} segments",
        )

    def held(self) -> list[str]:
        return [e.id for page in self.journal.pages() for e in page]

    def whole(self) -> list[Entry]:
        return [e for page in History.of(self.conn, JOB).pages() for e in page]


@pytest.fixture
def job(conn, tmp_path: Path) -> Job:  # type: ignore[no-untyped-def]
    return Job(conn, tmp_path / "storage")


def test_redis_keeps_a_hot_tail_and_the_archive_with_it_is_the_whole_journal(job: Job) -> None:
    leader = job.lead("c1")
    job.train(leader, 700)
    job.archived(leader, 2)
    job.record()
    held = job.held()
    assert HOT // 2 <= len(held) <= HOT + 60, len(held)
    whole = job.whole()
    assert whole == job.copy  # every entry, once, in order, byte for byte
    facts = Journal.decode_page(whole)
    assert fold(facts) == leader.state
    segments = [f for f in facts if isinstance(f, JournalArchived)]
    assert [s.first for s in segments[1:]] == [
        whole[[e.id for e in whole].index(s.last) + 1].id for s in segments[:-1]
    ]  # each segment starts right after the one before
    assert all(Path(s.uri).is_file() for s in segments)


def test_replay_audit_and_export_of_an_archived_job_equal_those_of_the_whole_journal(
    job: Job, tmp_path: Path
) -> None:
    leader = job.lead("c1")
    job.train(leader, 500)
    job.archived(leader, 1)
    job.record()
    run = from_redis(job.conn, JOB)
    assert run.journal == job.copy
    state, timeline = rebuild(run)
    assert state == leader.state
    whole = Journal.decode_page(job.copy)
    assert [f for _, f in timeline] == whole
    assert audit(f for _, f in timeline) == audit(whole)
    with (tmp_path / "a.export").open("wb") as out:
        export(run, out, 1.0)
    run.journal = job.copy
    with (tmp_path / "b.export").open("wb") as out:
        export(run, out, 1.0)
    assert (tmp_path / "a.export").read_bytes() == (tmp_path / "b.export").read_bytes()


def test_a_new_leader_with_no_snapshot_starts_from_the_archived_state(job: Job) -> None:
    leader = job.lead("c1")
    job.train(leader, 500)
    job.archived(leader, 1)
    job.conn.delete(job.keys.snapshot)
    again = job.lead("c2")
    assert again.state.archived == leader.state.archived
    job.train(again, 5)
    assert fold(Journal.decode_page(job.whole())) == again.state


def test_a_changed_segment_is_named_and_never_skipped(job: Job) -> None:
    leader = job.lead("c1")
    job.train(leader, 500)
    job.archived(leader, 1)
    segment = leader.state.archived[0]
    Path(segment.uri).write_bytes(Path(segment.uri).read_bytes()[:-10])
    with pytest.raises(ArchiveError, match="not the journaled") as caught:
        job.whole()
    assert segment.uri in str(caught.value)
    with pytest.raises(ReplayError, match=segment.first):
        from_redis(job.conn, JOB)
    Path(segment.uri).unlink()
    with pytest.raises(ArchiveError, match="cannot be read"):
        job.whole()


def _segment_written(job: Job, leader: Coordinator) -> None:
    """Dies once the segment file is whole, before the leader journals it."""
    written: list[object] = []
    journal_it = leader.archiving._written

    def crash(*args: Any) -> JournalArchived | None:
        fact = journal_it(*args)
        if fact is not None:
            written.append(fact)
            raise Crash
        return fact

    leader.archiving._written = crash  # type: ignore[method-assign]
    with pytest.raises(Crash):
        job.train(leader, 1000)
    (fact,) = written
    assert isinstance(fact, JournalArchived) and Path(fact.uri).is_file()


def _journaled(job: Job, leader: Coordinator) -> None:
    """Dies after journaling the segment, before trimming."""

    def crash(*_: object) -> int:
        raise Crash

    leader.joblog.trim_journal = crash  # type: ignore[method-assign]
    with pytest.raises(Crash):
        job.train(leader, 1000)
    (segment,) = [
        f for f in Journal.decode_page(job.journal.range()) if isinstance(f, JournalArchived)
    ]
    assert job.held()[0] == segment.first  # journaled, not trimmed


def _trimmed(job: Job, leader: Coordinator) -> None:
    """Dies right after a trim."""
    job.train(leader, 250)
    job.archived(leader, 1)


@pytest.mark.parametrize("crash", [_segment_written, _journaled, _trimmed])
def test_a_leader_dying_between_any_two_steps_of_archiving_loses_nothing(
    job: Job, crash: Callable[[Job, Coordinator], None]
) -> None:
    first = job.lead("c1")
    crash(job, first)
    job.record()
    second = job.lead("c2")
    job.train(second, 300)
    job.archived(second, 2)
    job.record()
    whole = job.whole()
    assert whole == job.copy
    facts = Journal.decode_page(whole)
    assert fold(facts) == second.state
    assert second.state.last_committed == job.step - 1
    assert audit(facts).ok
    segments = second.state.archived
    assert sum(s.facts for s in segments) == [e.id for e in whole].index(segments[-1].last) + 1


def _follower(job: Job, stop: threading.Event) -> JournalFollower:
    log = logging.getLogger("cohort.worker")
    return JournalFollower(
        job.journal,
        JOB,
        "a",
        Link(log, "test"),
        stop,
        log,
        world_changed=threading.Event(),
        config_changed=threading.Event(),
        advice_changed=lambda view: None,
    )


def test_a_worker_starting_on_an_archived_journal_folds_it_whole(job: Job) -> None:
    leader = job.lead("c1")
    job.train(leader, 500)
    job.archived(leader, 1)
    follow = _follower(job, threading.Event())
    follow.catch_up(None, threading.Event())
    assert follow.view == views.fold(Journal.decode_page(job.whole()), View(worker="a"))


def test_a_worker_that_fell_behind_a_trim_reads_what_it_missed_from_the_archive(
    job: Job, caplog: pytest.LogCaptureFixture
) -> None:
    leader = job.lead("c1")
    job.train(leader, 20)
    stop = threading.Event()
    follow = _follower(job, stop)
    follow.catch_up(None, threading.Event())  # then it stops reading (a suspended process)
    behind = follow._position
    job.train(leader, 500)
    job.archived(leader, 1)
    assert not job.conn.xrange(job.keys.journal, behind, behind)  # trimmed past it
    tail = threading.Thread(target=follow.run, daemon=True)
    tail.start()
    try:
        end = leader.state.last_committed
        follow.wait(lambda v: v.last_committed == end, time.monotonic() + 30, TimeoutError)
    finally:
        stop.set()
        tail.join(timeout=5)
    assert follow.view == views.fold(Journal.decode_page(job.whole()), View(worker="a"))
    assert "fell behind the journal's trim" in caplog.text
