"""Steps per second, epoch progress and the time to the job's end, from journaled times."""

from __future__ import annotations

import math

import pytest

from cohort.coordinator.fold import fold
from cohort.coordinator.metrics import Metrics
from cohort.coordinator.progress import progress
from cohort.coordinator.state import RATE_WINDOW
from tests.unit.job import Job

SECONDS_PER_STEP = 0.5


def _train(job: Job, steps: int, seconds: float = SECONDS_PER_STEP) -> None:
    for _ in range(steps):
        job.now += seconds
        job.step()


def _job(**config: object) -> Job:
    """Two ranks from the first step: 64 samples a step, 10 steps an epoch."""
    job = Job(**{"dataset_size": 640, "batch_size": 32, "min_workers": 2, **config})
    job.start("a", "b")
    return job


def test_the_rate_and_eta_come_from_the_commits_journaled_times() -> None:
    job = _job(max_steps=100)
    _train(job, 10)
    ahead = progress(job.state, job.now)
    assert ahead.steps_per_second == pytest.approx(1 / SECONDS_PER_STEP)
    assert ahead.steps_left == 90
    assert ahead.eta_seconds == pytest.approx(90 * SECONDS_PER_STEP)
    # Time since the last commit counts down the estimate; the rate stays the journal's.
    later = progress(job.state, job.now + 5)
    assert later.eta_seconds == pytest.approx(90 * SECONDS_PER_STEP - 5)
    assert later.since_commit == pytest.approx(5)
    assert progress(job.replayed(), job.now) == ahead


def test_the_rate_follows_the_recent_window_when_steps_get_slower() -> None:
    job = _job(max_steps=1000)
    _train(job, 40, seconds=0.1)
    _train(job, RATE_WINDOW, seconds=2.0)
    assert len(job.state.commits) == RATE_WINDOW
    assert progress(job.state, job.now).steps_per_second == pytest.approx(0.5)


def test_epoch_progress_and_steps_left_count_by_the_configured_epochs() -> None:
    job = _job(epochs=3)
    _train(job, 5)
    ahead = progress(job.state, job.now)
    assert ahead.epoch_progress == pytest.approx(0.5)
    assert ahead.steps_left == 5 + 2 * 10
    _train(job, 10)  # into the second epoch, half of it done
    ahead = progress(job.state, job.now)
    assert job.state.epoch == 1 and ahead.epoch_progress == pytest.approx(0.5)
    assert ahead.steps_left == 15


def test_the_nearer_of_max_steps_and_epochs_ends_the_job() -> None:
    job = _job(epochs=3, max_steps=12)
    _train(job, 5)
    assert progress(job.state, job.now).steps_left == 7


def test_a_pause_restarts_the_measure_and_hides_the_eta() -> None:
    job = _job(max_steps=100)
    _train(job, 5)
    job.leave("b")
    ahead = progress(job.state, job.now)
    assert job.state.paused and ahead.steps_per_second is None and ahead.eta_seconds is None
    assert ahead.steps_left == 95


def test_a_finished_job_has_nothing_left() -> None:
    job = _job(max_steps=4)
    _train(job, 4)
    ahead = progress(job.state, job.now + 100)
    assert job.state.finished and ahead.steps_left == 0 and ahead.eta_seconds == 0.0


def test_a_job_without_a_length_has_a_rate_and_no_eta() -> None:
    job = _job()
    _train(job, 3)
    ahead = progress(job.state, job.now)
    assert ahead.steps_per_second == pytest.approx(2.0)
    assert ahead.steps_left is None and ahead.eta_seconds is None


def test_the_batched_fold_keeps_the_same_commit_times_as_one_by_one() -> None:
    job = _job(max_steps=1000)
    _train(job, RATE_WINDOW + 7)
    assert fold(job.journal).commits == job.state.commits
    assert job.state.commits[-1][0] == job.state.last_committed


def test_metrics_show_the_rate_progress_and_eta_and_nan_while_unknown() -> None:
    job = _job(max_steps=100)
    metrics = Metrics("unit", "c1")
    metrics.update(job.state, True, 0.0, job.now)
    labels = {"job": "unit", "coordinator": "c1"}
    assert math.isnan(metrics.registry.get_sample_value("cohort_eta_seconds", labels) or 0)
    _train(job, 5)
    metrics.update(job.state, True, 0.0, job.now)
    sample = metrics.registry.get_sample_value
    assert sample("cohort_steps_per_second", labels) == pytest.approx(2.0)
    assert sample("cohort_steps_left", labels) == 95
    assert sample("cohort_eta_seconds", labels) == pytest.approx(47.5)
    assert sample("cohort_epoch_progress", labels) == pytest.approx(0.5)
