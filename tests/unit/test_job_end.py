"""The end of a job is exact for every rank (issue 47): a process that ends the loops knows
whether it holds the final weights; the script's epoch count is the job's or refused; a
signal leaves the script a way to tell an interrupted epoch from a finished one.

The test is the leader (facts written to a fakeredis journal); the state is a number.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from cohort.events import models as m
from cohort.events.errors import InvalidValueError
from cohort.events.shards import Shard
from cohort.worker.loop import checkpoints
from cohort.worker.loop.elastic import Elastic, Step
from tests.unit.test_capture_point import Number
from tests.unit.test_elastic_gate import ME, joined
from tests.unit.test_worker_client import JOB, Leader, fact

WHOLE = (Shard(ranges=((0, 16),)),)
LATE_WORLD = (
    fact(m.WorkerJoined, worker="w-first"),
    fact(m.WorkerSynced, worker="w-first", step=0),
    fact(m.WorkerActivated, worker="w-first"),
    fact(m.WorldChanged, version=1, start_step=0, epoch=0, ranks=("w-first",), shards=WHOLE),
)
"""The job's last world, begun before ME got a rank: ME is ready but never activated."""


@pytest.fixture
def late(tmp_path: Path) -> Iterator[tuple[Leader, Elastic, Number]]:
    """ME joined a job whose last world began without it."""
    config = m.JobConfig(dataset_size=16, batch_size=4, max_steps=1)
    leader, elastic = joined(config)
    state = Number()
    elastic.attach(state)
    leader.expect("WeightsLoaded")  # ready: it waits for a rank
    leader.say(*LATE_WORLD, fact(m.WorkerSynced, worker=ME, step=0))
    yield leader, elastic, state
    elastic.worker.stop()


def alone(**config: Any) -> tuple[Leader, Elastic]:
    """ME joined a job of 16 samples, 4 a step, and is its only rank from step 0."""
    leader, elastic = joined(m.JobConfig(dataset_size=16, batch_size=4, **config))
    elastic.attach(Number())
    leader.say(
        fact(m.WorkerSynced, worker=ME, step=0),
        fact(m.WorkerActivated, worker=ME),
        fact(m.WorldChanged, version=1, start_step=0, epoch=0, ranks=(ME,), shards=WHOLE),
    )
    return leader, elastic


def finish(leader: Leader, *before: Any) -> None:
    leader.say(
        fact(m.StepCommitted, step=0, world=1),
        *before,
        fact(m.JobFinished, step=0, epoch=0, reason="max_steps=1 reached"),
    )


def test_a_rank_that_joined_after_the_last_world_began_says_it_lacks_the_final_weights(
    late: tuple[Leader, Elastic, Number], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    leader, elastic, _ = late
    caplog.set_level(logging.INFO, logger="cohort")
    with ThreadPoolExecutor(1) as pool:
        walk = pool.submit(list, elastic.steps())
        finish(leader)
        assert walk.result(timeout=10) == []  # it trained nothing
    assert elastic.finished and not elastic.has_final_weights
    said = caplog.text
    assert "does not hold the final weights" in said and "ends with the final weights" not in said
    assert elastic.save(tmp_path / "final.npz") is False
    assert not (tmp_path / "final.npz").exists()
    assert "job.save" in caplog.text and "not hold the final weights" in caplog.text


def test_a_late_rank_takes_the_final_weights_from_the_job_s_last_checkpoint(
    tmp_path: Path,
) -> None:
    config = m.JobConfig(
        dataset_size=16, batch_size=4, max_steps=1, checkpoint_uri=f"file://{tmp_path}"
    )
    leader, elastic = joined(config)
    state = Number()
    elastic.attach(state)
    leader.expect("WeightsLoaded")
    leader.say(*LATE_WORLD, fact(m.WorkerSynced, worker=ME, step=0))
    position = m.DataPosition(epoch=1, rest=WHOLE[0])
    uri = f"file://{tmp_path}/step-0"
    digest = f"{7:032x}"  # Number's digest of the final weights, 7
    try:
        with ThreadPoolExecutor(1) as pool:
            walk = pool.submit(list, elastic.steps())
            request = fact(
                m.CheckpointRequested, worker="w-first", step=0, uri=uri, position=position
            )
            finish(leader, request)
            # the holder writes the final checkpoint after the end, before it leaves
            written = checkpoints.write(uri, JOB, 0, digest, position, b"7")
            leader.say(
                fact(
                    m.CheckpointSaved,
                    worker="w-first",
                    step=0,
                    uri=uri,
                    digest=digest,
                    sha256=written.sha256,
                    bytes=written.bytes,
                    position=position,
                )  # fmt: skip
            )
            assert walk.result(timeout=10) == []
        assert elastic.has_final_weights and state.value == 7
    finally:
        elastic.worker.stop()


def test_a_rank_that_trained_the_last_step_holds_the_final_weights(tmp_path: Path) -> None:
    leader, elastic = alone(max_steps=1)
    try:
        walk = elastic.steps()
        assert isinstance(next(walk), Step)
        finish(leader)
        assert list(walk) == []
        assert elastic.has_final_weights and not elastic.interrupted
    finally:
        elastic.worker.stop()


# ---------------------------------------------------------------- the job's length, said once


@pytest.mark.parametrize(
    ("config", "said"),
    [
        ({"epochs": 2}, "the job's length is --epochs 2"),
        ({}, "the job was given no --epochs"),
        ({"max_steps": 9}, "it ends after --max-steps 9"),
    ],
)
def test_a_script_epoch_count_other_than_the_job_s_is_refused_by_name(
    config: dict[str, int], said: str
) -> None:
    leader, elastic = joined(m.JobConfig(dataset_size=16, batch_size=4, **config))
    try:
        with pytest.raises(InvalidValueError, match=r"job\.epochs\(3\)") as refused:
            elastic.check_epochs(3)
        assert said in str(refused.value)
        assert "drop the argument" in str(refused.value)
        assert "cohort run --epochs 3" in str(refused.value)
        elastic.check_epochs(None)  # the job's own length
        elastic.check_epochs(config.get("epochs"))  # the same count, said twice, is fine
    finally:
        elastic.worker.stop()


# ---------------------------------------------------------------- Ctrl-C


def test_a_signal_before_the_end_marks_the_job_interrupted() -> None:
    leader, elastic = alone()
    try:
        walk = elastic.steps()
        next(walk)  # step 0 of 4 in the epoch
        assert not elastic.interrupted
        elastic.worker.stopping.set()  # what the first SIGINT/SIGTERM does
        assert elastic.interrupted
        walk.close()
    finally:
        elastic.worker.stop()
