"""The heartbeat thread: a worker says it is alive, and how far it got, every interval.

It beats from the moment the worker's Join is in the inbox (`joining`): a worker may start
long before any coordinator, and the leader that decides its Join from the backlog must
see it alive.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from cohort.events.models import Command, Heartbeat
from cohort.worker.errors import Stopped
from cohort.worker.membership.stamp import Stamp
from cohort.worker.membership.view import View

DEFAULT_HEARTBEAT = 1.0  # seconds between beats before the job's config says otherwise


class HeartbeatThread:
    """One worker's heartbeats: every `interval` s (the job's config's unless given) while
    it is a member or its Join waits for an answer, until `stop` is set."""

    def __init__(
        self,
        send: Callable[[Command], object],
        stamp: Stamp,
        view: Callable[[], View],
        progress: Callable[[], tuple[int, int] | None],
        stop: threading.Event,
        log: logging.Logger,
        interval: float | None = None,
        chore: Callable[[], None] | None = None,
    ) -> None:
        self._send = send
        self._stamp = stamp
        self._view = view
        self._progress = progress  # (last finished step, its world)
        self._stop = stop
        self.log = log
        self.given_interval = interval
        self._chore = chore
        """Run on every turn (a credential refresh); it keeps its own pace."""
        self.joining = threading.Event()
        """A Join is sent and not answered yet: beat as a member would."""
        self.wake = threading.Event()
        """Set to end the current wait: the worker stops, or the job's config changed."""

    def run(self) -> None:
        """Heartbeat every interval; a JobConfigured arriving later re-paces the next beat."""
        last = time.monotonic()
        while True:
            self.wake.wait(max(0.0, last + self.interval() - time.monotonic()))
            self.wake.clear()
            if self._stop.is_set():
                return
            self._run_chore()
            if time.monotonic() < last + self.interval():
                continue  # woken early by a new config; wait out the (new) interval
            last = time.monotonic()
            view = self._view()
            if not (view.member or self.joining.is_set()):
                continue
            step, world = self._progress() or (None, view.world_version)
            try:
                self._send(self._stamp(Heartbeat, step=step, world=world))
            except Stopped:
                return
            except Exception:
                self.log.exception("worker %s could not send a heartbeat", self._stamp.worker)

    def _run_chore(self) -> None:
        if self._chore is None:
            return
        try:
            self._chore()
        except Exception:
            self.log.exception("worker %s: a heartbeat chore failed", self._stamp.worker)

    def interval(self) -> float:
        """Seconds between beats: as given, else the job's config's, else the default."""
        if self.given_interval is not None:
            return self.given_interval
        config = self._view().config
        return config.heartbeat_interval if config is not None else DEFAULT_HEARTBEAT
