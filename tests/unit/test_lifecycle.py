"""A job's length and its end (docs/control-plane.md): the commit that reaches `max_steps` or
`epochs` finishes the job, and a finished job trains no more."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cohort.coordinator.audit import audit
from cohort.events.models import (
    CheckpointRequested,
    EpochFinished,
    JobConfig,
    JobFinished,
    JoinRefused,
    WorkerLeft,
)
from tests.unit.job import Job, types


def test_the_commit_of_the_last_step_finishes_the_job_with_the_final_digest() -> None:
    job = Job(max_steps=3, dataset_size=1000, batch_size=10)
    job.start("a")
    job.step()
    job.step()
    facts = job.done("a", digest="ab" * 8)
    assert types(facts) == ["StepCommitted", "JobFinished"]
    end = facts[-1]
    assert isinstance(end, JobFinished)
    assert (end.step, end.epoch, end.digest) == (2, 0, "ab" * 8)
    assert end.reason == "max_steps=3 reached"
    assert job.state.finished == "max_steps=3 reached" and job.state.last_committed == 2
    assert job.replayed() == job.state


def test_the_last_epoch_finishes_the_job_instead_of_starting_another() -> None:
    job = Job(epochs=2, min_workers=2, dataset_size=40, batch_size=10)
    job.start("a", "b")  # 20 samples a rank: 2 steps an epoch
    job.step()
    assert types(job.step()) == ["StepCommitted", "EpochFinished", "EpochStarted"]
    job.step()
    facts = job.step()
    assert types(facts) == ["StepCommitted", "EpochFinished", "JobFinished"]
    assert isinstance(facts[1], EpochFinished) and facts[1].epoch == 1
    assert job.state.finished == "epochs=2 finished"
    report = audit(job.journal)
    assert report.ok and sorted(report.epochs) == [0, 1]


def test_whichever_limit_comes_first_ends_the_job() -> None:
    job = Job(epochs=5, max_steps=2, dataset_size=40, batch_size=10)
    job.start("a")
    job.step()
    assert types(job.step())[-1] == "JobFinished"
    assert job.state.finished == "max_steps=2 reached"


def test_a_finished_job_commits_nothing_refuses_joiners_and_lets_members_go() -> None:
    job = Job(max_steps=1, min_workers=2, dataset_size=100, batch_size=10)
    job.start("a", "b")
    job.step()
    assert job.state.finished is not None
    assert job.done("a", step=1) == () and job.done("b", step=1) == ()
    (refused,) = job.join("c")
    assert isinstance(refused, JoinRefused)
    assert "finished at step 0" in refused.reason and "cohort reset --job unit" in refused.reason
    (left,) = job.leave("a", after_step=5)  # no boundary comes: it leaves at once
    assert isinstance(left, WorkerLeft)
    assert types(job.advance(60)) == ["WorkerFailed"]  # b went silent: no new world follows
    assert not job.state.members and job.state.world_version == 1
    assert job.replayed() == job.state


def test_a_failure_that_commits_the_last_step_still_finishes_the_job() -> None:
    job = Job(max_steps=1, min_workers=2, heartbeat_timeout=5.0, dataset_size=100)
    job.start("a", "b")
    job.done("a")  # a finished the step, so both contributed; b dies before reporting
    job.alive("a")
    job.now += 3
    job.alive("a")
    facts = job.advance(3)
    assert types(facts) == ["StepCommitted", "JobFinished", "WorkerFailed"]
    assert job.state.finished is not None and job.state.ranks == ("a", "b")


def test_the_last_step_is_checkpointed_and_its_file_indexed_after_the_end() -> None:
    job = Job(max_steps=3, checkpoint_uri="/ckpt", checkpoint_every=2, dataset_size=100)
    job.start("a")
    job.step()
    assert types(job.step()) == ["StepCommitted", "CheckpointRequested"]  # step 1: every 2
    facts = job.step()
    assert types(facts) == ["StepCommitted", "CheckpointRequested", "JobFinished"]
    request = facts[1]
    assert isinstance(request, CheckpointRequested) and request.step == 2
    assert types(job.checkpoint_written(request)) == ["CheckpointSaved"]
    assert job.state.latest_checkpoint is not None and job.state.latest_checkpoint.step == 2


def test_members_draining_when_the_job_ends_leave_with_it() -> None:
    job = Job(max_steps=2, min_workers=2, dataset_size=100, batch_size=10)
    job.start("a", "b")
    job.leave("b", after_step=4)  # would train on to step 4
    assert job.state.members["b"].status == "draining"
    job.step()
    facts = job.step()
    assert types(facts) == ["StepCommitted", "WorkerLeft", "JobFinished"]
    assert set(job.state.members) == {"a"}


@pytest.mark.parametrize("field", ["max_steps", "epochs"])
def test_a_length_below_one_is_a_settings_error(field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        JobConfig(**{field: 0})
