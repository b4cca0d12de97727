"""Fuzzing the door: random and mutated inbox entries never stop the leader, and every one
is either decided or dead-lettered with a reason (invariant 6 of docs/design.md)."""

from __future__ import annotations

import contextlib
import hashlib

import fakeredis
import msgpack
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cohort.coordinator.service import Coordinator, ServiceSettings
from cohort.coordinator.stores import DeadLetter
from cohort.events.codec import FIELD, decode_command, encode
from cohort.events.connection import RedisSettings, connect
from cohort.events.errors import DecodeError
from cohort.events.keys import Keys
from cohort.events.models import (
    Heartbeat,
    JobConfig,
    Join,
    Leave,
    StepDone,
    WeightsLoaded,
    WorkerFailed,
)
from cohort.events.streams import Inbox, Journal, id_key, id_ms
from cohort.localredis import LocalRedis

JOB = "fuzz"
VALID = [
    encode(Join(at=1.0, job=JOB, worker="a", host="h", pid=3)),
    encode(WeightsLoaded(at=1.0, job=JOB, worker="a", step=0)),
    encode(StepDone(at=1.0, job=JOB, worker="a", step=0, world=1, step_time=0.1, loss=0.5)),
    encode(Heartbeat(at=1.0, job=JOB, worker="a", step=0, world=1)),
    encode(Leave(at=1.0, job=JOB, worker="a", after_step=3, reason="bye")),
]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=50),
    st.binary(max_size=50),
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=20,
)
hostile_maps = st.fixed_dictionaries(
    {
        "type": st.sampled_from(
            [
                "Join",
                "Heartbeat",
                "StepDone",
                "Leave",
                "GpuReading",
                "WeightsLoaded",
                "EpochDone",
                "WorkerJoined",
                "x" * 300,
            ]
        )
    },
    optional={
        "v": values,
        "at": values,
        "job": st.sampled_from([JOB, "other", "", "../x"]),
        "worker": values,
        "step": values,
        "world": values,
        "devices": values,
        "after_step": values,
        "digest": values,
        "extra": values,
    },
).map(lambda body: msgpack.packb(body, use_bin_type=True))


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    raw = bytearray(draw(st.sampled_from(VALID)))
    for _ in range(draw(st.integers(1, 4))):
        where = draw(st.integers(0, len(raw) - 1))
        op = draw(st.sampled_from(["flip", "cut", "dup"]))
        if op == "flip":
            raw[where] ^= draw(st.integers(1, 255))
        elif op == "cut":
            del raw[where:]
            if not raw:
                break
        else:
            raw[where:where] = raw[where : where + 8]
    return bytes(raw)


entries = st.lists(
    st.one_of(
        st.binary(max_size=300),
        mutated(),
        hostile_maps,
        st.sampled_from(VALID),
        st.just(b"\x00" * 70_000),
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(entries)
def test_no_inbox_entry_stops_the_leader_and_each_is_decided_or_dead_lettered(
    batch: list[bytes],
) -> None:
    conn = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    keys = Keys(JOB)
    leader = Coordinator.on_redis(
        conn,
        ServiceSettings(
            job=JOB,
            coordinator="c",
            block_ms=1,
            config=JobConfig(dataset_size=60_000),
            allow_volatile=True,
            allow_eviction=True,
        ),
    )
    leader.start()
    leader.step()
    assert leader.leading
    sent = [conn.xadd(keys.inbox, {FIELD: raw}).decode() for raw in batch]
    for _ in range(3):
        leader.step()
    assert leader.cursor == sent[-1], "the leader stopped before the end of the inbox"

    dead = {f[b"inbox_id"].decode(): f for _, f in conn.xrange(keys.dead)}
    for entry_id, raw in zip(sent, batch, strict=True):
        try:
            command = decode_command(raw)
            valid = command.job == JOB
        except DecodeError:
            valid = False
        if valid:
            assert entry_id not in dead
        else:
            assert entry_id in dead, f"entry {raw[:40]!r} was neither decided nor dead-lettered"
            letter = dead[entry_id]
            assert letter[b"reason"]
            assert letter[b"raw"] == raw[: DeadLetter.HEAD_BYTES]
            assert letter[b"sha256"].decode() == hashlib.sha256(raw).hexdigest()
            assert int(letter[b"size"]) == len(FIELD) + len(raw)


# ---------------------------------------------------------------- IDs, names, sizes (issue 33)

ids = st.one_of(
    st.just("*"),
    st.builds(lambda ms, seq: f"{ms}-{seq}", st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1)),
    st.builds(lambda d: f"+{d}", st.integers(-3_600_000, 3_600_000)),  # relative to the clock
    st.sampled_from([f"{2**64 - 1}-{2**64 - 1}", f"{2**64 - 1}-0", "0-1"]),
)
names = st.one_of(
    st.sampled_from([b"e", b"w", b"s", b"o", b"x"]), st.binary(min_size=1, max_size=20)
)
bodies = st.one_of(
    st.sampled_from(VALID[:4]),  # a's commands, but a's Leave
    st.binary(max_size=200),
    hostile_maps,
    st.integers(0, 3).map(lambda mb: b"\x00" * (mb << 19)),  # up to 1.5 MB
)
HONEST = "h0nest-worker"  # a name no strategy here draws
hostile_entries = st.tuples(ids, st.dictionaries(names, bodies, min_size=1, max_size=4))


@pytest.mark.redis_server
@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(st.lists(hostile_entries, min_size=1, max_size=8))
def test_no_id_field_name_size_or_encoding_stops_the_leader_or_moves_its_clock(
    redis_server: LocalRedis, batch: list[tuple[str, dict[bytes, bytes]]]
) -> None:
    """Through a real server: whatever is appended, with whatever ID, the leader keeps
    leading, an honest worker that heartbeats is never failed, no fact is dated past the
    server's clock, and the honest worker's entries are read."""
    conn = connect(RedisSettings(url=redis_server.url))
    conn.flushall()
    conn.function_flush()  # another test may have left a stub library that claims a newer version
    keys = Keys(JOB)
    leader = Coordinator.on_redis(
        conn,
        ServiceSettings(
            job=JOB, coordinator="c", block_ms=1, allow_volatile=True, allow_eviction=True,
            config=JobConfig(dataset_size=60_000, heartbeat_timeout=2.0),
        ),
    )  # fmt: skip
    leader.start()
    leader.step()
    honest = Inbox(conn, keys.inbox)
    sent = [
        honest.send(Join(at=0.0, job=JOB, worker=HONEST)),
        honest.send(WeightsLoaded(at=0.0, job=JOB, worker=HONEST, step=0)),
    ]
    for entry_id, fields in batch:
        if entry_id.startswith("+"):
            entry_id = f"{_server_ms(conn) + int(entry_id[1:])}-0"
        with contextlib.suppress(redis.ResponseError):  # IDs the stream refuses
            conn.xadd(keys.inbox, fields, id=entry_id)  # type: ignore[arg-type]
    for _ in range(4):
        leader.step()
        beat = Heartbeat(at=0.0, job=JOB, worker=HONEST, step=0, world=1)
        with contextlib.suppress(redis.ResponseError):  # jammed until the leader repairs it
            sent.append(honest.send(beat))
        leader.step()
    leader.step()

    assert leader.leading
    assert HONEST in leader.state.members
    now = _server_ms(conn) / 1000
    facts = [fact for _, fact in Journal(conn, keys.journal).facts()]
    assert not [f for f in facts if isinstance(f, WorkerFailed)]
    assert max(f.at for f in facts) <= now + 1.5
    assert id_ms(leader.cursor) <= _server_ms(conn) + 1500
    assert id_key(leader.cursor) >= id_key(sent[-1]) or leader.cursor == "0-1"
    conn.close()


def _server_ms(conn: redis.Redis) -> int:
    seconds, micros = conn.time()
    return int(seconds) * 1000 + int(micros) // 1000
