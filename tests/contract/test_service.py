"""The coordinator loop against Redis: leading, following, fencing, dead letters, snapshots."""

from __future__ import annotations

import hashlib

import msgpack
import pytest

from cohort.coordinator.fold import fold
from cohort.coordinator.service import Coordinator, ServiceSettings
from cohort.coordinator.state import state_hash
from cohort.coordinator.stores import DeadLetter
from cohort.events.codec import FIELD, encode
from cohort.events.keys import Keys
from cohort.events.models import (
    Heartbeat,
    JobConfig,
    Join,
    LeaderElected,
    StepDone,
    WeightsLoaded,
    WorkerJoined,
)
from cohort.events.streams import Inbox, Journal

JOB = "svc"


def settings(name: str, **config: object) -> ServiceSettings:
    return ServiceSettings(
        job=JOB,
        coordinator=name,
        config=JobConfig(**{"min_workers": 1, "dataset_size": 60_000, **config}),  # type: ignore[arg-type]
        lease_ms=2000,
        block_ms=10,
        snapshot_every=5,
        allow_volatile=True,  # fakeredis cannot say how it persists
        allow_eviction=True,  # nor whether it evicts
    )


def drive(coord: Coordinator, turns: int = 3) -> None:
    if not getattr(coord, "_started", False):
        coord.start()
        coord._started = True  # type: ignore[attr-defined]
    for _ in range(turns):
        coord.step()


def join(inbox: Inbox, worker: str) -> None:
    inbox.send(Join(at=0, job=JOB, worker=worker))
    inbox.send(WeightsLoaded(at=0, job=JOB, worker=worker))


def journal_facts(conn):  # type: ignore[no-untyped-def]
    return [f for _, f in Journal(conn, Keys(JOB).journal).facts()]


def test_leader_turns_commands_into_facts_that_replay_to_its_state(conn) -> None:  # type: ignore[no-untyped-def]
    leader = Coordinator.on_redis(conn, settings("c1"))
    drive(leader, 1)
    assert leader.leading
    inbox = Inbox(conn, Keys(JOB).inbox)
    join(inbox, "a")
    inbox.send(StepDone(at=0, job=JOB, worker="a", step=0, world=1))
    drive(leader)
    facts = journal_facts(conn)
    assert [type(f).__name__ for f in facts][:2] == ["JobConfigured", "LeaderElected"]
    assert leader.state.ranks == ("a",) and leader.state.last_committed == 0
    assert fold(facts) == leader.state
    assert leader.cursor == inbox.last_id()


def test_follower_folds_the_journal_and_has_the_same_state(conn) -> None:  # type: ignore[no-untyped-def]
    leader, follower = (
        Coordinator.on_redis(conn, settings("c1")),
        Coordinator.on_redis(conn, settings("c2")),
    )
    drive(leader, 1)
    drive(follower, 1)
    assert leader.leading and not follower.leading
    join(Inbox(conn, Keys(JOB).inbox), "a")
    drive(leader)
    drive(follower)
    assert state_hash(follower.state) == state_hash(leader.state)


def test_follower_takes_over_at_the_cursor_without_losing_or_repeating_commands(conn) -> None:  # type: ignore[no-untyped-def]
    leader, follower = (
        Coordinator.on_redis(conn, settings("c1")),
        Coordinator.on_redis(conn, settings("c2")),
    )
    drive(leader, 1)
    drive(follower, 1)
    inbox = Inbox(conn, Keys(JOB).inbox)
    join(inbox, "a")
    drive(leader)
    leader.close()  # gives the lease back
    join(inbox, "b")
    drive(follower)
    assert follower.leading
    facts = journal_facts(conn)
    joined = [f.worker for f in facts if isinstance(f, WorkerJoined)]
    assert joined == ["a", "b"]
    elected = [f.epoch for f in facts if isinstance(f, LeaderElected)]
    assert elected == [1, 2]


def test_a_stale_leader_cannot_append(conn) -> None:  # type: ignore[no-untyped-def]
    stale, fresh = (
        Coordinator.on_redis(conn, settings("c1")),
        Coordinator.on_redis(conn, settings("c2")),
    )
    drive(stale, 1)
    conn.delete(Keys(JOB).leader)  # its lease ran out while it was paused
    drive(fresh, 2)
    assert fresh.leading
    join(Inbox(conn, Keys(JOB).inbox), "a")
    before = len(journal_facts(conn))
    drive(stale, 1)  # tries to append with its old token
    assert not stale.leading
    assert len(journal_facts(conn)) == before
    drive(fresh)
    assert [f.worker for f in journal_facts(conn) if isinstance(f, WorkerJoined)] == ["a"]


@pytest.mark.parametrize(
    "raw, reason",
    [
        (b"\xc1garbage", "not msgpack"),
        (msgpack.packb([1, 2, 3]), "not a map"),
        (msgpack.packb({"type": "Explode", "v": 1}), "Explode"),
        (msgpack.packb({"type": "Join", "v": 2, "at": 0, "job": JOB}), "worker"),
        pytest.param(b"\x00" * 70_000, "limit", id="70-kB-of-zeros"),
        (encode(Join(at=0, job="other", worker="x")), "other"),
        (
            msgpack.packb(
                {"type": "Heartbeat", "v": 2, "at": 0, "job": JOB, "worker": "a", "evil": 1}
            ),
            "evil",
        ),
    ],
)
def test_bad_inbox_entries_are_dead_lettered_and_the_leader_keeps_going(conn, raw, reason) -> None:  # type: ignore[no-untyped-def]
    leader = Coordinator.on_redis(conn, settings("c1"))
    drive(leader, 1)
    keys = Keys(JOB)
    bad_id = conn.xadd(keys.inbox, {FIELD: raw}).decode()
    join(Inbox(conn, keys.inbox), "a")
    drive(leader)
    ((dead_id, fields),) = conn.xrange(keys.dead)
    assert fields[b"inbox_id"].decode() == bad_id
    assert reason in fields[b"reason"].decode()
    assert fields[b"raw"] == raw[: DeadLetter.HEAD_BYTES]
    assert fields[b"sha256"].decode() == hashlib.sha256(raw).hexdigest()
    assert "a" in leader.state.members


def test_entry_without_the_event_field_is_dead_lettered(conn) -> None:  # type: ignore[no-untyped-def]
    leader = Coordinator.on_redis(conn, settings("c1"))
    drive(leader, 1)
    conn.xadd(Keys(JOB).inbox, {"x": "y"})
    drive(leader)
    ((_, fields),) = conn.xrange(Keys(JOB).dead)
    assert "no 'e' field" in fields[b"reason"].decode()


def test_restart_from_a_snapshot_equals_folding_from_zero(conn) -> None:  # type: ignore[no-untyped-def]
    leader = Coordinator.on_redis(conn, settings("c1"))
    drive(leader, 1)
    inbox = Inbox(conn, Keys(JOB).inbox)
    for name in "abcd":
        join(inbox, name)
    for _ in range(3):
        for name in leader.state.ranks:
            inbox.send(Heartbeat(at=0, job=JOB, worker=name))
        drive(leader)
    assert conn.get(Keys(JOB).snapshot)
    leader.close()
    again = Coordinator.on_redis(conn, settings("c2"))
    again._load_snapshot()
    assert again.journal_id != "0-0"
    again.catch_up()
    assert again.state == fold(journal_facts(conn))


def test_status_key_carries_the_leaders_view(conn) -> None:  # type: ignore[no-untyped-def]
    leader = Coordinator.on_redis(conn, settings("c1"))
    drive(leader, 1)
    join(Inbox(conn, Keys(JOB).inbox), "a")
    drive(leader)
    status = msgpack.unpackb(conn.get(Keys(JOB).status))
    assert status["coordinator"] == "c1" and status["epoch"] == 1
    assert "a" in status["workers"]
