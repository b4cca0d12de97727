"""The header every command a worker sends carries: when, for which job, from which worker."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from cohort.events.clock import Clock
from cohort.events.models import Event

E = TypeVar("E", bound=Event)


class Stamp:
    """Builds one worker's commands with their header filled in (`at` from its clock, its
    `job`, its `worker` id), so a caller writes only the command's own fields."""

    def __init__(self, clock: Clock, job: str, worker: str) -> None:
        self.clock = clock
        self.job = job
        self.worker = worker

    def __call__(self, kind: Callable[..., E], **body: Any) -> E:
        """A `kind` command stamped now, `body` its own fields (pydantic checks them)."""
        return kind(at=self.clock.now(), job=self.job, worker=self.worker, **body)
