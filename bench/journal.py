"""A long run's journal, made by the coordinator's own pure core: no hand-written facts.

A small world trains for many steps. Now and then a rank is slow (a straggler
is flagged and cleared), a GPU runs hot (advice issued and cleared), a worker
falls silent and fails, and a new one joins in its place. The facts are what
`decide` said, in order, so a replay of them is a replay of a real run's kind.
"""

from __future__ import annotations

from collections.abc import Iterator

from cohort.coordinator.core import Core
from cohort.events.codec import encode
from cohort.events.models import (
    Command,
    Fact,
    GpuDevice,
    GpuReading,
    Heartbeat,
    JobConfig,
    Join,
    StepDone,
    WeightsLoaded,
)

JOB = "bench"
STEP_S = 0.25  # simulated seconds per step


def config(workers: int) -> JobConfig:
    return JobConfig(
        min_workers=workers,
        max_workers=workers + 1,
        heartbeat_interval=1,
        heartbeat_timeout=5,
        dataset_size=32 * workers * 400,  # an epoch every 400 steps
        batch_size=32,
    )


def long_run(facts: int, workers: int = 2) -> Iterator[bytes]:
    """Encoded facts of one job, at least `facts` of them (the last step completes)."""
    run = _Run()
    yield from run.emit(run.core.take_over(JOB, config(workers), "bench", 1, run.now))
    for _ in range(workers):
        yield from run.join()
    while run.made < facts:
        yield from run.step()


class _Run:
    """One job driven through the pure core on a simulated clock; `made` counts its facts."""

    def __init__(self) -> None:
        self.core = Core()
        self.now = 0.0
        self.made = 0
        self.serial = 0  # the next joiner's number

    def emit(self, new: tuple[Fact, ...]) -> Iterator[bytes]:
        self.made += len(new)
        self.core.commit()  # as if journaled at once
        return (encode(f) for f in new)

    def handle(self, command: Command) -> Iterator[bytes]:
        return self.emit(self.core.handle(command, self.now, self.now))

    def join(self) -> Iterator[bytes]:
        """A new worker joins and loads the weights."""
        name = f"w{self.serial:04d}"
        self.serial += 1
        yield from self.handle(Join(at=self.now, job=JOB, worker=name))
        yield from self.handle(
            WeightsLoaded(at=self.now, job=JOB, worker=name, step=self.core.state.next_step)
        )

    def step(self) -> Iterator[bytes]:
        """Every rank finishes the next step; after every 1000th the last rank is replaced."""
        step, world = self.core.state.next_step, self.core.state.world_version
        self.now += STEP_S
        for rank, worker in enumerate(self.core.state.ranks):
            yield from self.rank_step(rank, worker, step, world)
        if step % 1000 == 999 and self.core.state.ranks:  # the last rank falls silent
            yield from self.fail_last_rank(step, world)
            yield from self.join()

    def rank_step(self, rank: int, worker: str, step: int, world: int) -> Iterator[bytes]:
        """One rank's StepDone, with a heartbeat every 4th step and a GPU reading every 50th."""
        slow = step % 97 < 6 and rank == 0  # a straggling streak now and then
        took = STEP_S * (3.0 if slow else 1.0)
        done = StepDone(
            at=self.now,
            job=JOB,
            worker=worker,
            step=step,
            world=world,
            step_time=took,
            samples=32,
            digest="ab" * 8,
            loss=1.0 / (step + 1),
        )
        yield from self.handle(done)
        if step % 4 == 0:
            yield from self.handle(self.beat(worker, step, world))
        if step % 50 == 0:
            hot = 95.0 if step % 200 == 0 else 40.0
            gpu = GpuDevice(index=0, memory_total=100, memory_used=int(hot), temperature=60.0)
            yield from self.handle(GpuReading(at=self.now, job=JOB, worker=worker, devices=(gpu,)))

    def fail_last_rank(self, step: int, world: int) -> Iterator[bytes]:
        """The last rank stops beating while the others go on, until the leader fails it."""
        core = self.core
        silent = core.state.ranks[-1]
        for worker in core.state.ranks[:-1]:
            core.handle(self.beat(worker, step, world), self.now, self.now)
        while silent in core.state.members:
            self.now += 1.0
            for worker in core.state.ranks:
                if worker != silent:
                    yield from self.handle(self.beat(worker, step, world))
            yield from self.emit(core.tick(self.now))

    def beat(self, worker: str, step: int, world: int) -> Heartbeat:
        return Heartbeat(at=self.now, job=JOB, worker=worker, step=step, world=world)
