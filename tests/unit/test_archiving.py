"""When the journal's cold part leaves Redis, and up to where (coordinator/archiving.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cohort.coordinator.archiving import RETRY_S, Archiving, Points, Trim
from cohort.coordinator.state import JobState
from cohort.events.archive import read_segment
from cohort.events.codec import FIELD, encode
from cohort.events.models import JournalArchived, StepCommitted
from cohort.events.streams import Entry

HOT = 1000


def entry(n: int) -> Entry:
    return Entry(f"{n}-0", {FIELD: encode(StepCommitted(at=0, job="j", step=n, world=1))})


def state(facts: int, archived_to: int = 0) -> JobState:
    segments = ()
    if archived_to:
        segment = JournalArchived(
            at=0, job="j", first="1-0", last=f"{archived_to}-0", facts=archived_to,
            uri="/x", sha256="0" * 64, bytes=1,
        )  # fmt: skip
        segments = (segment,)
    return JobState(job="j", facts=facts, archived=segments)


def points_every(step: int, upto: int) -> Points:
    points = Points(HOT)
    for n in range(step, upto + 1, step):
        points.record(f"{n}-0", state(n))
    return points


def test_nothing_is_archived_until_redis_holds_journal_hot_facts() -> None:
    points = points_every(50, HOT - 1)
    assert points.choose(state(HOT - 1), HOT) is None
    assert points.choose(state(HOT), HOT) is not None


def test_archiving_starts_early_by_what_the_job_appends_while_a_segment_is_archived() -> None:
    points = points_every(50, 950)
    assert points.choose(state(899), HOT, early=100) is None
    chosen = points.choose(state(900), HOT, early=100)
    assert chosen is not None and chosen.journal_id == "400-0"
    assert points.choose(state(499), HOT, early=10_000) is None  # at most half of hot early


def test_the_segment_ends_at_the_newest_point_that_leaves_half_of_journal_hot_in_redis() -> None:
    points = points_every(50, 1200)
    chosen = points.choose(state(1200), HOT)
    assert chosen is not None and chosen.journal_id == "700-0"  # 500 facts after it


def test_a_segment_never_ends_at_or_before_the_last_archived_entry() -> None:
    points = points_every(50, 1600)
    assert points.choose(state(1600, archived_to=700), HOT) is None  # 900 in Redis: not due
    assert points.choose(state(2700, archived_to=1600), HOT) is None  # due; no point past it
    chosen = points.choose(state(1800, archived_to=700), HOT)
    assert chosen is not None and chosen.journal_id == "1300-0"


def test_points_are_recorded_once_per_twentieth_of_journal_hot() -> None:
    points = Points(HOT)
    for n in range(1, 201):
        points.record(f"{n}-0", state(n))
    assert [p.state.facts for p in points._kept] == [1, 51, 101, 151]


def wait_for(archiving: Archiving, *args: object) -> JournalArchived | Trim | None:
    """`archiving.next(*args)` once the segment on the writing thread is written or failed."""
    running = archiving._archiver._running if archiving._archiver else None
    if running is not None:
        running[1].exception(timeout=10)  # waits for the thread, whatever its outcome
    return archiving.next(*args)  # type: ignore[arg-type]


@pytest.fixture
def journal() -> list[Entry]:
    return [entry(n) for n in range(1, 1201)]


def reader(journal: list[Entry]):  # type: ignore[no-untyped-def]
    def read(after: str, until: str) -> list[Entry]:
        low = 0 if after == "0-0" else int(after.split("-")[0])
        high = int(until.split("-")[0])
        return [e for e in journal if low < int(e.id.split("-")[0]) <= high]

    return read


def folded(held: list[Entry]) -> Archiving:
    """A leader that folded 1,200 facts (a point every 50) over a journal holding `held`."""
    archiving = Archiving(HOT, reader(held))
    for n in range(50, 1201, 50):
        archiving.points.record(f"{n}-0", state(n))
    return archiving


def test_a_written_segment_is_journaled_then_trimmed_until_the_trim_is_done(
    journal: list[Entry], tmp_path: Path
) -> None:
    archiving = folded(journal)
    now = state(1200)
    assert archiving.next(now, "1:c", str(tmp_path), 0.0, 0.0) is None  # the thread starts
    fact = wait_for(archiving, now, "1:c", str(tmp_path), 0.0, 0.0)
    assert isinstance(fact, JournalArchived) and (fact.first, fact.last) == ("1-0", "700-0")
    entries, _ = read_segment(fact)
    assert entries == journal[:700]
    journaled = JobState(job="j", facts=1201, archived=(fact,))
    trim = archiving.next(journaled, "1:c", str(tmp_path), 0.0, 0.0)
    assert isinstance(trim, Trim) and trim.keep == "700-0"
    assert archiving.next(journaled, "1:c", str(tmp_path), 0.0, 0.0) == trim  # until done
    archiving.trimmed(trim.keep, 1250)
    assert archiving.early == 50  # the facts appended between starting the segment and now
    assert archiving.next(journaled, "1:c", str(tmp_path), 0.0, 0.0) is None
    archiving.lead()  # a new lease: it trims again, as its predecessor may not have
    assert archiving.next(journaled, "2:c", str(tmp_path), 0.0, 0.0) == trim


def test_a_segment_written_under_another_lease_is_not_journaled(
    journal: list[Entry], tmp_path: Path
) -> None:
    archiving = folded(journal)
    archiving.next(state(1200), "1:c", str(tmp_path), 0.0, 0.0)
    assert wait_for(archiving, state(1200), "2:c", str(tmp_path), 0.0, 0.0) is None  # lease 1's
    again = archiving._archiver._running if archiving._archiver else None
    assert again is not None and again[0].token == "2:c"  # written again under lease 2
    assert isinstance(
        wait_for(archiving, state(1200), "2:c", str(tmp_path), 0.0, 0.0), JournalArchived
    )


def test_a_segment_that_cannot_be_written_is_tried_again_after_a_pause(
    journal: list[Entry], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    archiving = folded(journal[:-600])  # Redis holds fewer than were folded
    archiving.next(state(1200), "1:c", str(tmp_path), 0.0, 0.0)
    assert wait_for(archiving, state(1200), "1:c", str(tmp_path), 1.0, 0.0) is None
    assert "not the 700 folded" in caplog.text
    assert archiving._archiver is not None and not archiving._archiver.busy
    archiving.next(state(1200), "1:c", str(tmp_path), RETRY_S, 0.0)
    assert not archiving._archiver.busy  # not before RETRY_S from the failure
    archiving.next(state(1200), "1:c", str(tmp_path), 1.0 + RETRY_S, 0.0)
    assert archiving._archiver.busy


def test_the_command_line_refuses_a_journal_hot_below_what_readers_rely_on() -> None:
    from cohort.commands.coordinator import coordinator
    from cohort.coordinator.archiving import MIN_HOT

    (option,) = [p for p in coordinator.params if p.name == "journal_hot"]
    assert option.type.min == MIN_HOT  # type: ignore[attr-defined]
