"""GPU workloads registered by members, and the workers' transfer queues in the metrics."""

from __future__ import annotations

import fakeredis
import pytest

from cohort.coordinator.metrics import Metrics
from cohort.coordinator.replay import view
from cohort.events.models import RegisterWorkload, TransfersWaiting, Workload
from cohort.worker.membership.client import Worker
from tests.unit.job import JOB, Job, types

LABELS = {"job": "unit", "coordinator": "c1"}


def _register(job: Job, worker: str, **workload: object):  # type: ignore[no-untyped-def]
    return job.send(
        RegisterWorkload(at=job.now, job=JOB, worker=worker, workload=Workload(**workload))
    )


def test_a_workload_is_journaled_once_updated_by_name_and_goes_with_its_worker() -> None:
    job = Job()
    job.start("a")
    assert types(_register(job, "a", name="train", devices=(0,), memory=2**30)) == [
        "WorkloadRegistered"
    ]
    assert _register(job, "a", name="train", devices=(0,), memory=2**30) == ()  # a resend
    _register(job, "a", name="train", devices=(0, 1), memory=2**31, priority=5)
    _register(job, "a", name="prefetch", memory=2**28)
    assert [(w.name, w.memory) for w in job.state.members["a"].workloads] == [
        ("train", 2**31),
        ("prefetch", 2**28),
    ]
    assert view(job.state)["members"]["a"]["workloads"][0]["devices"] == [0, 1]
    assert job.replayed() == job.state
    assert _register(job, "stranger", name="x") == ()  # not a member: nothing journaled
    metrics = Metrics("unit", "c1")
    metrics.update(job.state, True, 0.0, job.now)
    assert metrics.registry.get_sample_value("cohort_gpu_workloads", LABELS) == 2
    assert (
        metrics.registry.get_sample_value("cohort_gpu_workload_memory_bytes", LABELS)
        == 2**31 + 2**28
    )
    job.leave("a")
    assert "a" not in job.state.members


def test_the_transfer_queues_workers_report_add_up_in_the_metrics() -> None:
    metrics = Metrics("unit", "c1")
    metrics.transfers(
        [
            TransfersWaiting(at=1, job=JOB, worker="a", pending=3, staged=1, delayed=30.0),
            TransfersWaiting(at=1, job=JOB, worker="b", pending=1, delayed=60.0),
        ]
    )
    sample = metrics.registry.get_sample_value
    assert sample("cohort_transfers_pending", LABELS) == 4
    assert sample("cohort_transfers_staged", LABELS) == 1
    assert sample("cohort_transfer_delay_seconds", LABELS) == 90.0


@pytest.mark.parametrize(
    "kw, says",
    [
        ({"name": "no spaces"}, "workload name='no spaces'"),
        ({"name": "t", "memory": -1}, "workload memory=-1"),
        ({"name": "t", "priority": 10**6}, "workload priority=1000000"),
    ],
)
def test_a_bad_workload_is_refused_naming_the_value(kw: dict[str, object], says: str) -> None:
    worker = Worker(fakeredis.FakeRedis(), JOB, worker_id="w")
    with pytest.raises(ValueError, match=says):
        worker.register_workload(**kw)  # type: ignore[arg-type]
