"""Fuzzing the door: random and mutated inbox entries never stop the leader, and every one
is either decided or dead-lettered with a reason (invariant 6 of docs/design.md)."""

from __future__ import annotations

import hashlib

import fakeredis
import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cohort.coordinator.service import Coordinator, ServiceSettings
from cohort.coordinator.stores import DeadLetter
from cohort.events.codec import FIELD, decode_command, encode
from cohort.events.errors import DecodeError
from cohort.events.keys import Keys
from cohort.events.models import Heartbeat, JobConfig, Join, Leave, StepDone, WeightsLoaded

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
