"""What `cohort run` takes from a SLURM job step's environment (cohort/launcher/slurm.py):
pure functions over environments as SLURM 22.05 sets them (printed from a real job step)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cohort.launcher import slurm
from cohort.launcher.slurm import SlurmError, SlurmJob

STEP = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NAME": "train run.sbatch",
    "SLURMD_NODENAME": "gpu-a17",
    "SLURM_NODEID": "1",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_SUBMIT_DIR": "/home/me/exp",
    "SLURM_CPUS_ON_NODE": "2",
    "SLURM_NTASKS_PER_NODE": "1",  # the step's one launcher per node, not the job's ranks
}


def job(**more: str) -> SlurmJob:
    found = SlurmJob.of({**STEP, **more})
    assert found is not None
    return found


def test_outside_a_job_step_there_is_no_slurm_job() -> None:
    assert SlurmJob.of({}) is None
    assert SlurmJob.of({"SLURM_JOB_ID": "1"}) is None  # salloc's shell on the login node
    assert job().restarts == 0 and job(SLURM_RESTART_COUNT="3").restarts == 3


def test_the_job_name_is_the_slurm_jobs_name_and_id_the_same_after_a_requeue() -> None:
    assert slurm.job_name(job()) == "train-run.sbatch-4242"
    assert slurm.job_name(job(SLURM_RESTART_COUNT="2")) == "train-run.sbatch-4242"
    assert slurm.job_name(job(SLURM_JOB_NAME="")) == "slurm-4242"
    assert slurm.node_name(job(SLURMD_NODENAME="n/1 x")) == "n-1-x"


def test_ranks_are_the_nodes_gpus_else_the_jobs_tasks_per_node_else_one() -> None:
    assert slurm.ranks(job(SLURM_GPUS_ON_NODE="4"), 8) == ("gpu", "SLURM_GPUS_ON_NODE=4")
    assert slurm.ranks(job(), 3)[0] == "3"
    assert slurm.ranks(job(), None)[0] == "1"


@pytest.mark.parametrize(
    ("record", "per_node"),
    [
        ("JobId=7 JobName=x NumNodes=2 NumCPUs=4 NumTasks=4 CPUs/Task=1", 2),
        ("JobId=7 NumNodes=2-2 NumTasks=3", 2),
        ("JobId=7 NumNodes=1 NumTasks=N/A", None),
        ("", None),
    ],
)
def test_tasks_per_node_come_from_the_jobs_record(record: str, per_node: int | None) -> None:
    assert slurm.tasks_per_node(record) == per_node


def test_the_run_directory_is_the_jobs_and_the_same_after_a_requeue() -> None:
    first = Path("/home/me/exp/cohort-runs/slurm-4242")
    assert slurm.run_dir(job(SLURM_NODEID="0"), own_redis=True) == first
    assert slurm.run_dir(job(SLURM_RESTART_COUNT="1", SLURM_NODEID="0"), own_redis=True) == first
    assert slurm.run_dir(job(), own_redis=False) == first / "nodes" / "gpu-a17"


def test_the_first_node_hosts_the_redis_and_the_first_world_waits_for_every_node() -> None:
    assert job(SLURM_NODEID="0").hosts_redis and not job().hosts_redis
    assert slurm.start_workers(job(), 4) == 8


def test_only_this_allocations_published_url_is_taken() -> None:
    now = job(SLURM_RESTART_COUNT="1")
    body = {"url": "redis://:pw@10.0.0.1:6379/0", "job_id": "4242", "restarts": 1}
    assert slurm.published_url(body, now) == "redis://:pw@10.0.0.1:6379/0"
    assert slurm.published_url({**body, "restarts": 0}, now) is None  # before the requeue
    assert slurm.published_url({**body, "job_id": "9"}, now) is None
    assert slurm.published_url(None, now) is None


def test_a_url_never_published_is_an_error_naming_the_file(tmp_path: Path) -> None:
    late = job(SLURM_SUBMIT_DIR=str(tmp_path))
    ticks = iter(range(100))
    with pytest.raises(SlurmError, match="did not publish the job's Redis in .*redis.json"):
        slurm.await_url(late, timeout=5, clock=lambda: float(next(ticks)), pause=lambda _: None)
    slurm.publish(late, "redis://:pw@h:1/0")
    assert slurm.await_url(late, timeout=0, pause=lambda _: None) == "redis://:pw@h:1/0"
    assert (late.root / slurm.URL_FILE).stat().st_mode & 0o777 == 0o600


def test_the_redis_host_is_cohort_redis_host_when_given() -> None:
    assert slurm.redis_host({"COHORT_REDIS_HOST": "10.1.2.3"}) == "10.1.2.3"
