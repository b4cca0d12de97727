"""Where a step's state is captured: what a checkpoint of it holds (docs/guarantees.md).

A run resumed from a checkpoint of step s must start step s + 1 as the uninterrupted run
did. So the copy is taken as the script asks for the next step, after everything it did
once step s applied; after an epoch's last step the walk first gives the script the
epoch's end, where its code between epochs runs (a scheduler's step, counters), and
copies the state only when the script asks past it. The test is the leader; the state
is a number the "script" changes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cohort.events import models as m
from cohort.events.shards import Shard
from cohort.worker.loop.elastic import Elastic, EpochEnd, Step
from tests.unit.test_elastic_gate import ME, joined
from tests.unit.test_worker_client import Leader, fact

WHOLE = (Shard(ranges=((0, 16),)),)  # 16 samples, 4 a step: 4 steps an epoch


class Number:
    """A training state that is one number; every copy taken is kept."""

    def __init__(self) -> None:
        self.value = 0
        self.copies: list[int] = []

    def digest(self) -> str:
        return f"{self.value:032x}"

    def broadcast(self, collective: Any, step: int, world: int) -> None:
        pass  # one rank

    def snapshot(self) -> bytes:
        self.copies.append(self.value)
        return str(self.value).encode()

    def load(self, blob: bytes) -> None:
        self.value = int(blob)

    def reset(self) -> None:
        self.value = 0


@pytest.fixture
def job(tmp_path: Path) -> Iterator[tuple[Leader, Elastic, Number]]:
    config = m.JobConfig(
        dataset_size=16, batch_size=4, checkpoint_uri=f"file://{tmp_path}", checkpoint_every=2
    )
    leader, elastic = joined(config)
    state = Number()
    elastic.attach(state)
    leader.say(
        fact(m.WorkerSynced, worker=ME, step=0),
        fact(m.WorkerActivated, worker=ME),
        fact(m.WorldChanged, version=1, start_step=0, epoch=0, ranks=(ME,), shards=WHOLE),
    )
    yield leader, elastic, state
    elastic.worker.stop()


def commit(leader: Leader, step: int, *then: Any) -> None:
    leader.say(fact(m.StepCommitted, step=step, world=1), *then)


def train(walk: Any, state: Number, step: int) -> None:
    """The script asks for `step` and trains it: the weights, then a per-step scheduler."""
    given = next(walk)
    assert isinstance(given, Step) and given.step == step
    state.value = 10 * step
    state.value += 1


def test_inside_an_epoch_the_copy_is_taken_as_the_script_asks_for_the_next_step(job) -> None:
    leader, elastic, state = job
    walk = elastic._walk()
    train(walk, state, 0)
    commit(leader, 0)
    train(walk, state, 1)  # checkpointed (every 2 steps)
    assert state.copies == []
    train(walk, state, 2)
    assert state.copies == [11]  # step 1's weights and its scheduler step
    commit(leader, 1)
    walk.close()


def test_a_checkpoint_of_an_epoch_s_last_step_holds_what_the_script_did_between_epochs(
    job,
) -> None:
    leader, elastic, state = job
    walk = elastic._walk()
    for step in range(4):
        train(walk, state, step)
        if step < 3:
            commit(leader, step)
    assert next(walk) == EpochEnd(0)  # the script's loop over epoch 0 ends here
    assert state.copies == [11]  # step 3's is not taken yet
    state.value += 100  # the script's code between epochs: an epoch scheduler's step
    position = m.DataPosition(epoch=1, rest=WHOLE[0])
    request = fact(m.CheckpointRequested, worker=ME, step=3, uri="file:///x", position=position)
    leader.say(
        fact(m.StepCommitted, step=3, world=1),
        fact(m.EpochFinished, epoch=0, step=3),
        fact(m.EpochStarted, epoch=1, start_step=4, shards=WHOLE),
        request,
    )
    upcoming = next(walk)  # the script asks for epoch 1's first step
    assert isinstance(upcoming, Step) and (upcoming.step, upcoming.epoch) == (4, 1)
    assert state.copies == [11, 131]  # the state the next step starts from
    walk.close()  # step 3 was settled before step 4 was built: nothing to wait for
