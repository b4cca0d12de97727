"""The worker's outbox: posted commands go out in order, without the poster waiting."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from cohort.events import models as m
from cohort.worker.errors import Stopped, WorkerError
from cohort.worker.membership.outbox import Outbox
from tests.helpers import wait_until


def done(step: int) -> m.StepDone:
    return m.StepDone(at=1.0, job="unit", worker="w", step=step, world=1)


def step_of(command: m.Command) -> int:
    assert isinstance(command, m.StepDone)
    return command.step


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=1) as ex:
        yield ex


def test_posted_commands_are_delivered_in_the_order_they_were_posted() -> None:
    delivered: list[int] = []
    outbox = Outbox(lambda c: delivered.append(step_of(c)), "test-outbox")
    for step in range(50):
        outbox.post(done(step))
    outbox.flush()
    assert delivered == list(range(50))
    outbox.close()


def test_post_returns_before_delivery_and_flush_waits_for_it(pool: ThreadPoolExecutor) -> None:
    gate = threading.Event()
    delivered: list[int] = []

    def deliver(command: m.Command) -> None:
        gate.wait(10)
        delivered.append(step_of(command))

    outbox = Outbox(deliver, "test-outbox")
    outbox.post(done(0))  # returns while the delivery is held
    flushing = pool.submit(outbox.flush)
    assert delivered == [] and not flushing.done()
    gate.set()
    flushing.result(timeout=10)
    assert delivered == [0]
    outbox.close()


def test_flush_with_nothing_posted_returns_at_once() -> None:
    outbox = Outbox(lambda c: None, "test-outbox")
    outbox.flush()
    outbox.close()
    outbox.flush()  # nothing was posted: nothing is owed, closed or not


def test_a_failed_delivery_is_raised_by_the_next_flush_and_post() -> None:
    def deliver(command: m.Command) -> None:
        raise ValueError(f"refused step {step_of(command)}")

    outbox = Outbox(deliver, "test-outbox")
    outbox.post(done(7))
    with pytest.raises(WorkerError, match="test-outbox could not deliver.*refused step 7") as info:
        outbox.flush()
    assert isinstance(info.value.__cause__, ValueError)
    with pytest.raises(WorkerError, match="refused step 7"):
        outbox.post(done(8))
    outbox.close()


def test_a_stopped_delivery_drops_the_rest_and_waiters_are_told() -> None:
    stop = threading.Event()
    delivered: list[int] = []

    def deliver(command: m.Command) -> None:
        if step_of(command) == 0:  # as a delivery retrying through an outage when stopped
            stop.wait(10)
            raise Stopped("stopped while sending StepDone")
        delivered.append(step_of(command))

    outbox = Outbox(deliver, "test-outbox")
    outbox.post(done(0))
    outbox.post(done(1))
    stop.set()
    with pytest.raises(Stopped):
        outbox.flush()
    outbox.close()
    assert delivered == []
    with pytest.raises(Stopped):
        outbox.post(done(2))


class FakeWire:
    """A wire that records what it wrote; `refuse` writes fail, `lose` replies never land."""

    def __init__(self) -> None:
        self.written: list[int] = []
        self.landed_: list[int] = []
        self.refuse = False
        self.lose = False
        self.closed = 0

    def write(self, command: m.Command) -> bool:
        if self.refuse:
            return False
        self.written.append(step_of(command))
        return True

    def landed(self, wait: float) -> bool:
        if self.lose:
            return False
        self.landed_.append(self.written[-1])
        return True

    def close(self, drop: bool = False) -> None:
        self.closed += 1


def test_with_a_wire_the_poster_writes_each_command_and_the_next_post_reads_its_reply() -> None:
    delivered: list[int] = []
    wire = FakeWire()
    outbox = Outbox(lambda c: delivered.append(step_of(c)), "test-outbox", wire)
    for step in range(5):
        outbox.post(done(step))
        assert wire.landed_ == list(range(step))  # the one before, read as this one goes
    outbox.flush()
    assert wire.written == wire.landed_ == list(range(5))
    assert delivered == []  # no thread was needed
    outbox.close()
    assert wire.closed == 1


def test_a_command_that_did_not_land_is_sent_again_before_any_later_one() -> None:
    delivered: list[int] = []
    wire = FakeWire()
    outbox = Outbox(lambda c: delivered.append(step_of(c)), "test-outbox", wire)
    outbox.post(done(0))
    wire.lose = True
    outbox.post(done(1))  # 0's reply does not come: 0 goes to the retrying thread, then 1
    outbox.post(done(2))
    outbox.flush()
    assert wire.written[0] == 0 and wire.landed_ == []
    assert delivered == [0, 1, 2]  # the lost one first, then the rest, in order
    outbox.close()


def test_while_the_thread_has_commands_the_wire_waits_so_nothing_overtakes_them() -> None:
    gate = threading.Event()
    sent: list[int] = []

    def deliver(command: m.Command) -> None:
        gate.wait(10)
        sent.append(step_of(command))

    wire = FakeWire()
    wire.refuse = True
    outbox = Outbox(deliver, "test-outbox", wire)
    outbox.post(done(0))  # the wire refuses: to the thread, which is held
    wire.refuse = False
    outbox.post(done(1))  # 0 still pending: 1 queues behind it, not on the wire
    assert wire.written == []
    gate.set()
    outbox.flush()
    assert sent == [0, 1]
    outbox.post(done(2))  # the thread caught up: the wire again
    outbox.flush()
    assert wire.written == [2] and sent == [0, 1]
    outbox.close()


def test_a_posted_command_redis_refused_is_sent_again_once_its_reply_is_asked_for() -> None:
    """A loop awaiting its step's commit posts nothing more: `land` reads the StepDone's
    reply, and one an inbox jammed by another writer refused goes out again at once."""
    delivered: list[int] = []
    wire = FakeWire()
    outbox = Outbox(lambda c: delivered.append(step_of(c)), "test-outbox", wire)
    outbox.post(done(0))
    wire.lose = True  # the XADD was refused

    outbox.land()

    wait_until(lambda: delivered == [0], 10, message="the refused StepDone sent again")
    outbox.land()  # nothing on the wire now: nothing to do
    outbox.close()
    outbox.land()  # closed: nothing either
