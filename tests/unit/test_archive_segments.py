"""Archived journal segments (events/archive.py): written whole, read back byte for byte, and
any file that is not the one the journal names is refused, naming it."""

from __future__ import annotations

from pathlib import Path

import fakeredis
import pytest

from cohort.events import archive, storage
from cohort.events.archive import ArchiveError, History, read_segment, write_segment
from cohort.events.codec import FIELD
from cohort.events.keys import Keys
from cohort.events.models import JournalArchived
from cohort.events.streams import Entry

ENTRIES = [Entry(f"{n}-{n % 3}", {FIELD: b"fact %d" % n}) for n in range(1, 51)]


def written(tmp_path: Path) -> JournalArchived:
    return write_segment(str(tmp_path), "j", ENTRIES, b"state", at=1.0)


def test_a_segment_reads_back_its_entries_and_the_state_byte_for_byte(tmp_path: Path) -> None:
    segment = written(tmp_path)
    assert (segment.first, segment.last, segment.facts) == ("1-1", "50-2", 50)
    assert segment.uri == f"{tmp_path}/journal/j/1-1.segment"
    assert read_segment(segment) == (ENTRIES, b"state")


def test_a_segment_changed_after_it_was_journaled_is_refused_naming_it(tmp_path: Path) -> None:
    segment = written(tmp_path)
    path = Path(segment.uri)
    path.write_bytes(path.read_bytes().replace(b"fact 7", b"fact 8"))
    with pytest.raises(ArchiveError, match="not the journaled") as caught:
        read_segment(segment)
    assert segment.uri in str(caught.value) and "1-1..50-2" in str(caught.value)


def test_another_segment_under_the_journaled_name_and_digest_is_refused(tmp_path: Path) -> None:
    other = write_segment(str(tmp_path), "j", ENTRIES[:10], b"", at=1.0)  # same name, fewer
    claimed = other.model_copy(update={"last": "50-2", "facts": 50})
    with pytest.raises(ArchiveError, match="not the journaled"):
        read_segment(claimed)


def test_a_missing_segment_is_named_at_once(tmp_path: Path) -> None:
    segment = written(tmp_path)
    Path(segment.uri).unlink()
    with pytest.raises(ArchiveError, match="cannot be read"):
        read_segment(segment)


def test_storage_that_fails_for_a_while_is_read_again_with_backoff(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    segment = written(tmp_path)
    real, failures = storage.read_whole, [2]

    def flaky(uri: str, what: str = "file") -> bytes:
        if failures[0]:
            failures[0] -= 1
            raise storage.StorageError(f"cannot read {what} {uri!r}: timed out")
        return real(uri, what)

    monkeypatch.setattr(storage, "read_whole", flaky)
    monkeypatch.setattr(archive, "READ_RETRIES", (0.0, 0.0, 0.0))
    assert read_segment(segment)[0] == ENTRIES
    failures[0] = 4  # more than the retries
    with pytest.raises(ArchiveError, match="timed out"):
        read_segment(segment)


def test_a_reader_that_a_trim_overtakes_between_two_pages_reads_the_segment_instead(
    tmp_path: Path,
) -> None:
    conn = fakeredis.FakeRedis()
    keys = Keys("j")
    for n in range(1, 1001):
        conn.xadd(keys.journal, {FIELD: b"fact %d" % n}, id=f"{n}-0")
    history = History.of(conn, "j")
    whole = history.journal.range()
    pages = history.pages(count=100)
    read = list(next(pages))  # the first 100, from Redis
    segment = write_segment(str(tmp_path), "j", whole[:500], b"", at=1.0)
    conn.set(keys.archive, archive.encode_index([segment]))
    conn.xtrim(keys.journal, minid="500-0")  # the leader archives past the reader
    read += [entry for page in pages for entry in page]
    assert read == whole
    assert (
        list(history.pages(after="250-0"))
        and [e for page in history.pages(after="250-0") for e in page] == whole[250:]
    )
