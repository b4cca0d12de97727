"""How a worker's commands reach the inbox: sent (waiting for Redis to acknowledge each) or
posted (delivered in order by the outbox's thread). Both retry through outages, and a sent
command never overtakes one posted before it."""

from __future__ import annotations

import threading

from cohort.events.models import Command
from cohort.events.streams import Inbox
from cohort.worker.membership.outbox import Outbox
from cohort.worker.membership.retry import Halt, Link, with_retry


class Delivery:
    """One worker's commands on their way to `inbox`, through `link`, until `stop` is set."""

    def __init__(self, inbox: Inbox, link: Link, stop: threading.Event, name: str) -> None:
        self.inbox = inbox
        self.link = link
        self.name = name
        self._stop = stop
        self._outbox = self._new_outbox()

    def send(
        self, command: Command, deadline: float | None = None, stop: Halt | None = None
    ) -> str:
        """XADD `command` to the inbox, after every command posted to the outbox before it,
        retrying through outages until it is acknowledged (or `stop`, default the worker's
        own, is set)."""
        self._outbox.flush()
        return self._deliver(command, deadline, stop)

    def post(self, command: Command) -> None:
        """Queue `command` and return at once; raises what ended delivery, if it ended."""
        self._outbox.post(command)

    def land(self) -> None:
        """Read the posted command's reply now: if Redis refused it, it is retried at once."""
        self._outbox.land()

    def close(self) -> None:
        """Drop what was posted and not delivered yet, as at a crash; what is posted after
        this (a join after a stop) goes out through a new outbox."""
        self._outbox.close()
        self._outbox = self._new_outbox()

    def _new_outbox(self) -> Outbox:
        return Outbox(self._deliver, name=self.name, wire=self.inbox.wire())

    def _deliver(
        self, command: Command, deadline: float | None = None, stop: Halt | None = None
    ) -> str:
        return with_retry(
            lambda: self.inbox.send(command),
            self._stop if stop is None else stop,
            self.link,
            f"sending {command.type}",
            deadline=deadline,
            wait_for_memory=True,
        )
