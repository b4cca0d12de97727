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
    core = Core()
    now = 0.0
    made = 0

    def emit(new: tuple[Fact, ...]) -> Iterator[bytes]:
        nonlocal made
        made += len(new)
        core.commit()  # as if journaled at once
        return (encode(f) for f in new)

    yield from emit(core.take_over(JOB, config(workers), "bench", 1, now))

    serial = 0

    def join(now: float) -> Iterator[bytes]:
        nonlocal serial
        name = f"w{serial:04d}"
        serial += 1
        yield from emit(core.handle(Join(at=now, job=JOB, worker=name), now, now))
        loaded = WeightsLoaded(at=now, job=JOB, worker=name, step=core.state.next_step)
        yield from emit(core.handle(loaded, now, now))

    for _ in range(workers):
        yield from join(now)

    while made < facts:
        step, world = core.state.next_step, core.state.world_version
        now += STEP_S
        for rank, worker in enumerate(core.state.ranks):
            slow = step % 97 < 6 and rank == 0  # a straggling streak now and then
            took = STEP_S * (3.0 if slow else 1.0)
            done = StepDone(
                at=now,
                job=JOB,
                worker=worker,
                step=step,
                world=world,
                step_time=took,
                samples=32,
                digest="ab" * 8,
                loss=1.0 / (step + 1),
            )
            yield from emit(core.handle(done, now, now))
            if step % 4 == 0:
                beat = Heartbeat(at=now, job=JOB, worker=worker, step=step, world=world)
                yield from emit(core.handle(beat, now, now))
            if step % 50 == 0:
                hot = 95.0 if step % 200 == 0 else 40.0
                gpu = GpuDevice(index=0, memory_total=100, memory_used=int(hot), temperature=60.0)
                reading = GpuReading(at=now, job=JOB, worker=worker, devices=(gpu,))
                yield from emit(core.handle(reading, now, now))
        if step % 1000 == 999 and core.state.ranks:  # the last rank falls silent
            silent = core.state.ranks[-1]
            for worker in core.state.ranks[:-1]:
                beat = Heartbeat(at=now, job=JOB, worker=worker, step=step, world=world)
                core.handle(beat, now, now)
            while silent in core.state.members:
                now += 1.0
                for worker in core.state.ranks:
                    if worker != silent:
                        beat = Heartbeat(at=now, job=JOB, worker=worker, step=step, world=world)
                        yield from emit(core.handle(beat, now, now))
                yield from emit(core.tick(now))
            yield from join(now)
