"""An evaluator: a member of a job that trains nothing and evaluates the committed weights.

It joins with the role "evaluator": the leader gives it no rank and no shard, counts it
toward no world and no `min_workers`, and its failure aborts no step. It takes the
weights of each checkpoint the job saves (at most one every `every` steps), the script
evaluates them, and `report` sends the metrics (`EvalDone`); the leader journals them
(`EvalReported`), `cohort status` shows the latest and the report plots them::

    with cohort.Evaluator(conn, "mnist", every=100) as evaluator:
        for checkpoint in evaluator.checkpoints():
            model.load_state_dict(decode(checkpoint.payload))
            evaluator.report(checkpoint.step, {"accuracy": accuracy(model, test_set)})
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping
from types import TracebackType

from pydantic import ValidationError

from cohort.events.clock import Clock
from cohort.events.connection import Client
from cohort.events.errors import InvalidValueError, invalid_field
from cohort.events.models import CheckpointSaved, EvalDone
from cohort.worker.errors import WaitTimeoutError
from cohort.worker.loop import checkpoints
from cohort.worker.membership.client import Worker
from cohort.worker.membership.view import View

FINAL_WAIT = 30.0
"""Seconds a finished job's evaluator waits for the checkpoint of the last step."""


class Evaluator:
    """Job `job`'s evaluator `worker_id` (default: host-pid-random), evaluating at most
    once every `every` committed steps."""

    def __init__(
        self,
        conn: Client,
        job: str,
        worker_id: str | None = None,
        every: int = 1,
        clock: Clock | None = None,
        heartbeat_interval: float | None = None,
        log: logging.Logger | None = None,
    ) -> None:
        if not isinstance(every, int) or every < 1:
            raise InvalidValueError(
                f"every={every!r}: an evaluator evaluates every 1 or more steps"
            )
        self.every = every
        self.log = log or logging.getLogger("cohort.evaluator")
        self.worker = Worker(
            conn,
            job,
            worker_id,
            clock=clock,
            heartbeat_interval=heartbeat_interval,
            log=self.log,
            role="evaluator",
        )
        self.last: int | None = None
        """The step of the last checkpoint handed out."""

    @property
    def id(self) -> str:
        return self.worker.id

    def __enter__(self) -> Evaluator:
        self.join()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.leave()

    def join(self, timeout: float | None = None) -> None:
        self.worker.join(timeout=timeout)

    def leave(self) -> None:
        self.worker.leave("evaluator done")

    def checkpoints(self, final_wait: float = FINAL_WAIT) -> Iterator[checkpoints.Checkpoint]:
        """Each checkpoint due, read and verified against its journaled sha256, as the job
        saves it; ends once the job finished and its last checkpoint (if it writes one,
        waited for up to `final_wait` s) was handed out. A checkpoint that cannot be read
        (expired and deleted meanwhile) is logged and skipped."""
        if not self.worker.view.member:
            self.join()
        while True:
            view = self._next(final_wait)
            saved = self._due(view)
            if saved is None:
                return
            self.last = saved.step
            try:
                yield checkpoints.read(saved.uri, saved.sha256)
            except checkpoints.CheckpointError as exc:
                self.log.warning("evaluator %s skips step %d: %s", self.id, saved.step, exc)

    def report(self, step: int, metrics: Mapping[str, float]) -> None:
        """Send the metrics of the weights after `step`; the leader journals them. ValueError
        names a bad value (at most 64 metrics, names of 1-64 letters, digits, ._:/-)."""
        try:
            self.worker.send(EvalDone, step=step, metrics=dict(metrics))
        except ValidationError as exc:
            raise invalid_field("evaluation", exc) from None

    # ------------------------------------------------------------ what is due
    def _due(self, view: View) -> CheckpointSaved | None:
        """The newest saved checkpoint at least `every` steps after the last handed out."""
        floor = -math.inf if self.last is None else self.last + self.every
        due = [c for c in view.checkpoints if c.step >= floor]
        return max(due, key=lambda c: c.step) if due else None

    def _next(self, final_wait: float) -> View:
        """The view once a checkpoint is due or the job finished; after the end, up to
        `final_wait` s more for the last step's checkpoint."""
        worker = self.worker
        view = worker.wait_for(
            lambda v: self._due(v) is not None or v.finished is not None,
            None,
            stop=worker.stopping,
        )
        if self._due(view) is not None or view.config is None:
            return view
        if view.config.checkpoint_uri is None or self.last == view.last_committed:
            return view
        try:
            return worker.wait_for(
                lambda v: self._due(v) is not None,
                final_wait,
                stop=worker.stopping,
                removed=False,
            )
        except WaitTimeoutError:
            self.log.warning(
                "evaluator %s: job %r finished at step %d and no checkpoint of it came within %g s",
                self.id,
                worker.job,
                view.last_committed,
                final_wait,
            )
            return view
