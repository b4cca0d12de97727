"""The end of a job is exact for every rank (issue 47), with real processes: a process that
joined after the last world began takes the final weights from the last checkpoint or says
it lacks them; a job whose scripts all ended early never exits 0 from `cohort run`; a
script's epoch count other than the job's is refused by name; Ctrl-C leaves the script a
way to tell an interrupted epoch from a finished one."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from cohort.errors import Exit
from tests.helpers import wait_until
from tests.integration.cluster import Cluster, Process
from tests.integration.launch import Launch

pytestmark = [pytest.mark.redis_server, pytest.mark.slow]

SCRIPT = str(Path(__file__).with_name("end_script.py"))
FAST = ("--heartbeat-interval", "0.5", "--heartbeat-timeout", "3")


def report(proc: Process | Launch) -> dict[str, Any]:
    text = proc.output() if isinstance(proc, Process) else proc.output
    line = next(x for x in text.splitlines() if "END {" in x)
    return json.loads(line.split("END ", 1)[1])  # type: ignore[no-any-return]


def _torch() -> None:
    if os.environ.get("CI") != "true":
        pytest.importorskip("torch")


def _late_joiner(cluster: Cluster, tmp_path: Path, *flags: str) -> tuple[Process, ...]:
    """Two ranks train a 3-step job and hold before its last step; a third process starts
    then and is ready before they go on: the job finishes with it never given a rank."""
    cluster.coordinator(
        "c1", "--min-workers", "2", "--dataset-size", "64", "--batch-size", "4",
        "--max-steps", "3", *FAST, *flags,
    )  # fmt: skip
    env = {"COHORT_JOB": cluster.job, "COHORT_REDIS_URL": cluster.url}
    ranks = [
        cluster.python(name, SCRIPT, "numpy", str(tmp_path), "--hold-last-step", "2",
                       env={**env, "COHORT_WORKER_ID": name})
        for name in ("a", "b")
    ]  # fmt: skip
    wait_until(lambda: all("AT_LAST" in p.output() for p in ranks), 120, message="at step 2")
    late = cluster.python(
        "late", SCRIPT, "numpy", str(tmp_path), env={**env, "COHORT_WORKER_ID": "late"}
    )
    cluster.until(
        lambda s: "late" in s.members and s.members["late"].status == "ready", 60, "late ready"
    )
    (tmp_path / "go").touch()
    for proc in (*ranks, late):
        assert cluster.finished(proc, 120) == 0, proc.output()[-3000:]
    assert cluster.pull().finished is not None
    return (*ranks, late)


def test_a_process_that_joined_after_the_last_world_began_says_it_lacks_the_final_weights(
    cluster: Cluster, tmp_path: Path
) -> None:
    a, b, late = _late_joiner(cluster, tmp_path)
    first, second, last = report(a), report(b), report(late)
    assert first["weights"] == second["weights"] != [0.0] * 4
    assert first["has_final_weights"] and second["has_final_weights"]
    assert last["finished"] and not last["has_final_weights"] and last["saved"] is False
    assert last["weights"] == [0.0] * 4  # its initial weights: it never trained
    said = late.output()
    assert "does not hold the final weights" in said
    assert "ends with the final weights" not in said
    assert [first["saved"], second["saved"]].count(True) == 1


def test_a_process_that_joined_after_the_last_world_began_takes_the_final_checkpoint(
    cluster: Cluster, tmp_path: Path
) -> None:
    uri = f"file://{tmp_path / 'checkpoints'}"
    a, b, late = _late_joiner(cluster, tmp_path, "--checkpoint-uri", uri)
    first, last = report(a), report(late)
    assert last["has_final_weights"] and last["weights"] == first["weights"]
    assert "took the final weights from the job's last checkpoint" in late.output()


def test_run_whose_scripts_end_before_the_job_s_length_does_not_exit_0(tmp_path: Path) -> None:
    run = Launch(
        "-n", "2", *FAST, "--max-steps", "1000", "--batch-size", "4",
        SCRIPT, "numpy", str(tmp_path), "--quit-after", "2", cwd=tmp_path,
    )  # fmt: skip
    assert run.wait(240) == Exit.UNFINISHED, run.output[-3000:]
    assert "did not finish" in run.output and "--epochs N or --max-steps N" in run.output


def test_a_script_epoch_count_other_than_the_job_s_is_refused_by_name(tmp_path: Path) -> None:
    _torch()
    run = Launch(
        "-n", "1", "--max-restarts", "0", *FAST, "--epochs", "2", "--batch-size", "512",
        SCRIPT, "torch", str(tmp_path), "--epochs", "3", cwd=tmp_path,
    )  # fmt: skip
    assert run.wait(240) == Exit.FAILED, run.output[-3000:]
    assert "job.epochs(3): the job's length is --epochs 2" in run.output
    assert "cohort run --epochs 3" in run.output


def test_ctrl_c_mid_epoch_tells_the_script_its_epoch_did_not_end(
    cluster: Cluster, tmp_path: Path
) -> None:
    _torch()
    cluster.coordinator("c1", "--dataset-size", "4096", "--batch-size", "4", *FAST)
    env = {"COHORT_JOB": cluster.job, "COHORT_REDIS_URL": cluster.url}
    trainer = cluster.python("t", SCRIPT, "torch", str(tmp_path), env=env)
    cluster.until(lambda s: s.last_committed >= 3, 120, message="the script trains")
    trainer.kill(signal.SIGINT)
    assert cluster.finished(trainer, 60) == 0, trainer.output()[-3000:]
    got = report(trainer)
    assert got["interrupted"] and not got["finished"] and got["epochs_done"] == []
    assert "EPOCH_LOOP_ENDED interrupted=True" in trainer.output()


def test_run_on_its_own_redis_trains_step_0_with_every_rank(tmp_path: Path) -> None:
    """`cohort run -n 3` does not start its first world with the first rank to be ready."""
    run = Launch(
        "-n", "3", *FAST, "--max-steps", "4", "--batch-size", "4",
        SCRIPT, "numpy", str(tmp_path), cwd=tmp_path,
    )  # fmt: skip
    assert run.wait(240) == Exit.OK, run.output[-3000:]
    starts = [line for line in run.lines if "trains as rank" in line]
    assert len(starts) == 3, starts
    assert all("of 3 (world 1) from step 0" in line for line in starts), starts
