"""The fenced writes (fencing.lua via coordinator.election) on fakeredis and a real redis-server.

Invariant 4 of docs/design.md: no fact is appended by a coordinator without the current token.
"""

from __future__ import annotations

import hashlib

import fakeredis
import pytest
import redis

from cohort.coordinator.election import (
    FencedJournal,
    RedisLease,
    installed_version,
    library_version,
    load_library,
)
from cohort.coordinator.errors import Conflict, CoordinatorError, Fenced
from cohort.coordinator.stores import DeadLetter, epoch_of
from cohort.events.keys import Keys
from cohort.events.streams import ZERO, Stream, id_key

KEYS = Keys("fencing")
LEASE_MS = 30_000
OLD_LIBRARY = """#!lua name=cohort
redis.register_function{function_name='cohort_version', callback=function() return 0 end,
                        flags={'no-writes'}}
"""


@pytest.fixture
def lease(conn: redis.Redis) -> RedisLease:
    load_library(conn)
    return RedisLease(conn, KEYS, LEASE_MS)


@pytest.fixture
def journal(conn: redis.Redis) -> FencedJournal:
    load_library(conn)
    return FencedJournal(conn, KEYS, dead_maxlen=50)


def state(conn: redis.Redis, journal: FencedJournal) -> tuple[int, str, str]:
    """What a refused write must leave untouched: journal length and last ID, cursor."""
    stream = Stream(conn, KEYS.journal)
    return stream.length(), stream.last_id(), journal.cursor()


# -------------------------------------------------------------------- lease


def test_epochs_grow_by_one_per_election(lease: RedisLease) -> None:
    first = lease.acquire("a")
    assert first is not None
    assert lease.release(first)
    second = lease.acquire("b")

    assert first == "1:a"
    assert second == "2:b"
    assert epoch_of(second) > epoch_of(first)


def test_acquire_while_held_returns_none_and_keeps_the_holder(lease: RedisLease) -> None:
    token = lease.acquire("a")

    assert lease.acquire("b") is None
    assert lease.holder() == token


def test_acquire_without_nonce_makes_a_unique_token(lease: RedisLease) -> None:
    token = lease.acquire()
    assert token is not None and lease.release(token)
    other = lease.acquire()

    assert token is not None and other is not None
    assert token.split(":", 1)[1] != other.split(":", 1)[1]


def test_renew_extends_only_the_current_token(conn: redis.Redis, lease: RedisLease) -> None:
    token = lease.acquire("a")
    assert token is not None
    conn.pexpire(KEYS.leader, 1_000)

    assert not lease.renew("1:someone-else")
    assert 0 < int(conn.pttl(KEYS.leader)) <= 1_000
    assert lease.renew(token)
    assert int(conn.pttl(KEYS.leader)) > 1_000


def test_release_with_a_wrong_token_keeps_the_lease(lease: RedisLease) -> None:
    token = lease.acquire("a")

    assert not lease.release("1:b")
    assert lease.holder() == token


def test_expired_lease_can_be_taken_with_the_next_epoch(
    conn: redis.Redis, lease: RedisLease
) -> None:
    token = lease.acquire("a")
    assert token is not None
    conn.delete(KEYS.leader)  # what expiry does, without waiting for it

    assert not lease.renew(token)
    assert lease.acquire("b") == "2:b"


def test_lease_is_set_with_the_lease_time(conn: redis.Redis, lease: RedisLease) -> None:
    lease.acquire("a")

    assert 0 < int(conn.pttl(KEYS.leader)) <= LEASE_MS


def test_epoch_of_rejects_a_malformed_token() -> None:
    assert epoch_of("12:abc:def") == 12
    with pytest.raises(CoordinatorError, match="'nonsense'"):
        epoch_of("nonsense")


# -------------------------------------------------------------------- journal


def test_append_with_current_token_writes_facts_and_cursor_together(
    conn: redis.Redis, lease: RedisLease, journal: FencedJournal
) -> None:
    token = lease.acquire("a")
    assert token is not None

    ids = journal.append(token, ZERO, [b"f1", b"f2"], cursor="17-3")

    entries = Stream(conn, KEYS.journal).range()
    assert [e.id for e in entries] == ids
    assert [e.raw for e in entries] == [b"f1", b"f2"]
    assert journal.cursor() == "17-3"


def test_append_continues_from_the_last_id_it_returned(
    lease: RedisLease, journal: FencedJournal
) -> None:
    token = lease.acquire("a")
    assert token is not None
    first = journal.append(token, ZERO, [b"f1"], cursor="1-0")

    second = journal.append(token, first[-1], [b"f2"], cursor=None)

    assert len(second) == 1
    assert journal.cursor() == "1-0", "cursor=None leaves the cursor alone"


def test_append_of_no_facts_can_move_only_the_cursor(
    lease: RedisLease, journal: FencedJournal
) -> None:
    token = lease.acquire("a")
    assert token is not None

    assert journal.append(token, ZERO, [], cursor="5-0") == []
    assert journal.cursor() == "5-0"


def test_stale_token_is_fenced_and_writes_nothing(
    conn: redis.Redis, lease: RedisLease, journal: FencedJournal
) -> None:
    old = lease.acquire("old")
    assert old is not None
    ids = journal.append(old, ZERO, [b"f1"], cursor="1-0")
    conn.delete(KEYS.leader)  # the old leader's lease lapsed while it was paused
    new = lease.acquire("new")
    before = state(conn, journal)

    with pytest.raises(Fenced) as caught:
        journal.append(old, ids[-1], [b"forged"], cursor="9-0", dead=[DeadLetter("9-0", "x", b"")])

    assert caught.value.holder == new
    assert state(conn, journal) == before
    assert Stream(conn, KEYS.dead).length() == 0


def test_append_without_any_leader_is_fenced(journal: FencedJournal) -> None:
    with pytest.raises(Fenced) as caught:
        journal.append("1:ghost", ZERO, [b"f"], cursor=None)

    assert caught.value.holder is None


def test_wrong_expected_last_is_a_conflict_and_writes_nothing(
    conn: redis.Redis, lease: RedisLease, journal: FencedJournal
) -> None:
    token = lease.acquire("a")
    assert token is not None
    ids = journal.append(token, ZERO, [b"f1"], cursor="1-0")
    before = state(conn, journal)

    with pytest.raises(Conflict) as caught:
        journal.append(token, ZERO, [b"f2"], cursor="2-0")

    assert caught.value.actual_last == ids[-1]
    assert caught.value.expected_last == ZERO
    assert state(conn, journal) == before


def test_retrying_a_successful_append_is_detected_as_conflict(
    conn: redis.Redis, lease: RedisLease, journal: FencedJournal
) -> None:
    """A reply lost after the write: the retry must not append the facts a second time."""
    token = lease.acquire("a")
    assert token is not None
    ids = journal.append(token, ZERO, [b"f1", b"f2"], cursor="3-0")

    with pytest.raises(Conflict) as caught:
        journal.append(token, ZERO, [b"f1", b"f2"], cursor="3-0")

    assert caught.value.actual_last == ids[-1]
    assert Stream(conn, KEYS.journal).length() == 2


def test_dead_letters_keep_a_bounded_record_of_the_entry(
    conn: redis.Redis, lease: RedisLease, journal: FencedJournal
) -> None:
    token = lease.acquire("a")
    assert token is not None
    big = b"\xff\x00junk" * 100_000
    letters = [
        DeadLetter.of("5-0", "not msgpack", big, "malformed", ("w1", False)),
        DeadLetter.of("6-1", "speaks for w1", b"", "forged", ("w2", True), size=7),
    ]

    journal.append(token, ZERO, [b"f1"], cursor="6-1", dead=letters)

    rows = conn.xrange(KEYS.dead)
    assert [fields for _, fields in rows] == [
        {
            b"inbox_id": b"5-0",
            b"reason": b"not msgpack",
            b"kind": b"malformed",
            b"sender": b"w1 (claimed)",
            b"size": str(len(big)).encode(),
            b"sha256": hashlib.sha256(big).hexdigest().encode(),
            b"raw": big[: DeadLetter.HEAD_BYTES],
        },
        {
            b"inbox_id": b"6-1",
            b"reason": b"speaks for w1",
            b"kind": b"forged",
            b"sender": b"w2",
            b"size": b"7",
            b"sha256": hashlib.sha256(b"").hexdigest().encode(),
            b"raw": b"",
        },
    ]
    assert journal.cursor() == "6-1"


def test_dead_letters_are_capped_near_maxlen(
    conn: redis.Redis, lease: RedisLease, journal: FencedJournal
) -> None:
    """MAXLEN ~ trims whole stream nodes (100 entries by default), so the cap is approximate."""
    token = lease.acquire("a")
    assert token is not None
    last = ZERO
    for batch in range(6):
        letters = [DeadLetter(f"{batch}-{i}", "bad", b"x") for i in range(100)]
        ids = journal.append(token, last, [b"f"], cursor=None, dead=letters)
        last = ids[-1]

    length = int(conn.xlen(KEYS.dead))
    assert journal.dead_maxlen <= length <= journal.dead_maxlen + 100
    newest = conn.xrevrange(KEYS.dead, count=1)[0][1]
    assert newest[b"inbox_id"] == b"5-99"


def test_bad_arguments_are_an_error_reply_not_a_crash(conn: redis.Redis) -> None:
    load_library(conn)
    keys = [KEYS.leader, KEYS.journal, KEYS.cursor, KEYS.dead]

    with pytest.raises(redis.ResponseError, match="n_facts x is not a non-negative integer"):
        conn.fcall("cohort_append", 4, *keys, "t", ZERO, "", "x", 10)
    with pytest.raises(redis.ResponseError, match="groups of 7"):
        conn.fcall("cohort_append", 4, *keys, "t", ZERO, "", 0, 10, "only-two", "args")
    with pytest.raises(redis.ResponseError, match="expects 4 keys"):
        conn.fcall("cohort_append", 1, KEYS.leader, "t", ZERO, "", 0, 10)


# -------------------------------------------------------------------- the inbox put back in order

MAX_ID = f"{2**64 - 1}-{2**64 - 1}"
LIMIT = f"2000000000000-{2**64 - 1}"  # the server's clock plus a skew, as the leader computes it


@pytest.fixture
def real_only(conn: redis.Redis) -> None:
    if isinstance(conn, fakeredis.FakeRedis):
        pytest.skip("fakeredis has no XSETID; cohort_repair_inbox runs on redis-server only")


def inbox(conn: redis.Redis) -> list[tuple[str, dict[bytes, bytes]]]:
    return [(i.decode(), f) for i, f in conn.xrange(KEYS.inbox)]


@pytest.mark.usefixtures("real_only")
def test_entries_ahead_of_the_clock_are_moved_behind_it_in_order(
    conn: redis.Redis, lease: RedisLease, journal: FencedJournal
) -> None:
    token = lease.acquire("a")
    assert token is not None
    read = conn.xadd(KEYS.inbox, {"e": "read"}).decode()
    conn.xadd(KEYS.inbox, {"e": "forged"}, id="99999999999999-0")
    conn.xadd(KEYS.inbox, {"e": "honest"})  # the server gives it 99999999999999-1

    cursor, moved, dropped = journal.repair_inbox(token, read, LIMIT)

    assert (cursor, moved, dropped) == (read, 2, 0)
    after = inbox(conn)
    assert [f[b"e"] for _, f in after] == [b"read", b"forged", b"honest"]
    assert [f.get(b"o") for _, f in after] == [None, b"99999999999999-0", b"99999999999999-1"]
    assert all(id_key(i) <= id_key(LIMIT) for i, _ in after)
    assert journal.cursor() == read
    fresh = conn.xadd(KEYS.inbox, {"e": "next"}).decode()  # the stream takes IDs again
    assert id_key(fresh) < id_key(LIMIT)
    marks = journal.inbox_marks(read)
    assert marks is not None and (marks.last, marks.deleted) == (fresh, read)


@pytest.mark.usefixtures("real_only")
def test_an_exhausted_inbox_takes_entries_again_and_read_ones_ahead_are_dropped(
    conn: redis.Redis, lease: RedisLease, journal: FencedJournal
) -> None:
    token = lease.acquire("a")
    assert token is not None
    conn.xadd(KEYS.inbox, {"e": "read"})
    conn.xadd(KEYS.inbox, {"e": "max"}, id=MAX_ID)
    with pytest.raises(redis.ResponseError, match="exhausted"):
        conn.xadd(KEYS.inbox, {"e": "refused"})

    cursor, moved, dropped = journal.repair_inbox(token, MAX_ID, LIMIT)  # an old leader read it

    assert (moved, dropped) == (0, 1)
    assert [f[b"e"] for _, f in inbox(conn)] == [b"read"]
    assert cursor == inbox(conn)[0][0] == journal.cursor()
    assert conn.xadd(KEYS.inbox, {"e": "taken"})


@pytest.mark.usefixtures("real_only")
def test_an_inbox_recreated_below_the_cursor_is_read_from_its_start(
    conn: redis.Redis, lease: RedisLease, journal: FencedJournal
) -> None:
    token = lease.acquire("a")
    assert token is not None
    conn.xadd(KEYS.inbox, {"e": "new"}, id="5-0")  # deleted and appended to again

    assert journal.repair_inbox(token, "9-0", LIMIT) == (ZERO, 0, 0)
    assert journal.cursor() == ZERO


@pytest.mark.usefixtures("real_only")
def test_unread_entries_deleted_by_someone_else_are_found_and_acknowledged_once(
    conn: redis.Redis, lease: RedisLease, journal: FencedJournal
) -> None:
    token = lease.acquire("a")
    assert token is not None
    read = conn.xadd(KEYS.inbox, {"e": "read"}).decode()
    gone = conn.xadd(KEYS.inbox, {"e": "gone"}).decode()
    conn.xdel(KEYS.inbox, gone)
    marks = journal.inbox_marks(read)
    assert marks is not None
    assert marks.lost(read) == f"unread inbox entries up to {gone} were deleted"

    journal.repair_inbox(token, read, LIMIT)

    after = journal.inbox_marks(read)
    assert after is not None and after.lost(read) is None


@pytest.mark.usefixtures("real_only")
def test_unread_entries_trimmed_by_an_xadd_with_maxlen_are_found(
    conn: redis.Redis, journal: FencedJournal
) -> None:
    read = conn.xadd(KEYS.inbox, {"e": "read"}).decode()
    conn.xadd(KEYS.inbox, {"e": "gone"})
    kept = conn.xadd(KEYS.inbox, {"e": "trim"}, maxlen=1, approximate=False).decode()

    marks = journal.inbox_marks(read)

    assert marks is not None and not marks.holds_cursor
    assert marks.lost(read) == f"inbox entries before {kept}, unread ones among them, were trimmed"
    assert marks.lost(kept) is None  # once the leader read past them


def test_only_the_leader_repairs_the_inbox(
    conn: redis.Redis, lease: RedisLease, journal: FencedJournal
) -> None:
    assert lease.acquire("a") is not None
    with pytest.raises(Fenced):
        journal.repair_inbox("0:stale", ZERO, LIMIT)


def test_no_inbox_has_no_marks(journal: FencedJournal) -> None:
    assert journal.inbox_marks(ZERO) is None


# -------------------------------------------------------------------- snapshot


def test_snapshot_is_saved_by_the_leader_and_refused_to_others(
    conn: redis.Redis, lease: RedisLease, journal: FencedJournal
) -> None:
    assert journal.load_snapshot() is None
    token = lease.acquire("a")
    assert token is not None
    journal.save_snapshot(token, b"\x00state")

    with pytest.raises(Fenced):
        journal.save_snapshot("0:stale", b"forged")

    assert journal.load_snapshot() == b"\x00state"


# -------------------------------------------------------------------- library


def test_load_library_is_idempotent(conn: redis.Redis) -> None:
    assert installed_version(conn) is None

    assert load_library(conn) == library_version()
    assert load_library(conn) == library_version()
    assert installed_version(conn) == library_version()


def test_load_library_replaces_an_older_version(conn: redis.Redis) -> None:
    conn.function_load(OLD_LIBRARY, replace=True)
    assert installed_version(conn) == 0

    assert load_library(conn) == library_version()
    assert RedisLease(conn, KEYS, LEASE_MS).acquire("a") == "1:a"


def test_load_library_keeps_a_newer_version(conn: redis.Redis) -> None:
    newer = OLD_LIBRARY.replace("return 0", f"return {library_version() + 1}")
    conn.function_load(newer, replace=True)

    assert load_library(conn) == library_version() + 1
    assert installed_version(conn) == library_version() + 1


def test_calls_load_the_library_when_the_server_has_none(conn: redis.Redis) -> None:
    """A fresh or flushed server: the first fenced call loads the library itself."""
    assert installed_version(conn) is None

    assert RedisLease(conn, KEYS, LEASE_MS).acquire("a") == "1:a"
    assert installed_version(conn) == library_version()


def test_a_server_without_functions_is_refused_with_the_version_needed() -> None:
    old_server = fakeredis.FakeRedis(server=fakeredis.FakeServer(version=(6, 2)))

    with pytest.raises(CoordinatorError, match=r"cohort needs Redis >= 7\.0"):
        load_library(old_server)
    with pytest.raises(CoordinatorError, match=r"no FUNCTION/FCALL support"):
        RedisLease(old_server, KEYS, LEASE_MS).acquire("a")
