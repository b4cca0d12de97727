"""Whoever may append to the inbox may choose an entry's ID, its fields and its size; none of
it moves the leader's clock, stops the leader or erases the evidence (issue 33).

- An entry's ID counts as its arrival only up to the server's time: an entry further ahead
  stops the read, is journaled (InboxRepaired) and moved behind the server's clock with
  every entry after it, so honest workers go on being judged by real time.
- Unread entries someone else deleted are found and journaled once.
- Every refused entry is a bounded dead letter, and the refusals are journaled by sender
  and kind (CommandsRefused), so they outlive the capped stream and the leader.
"""

from __future__ import annotations

import logging

import pytest
import redis

from cohort.coordinator import decide, refusals
from cohort.coordinator.liveness import Liveness
from cohort.coordinator.service import MAX_ENTRY_BYTES, Coordinator
from cohort.coordinator.stores import DeadLetter
from cohort.events.codec import FIELD, encode
from cohort.events.models import (
    CommandsRefused,
    Heartbeat,
    InboxRepaired,
    Refusal,
    WorkerFailed,
)
from tests.unit.job import Job
from tests.unit.memory import MAX_ID
from tests.unit.test_identity_service import Signed, signer, training
from tests.unit.test_service import JOB, Setup, leader_of

HOUR_MS = 3_600_000


def now_ms(setup: Setup) -> int:
    return int(setup.clock.now() * 1000)


def beat(setup: Signed, *workers: str) -> None:
    for worker in workers:
        setup.send_as(worker, Heartbeat(at=0, job=JOB, worker=worker, step=0, world=1))


def run_for(leader: Coordinator, setup: Signed, seconds: float, beating: tuple[str, ...]) -> None:
    """Half-second turns for `seconds`, the `beating` workers heartbeating each turn."""
    for _ in range(int(seconds * 2)):
        setup.clock.advance(0.5)
        beat(setup, *beating)
        leader.step()


def facts_of(setup: Setup, kind: type) -> list:
    return [fact for fact in setup.log.facts() if isinstance(fact, kind)]


def test_an_entry_an_hour_ahead_moves_no_clock_and_fails_no_honest_worker() -> None:
    setup = Signed()
    leader = training(setup)
    ahead = setup.log.send_at(f"{now_ms(setup) + HOUR_MS}-0", {FIELD: b"x"})
    beat(setup, "a", "b")  # honest entries behind it get IDs an hour ahead too

    leader.step()

    (repaired,) = facts_of(setup, InboxRepaired)
    assert (repaired.trouble, repaired.entry) == ("ahead", ahead)
    assert repaired.ahead_s == pytest.approx(3600, abs=2)
    assert max(int(e.id.split("-")[0]) for e in setup.log.inbox) <= now_ms(setup) + 1000
    run_for(leader, setup, 20, beating=("a", "b"))
    assert not facts_of(setup, WorkerFailed)
    assert setup.log.dead and "unsigned" in setup.log.dead[0].reason
    assert setup.log.dead[0].inbox_id != ahead  # it was moved, then refused at its new ID

    run_for(leader, setup, 7, beating=("a",))  # b goes silent: time still passes

    (failed,) = facts_of(setup, WorkerFailed)
    assert failed.worker == "b"
    assert failed.at <= setup.clock.now()


def test_the_largest_id_a_stream_allows_costs_the_inbox_one_turn() -> None:
    setup = Signed()
    leader = training(setup)
    setup.log.send_at(f"{MAX_ID}-{MAX_ID}", {FIELD: b"x"})
    with pytest.raises(Exception, match="exhausted"):
        beat(setup, "a")

    leader.step()

    beat(setup, "a", "b")  # the inbox takes entries again
    run_for(leader, setup, 10, beating=("a", "b"))
    assert not facts_of(setup, WorkerFailed)
    assert [f.trouble for f in facts_of(setup, InboxRepaired)] == ["ahead"]
    assert set(leader.state.ranks) == {"a", "b"}


def test_unread_entries_deleted_by_someone_else_are_journaled_once() -> None:
    setup = Signed()
    leader = training(setup)
    beat(setup, "a", "b")
    setup.log.delete_unread(2)

    run_for(leader, setup, 3, beating=("a", "b"))

    (lost,) = facts_of(setup, InboxRepaired)
    assert lost.trouble == "lost"
    assert "deleted" in lost.reason
    assert not facts_of(setup, WorkerFailed)


def test_refusals_are_journaled_by_sender_and_kind_and_a_new_leader_keeps_the_count() -> None:
    setup = Signed()
    leader = training(setup)
    for _ in range(20):  # unsigned, claiming b
        setup.log.send(Heartbeat(at=0, job=JOB, worker="b", step=0, world=1))
    for _ in range(3):  # a's own credential, speaking for b
        setup.send_as("a", Heartbeat(at=0, job=JOB, worker="b", step=0, world=1))
    junk = b"\xc1 not msgpack"
    setup.log.send_raw(junk)  # unsigned too: refused at the signature, before decoding

    run_for(leader, setup, refusals.EVERY + 1, beating=("a", "b"))

    (fact,) = facts_of(setup, CommandsRefused)
    assert set(fact.refusals) == {
        Refusal(sender="b", verified=False, kind="forged", count=20, bytes=fact.refusals[0].bytes),
        Refusal(sender="a", verified=True, kind="forged", count=3, bytes=_bytes(fact, "a")),
        Refusal(sender="unknown", kind="forged", count=1, bytes=len(FIELD) + len(junk)),
    }
    assert (leader.state.counters.dead_letters, leader.state.counters.forged) == (24, 24)
    leader.close()
    successor = setup.coordinator("c2")
    successor.step()
    assert successor.leading
    assert (successor.state.counters.dead_letters, successor.state.counters.forged) == (24, 24)


def _bytes(fact: CommandsRefused, sender: str) -> int:
    return next(r.bytes for r in fact.refusals if r.sender == sender)


def test_dead_letters_are_logged_a_few_per_sender_then_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    setup = Signed()
    leader = training(setup)
    caplog.set_level(logging.WARNING, logger="cohort.coordinator")
    for _ in range(100):
        setup.log.send(Heartbeat(at=0, job=JOB, worker="b", step=0, world=1))

    leader.step()
    run_for(leader, setup, refusals.WINDOW + 1, beating=("a", "b"))

    lines = [r.getMessage() for r in caplog.records if "dead letter" in r.getMessage()]
    assert len([line for line in lines if line.startswith("dead letter ")]) == refusals.LINES
    assert f"{100 - refusals.LINES} more dead letters from {refusals.UNPROVEN}" in lines[-1]


def test_an_oversized_entry_is_dead_lettered_undecoded_as_a_bounded_record() -> None:
    setup = Signed()
    leader = training(setup)
    big = b"\x00" * (MAX_ENTRY_BYTES + 1)
    entry_id = setup.log.send_raw(big)

    leader.step()

    (letter,) = setup.log.dead
    assert (letter.inbox_id, letter.kind, letter.size) == (entry_id, "oversized", len(big) + 1)
    assert len(letter.raw) <= DeadLetter.HEAD_BYTES
    assert str(MAX_ENTRY_BYTES) in letter.reason


def test_a_command_the_core_cannot_decide_is_a_dead_letter_and_the_leader_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    setup = Setup()
    leader = leader_of(setup)
    setup.join("a")
    leader.step()
    real = decide.decide

    def broken(state, seen, command, now):  # type: ignore[no-untyped-def]
        if isinstance(command, Heartbeat):
            raise ValueError("a bug of ours")
        return real(state, seen, command, now)

    monkeypatch.setattr(decide, "decide", broken)
    entry_id = setup.log.send(Heartbeat(at=0, job=JOB, worker="a", step=0, world=1))
    setup.join("b")

    leader.step()

    (letter,) = setup.log.dead
    assert (letter.inbox_id, letter.kind) == (entry_id, "undecidable")
    assert "a bug of ours" in letter.reason
    assert "b" in leader.state.members


def test_a_refusal_tally_beyond_its_rows_is_summed_as_other() -> None:
    tally = refusals.Refusals()
    letters = [
        DeadLetter.of(f"1-{i}", "unsigned", b"x", "forged", (f"w{i}", False))
        for i in range(refusals.MAX_REFUSAL_ROWS + 10)
    ]
    tally.add(letters, now=0.0)

    fact = tally.fact(JOB, now=1.0)

    assert len(fact.refusals) == refusals.MAX_REFUSAL_ROWS + 1
    assert fact.refusals[-1] == Refusal(sender="other", kind="forged", count=10)
    assert (fact.first, fact.last) == ("1-0", f"1-{refusals.MAX_REFUSAL_ROWS + 9}")
    assert sum(r.count for r in fact.refusals) == len(letters)


def test_an_inbox_run_ahead_every_turn_is_repaired_every_turn_and_journaled_every_5_s() -> None:
    """A worker that XADDs far ahead every half second cannot grow the journal that fast:
    each is repaired at once, the first journaled, the rest counted in the next fact."""
    setup = Signed()
    leader = training(setup)
    for _ in range(20):
        setup.log.send_at(f"{now_ms(setup) + HOUR_MS}-0", {FIELD: b"x"})
        run_for(leader, setup, 0.5, beating=("a", "b"))

    repaired = facts_of(setup, InboxRepaired)
    assert 2 <= len(repaired) <= 3  # 10 s of it
    assert "more troubles since, repaired alike" in repaired[1].reason
    assert max(int(e.id.split("-")[0]) for e in setup.log.inbox) <= now_ms(setup) + 1000
    assert not facts_of(setup, WorkerFailed)


def test_a_leader_whose_user_may_not_look_at_the_inbox_says_how_to_fix_it_and_leads_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A coordinator user applied by an older cohort lacks XINFO: said once, never fatal."""
    setup = Signed()
    leader = training(setup)

    def refused(cursor: str) -> None:
        raise redis.exceptions.NoPermissionError("NOPERM this user has no permissions")

    monkeypatch.setattr(setup.log, "inbox_marks", refused)
    with caplog.at_level(logging.ERROR, logger="cohort.coordinator"):
        run_for(leader, setup, 5, beating=("a", "b"))

    said = [r.getMessage() for r in caplog.records if "look at the inbox" in r.getMessage()]
    assert len(said) == 1 and "--role coordinator --apply" in said[0]
    assert leader.leading and not facts_of(setup, WorkerFailed)


# ---------------------------------------------------------------- issue 48: an unusable inbox


def test_time_the_inbox_could_take_no_entry_is_nobodys_silence() -> None:
    """From an entry ahead of the clock to its repair no worker can be heard: that span is
    left out of every member's silence, and only that span (a fake clock, the pure rule)."""
    job = Job(min_workers=1, heartbeat_interval=1, heartbeat_timeout=3)
    job.start("a", "b")
    job.step()
    job.alive("a", "b")
    heard = job.now
    job.core.seen.blind(heard + 1.0, heard + 3.5)  # 2.5 s the inbox refused every XADD

    assert job.advance(4.0) == ()  # 4 s since heard, 1.5 s of it silence
    job.alive("a")
    assert job.advance(1.4) == ()  # b: 2.9 s of silence
    facts = job.advance(0.2)  # b: 3.1 s

    failed = next(f for f in facts if isinstance(f, WorkerFailed))
    assert (failed.worker, failed.last_seen) == ("b", heard)
    assert job.state.ranks == ("a",)


def test_spans_of_an_unusable_inbox_add_up_and_overlapping_ones_count_once() -> None:
    seen = Liveness()
    seen.blind(10.0, 11.0)
    seen.blind(12.0, 13.0)
    seen.blind(12.5, 13.5)  # seen again before the first repair of it was recorded
    seen.blind(14.0, 14.0)  # nothing

    assert seen.blinded == [(10.0, 11.0), (12.0, 13.5)]
    assert seen.silence(9.0, 16.0) == pytest.approx(7.0 - 1.0 - 1.5)
    assert seen.silence(12.5, 13.0) == pytest.approx(0.0)  # heard inside a span
    assert seen.silence(13.5, 16.0) == pytest.approx(2.5)  # heard after them all


def test_an_entry_ahead_soon_after_the_last_repair_is_repaired_in_the_turn_that_sees_it() -> None:
    """The repair never waits for the rate-limited InboxRepaired (issue 48): the largest ID,
    half a second after an hour-ahead entry was repaired, jams the inbox for one turn; the
    trouble is journaled once the rate limit lets it through, and every one is counted.
    (a's own heartbeats, signed: no dead letter makes the turn write anything.)"""
    setup = Signed()
    leader = training(setup)

    def ahead(entry_id: str) -> None:
        fields = signer("a").fields(encode(Heartbeat(at=0, job=JOB, worker="a", step=0, world=1)))
        setup.log.send_at(entry_id, fields)

    ahead(f"{now_ms(setup) + HOUR_MS}-0")
    leader.step()
    run_for(leader, setup, 0.5, beating=("a", "b"))
    ahead(f"{MAX_ID}-{MAX_ID}")

    leader.step()

    beat(setup, "a", "b")  # taken at once: the inbox is in order again
    assert len(facts_of(setup, InboxRepaired)) == 1  # the second's evidence waits its turn
    for _ in range(3):  # the same ID again, each time within a second of the last repair
        setup.clock.advance(0.5)
        ahead(f"{MAX_ID}-{MAX_ID}")
        leader.step()
        beat(setup, "a", "b")
    run_for(leader, setup, 6, beating=("a", "b"))
    repaired = facts_of(setup, InboxRepaired)
    assert len(repaired) + sum(r.more for r in repaired) == 5
    assert not facts_of(setup, WorkerFailed)


def test_a_repair_redis_refuses_is_tried_every_turn_and_said_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The repair runs in every turn that finds the inbox out of order: where Redis refuses it
    (fakeredis, an older coordinator user), the error is said once, not once a turn."""
    setup = Signed()
    leader = training(setup)
    tried = 0

    def refused(token: str, cursor: str, limit: str) -> tuple[str, int, int]:
        nonlocal tried
        tried += 1
        raise redis.ResponseError("ERR unknown command 'XSETID'")

    monkeypatch.setattr(setup.log, "repair_inbox", refused)
    setup.log.send_at(f"{now_ms(setup) + HOUR_MS}-0", {FIELD: b"x"})
    with caplog.at_level(logging.ERROR, logger="cohort.coordinator"):
        for _ in range(5):
            setup.clock.advance(0.1)
            leader.step()

    assert tried == 5
    said = [r for r in caplog.records if "could not repair the inbox" in r.getMessage()]
    assert len(said) == 1


def test_the_span_excused_by_a_repair_starts_no_earlier_than_the_entry_ahead_could_arrive() -> None:
    """The entry ahead came after the last read that found the inbox in order, and after every
    entry before it: only from then on is silence excused, so an attacker who keeps the inbox
    out of order cannot keep a dead member alive for longer than the inbox was unusable."""
    setup = Signed()
    leader = training(setup)
    setup.clock.advance(0.5)
    leader.step()  # a read that found the inbox in order
    setup.clock.advance(2.0)
    heard = setup.clock.now()
    beat(setup, "a")  # read in the same turn as the entry ahead that follows it
    setup.log.send_at(f"{now_ms(setup) + HOUR_MS}-0", {FIELD: b"x"})
    setup.clock.advance(0.1)

    leader.step()

    assert leader.core.seen.blinded == [(heard, setup.clock.now())]
