"""Resuming and inspecting `cohort run`'s runs (issue 47, items 7 and 8), with real
launchers and real signals: a launcher SIGKILLed mid-run is resumed by the same command
at its last committed step; a finished run is read from its directory with no Redis
running and its files untouched; a finished job is not run again by accident; another
job is refused the checkpoint location of the first."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from cohort.coordinator.replay import from_file
from cohort.errors import Exit
from cohort.events.models import EpochFinished
from tests.helpers import processes_mentioning, wait_until
from tests.integration.launch import Launch, training

pytestmark = pytest.mark.slow

SCRIPT = str(Path(__file__).with_name("run_script.py"))
FAST = ("--heartbeat-timeout", "2", "--heartbeat-interval", "0.5", "--batch-size", "16")
"""512 samples at 2 x 16 a step: 16 steps an epoch."""


def cohort(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`cohort ARGS` in `cwd`, its temporary files (a finished run's reader) in cwd/tmp."""
    env = {k: v for k, v in os.environ.items() if k not in ("COHORT_REDIS_URL", "COHORT_JOB")}
    (cwd / "tmp").mkdir(exist_ok=True)
    env["TMPDIR"] = str(cwd / "tmp")
    return subprocess.run(
        [sys.executable, "-m", "cohort", *args],
        capture_output=True, text=True, timeout=120, cwd=cwd, env=env,
    )  # fmt: skip


def run_dirs(cwd: Path) -> list[Path]:
    return sorted((cwd / "cohort-runs").iterdir())


def test_a_launcher_sigkilled_mid_run_is_resumed_by_the_same_command_at_its_last_step(
    tmp_path: Path,
) -> None:
    args = (
        "-n", "2", *FAST, "--max-steps", "60", "--checkpoint-uri", f"file://{tmp_path}/ckpt",
        "--checkpoint-every", "8", SCRIPT, "0.05",
    )  # fmt: skip
    first = Launch(*args, cwd=tmp_path)
    body, watch = first.run_json(), first.journal()
    wait_until(
        lambda: watch.pull(100) is not None and watch.state.config, 60, message="the job's settings"
    )
    live = cohort("status", "--run-dir", body["run_dir"], "--json", cwd=tmp_path)
    assert live.returncode == 0 and f'"job": "{body["job"]}"' in live.stdout, live.stderr
    wait_until(
        lambda: training(watch, 2, steps=20) and watch.state.last_committed % 8 in range(1, 5),
        60, message="two ranks past step 20, between two checkpoints",
    )  # fmt: skip
    first.children()  # remembered: each must die with the launcher
    watch.pull(0)
    os.kill(first.popen.pid, signal.SIGKILL)
    with contextlib.suppress(redis.ConnectionError):  # the run's Redis goes with its launcher
        watch.pull(0)
    lost_at = watch.state.last_committed
    assert first.wait(30) == -signal.SIGKILL
    wait_until(lambda: first.left() == [], 30, message="the lost launcher's processes gone")

    again = Launch(*args, cwd=tmp_path)  # the same command, as a user types it again
    assert again.wait() == Exit.OK, again.output[-3000:]
    resumed = next(line for line in again.lines if "resuming job" in line)
    step = int(resumed.rsplit("at step ", 1)[1].split()[0])
    assert f"resuming job {body['job']!r} from {body['run_dir']} at step" in resumed
    assert step >= lost_at >= 20
    assert run_dirs(tmp_path) == [Path(body["run_dir"])]  # its run directory, no other
    assert "audit (every sample exactly once per epoch): passed" in again.output
    # its ranks are new workers, never taken for the lost ones the journal still holds
    assert "is already a member" not in again.output and "Traceback" not in again.output
    # item 9: the lineage's steps and epochs, the steps a rewind discarded counted once
    out = tmp_path / "run.export"
    assert (
        cohort("export", "--run-dir", body["run_dir"], "-o", str(out), cwd=tmp_path).returncode == 0
    )
    epochs = {f.epoch for _, f in from_file(out).facts() if isinstance(f, EpochFinished)}
    assert f"60 steps committed over {len(epochs)} epochs (" in again.output, again.output[-600:]
    assert "redone after a rewind" in again.output


@dataclass(frozen=True)
class Finished:
    cwd: Path
    args: tuple[str, ...]
    job: str
    run_dir: Path
    url: str


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Finished:
    """A short run that finished, its launcher and private Redis gone."""
    cwd = tmp_path_factory.mktemp("finished")
    args = (
        "-n", "1", *FAST, "--max-steps", "4", "--checkpoint-uri", f"file://{cwd}/ckpt",
        SCRIPT, "0.01",
    )  # fmt: skip
    launch = Launch(*args, cwd=cwd)
    body = launch.run_json()
    assert launch.wait() == Exit.OK, launch.output[-3000:]
    return Finished(cwd, args, body["job"], Path(body["run_dir"]), body["redis_url"])


def _files(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_a_finished_run_is_read_from_its_directory_with_no_redis_running(
    finished: Finished, tmp_path: Path
) -> None:
    cwd, run_dir = finished.cwd, str(finished.run_dir)
    before = _files(finished.run_dir)
    dead = cohort("status", "--redis-url", finished.url, "--job", finished.job, cwd=cwd)
    assert dead.returncode == Exit.REDIS and f"--run-dir {run_dir}" in dead.stderr
    status = cohort("status", "--run-dir", run_dir, cwd=cwd)
    assert status.returncode == 0, status.stderr
    assert f"job {finished.job}" in status.stdout and "finished (max_steps=4" in status.stdout
    replay = cohort("replay", "--run-dir", run_dir, "--audit", "-q", cwd=cwd)
    assert replay.returncode == 0 and "next step 4" in replay.stdout, replay.stderr
    out = tmp_path / "run.export"
    exported = cohort("export", "--run-dir", run_dir, "-o", str(out), cwd=cwd)
    assert exported.returncode == 0 and out.stat().st_size > 0, exported.stderr
    page = tmp_path / "report.html"
    assert cohort("report", "--run-dir", run_dir, "-o", str(page), cwd=cwd).returncode == 0
    assert _files(finished.run_dir) == before  # read-only: the run's files as they were
    assert processes_mentioning(str(cwd / "tmp")) == []  # its reader's Redis is gone too
    nothing = cohort("status", "--run-dir", str(tmp_path), cwd=cwd)
    assert nothing.returncode == Exit.USAGE and "holds no cohort run" in nothing.stderr


def test_a_finished_jobs_command_run_again_says_so_and_runs_nothing(finished: Finished) -> None:
    before = run_dirs(finished.cwd)
    again = Launch(*finished.args, cwd=finished.cwd)
    assert again.wait(60) == Exit.OK, again.output
    assert f"job {finished.job!r} finished (max_steps=4 reached)" in again.output
    assert "nothing to run; `--fresh` starts it over" in again.output
    assert run_dirs(finished.cwd) == before and again.seen == set()


def test_another_job_is_refused_the_first_jobs_checkpoint_location_by_name(
    finished: Finished,
) -> None:
    uri, before = f"file://{finished.cwd}/ckpt", run_dirs(finished.cwd)
    other = Launch("--job", "other", *finished.args, cwd=finished.cwd)
    assert other.wait(60) == Exit.USAGE, other.output
    assert f"checkpoint location {uri!r} belongs to job {finished.job!r}" in other.output
    assert run_dirs(finished.cwd) == before  # nothing started
    by_hand = cohort(
        "coordinator", "--job", "other", "--checkpoint-uri", uri, "--redis-url",
        "redis://127.0.0.1:1/0", cwd=finished.cwd,
    )  # fmt: skip
    assert by_hand.returncode == Exit.USAGE and "belongs to job" in by_hand.stderr


def test_fresh_starts_a_finished_job_over_in_a_new_run_directory(finished: Finished) -> None:
    before = run_dirs(finished.cwd)
    fresh = Launch("--fresh", *finished.args, cwd=finished.cwd)
    body = fresh.run_json()
    assert fresh.wait() == Exit.OK, fresh.output[-3000:]
    assert body["job"] == finished.job and Path(body["run_dir"]) not in before
    assert "resuming" not in fresh.output and "4 steps committed" in fresh.output
    assert run_dirs(finished.cwd) == sorted([*before, Path(body["run_dir"])])
