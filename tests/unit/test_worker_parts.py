"""The pieces a Worker is made of, each alone: the stamp on its commands, its signal handling,
its heartbeat's pace, its GPU advice channel, its journal follower and its join request.

No thread is needed but the follower's own tail, and every wait is bounded.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any

import fakeredis
import msgpack
import pytest

from cohort.events import models as m
from cohort.events.clock import ManualClock
from cohort.events.codec import encode
from cohort.events.keys import Keys
from cohort.events.shards import Shard
from cohort.events.streams import Journal
from cohort.worker.errors import Stopped, WaitTimeoutError, WorkerError
from cohort.worker.membership import signals
from cohort.worker.membership.advice import AdviceChannel
from cohort.worker.membership.following import JournalFollower
from cohort.worker.membership.heartbeat import DEFAULT_HEARTBEAT, HeartbeatThread
from cohort.worker.membership.joining import JoinRequest
from cohort.worker.membership.retry import Link
from cohort.worker.membership.signals import ShutdownSignals
from cohort.worker.membership.stamp import Stamp
from cohort.worker.membership.view import View

JOB = "unit"
ME = "w-me"
LOG = logging.getLogger("cohort.worker")


def fact(cls: type[Any], **body: Any) -> Any:
    return cls(at=1.0, job=JOB, **body)


def world(version: int) -> m.WorldChanged:
    shards = (Shard(ranges=((0, 10),)),)
    return fact(m.WorldChanged, version=version, start_step=0, epoch=0, ranks=(ME,), shards=shards)


def unreadable(event_type: str) -> bytes:
    """An entry whose envelope names `event_type` but whose body is not one."""
    return msgpack.packb({"type": event_type, "v": 1, "at": 1.0, "job": JOB}, use_bin_type=True)


# ---------------------------------------------------------------- the stamp


def test_a_stamp_heads_a_command_with_the_clock_s_time_the_job_and_the_worker() -> None:
    clock = ManualClock(100.0)
    stamp = Stamp(clock, JOB, ME)
    first = stamp(m.Leave, reason="done")
    clock.advance(5)
    second = stamp(m.Heartbeat, step=3, world=1)
    assert (first.at, first.job, first.worker, first.reason) == (100.0, JOB, ME, "done")
    assert (second.at, second.step) == (105.0, 3)


def test_a_stamp_lets_pydantic_refuse_a_field_the_command_does_not_have() -> None:
    with pytest.raises(ValueError, match="bogus"):
        Stamp(ManualClock(), JOB, ME)(m.Leave, bogus=1)


# ---------------------------------------------------------------- signals


def test_the_first_signal_asks_to_stop_and_the_second_exits_now(monkeypatch) -> None:
    exits: list[int] = []
    monkeypatch.setattr("cohort.worker.membership.signals.os._exit", exits.append)
    stopping = threading.Event()
    handler = ShutdownSignals(stopping, LOG, ME, JOB)
    handler.on_signal(signal.SIGTERM, None)
    assert stopping.is_set() and exits == []
    handler.on_signal(signal.SIGINT, None)
    assert exits == [signals.EXIT_NOW] == [130]


def test_a_signal_after_the_leave_cuts_nothing_short_and_gives_the_script_its_handlers_back(
    monkeypatch, caplog
) -> None:
    exits: list[int] = []
    monkeypatch.setattr("cohort.worker.membership.signals.os._exit", exits.append)

    def the_script_s(signum: int, frame: object) -> None:
        pass

    before = signal.signal(signal.SIGTERM, the_script_s)
    try:
        handler = ShutdownSignals(threading.Event(), LOG, ME, JOB)
        handler.install()
        assert signal.getsignal(signal.SIGTERM) == handler.on_signal
        handler.on_signal(signal.SIGTERM, None)  # stopping: the loop finishes its step
        handler.left = True  # ... and leaves
        handler.on_signal(signal.SIGTERM, None)
        assert exits == []
        assert signal.getsignal(signal.SIGTERM) is the_script_s
        assert "has already left job 'unit'" in caplog.text
    finally:
        signal.signal(signal.SIGTERM, before)
        signal.signal(signal.SIGINT, signal.default_int_handler)


# ---------------------------------------------------------------- the heartbeat's pace


@pytest.mark.parametrize(
    "given, config, expected",
    [
        (0.5, m.JobConfig(heartbeat_interval=2.0), 0.5),
        (None, m.JobConfig(heartbeat_interval=2.0), 2.0),
        (None, None, DEFAULT_HEARTBEAT),
    ],
)
def test_the_heartbeat_interval_is_the_given_one_else_the_job_s_else_the_default(
    given, config, expected
) -> None:
    view = View(worker=ME, config=config)
    beat = HeartbeatThread(
        lambda command: None,
        Stamp(ManualClock(), JOB, ME),
        lambda: view,
        lambda: None,
        threading.Event(),
        LOG,
        given,
    )
    assert beat.interval() == expected


# ---------------------------------------------------------------- the GPU advice channel


class Sent:
    """What a channel sends (waiting) and posts (not waiting)."""

    def __init__(self) -> None:
        self.sent: list[Any] = []
        self.posted: list[Any] = []

    def send(self, command: Any) -> None:
        self.sent.append(command)

    def post(self, command: Any) -> None:
        self.posted.append(command)


def channel(view: View, out: Sent) -> AdviceChannel:
    return AdviceChannel(Stamp(ManualClock(), JOB, ME), out.send, out.post, lambda: view, LOG)


def test_gpu_readings_and_transfer_reports_go_out_only_while_a_member() -> None:
    out = Sent()
    device = m.GpuDevice(index=0)
    outside = channel(View(worker=ME), out)
    outside.send_reading((device,))
    outside.report_transfers({"pending": 1, "staged": 0, "delayed_seconds": 0.0})
    assert out.sent == out.posted == []
    member = channel(View(worker=ME, members=frozenset({ME})), out)
    member.send_reading((device,))
    member.report_transfers({"pending": 2, "staged": 1, "delayed_seconds": 3.0})
    assert [c.type for c in out.sent] == ["GpuReading"]
    (waiting,) = out.posted  # a report does not wait for Redis
    assert (waiting.worker, waiting.pending, waiting.staged, waiting.delayed) == (ME, 2, 1, 3.0)


def test_a_failed_advice_callback_is_logged_and_the_others_still_hear_the_advice(caplog) -> None:
    caplog.set_level(logging.INFO, "cohort.worker")
    advice = fact(
        m.GpuAdviceIssued,
        worker=ME,
        device=0,
        rule="hot",
        action="reduce_prefetch",
        factor=0.5,
        metric="temperature",
        value=90.0,
        threshold=85.0,
    )
    view = View(worker=ME, advice=(advice,))
    gpu = channel(view, Sent())
    heard: list[float] = []

    def broken(_: object) -> None:
        raise RuntimeError("boom")

    gpu.on_advice(broken)
    gpu.on_advice(lambda a: heard.append(a.prefetch_factor))
    gpu.advice_changed(view)
    assert heard == [0.5] and gpu.advice.prefetch_factor == 0.5
    assert "GPU advice callback" in caplog.text and "prefetch x0.5" in caplog.text


def test_a_workload_with_a_bad_value_raises_value_error_naming_it() -> None:
    with pytest.raises(ValueError, match="workload memory=-1"):
        channel(View(worker=ME), Sent()).register_workload("train", (0,), -1, 0, None)


# ---------------------------------------------------------------- the journal follower


@pytest.fixture
def journal() -> Journal:
    return Journal(fakeredis.FakeRedis(), Keys(JOB).journal)


def follower(journal: Journal, stop: threading.Event) -> JournalFollower:
    return JournalFollower(
        journal,
        JOB,
        ME,
        Link(LOG, "fake"),
        stop,
        LOG,
        world_changed=threading.Event(),
        config_changed=threading.Event(),
        advice_changed=lambda view: None,
    )


def test_the_follower_skips_what_it_cannot_read_warning_once_per_event_type(
    journal, caplog
) -> None:
    caplog.set_level(logging.DEBUG, "cohort.worker")
    for raw in (unreadable("WorldChanged"), unreadable("WorldChanged"), unreadable("Future")):
        journal.append_raw(raw)
    journal.append_raw(encode(world(1)))
    follow = follower(journal, threading.Event())
    follow.catch_up(None, threading.Event())
    assert follow.view.world_version == 1  # the fact after the bad entries got through
    warned = [r for r in caplog.records if "cannot read" in r.message]
    assert [r.levelno for r in warned] == [logging.WARNING, logging.DEBUG, logging.WARNING]
    assert "invalid 'WorldChanged' fact" in warned[0].message


def test_a_new_leader_over_a_journal_that_lost_the_folded_entry_is_folded_again(
    journal, caplog
) -> None:
    def add(entry_id: str, raw: bytes) -> None:  # IDs of its own: a new stream's could be older
        journal.conn.xadd(journal.key, {b"e": raw}, id=entry_id)

    add("5-1", encode(world(1)))
    add("5-2", encode(world(2)))
    stop = threading.Event()
    follow = follower(journal, stop)
    follow.catch_up(None, threading.Event())
    assert follow.view.world_version == 2
    tail = threading.Thread(target=follow.run, daemon=True)
    tail.start()
    try:
        journal.conn.delete(journal.key)  # a failover to a replica that never saw them
        add("6-1", encode(world(1)))
        add("6-2", unreadable("LeaderElected"))  # known by its type alone
        view = follow.wait(lambda v: v.world_version == 1, time.monotonic() + 5, WaitTimeoutError)
        assert view.world_version == 1 and follow.world_changed.is_set()
        assert "folding it again from the start" in caplog.text
    finally:
        stop.set()
        tail.join(timeout=5)


def test_a_new_leader_over_a_journal_that_kept_everything_is_folded_on_from_where_it_was(
    journal, caplog
) -> None:
    journal.append_raw(encode(world(1)))
    stop = threading.Event()
    follow = follower(journal, stop)
    follow.catch_up(None, threading.Event())
    tail = threading.Thread(target=follow.run, daemon=True)
    tail.start()
    try:
        journal.append_raw(encode(fact(m.LeaderElected, coordinator="c2", epoch=2)))
        journal.append_raw(encode(world(2)))
        follow.wait(lambda v: v.world_version == 2, time.monotonic() + 5, WaitTimeoutError)
        assert "folding it again" not in caplog.text
    finally:
        stop.set()
        tail.join(timeout=5)


def test_a_wait_ends_with_stopped_once_its_stop_event_is_set(journal) -> None:
    follow = follower(journal, threading.Event())
    stop = threading.Event()
    stop.set()
    with pytest.raises(Stopped, match="'w-me' was stopped"):
        follow.wait(lambda v: False, time.monotonic() + 5, WaitTimeoutError, stop=stop)


# ---------------------------------------------------------------- the join request


def test_only_a_pending_join_is_withdrawn() -> None:
    out = Sent()

    class Delivery:
        def send(self, command: Any, deadline: Any = None, stop: Any = None) -> None:
            out.send(command)

    pending = threading.Event()
    request = JoinRequest(
        fakeredis.FakeRedis(),
        1.0,
        follower(Journal(fakeredis.FakeRedis(), "j"), threading.Event()),
        Delivery(),  # type: ignore[arg-type]
        Stamp(ManualClock(), JOB, ME),
        Link(LOG, "fake"),
        LOG,
        pending,
    )
    request.withdraw(WorkerError("nobody answered"))
    assert out.sent == []
    pending.set()
    request.withdraw(WorkerError("nobody answered"))
    (leave,) = out.sent
    assert (leave.type, leave.worker, leave.reason) == (
        "Leave",
        ME,
        "gave up joining: nobody answered",
    )
