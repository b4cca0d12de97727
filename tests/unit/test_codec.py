"""The wire format: round trips, upcasting of stored old versions, and the door for bad bytes."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from cohort.events.codec import (
    FIELD,
    MAX_FACT_BYTES,
    MAX_MAP_LEN,
    decode_command,
    decode_commands,
    decode_fact,
    decode_facts,
    encode,
)
from cohort.events.errors import DecodeError
from cohort.events.models import (
    Heartbeat,
    JobConfig,
    JobConfigured,
    Join,
    LeaderElected,
    Leave,
    StepCommitted,
    StepDone,
    WorkerFailed,
    WorkerJoined,
    WorldChanged,
)
from cohort.events.shards import Shard
from cohort.events.streams import Entry, Journal, elects
from cohort.events.upcasters import UPCASTERS

FIXTURES = Path(__file__).parent.parent / "fixtures" / "events"
CURRENT = JobConfigured.model_fields["v"].default
"""The version a JobConfigured is written at today: older ones upcast to it."""


def test_every_upcaster_has_a_stored_old_version_fixture() -> None:
    for type_, version in UPCASTERS:
        assert (FIXTURES / f"{type_}.v{version}.msgpack").is_file(), (type_, version)


def test_join_v1_reads_as_today_s_join() -> None:
    join = decode_command((FIXTURES / "Join.v1.msgpack").read_bytes())
    assert isinstance(join, Join)
    assert (join.v, join.worker, join.host, join.pid) == (4, "w-old", "h1", 42)


def test_a_step_reported_before_v2_carries_its_loss_and_no_other_figures() -> None:
    done = decode_command((FIXTURES / "StepDone.v1.msgpack").read_bytes())
    assert isinstance(done, StepDone)
    assert (done.v, done.worker, done.step, done.loss, done.metrics) == (2, "w-old", 7, 0.25, None)


def test_a_join_or_joined_before_v3_describes_no_machine_and_declares_no_dataset() -> None:
    join = decode_command((FIXTURES / "Join.v2.msgpack").read_bytes())
    assert isinstance(join, Join)
    assert (join.v, join.worker, join.node, join.dataset) == (4, "w-v2", None, None)
    joined = decode_fact((FIXTURES / "WorkerJoined.v1.msgpack").read_bytes())
    assert isinstance(joined, WorkerJoined)
    assert (joined.v, joined.worker, joined.pid, joined.node) == (4, "w-v1", 9, None)


def test_a_join_or_joined_before_v4_is_no_spare() -> None:
    join = decode_command((FIXTURES / "Join.v3.msgpack").read_bytes())
    assert isinstance(join, Join)
    assert (join.v, join.worker, join.role, join.spare) == (4, "w-v3", "trainer", False)
    assert join.dataset is not None and join.dataset.size == 100
    joined = decode_fact((FIXTURES / "WorkerJoined.v3.msgpack").read_bytes())
    assert isinstance(joined, WorkerJoined)
    assert (joined.v, joined.worker, joined.role, joined.spare) == (4, "w-v3", "trainer", False)


def test_only_a_trainer_joins_as_a_spare() -> None:
    with pytest.raises(ValidationError, match="role 'evaluator' cannot be one"):
        Join(at=1.0, job="j", worker="w", role="evaluator", spare=True)


def test_a_v2_job_config_deals_contiguously_with_no_global_batch() -> None:
    fact = decode_fact((FIXTURES / "JobConfigured.v2.msgpack").read_bytes())
    assert isinstance(fact, JobConfigured)
    assert fact.v == CURRENT and fact.config.shuffle is True
    assert (fact.config.dataset_size, fact.config.seed, fact.config.epochs) == (2000, 5, 2)
    assert (fact.config.placement, fact.config.global_batch) == ("contiguous", None)


def test_a_config_that_left_out_its_dataset_size_keeps_v2_s_default() -> None:
    body = {"type": "JobConfigured", "v": 2, "at": 1.0, "job": "j", "config": {}}
    fact = decode_fact(msgpack.packb(body))
    assert isinstance(fact, JobConfigured)
    assert fact.config.dataset_size == 60_000
    assert JobConfig().dataset_size is None  # today a job may wait for a worker to declare


def test_a_v3_job_config_watches_no_connections() -> None:
    """Workers of a job configured before v4 did not show their connections: replayed or led
    today, silence alone fails its members."""
    fact = decode_fact((FIXTURES / "JobConfigured.v3.msgpack").read_bytes())
    assert isinstance(fact, JobConfigured)
    assert fact.v == CURRENT and fact.config.disconnect_grace == 0
    assert JobConfig().disconnect_grace == 0.3  # a new job watches them


def test_a_v1_failure_was_a_silence() -> None:
    fact = decode_fact((FIXTURES / "WorkerFailed.v1.msgpack").read_bytes())
    assert isinstance(fact, WorkerFailed)
    assert (fact.v, fact.cause, fact.closed_at, fact.grace) == (2, "silent", None, None)
    assert fact.reason == "silent 5 s (no heartbeat)"


def test_heartbeat_v1_reads_with_unknown_progress() -> None:
    beat = decode_command((FIXTURES / "Heartbeat.v1.msgpack").read_bytes())
    assert isinstance(beat, Heartbeat)
    assert (beat.v, beat.step, beat.world) == (2, None, None)


def test_a_v1_job_config_keeps_its_unshuffled_epochs() -> None:
    """A job configured before shuffling existed trained in index order: replayed today, its
    positions still are its samples, whatever today's default says."""
    fact = decode_fact((FIXTURES / "JobConfigured.v1.msgpack").read_bytes())
    assert isinstance(fact, JobConfigured)
    assert fact.v == CURRENT and fact.config.shuffle is False
    assert (fact.config.dataset_size, fact.config.epochs) == (1000, 3)
    assert fact.config.order(1).samples(((0, 5),)).tolist() == [0, 1, 2, 3, 4]
    assert JobConfig().shuffle is True  # a new job shuffles


def test_commands_and_facts_round_trip() -> None:
    command = StepDone(
        at=1.5,
        job="j",
        worker="w",
        step=3,
        world=2,
        step_time=0.25,
        samples=32,
        digest="ab" * 8,
        loss=0.5,
    )
    assert decode_command(encode(command)) == command
    fact = WorldChanged(
        at=2.0,
        job="j",
        version=3,
        start_step=7,
        epoch=1,
        ranks=("a", "b"),
        shards=(Shard(ranges=((0, 5),)), Shard(ranges=((5, 9), (20, 22)))),
    )
    assert decode_fact(encode(fact)) == fact
    configured = JobConfigured(at=0, job="j", config=JobConfig(min_workers=2))
    assert decode_fact(encode(configured)) == configured


def test_the_wire_layout_is_a_flat_msgpack_map_with_type_and_v() -> None:
    body = msgpack.unpackb(encode(Leave(at=1.0, job="j", worker="w", after_step=4)))
    assert body == {
        "v": 1,
        "at": 1.0,
        "job": "j",
        "type": "Leave",
        "worker": "w",
        "after_step": 4,
        "reason": "",
    }


@pytest.mark.parametrize(
    "raw, reason",
    [
        (b"", "not msgpack"),
        (msgpack.packb({"v": 1}), "no string 'type'"),
        (
            msgpack.packb({"type": "WorkerJoined", "v": 1, "at": 0, "job": "j", "worker": "w"}),
            "WorkerJoined",
        ),
        (
            msgpack.packb({"type": "Join", "v": 2, "at": 0, "job": "j", "worker": "../../etc"}),
            "worker",
        ),
        (msgpack.packb({"type": "Join", "v": 2, "at": -5, "job": "j", "worker": "w"}), "at"),
        (
            msgpack.packb(
                {"type": "Join", "v": 2, "at": 0, "job": "j", "worker": "w", "pid": 2**40}
            ),
            "pid",
        ),
        (msgpack.packb(msgpack.ExtType(5, b"x")), "extension"),
        (msgpack.packb([[[[[[]]]]]]), "not a map"),
    ],
)
def test_bad_bytes_raise_decode_error_naming_the_problem_and_keeping_the_raw(raw, reason) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(DecodeError) as caught:
        decode_command(raw)
    assert reason in caught.value.reason
    assert caught.value.raw in (raw, None) or caught.value.raw == bytes(raw)


def test_a_batch_of_facts_decodes_like_each_alone_and_names_its_bad_entry() -> None:
    facts = [StepCommitted(at=float(i), job="j", step=i, world=1) for i in range(5)]
    raws = [encode(f) for f in facts]
    assert decode_facts(raws) == [decode_fact(r) for r in raws] == facts
    bad = msgpack.packb({"type": "StepCommitted", "v": 1, "at": 0, "job": "j", "step": -1})
    with pytest.raises(DecodeError) as caught:
        decode_facts([*raws[:3], bad, *raws[3:]])
    assert caught.value.index == 3
    assert "step" in caught.value.reason and caught.value.raw == bad


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2048))
def test_random_bytes_never_escape_as_anything_but_decode_error(raw: bytes) -> None:
    try:
        decode_command(raw)
    except DecodeError as exc:
        assert exc.reason


GOOD = encode(StepCommitted(at=1.0, job="j", step=1, world=1))
FACT_BODY = msgpack.unpackb(GOOD)
# bodies near a valid fact: a field dropped, changed in type or value, or one too many
NEAR_FACTS = st.builds(
    lambda key, value, drop: {
        **{k: v for k, v in FACT_BODY.items() if not (drop and k == key)},
        **({} if drop else {key: value}),
    },
    st.sampled_from([*FACT_BODY, "extra", "v"]),
    st.none()
    | st.integers(-3, 2**64 - 1)
    | st.text(max_size=4)
    | st.floats()
    | st.lists(st.none(), max_size=2),
    st.booleans(),
)


@settings(max_examples=400, deadline=None)
@given(
    st.binary(max_size=256)
    | NEAR_FACTS.map(msgpack.packb)
    | st.builds(
        lambda body, tail: msgpack.packb(body) + tail, NEAR_FACTS, st.binary(min_size=1, max_size=4)
    )
)
def test_a_batch_accepts_and_rejects_exactly_what_decoding_one_at_a_time_does(raw: bytes) -> None:
    try:
        alone = decode_fact(raw)
    except DecodeError as exc:
        with pytest.raises(DecodeError) as caught:
            decode_facts([GOOD, raw, GOOD])
        assert (caught.value.index, caught.value.reason) == (1, exc.reason)
    else:
        assert decode_facts([GOOD, raw, GOOD]) == [decode_fact(GOOD), alone, decode_fact(GOOD)]


BEAT = encode(Heartbeat(at=1.0, job="j", worker="w", step=3, world=1))
BEAT_BODY = msgpack.unpackb(BEAT)
NEAR_BEATS = st.builds(  # a field dropped, changed in type or value, or one too many
    lambda key, value, drop: {
        **{k: v for k, v in BEAT_BODY.items() if not (drop and k == key)},
        **({} if drop else {key: value}),
    },
    st.sampled_from([*BEAT_BODY, "extra", "v"]),
    st.none()
    | st.integers(-3, 2**64 - 1)
    | st.text(max_size=4)
    | st.sampled_from(["StepDone", "Join", "../w", "1.5", "j"])
    | st.floats()
    | st.booleans(),
    st.booleans(),
)


def _outcome(decoded: object) -> object:
    return decoded.reason if isinstance(decoded, DecodeError) else decoded


@settings(max_examples=400, deadline=None)
@given(st.lists(st.binary(max_size=64) | NEAR_BEATS.map(msgpack.packb) | st.just(BEAT), max_size=6))
def test_commands_decoded_as_a_batch_are_what_each_decodes_to_alone(raws: list[bytes]) -> None:
    """The leader's batch door accepts and refuses, with the same reasons, exactly what
    `decode_command` does one entry at a time."""
    alone = []
    for raw in raws:
        try:
            alone.append(decode_command(raw))
        except DecodeError as exc:
            alone.append(exc.reason)
    assert [_outcome(d) for d in decode_commands(raws)] == alone


@pytest.mark.parametrize(
    "raw, reason",
    [
        (b"\xc0" * (MAX_FACT_BYTES + 1), f"the limit is {MAX_FACT_BYTES}"),
        (msgpack.packb({**FACT_BODY, **{f"k{i}": i for i in range(MAX_MAP_LEN)}}), "not msgpack"),
        (msgpack.packb(msgpack.ExtType(5, b"x")), "extension"),
        (msgpack.packb([FACT_BODY]), "not a map"),
        (msgpack.packb({**FACT_BODY, "type": 7}), "no string 'type'"),
        (
            (FIXTURES / "Join.v1.msgpack").read_bytes(),
            "invalid 'Join' fact",
        ),  # upcast, then refused
    ],
)
def test_a_batch_names_each_kind_of_bad_entry_as_one_alone_would(raw: bytes, reason: str) -> None:
    with pytest.raises(DecodeError) as caught:
        decode_facts([GOOD, GOOD, raw])
    assert caught.value.index == 2 and reason in caught.value.reason


@pytest.mark.parametrize(
    "raw, event_type",
    [
        (msgpack.packb({**FACT_BODY, "step": -1}), "StepCommitted"),
        (msgpack.packb({**FACT_BODY, "type": "FromANewerCohort"}), "FromANewerCohort"),
        ((FIXTURES / "Join.v1.msgpack").read_bytes(), "Join"),
        (msgpack.packb({**FACT_BODY, "type": 7}), None),
        (msgpack.packb([FACT_BODY]), None),
        (b"\x93not an event", None),
    ],
)
def test_a_decode_error_names_the_event_type_its_envelope_named_as_a_field(
    raw: bytes, event_type: str | None
) -> None:
    with pytest.raises(DecodeError) as alone:
        decode_fact(raw)
    with pytest.raises(DecodeError) as in_a_batch:
        decode_facts([GOOD, raw])
    assert alone.value.event_type == in_a_batch.value.event_type == event_type


def test_a_command_s_decode_error_names_its_event_type_too() -> None:
    body = msgpack.unpackb(encode(Leave(at=1.0, job="j", worker="w")))
    with pytest.raises(DecodeError) as caught:
        decode_command(msgpack.packb({**body, "worker": ""}))
    assert caught.value.event_type == "Leave" and "Leave" in caught.value.reason


def test_a_page_read_keeps_each_fact_and_the_error_of_each_entry_that_has_none() -> None:
    bad = msgpack.packb({**FACT_BODY, "step": -1})
    rows = [Entry(f"1-{i}", {FIELD: raw}) for i, raw in enumerate([GOOD, bad, GOOD])]
    read = Journal.read_page(rows)
    assert read[0] == read[2] == decode_fact(GOOD)
    assert isinstance(read[1], DecodeError) and read[1].index == 1
    assert Journal.read_page(rows[:1]) == [decode_fact(GOOD)]


def test_a_leader_election_is_found_by_what_an_entry_is_never_by_its_bytes() -> None:
    elected = LeaderElected(at=1.0, job="j", coordinator="c2", epoch=2)
    named = WorkerJoined(at=1.0, job="j", worker="LeaderElected")  # the bytes, not the fact
    assert elects([decode_fact(GOOD), elected])
    assert not elects([decode_fact(GOOD), named])
    assert elects([DecodeError("invalid 'LeaderElected' fact", event_type="LeaderElected")])
    assert not elects([DecodeError("entry mentions LeaderElected but names no type")])


def test_a_v4_job_config_started_its_first_world_at_min_workers() -> None:
    fact = decode_fact((FIXTURES / "JobConfigured.v4.msgpack").read_bytes())
    assert isinstance(fact, JobConfigured)
    assert fact.v == CURRENT
    assert fact.config.disconnect_grace == 0.5 and fact.config.min_workers == 2
    assert (fact.config.start_workers, fact.config.start_wait) == (None, 30.0)


def test_a_v5_job_config_summed_in_floating_point_even_strided_with_a_global_batch() -> None:
    """Exact sums deal a strided step in whole units: a v5 job dealt item by item, and must
    replay so."""
    fact = decode_fact((FIXTURES / "JobConfigured.v5.msgpack").read_bytes())
    assert isinstance(fact, JobConfigured)
    assert (fact.v, fact.config.reduction, fact.config.exact) == (CURRENT, "float", False)
    assert (fact.config.placement, fact.config.global_batch) == ("strided", 96)
    today = JobConfig(dataset_size=512, batch_size=16, global_batch=96, placement="strided")
    assert today.exact  # a job configured now is exact there by default


def test_a_v6_job_config_placed_no_shard_groups() -> None:
    """Before v7 the leader knew no shard groups: survivors closed up in rank order."""
    fact = decode_fact((FIXTURES / "JobConfigured.v6.msgpack").read_bytes())
    assert isinstance(fact, JobConfigured)
    assert (fact.v, fact.config.shard_group, fact.config.reduction) == (CURRENT, None, "exact")
