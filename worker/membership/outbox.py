"""Commands a worker sends without waiting for Redis's answer, delivered in order.

A training step reports itself (StepDone) and goes on with the next step's work; one
thread delivers what was posted, one command after another in the order posted, with the
retrying delivery a blocking send uses. A command that must not overtake them (a Leave
after the last step, say) is sent after `flush()`: once it returns, everything posted
before it is in the inbox.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from cohort.events.models import Command
from cohort.worker.errors import Stopped, WorkerError


class Outbox:
    """Posted commands on their way to the inbox, in order; `deliver` sends one (retrying
    until it is acknowledged, or raising Stopped)."""

    def __init__(self, deliver: Callable[[Command], object], name: str) -> None:
        self._deliver = deliver
        self._name = name
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
            self._pending.append(command)
            self._posted += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def flush(self) -> None:
        """Return once every command posted before this call is delivered."""
        with self._cond:
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
