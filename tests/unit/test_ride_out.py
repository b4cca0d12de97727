"""How long a worker rides out a Redis outage: the link counts outage time, and an operation
given `ride_out` gives up with one line naming the URL, what waited and the setting."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import pytest
import redis

from cohort.events.clock import ManualClock
from cohort.events.errors import SettingsError
from cohort.worker.errors import OutageTooLongError, RedisUnreachableError
from cohort.worker.membership.retry import (
    DEFAULT_RIDE_OUT,
    JAMMED_RETRY,
    Link,
    ride_out_of,
    with_retry,
)


def test_the_link_counts_outage_time_across_outages() -> None:
    clock = ManualClock()
    link = Link(logging.getLogger("test"), "redis://r:1/0", clock=clock.monotonic)
    link.restored()
    link.lost(redis.ConnectionError("gone"), "x")
    clock.advance(30.0)
    assert link.down_for() == link.outage() == 30.0
    link.restored()
    clock.advance(100.0)  # Redis answers: none of this counts
    assert link.down_for() == 0.0 and link.outage() == 30.0
    link.lost(redis.ConnectionError("gone"), "x")
    clock.advance(5.0)
    assert link.outage() == 35.0


def test_an_outage_longer_than_the_ride_out_ends_the_operation_naming_it() -> None:
    clock = ManualClock()
    link = Link(logging.getLogger("test"), "redis://r:1/0", clock=clock.monotonic)
    calls = 0

    def op() -> None:
        nonlocal calls
        calls += 1
        clock.advance(100.0)  # each attempt finds Redis still away, 100 s later
        raise redis.ConnectionError("Connection refused")

    with pytest.raises(OutageTooLongError) as caught:
        with_retry(op, threading.Event(), link, "allreduce of step 7", ride_out=250.0)
    assert calls == 4  # the outage began at the first failure: 0, 100, 200, then 300 > 250 s
    message = str(caught.value)
    assert "unreachable for 300 s" in message and "redis://r:1/0" in message
    assert "allreduce of step 7" in message
    assert "250 s" in message and "COHORT_RIDE_OUT" in message
    assert isinstance(caught.value, RedisUnreachableError)  # the CLI exits 3 naming it


def test_an_operation_that_succeeds_within_the_ride_out_returns() -> None:
    clock = ManualClock()
    link = Link(logging.getLogger("test"), "redis://r:1/0", clock=clock.monotonic)
    answers = iter([redis.ConnectionError("away"), redis.ConnectionError("away"), "ok"])

    def op() -> str:
        clock.advance(100.0)
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert with_retry(op, threading.Event(), link, "x", ride_out=250.0) == "ok"
    assert not link.down and link.outage() == 200.0


def test_ride_out_comes_from_the_environment_and_bad_values_are_named() -> None:
    assert ride_out_of(env={}) == DEFAULT_RIDE_OUT >= 300
    assert ride_out_of(env={"COHORT_RIDE_OUT": "90"}) == 90.0
    assert ride_out_of(12.0, env={"COHORT_RIDE_OUT": "90"}) == 12.0
    for bad in ("soon", "-1", "0", "inf"):
        with pytest.raises(SettingsError, match=f"COHORT_RIDE_OUT '{bad}'"):
            ride_out_of(env={"COHORT_RIDE_OUT": bad})


def answering(*answers: str | Exception) -> Callable[[], str]:
    """An operation that raises or returns each of `answers` in turn."""
    left = iter(answers)

    def op() -> str:
        answer = next(left)
        if isinstance(answer, Exception):
            raise answer
        return answer

    return op


def test_a_write_refused_for_memory_waits_when_asked_and_is_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    link = Link(logging.getLogger("test.full"), "redis://r:1/0")
    op = answering(redis.OutOfMemoryError("full"), redis.OutOfMemoryError("full"), "id")

    with caplog.at_level(logging.WARNING, logger="test.full"):
        got = with_retry(op, threading.Event(), link, "sending Heartbeat", wait_for_memory=True)
    assert got == "id"
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "maxmemory" in warnings[0] and "nothing is dropped" in warnings[0]
    with pytest.raises(redis.OutOfMemoryError):  # not asked: the caller handles it
        with_retry(lambda: (_ for _ in ()).throw(redis.OutOfMemoryError("full")),
                   threading.Event(), link, "x")  # fmt: skip


def test_an_append_to_a_stream_whose_ids_ran_out_waits_for_the_repair_and_is_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Another writer's XADD with the largest ID jams the inbox until the leader repairs it
    (issue 33): the worker's command waits, it is neither dropped nor fatal."""
    link = Link(logging.getLogger("test.jammed"), "redis://r:1/0")
    exhausted = "The stream has exhausted the last possible ID, unable to add more items"
    op = answering(redis.ResponseError(exhausted), redis.ResponseError(exhausted), "id")

    with caplog.at_level(logging.WARNING, logger="test.jammed"):
        got = with_retry(op, threading.Event(), link, "sending Heartbeat", cap=0.01)
    assert got == "id"
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "leader repairs it" in warnings[0]
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):  # other refusals: at once
        with_retry(lambda: (_ for _ in ()).throw(redis.ResponseError("WRONGTYPE")),
                   threading.Event(), link, "x")  # fmt: skip


class Waits:
    """A stop event that is never set and records how long each wait asked for."""

    def __init__(self) -> None:
        self.asked: list[float] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.asked.append(timeout or 0.0)
        return False


def test_an_append_a_jammed_stream_refused_is_tried_again_soon_after_the_repair() -> None:
    """The leader repairs a jammed inbox in the turn that sees it (issue 48): however long
    the jam lasted, the worker's next attempt comes within JAMMED_RETRY, not a backoff grown
    to seconds that its heartbeat timeout would count as silence."""
    exhausted = redis.ResponseError("The stream has exhausted the last possible ID")
    waits = Waits()
    op = answering(*[exhausted] * 30, "id")

    got = with_retry(op, waits, Link(logging.getLogger("test"), "redis://r:1/0"), "x")

    assert got == "id"
    assert len(waits.asked) == 30 and max(waits.asked) <= JAMMED_RETRY
