"""events.streams behaves the same on fakeredis and on a real redis-server."""

from __future__ import annotations

import threading
import time

import redis

from cohort.events.codec import decode_command, encode
from cohort.events.keys import Keys
from cohort.events.models import Join, WorkerJoined
from cohort.events.streams import ZERO, Entry, Inbox, Journal
from tests.helpers import wait_until

JOB = "contract"
KEYS = Keys(JOB)


def joined(n: int) -> WorkerJoined:
    return WorkerJoined(at=1_700_000_000.0 + n, job=JOB, worker=f"w{n}")


def fill(journal: Journal, n: int) -> list[str]:
    return [journal.append_raw(encode(joined(i))) for i in range(n)]


def blocked_clients(conn: redis.Redis) -> int | None:
    """How many clients the server has blocked, or None if it cannot say (fakeredis: no INFO)."""
    try:
        return int(conn.info("clients")["blocked_clients"])
    except redis.ResponseError:
        return None


def test_empty_stream_has_zero_last_id_and_no_entries(conn: redis.Redis) -> None:
    journal = Journal(conn, KEYS.journal)
    assert journal.last_id() == ZERO
    assert journal.length() == 0
    assert journal.range() == []
    assert list(journal.facts()) == []


def test_range_excludes_after_and_includes_until(conn: redis.Redis) -> None:
    journal = Journal(conn, KEYS.journal)
    ids = fill(journal, 5)

    got = journal.range(after=ids[1], until=ids[3])

    assert [e.id for e in got] == ids[2:4]
    assert [e.raw for e in got] == [encode(joined(2)), encode(joined(3))]


def test_range_count_returns_the_oldest_first(conn: redis.Redis) -> None:
    journal = Journal(conn, KEYS.journal)
    ids = fill(journal, 5)

    assert [e.id for e in journal.range(count=2)] == ids[:2]
    assert [e.id for e in journal.range(after=ids[2], count=10)] == ids[3:]


def test_last_id_and_length_follow_appends(conn: redis.Redis) -> None:
    journal = Journal(conn, KEYS.journal)
    ids = fill(journal, 3)

    assert journal.last_id() == ids[-1]
    assert journal.length() == 3


def test_facts_are_decoded_in_order_across_batch_boundaries(conn: redis.Redis) -> None:
    journal = Journal(conn, KEYS.journal)
    ids = fill(journal, 7)

    got = list(journal.facts(batch=3))

    assert [i for i, _ in got] == ids
    assert [f for _, f in got] == [joined(i) for i in range(7)]
    assert [f for _, f in journal.facts(after=ids[2], until=ids[5], batch=2)] == [
        joined(i) for i in range(3, 6)
    ]


def test_batch_equal_to_length_ends_without_a_missing_entry(conn: redis.Redis) -> None:
    journal = Journal(conn, KEYS.journal)
    fill(journal, 6)

    assert len(list(journal.facts(batch=3))) == 6


def test_inbox_send_stores_a_decodable_command(conn: redis.Redis) -> None:
    inbox = Inbox(conn, KEYS.inbox)
    command = Join(at=1_700_000_000.0, job=JOB, worker="w1", host="h", pid=7)

    entry_id = inbox.send(command)

    [entry] = inbox.range()
    assert entry.id == entry_id
    assert decode_command(entry.raw or b"") == command


def test_a_wire_writes_commands_now_and_reads_each_reply_later(conn: redis.Redis) -> None:
    inbox = Inbox(conn, KEYS.inbox)
    wire = inbox.wire()
    assert wire is not None
    commands = [
        Join(at=1_700_000_000.0, job=JOB, worker=f"w{i}", host="h", pid=i) for i in range(3)
    ]
    for command in commands:
        assert wire.write(command)
        assert wire.landed(5.0)
    assert [decode_command(e.raw or b"") for e in inbox.range()] == commands
    wire.close()


def test_a_wire_whose_reply_is_an_error_says_it_did_not_land(conn: redis.Redis) -> None:
    conn.set(KEYS.inbox, b"not a stream")  # XADD answers WRONGTYPE
    wire = Inbox(conn, KEYS.inbox).wire()
    assert wire is not None
    assert wire.write(Join(at=1_700_000_000.0, job=JOB, worker="w1", host="h", pid=1))
    assert not wire.landed(5.0)
    conn.delete(KEYS.inbox)
    assert wire.write(Join(at=1_700_000_000.0, job=JOB, worker="w2", host="h", pid=2))
    assert wire.landed(5.0)  # a new connection from the pool
    assert len(Inbox(conn, KEYS.inbox).range()) == 1
    wire.close()


def test_a_reader_tails_as_the_stream_does_on_a_connection_of_its_own(conn: redis.Redis) -> None:
    journal = Journal(conn, KEYS.journal)
    reader = journal.reader()
    assert reader is not None
    assert reader.tail(ZERO, 1) == []  # nothing after the block time
    ids = fill(journal, 5)
    got = reader.tail(ZERO, 100, count=3)
    assert got == journal.tail(ZERO, 100, count=3)
    assert [e.id for e in got] == ids[:3]
    assert [e.id for e in reader.tail(ids[2], 100)] == ids[3:]
    assert reader.tail(ids[-1], 1) == []
    reader.close()


def test_tail_waits_for_an_entry_written_after_it_started(conn: redis.Redis) -> None:
    journal = Journal(conn, KEYS.journal)
    before = fill(journal, 2)[-1]
    started = threading.Event()
    result: list[list[Entry]] = []

    def read() -> None:
        started.set()
        result.append(journal.tail(before, block_ms=10_000))

    reader = threading.Thread(target=read, daemon=True)
    t0 = time.monotonic()
    reader.start()
    started.wait(5)
    if blocked_clients(conn) is not None:  # on a real server, see the XREAD actually block
        wait_until(lambda: blocked_clients(conn), 5, message="XREAD never blocked")
    assert result == []
    new_id = journal.append_raw(encode(joined(9)))

    wait_until(lambda: result, 5, message="tail did not return the new entry")
    reader.join(5)

    assert [e.id for e in result[0]] == [new_id]
    assert Journal.decode(result[0][0]) == joined(9)
    assert time.monotonic() - t0 < 5, "tail waited for its timeout instead of the write"


def test_tail_returns_nothing_after_its_block_time(conn: redis.Redis) -> None:
    journal = Journal(conn, KEYS.journal)
    last = fill(journal, 1)[-1]

    t0 = time.monotonic()
    assert journal.tail(last, block_ms=100) == []
    assert time.monotonic() - t0 >= 0.08


def test_tail_returns_existing_entries_without_waiting(conn: redis.Redis) -> None:
    journal = Journal(conn, KEYS.journal)
    ids = fill(journal, 4)

    got = journal.tail(ids[0], block_ms=10_000, count=2)

    assert [e.id for e in got] == ids[1:3]


def test_entry_ms_is_the_servers_clock(conn: redis.Redis) -> None:
    journal = Journal(conn, KEYS.journal)
    seconds, micros = conn.time()
    server_ms = int(seconds) * 1000 + int(micros) // 1000

    [entry_id] = fill(journal, 1)

    [entry] = journal.range()
    assert entry.id == entry_id
    assert abs(entry.ms - server_ms) < 5_000
