"""`cohort run` under a real SLURM (issue 55): munged, slurmctld and two slurmd started by the
tests on this machine (tests/integration/slurm.py: two node names on one host, each slurmd on
a port of its own), jobs submitted with `sbatch examples/slurm/cohort_run.sbatch`, unchanged.

A job trains to its end; `scontrol requeue` of a running job resumes it at its last committed
step; SLURM's warning before a time limit (sent here with `scancel --signal=USR1`, which is
what `--signal=USR1@120` does at limit - 120 s, rather than waiting for a real limit) drains
it, the script requeues it and the next allocation resumes it; a node's launcher SIGKILLed
leaves the other node training to the end. A requeued job waits for its BeginTime (SLURM
makes it now + 2 min); the tests move it to now + 3 s with `scontrol update`.

Skipped where slurm-wlm or munge are not installed (or not root), unless
COHORT_REQUIRE_SLURM=1 (CI), where that fails instead.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cohort.coordinator.replay import JournalWatch
from cohort.events.connection import RedisSettings, connect
from tests.helpers import wait_until
from tests.integration import slurm as slurm_daemons
from tests.integration.launch import running, training
from tests.integration.slurm import Slurm

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "examples" / "slurm" / "cohort_run.sbatch"
SCRIPT = str(Path(__file__).with_name("run_script.py"))
FAST = ("--heartbeat-timeout", "2", "--heartbeat-interval", "0.5", "--batch-size", "16")
"""512 samples at 2 x 16 a step: 16 steps an epoch."""
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Slurm]:
    why = slurm_daemons.missing()
    if why is not None:
        if os.environ.get("COHORT_REQUIRE_SLURM") == "1":
            pytest.fail(f"COHORT_REQUIRE_SLURM=1 but SLURM cannot run here: {why}")
        pytest.skip(f"SLURM cannot run here: {why}")
    # the jobs run `cohort` from this Python's environment, as a user's PATH has it
    path = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"
    tmp = tmp_path_factory.mktemp("slurm")
    with slurm_daemons.started(tmp, ("node1", "node2"), path=path) as made:
        yield made
    assert slurm_daemons.left(made) == [], "a SLURM daemon outlived the tests"


def submit(cluster: Slurm, cwd: Path, *args: str, nodes: int = 1) -> str:
    return cluster.sbatch(SBATCH, *args, options=(f"--nodes={nodes}",), cwd=cwd)


def output(cwd: Path, job_id: str) -> str:
    path = cwd / f"cohort-train-{job_id}.out"
    return path.read_text() if path.exists() else ""


def root(cwd: Path, job_id: str) -> Path:
    return cwd / "cohort-runs" / f"slurm-{job_id}"


def journal(url: str, job: str) -> JournalWatch:
    return JournalWatch.of(connect(RedisSettings.resolve(url)), job)


def first_node_journal(cwd: Path, job_id: str) -> JournalWatch:
    """The job's journal, in the single node's private Redis (run.json names it)."""
    run_json = root(cwd, job_id) / "run.json"
    wait_until(run_json.exists, 60, 0.1, message="the job's run.json")
    body = json.loads(run_json.read_text())
    return journal(body["redis_url"], body["job"])


def resume_now(cluster: Slurm, job_id: str) -> None:
    """A requeued job, pending until its BeginTime (SLURM's: 2 minutes on), eligible in 3 s:
    a job started again within the second its last allocation ended is refused by slurmd
    ("Job credential revoked", kept by job id to the second), and the job fails."""
    wait_until(
        lambda: cluster.job(job_id).get("Restarts") == "1" and cluster.state(job_id) == "PENDING",
        60, 0.2, message="the job requeued",
    )  # fmt: skip
    cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now+3")


def test_a_job_submitted_with_sbatch_trains_to_its_end(cluster: Slurm, tmp_path: Path) -> None:
    job_id = submit(cluster, tmp_path, "--max-steps", "20", *FAST, SCRIPT, "0.01")
    cluster.wait_state(job_id, DONE, 120)
    out = output(tmp_path, job_id)
    assert cluster.state(job_id) == "COMPLETED", out[-3000:]
    # nothing SLURM knows was given: the job, node, ranks and run directory are SLURM's
    assert f"cohort run: job 'cohort-train-{job_id}', 2 rank(s) on node 'node1'" in out
    assert "ranks from the job's tasks per node (2)" in out
    body = json.loads((root(tmp_path, job_id) / "run.json").read_text())
    assert body["node"] == "node1" and body["finished"] and body["exit"] == 0
    assert "20 steps committed" in out and "exactly once per epoch): passed" in out


def test_a_requeued_job_resumes_at_its_last_committed_step(cluster: Slurm, tmp_path: Path) -> None:
    job_id = submit(cluster, tmp_path, "--max-steps", "90", *FAST, SCRIPT, "0.05")
    watch = first_node_journal(tmp_path, job_id)
    wait_until(lambda: training(watch, 2, steps=20), 90, message="two ranks past step 20")
    watch.pull(0)
    before = watch.state.last_committed
    cluster.run("scontrol", "requeue", job_id)
    resume_now(cluster, job_id)
    cluster.wait_state(job_id, DONE, 150)
    out = output(tmp_path, job_id)
    assert cluster.state(job_id) == "COMPLETED", out[-3000:]
    # SLURM SIGTERMs every process of the step and SIGKILLs what is left: the launcher's
    # summary may never be printed, but the journal and its AOF are in the run directory
    resumed = next(line for line in out.splitlines() if "resuming job" in line)
    assert f"resuming job 'cohort-train-{job_id}' from {root(tmp_path, job_id)} at step" in resumed
    assert int(resumed.rsplit("at step ", 1)[1].split()[0]) >= before >= 20
    assert "90 steps committed" in out and "exactly once per epoch): passed" in out
    assert "(requeued 1 time(s))" in out


def test_a_job_signalled_before_its_time_limit_drains_and_resumes_next_allocation(
    cluster: Slurm, tmp_path: Path
) -> None:
    job_id = submit(cluster, tmp_path, "--max-steps", "90", *FAST, SCRIPT, "0.05")
    watch = first_node_journal(tmp_path, job_id)
    wait_until(lambda: training(watch, 2, steps=20), 90, message="two ranks past step 20")
    # what --signal=USR1@120 sends 120 s before the limit: SIGUSR1 to every process of the
    # job's steps (the launcher, its ranks, its coordinator and its Redis alike)
    cluster.run("scancel", "--signal=USR1", job_id)
    resume_now(cluster, job_id)
    cluster.wait_state(job_id, DONE, 150)
    out = output(tmp_path, job_id)
    assert cluster.state(job_id) == "COMPLETED", out[-3000:]
    first, second = out.split("(requeued 1 time(s))", 1)
    assert "SIGUSR1: every rank finishes its step and leaves" in first
    assert "exit 75: drained on SIGUSR1" in first
    # the ranks left (drained), none was killed by the signal meant for the launcher
    assert "killed by SIGUSR1" not in out and "did not leave within the grace" not in first
    assert "resuming job" in second
    assert "90 steps committed" in second and "exactly once per epoch): passed" in second


def test_a_nodes_launcher_sigkilled_leaves_the_other_node_training(
    cluster: Slurm, tmp_path: Path
) -> None:
    job_id = submit(cluster, tmp_path, "--max-steps", "160", *FAST, SCRIPT, "0.05", nodes=2)
    url_file = root(tmp_path, job_id) / "redis.json"
    wait_until(url_file.exists, 60, 0.1, message="the first node's Redis published")
    published = json.loads(url_file.read_text())
    assert published["node"] == "node1" and oct(url_file.stat().st_mode & 0o777) == "0o600"
    watch = journal(published["url"], f"cohort-train-{job_id}")
    wait_until(lambda: training(watch, 4, steps=10), 90, message="four ranks on two nodes")
    assert {w.split("-")[0] for w in watch.state.ranks} == {"node1", "node2"}
    lock = root(tmp_path, job_id) / "nodes" / "node2" / "launcher.lock"
    launcher = int(lock.read_text().split()[0])
    os.kill(launcher, signal.SIGKILL)
    wait_until(lambda: not running(launcher), 10, message="node2's launcher gone")
    lost_at = watch.state.last_committed
    wait_until(
        lambda: training(watch, 2, steps=lost_at + 10)
        and all(w.startswith("node1-") for w in watch.state.ranks),
        60, message="node1's two ranks training on without node2",
    )  # fmt: skip
    cluster.wait_state(job_id, DONE, 150)
    out = output(tmp_path, job_id)
    assert "job 'cohort-train-" in out and "finished (max_steps=160" in out, out[-3000:]
    assert "exactly once per epoch): passed" in out
