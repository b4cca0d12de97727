"""A simulated training loop for demos and tests: the client API exactly as a real loop uses it.

The "compute" is `stop.wait(step_time)`, so stopping interrupts it promptly.
The summary records which sample ranges each committed step used (`ranges`),
and every step reported done with its world (`reported`): a worker killed
after StepDone but before it saw the commit has trained on a committed step it
never saw commit, so exactly-once checks join `reported` with the journal.

Unlike a real loop, finishing a step here does not depend on the peers (there
is no allreduce), so a step the coordinator commits because "a rank finished
it" may include the batch of a rank that died before computing it.
"""

from __future__ import annotations

import hashlib
import threading
import time
from typing import Any

from cohort.events.shards import Range, range_count
from cohort.worker.errors import Finished, RemovedError, Stopped, WaitTimeoutError
from cohort.worker.membership.client import Worker

POLL = 0.5  # how often a long wait looks at the stop event


def digest(step: int) -> str:
    """The simulated weights after `step`: the same on every worker, as invariant 7 of
    docs/design.md asks."""
    return hashlib.sha256(f"weights-{step}".encode()).hexdigest()[:16]


def run(
    worker: Worker,
    steps: int,
    step_time: float,
    stop: threading.Event,
    join_timeout: float | None = None,
) -> dict[str, Any]:
    """Train until `steps` steps committed, or until stopped; then leave. Returns a summary.

    The join waits `join_timeout` s for a coordinator (None: until one answers or `stop`)."""
    simulation = Simulation(worker, steps, step_time, stop)
    summary = simulation.summary
    worker.join(join_timeout, stop)
    worker.ready(step=max(worker.view.last_committed, 0))
    try:
        simulation.train()
    except Finished as end:  # the job reached its length: leave with the final weights
        summary["finished"] = end.reason
    except RemovedError as exc:
        summary["removed"] = exc.reason
        worker.stop()
        return summary
    except Stopped:
        return summary  # stopped from outside (a simulated crash): no Leave
    done = summary["steps_committed"] >= steps or worker.finished
    worker.leave(reason="done" if done else "stopped")
    return summary


class Simulation:
    """One simulated worker's walk over the job's steps, and its summary."""

    def __init__(self, worker: Worker, steps: int, step_time: float, stop: threading.Event):
        self.worker = worker
        self.steps = steps
        self.step_time = step_time
        self.stop = stop
        self.used: dict[int, tuple[Range, ...]] = {}
        """Committed step -> its ranges, as this worker saw them."""
        self.reported: list[tuple[int, int, tuple[Range, ...]]] = []
        """(world, step, ranges) of every step reported done."""
        self.summary: dict[str, Any] = {
            "worker": worker.id,
            "steps_committed": 0,
            "world_changes": 0,
            "samples": 0,
            "ranges": self.used,
            "reported": self.reported,
            "removed": None,
            "finished": None,
        }
        self.world = 0
        self.step = 0

    def halted(self) -> bool:
        return self.stop.is_set() or self.worker.stopping.is_set()

    def train(self) -> None:
        """Step until `steps` committed or stopped; Finished, RemovedError and Stopped end it."""
        self.step = self.worker.next_step
        while self.summary["steps_committed"] < self.steps and not self.halted():
            try:
                assignment = self.worker.wait_active(POLL)
            except WaitTimeoutError:
                continue
            if assignment.world_version != self.world:
                if self.world:
                    self.summary["world_changes"] += 1
                self.world = assignment.world_version
            self.step = max(self.step, self.worker.next_step)
            if not self.train_step(assignment.world_version):
                return

    def train_step(self, world: int) -> bool:
        """Compute, report and settle the current step; False once stopped mid-way."""
        step, worker = self.step, self.worker
        ranges = worker.batch(step)
        started = time.monotonic()
        if self.stop.wait(self.step_time):
            return False  # stopped mid-step: the step is not done
        count = range_count(ranges)
        worker.step_done(
            step, step_time=time.monotonic() - started, samples=count, digest=digest(step)
        )
        self.reported.append((world, step, ranges))
        restart = _commit(worker, step, self.stop)
        if restart is not None:
            self.step = restart  # aborted: go on from where the new world starts
            return not self.stop.is_set()
        self.used[step] = ranges
        self.summary["steps_committed"] += 1
        self.summary["samples"] += count
        self.step = step + 1
        return True


def _commit(worker: Worker, step: int, stop: threading.Event) -> int | None:
    """Wait for `step` to commit: None if it did, else the step to continue from."""
    if worker.committed(step, stop, POLL):
        return None
    if stop.is_set():
        return step
    assignment = worker.assignment
    return assignment.start_step if assignment else worker.next_step
