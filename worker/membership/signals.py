"""Shutdown by signal: the first SIGINT/SIGTERM finishes the step and leaves, the second
exits now, and one after the leave is done gives the script its own handlers back.

The handler is a plain method (`on_signal`), so tests call it instead of sending signals.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from types import FrameType
from typing import Any

EXIT_NOW = 130
"""The exit status of a second signal (128 + SIGINT, as a shell reports an interrupt)."""


class ShutdownSignals:
    """How one worker answers SIGINT and SIGTERM; the first one sets `stopping`."""

    def __init__(self, stopping: threading.Event, log: logging.Logger, worker: str, job: str):
        self.stopping = stopping
        self.log = log
        self.worker = worker
        self.job = job
        self.left = False
        """The worker's leave is done: a signal has nothing of cohort's to cut short."""
        self.received = 0
        self._handlers: dict[int, Any] = {}  # the script's own, from before `install`

    def install(self) -> None:
        """Answer SIGTERM and SIGINT from now on (main thread only), keeping the script's
        own handlers to give back once the leave is done."""
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._handlers[signum] = signal.signal(signum, self.on_signal)

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        self.received += 1
        if self.left:
            self.log.warning(
                "%s received: worker %s has already left job %r, nothing to cut short; the "
                "script goes on (send it again to interrupt the script itself)",
                name,
                self.worker,
                self.job,
            )
            self.give_back()
            return
        if self.received == 1:
            self.log.warning(
                "%s received: worker %s finishes its step, then leaves; send it again to exit now",
                name,
                self.worker,
            )
            self.stopping.set()
            return
        self.log.warning("%s received again: worker %s exits now", name, self.worker)
        os._exit(EXIT_NOW)

    def give_back(self) -> None:
        """The handlers the script had before `install`, back in place."""
        for signum, handler in self._handlers.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._handlers = {}
