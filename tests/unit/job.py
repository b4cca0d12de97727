"""A job in memory: workers' commands go through the leader's Core; time moves when told."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cohort.coordinator.core import Core
from cohort.coordinator.fold import fold
from cohort.events.models import (
    CheckpointRequested,
    CheckpointWritten,
    Dataset,
    Fact,
    Heartbeat,
    JobConfig,
    Join,
    Leave,
    Node,
    Resume,
    StepDone,
    WeightsLoaded,
)

JOB = "unit"


class Job:
    """`dataset`: what every worker declares when it joins (None: nothing, the config's size
    is the job's); `nodes`: what each worker says of its machine."""

    def __init__(
        self,
        dataset: Dataset | None = None,
        nodes: Callable[[str], Node | None] = lambda worker: None,
        **config: Any,
    ) -> None:
        self.dataset, self.nodes = dataset, nodes
        self.core = Core()
        self.now = 1_000.0
        self.journal: list[Fact] = []
        config = {"dataset_size": 60_000 if dataset is None else None, **config}
        self._record(self.core.take_over(JOB, JobConfig(**config), "c1", 1, self.now))

    # ------------------------------------------------------------ plumbing
    def _record(self, facts: tuple[Fact, ...]) -> tuple[Fact, ...]:
        """Every decision is journaled at once: the core commits it."""
        self.core.commit()
        self.journal.extend(facts)
        return facts

    def send(self, command: Any) -> tuple[Fact, ...]:
        return self._record(self.core.handle(command, self.now, self.now))

    def advance(self, seconds: float) -> tuple[Fact, ...]:
        self.now += seconds
        return self._record(self.core.tick(self.now))

    @property
    def state(self):  # type: ignore[no-untyped-def]
        return self.core.state

    def replayed(self):  # type: ignore[no-untyped-def]
        return fold(self.journal)

    # ------------------------------------------------------------ what workers say
    def join(self, worker: str) -> tuple[Fact, ...]:
        return self.send(
            Join(at=self.now, job=JOB, worker=worker, node=self.nodes(worker), dataset=self.dataset)
        )

    def ready(self, worker: str, step: int = 0) -> tuple[Fact, ...]:
        return self.send(WeightsLoaded(at=self.now, job=JOB, worker=worker, step=step))

    def start(self, *workers: str) -> tuple[Fact, ...]:
        facts: tuple[Fact, ...] = ()
        for worker in workers:
            facts += self.join(worker)
        for worker in workers:
            facts += self.ready(worker)
        return facts

    def done(
        self,
        worker: str,
        step: int | None = None,
        world: int | None = None,
        step_time: float = 1.0,
        digest: str | None = None,
    ) -> tuple[Fact, ...]:
        step = self.state.next_step if step is None else step
        world = self.state.world_version if world is None else world
        return self.send(
            StepDone(
                at=self.now,
                job=JOB,
                worker=worker,
                step=step,
                world=world,
                step_time=step_time,
                digest=digest,
            )
        )

    def checkpoint_written(self, request: CheckpointRequested, digest: str | None = None):  # type: ignore[no-untyped-def]
        """The asked worker reports the checkpoint whole."""
        return self.send(
            CheckpointWritten(
                at=self.now,
                job=JOB,
                worker=request.worker,
                step=request.step,
                uri=request.uri,
                digest=digest,
                sha256="ab" * 32,
                bytes=1000,
            )
        )

    def resume(self, **body: Any) -> tuple[Fact, ...]:
        return self.send(Resume(at=self.now, job=JOB, **body))

    def heartbeat(self, worker: str, step: int | None = None, world: int | None = None):  # type: ignore[no-untyped-def]
        return self.send(Heartbeat(at=self.now, job=JOB, worker=worker, step=step, world=world))

    def leave(
        self, worker: str, after_step: int | None = None, reason: str = ""
    ) -> tuple[Fact, ...]:
        return self.send(
            Leave(at=self.now, job=JOB, worker=worker, after_step=after_step, reason=reason)
        )

    def step(self, times: dict[str, float] | None = None) -> tuple[Fact, ...]:
        """Every rank of the world finishes the next step."""
        facts: tuple[Fact, ...] = ()
        for worker in self.state.ranks:
            facts += self.done(worker, step_time=(times or {}).get(worker, 1.0))
        return facts

    def alive(self, *workers: str) -> None:
        for worker in workers:
            self.heartbeat(worker)

    def connections(self, server: str = "server-1", **counts: int) -> None:
        """The leader reads each named member's presence subscriptions on `server`, now."""
        self.core.seen.connected(server, counts, self.now)


def types(facts: tuple[Fact, ...] | list[Fact]) -> list[str]:
    return [type(f).__name__ for f in facts]
