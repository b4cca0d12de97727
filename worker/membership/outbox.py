"""Commands a worker sends without waiting for Redis's answer, delivered in order.

A training step reports itself (StepDone) and goes on with the next step's work. With a
wire (events/streams.py `InboxWire`) the poster writes the command itself and returns:
its reply is read at the next post or flush, by when it has nearly always arrived (a step
later), so a step costs one write and one read, not a thread's wake-up and Redis's round
trip in it. Without one, or once the wire fails (an outage, a refusal, a reply late by
`LAND_WAIT`), one thread delivers what was posted, one command after another in the order
posted, with the retrying delivery a blocking send uses; the wire is used again once that
thread has caught up. At most one command is on the wire: nothing overtakes it. A command
that must not overtake them (a Leave after the last step, say) is sent after `flush()`:
once it returns, everything posted before it is in the inbox.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Protocol

from cohort.events.models import Command
from cohort.worker.errors import Stopped, WorkerError

LAND_WAIT = 2.0
"""Seconds the next post waits for the reply of the command on the wire before sending it
again the retrying way (a reply comes in well under a millisecond from a Redis that runs)."""


class Wire(Protocol):
    """Writes a command now and reads its reply later (events/streams.py `InboxWire`)."""

    def write(self, command: Command) -> bool: ...

    def landed(self, wait: float) -> bool: ...

    def close(self, drop: bool = False) -> None: ...


class Outbox:
    """Posted commands on their way to the inbox, in order; `deliver` sends one (retrying
    until it is acknowledged, or raising Stopped), `wire` (if any) without waiting."""

    def __init__(
        self, deliver: Callable[[Command], object], name: str, wire: Wire | None = None
    ) -> None:
        self._deliver = deliver
        self._name = name
        self._wire = wire
        self._flying: Command | None = None
        """Written on the wire, its reply not read yet (then nothing is pending)."""
        self._pending: deque[Command] = deque()
        self._posted = 0
        self._delivered = 0
        self._failure: BaseException | None = None
        self._closed = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def post(self, command: Command) -> None:
        """Queue `command` and return at once. Raises what ended delivery, if it ended."""
        with self._cond:
            self._raise_if_ended()
            self._posted += 1
            self._land()
            wire = self._wire
            if wire is not None and not self._pending and wire.write(command):
                self._flying = command
                return
            self._queue(command)

    def _land(self) -> None:
        """Read the reply of the command on the wire; if it did not land, it goes first
        to the thread (nothing is pending meanwhile: every post lands the one before)."""
        command, self._flying = self._flying, None
        if command is None:
            return
        assert self._wire is not None
        if self._wire.landed(LAND_WAIT):
            self._delivered += 1
            self._cond.notify_all()
        else:
            self._queue(command)

    def _queue(self, command: Command) -> None:
        """`command` to the thread's queue (started on first use)."""
        self._pending.append(command)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        self._cond.notify_all()

    def land(self) -> None:
        """Read the reply of the command on the wire now, if one is: one Redis refused (an
        inbox jammed by another writer's ID) goes to the thread and is tried again at once,
        not at the next post or flush (a training loop awaiting its step's commit posts
        nothing meanwhile)."""
        with self._cond:
            if not self._closed:
                self._land()

    def flush(self) -> None:
        """Return once every command posted before this call is delivered."""
        with self._cond:
            self._land()
            until = self._posted
            while self._delivered < until and self._failure is None and not self._closed:
                self._cond.wait()
            if self._delivered < until:
                self._raise_if_ended()

    def close(self) -> None:
        """Stop delivering; what was not delivered yet is dropped, as at a crash."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
            self._flying = None
            if self._wire is not None:
                self._wire.close(drop=True)  # a reply may be on its way: not for a later one
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _raise_if_ended(self) -> None:
        if self._failure is not None:
            raise WorkerError(
                f"{self._name} could not deliver a command: {self._failure}"
            ) from self._failure
        if self._closed:
            raise Stopped(f"{self._name} was closed")

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                command = self._pending[0]
            try:
                self._deliver(command)
            except Stopped:
                with self._cond:
                    self._closed = True
                    self._cond.notify_all()
                return
            except BaseException as exc:  # retrying cannot fix it: the next post or flush raises
                with self._cond:
                    self._failure = exc
                    self._cond.notify_all()
                return
            with self._cond:
                self._pending.popleft()
                self._delivered += 1
                self._cond.notify_all()
