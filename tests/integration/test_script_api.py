"""What a script can ask its job, run under `cohort run` as a user runs it: who it is (worker
id, local rank, rank, world size, chief), where it is (step, epoch) inside and between its
loops, and `job.save`, which writes the final model once for the whole job.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cohort.errors import Exit
from cohort.localredis import LocalRedis
from tests.helpers import wait_until
from tests.integration.launch import Launch

pytestmark = pytest.mark.slow

SCRIPT = str(Path(__file__).with_name("whoami_script.py"))
SETTINGS = ("--heartbeat-timeout", "2", "--heartbeat-interval", "0.5", "--min-workers", "2")


def _torch() -> Any:
    """torch; in CI, which installs it, a missing torch fails instead of skipping."""
    if os.environ.get("CI") == "true":
        import torch

        return torch
    return pytest.importorskip("torch")


def reports(run: Launch) -> list[dict[str, Any]]:
    return [json.loads(line.split("WHOAMI ", 1)[1]) for line in run.lines if "WHOAMI " in line]


def launch(route: str, tmp_path: Path, *settings: str) -> tuple[Launch, list[dict[str, Any]]]:
    run = Launch(
        "-n", "2", "--node", "n", *SETTINGS, *settings, SCRIPT, route, str(tmp_path),
        cwd=tmp_path,
    )  # fmt: skip
    assert run.wait(240) == Exit.OK, run.output[-3000:]
    seen = reports(run)
    assert len(seen) == 2, run.output[-3000:]
    return run, sorted(seen, key=lambda r: r["local_rank"])


def run_script(route: str, tmp_path: Path, *settings: str) -> list[dict[str, Any]]:
    return launch(route, tmp_path, *settings)[1]


def test_a_numpy_script_knows_its_rank_step_and_epoch_and_saves_once(tmp_path: Path) -> None:
    run, (first, second) = launch("numpy", tmp_path, "--epochs", "2", "--batch-size", "16")
    # what it says without any logging set up: where it joined, its rank and weights
    joined = [line for line in run.lines if "cohort: worker n-" in line and "joined job" in line]
    assert len(joined) == 2 and all("on Redis redis://127.0.0.1:" in x for x in joined)
    starts = [line for line in run.lines if "trains as rank" in line]
    assert any("n-0 trains as rank" in x for x in starts) and len(starts) >= 2
    assert any("of 2 (world" in x and "with the initial weights" in x for x in starts)
    assert [first["worker_id"], second["worker_id"]] == ["n-0", "n-1"]
    assert [first["local_rank"], second["local_rank"]] == [0, 1]
    assert first["agree"] and second["agree"]  # job.step/rank/... are the step's, inside it
    for report in (first, second):
        after = report["after"]
        assert after["step"] == report["trained"][-1]  # the last step it trained
        assert after["epoch"] == 1 and after["world_size"] == 2
    assert sorted([first["after"]["rank"], second["after"]["rank"]]) == [0, 1]
    assert [first["saved"], second["saved"]].count(True) == 1  # the chief alone
    assert [r["after"]["is_chief"] for r in (first, second)] == [first["saved"], second["saved"]]
    with np.load(tmp_path / "final.npz") as saved:
        np.testing.assert_array_equal(saved["w"], np.array(first["weights"]))
    assert first["weights"] == second["weights"]
    assert not [name for name in os.listdir(tmp_path) if ".tmp-" in name]  # written whole


def test_a_torch_script_after_an_epoch_loop_is_still_in_that_epoch_and_hears_of_its_loader(
    tmp_path: Path,
) -> None:
    torch = _torch()
    run, (first, second) = launch("torch", tmp_path, "--epochs", "3", "--batch-size", "4")
    said = [line for line in run.lines if "UserWarning" in line]
    assert len(said) == 2, said  # once per rank, though each epoch makes a new loader
    assert all("the DataLoader's batch_size=8 is not used" in line for line in said)
    assert all("--batch-size 4" in line for line in said)
    assert not [line for line in run.lines if "Warning" in line and line not in said]
    for report in (first, second):
        assert report["agree"]  # inside the batches, job.epoch is the loop's epoch
        ended = [(epoch, seen["epoch"]) for epoch, seen in report["epochs"]]
        assert ended == [(0, 0), (1, 1), (2, 2)]  # not the next epoch's first step
        steps = [seen["step"] for _, seen in report["epochs"]]
        assert steps == sorted(steps) and steps[-1] == report["after"]["step"]
    assert [first["saved"], second["saved"]].count(True) == 1
    saved = torch.load(tmp_path / "final.pt", weights_only=True)
    weights = [t.flatten().tolist() for t in saved.values()]
    assert np.allclose(sum(weights, []), sum(first["weights"], []))


@pytest.mark.parametrize("route", ["numpy", "torch"])
def test_a_job_of_three_steps_gives_each_rank_three_steps_and_no_fourth(
    route: str, tmp_path: Path
) -> None:
    """No batch is given that would not be applied: the walk learns of the job's end with
    its last step's commit, before it builds another."""
    if route == "torch":
        _torch()
    first, second = run_script(route, tmp_path, "--max-steps", "3", "--batch-size", "4")
    assert first["given"] == second["given"] == [0, 1, 2]  # each a batch the script trains
    assert first["trained"] == second["trained"] == [0, 1, 2]
    assert first["after"]["step"] == second["after"]["step"] == 2


def test_status_of_a_finished_job_says_where_it_ended_and_waits_for_nothing(
    server: LocalRedis, tmp_path: Path
) -> None:
    run_script("numpy", tmp_path, "--redis-url", server.url, "--job", "over", "--epochs", "1")

    def status(*flags: str) -> str:
        said = subprocess.run(
            [sys.executable, "-m", "cohort", "--redis-url", server.url, "status", "--job",
             "over", *flags],
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        return said.stdout

    # the leader's last view outlives it by a few seconds; then the job's own end is said
    def without_leader() -> str:
        text = status()
        return "" if "inbox lag" in text else text  # the live view says its lag

    text = wait_until(without_leader, 30, 0.5, "the finished leader's view expired")
    assert "finished at step 3 in data epoch 0" in text, text
    assert "no live leader view: the coordinators end with the job" in text
    assert "no coordinator leads right now" not in text and "steps/s" not in text
    body = json.loads(status("--json"))
    assert (body["phase"], body["paused"]) == ("finished", False)


@pytest.mark.parametrize("backend", ["", "gloo"])
def test_a_sharded_validation_counts_every_sample_once_over_the_world(
    backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After each epoch each rank validates its `job.shard` of 50 samples; `job.sum`,
    `max` and `mean` over the world give every rank the whole set's figures."""
    _torch()
    monkeypatch.setenv("COHORT_TORCH_BACKEND", backend)
    first, second = run_script("torch", tmp_path, "--epochs", "2", "--batch-size", "16")
    expected = {"count": 50, "ids": sum(range(50)), "top": 49.0, "ranks": 0.5, "world_size": 2}
    assert first["validations"] == second["validations"] == [expected, expected]


def test_the_gloo_routes_clean_finish_says_no_world_is_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its ranks leaving a finished job end the last world: no news, and nothing to join
    again for (it said "world 1 is over: ... join again to return"). The job's close
    destroys the last world's process group."""
    _torch()
    monkeypatch.setenv("COHORT_TORCH_BACKEND", "gloo")
    run, reports = launch("torch", tmp_path, "--max-steps", "12", "--batch-size", "16")
    assert "finished at step 11" in run.output
    assert not [line for line in run.lines if "is over" in line or "join again" in line]
    assert [r["process_group"] for r in reports] == [False, False]


def test_a_copy_started_after_the_job_finished_says_so_in_one_line_and_exits_0(
    server: LocalRedis, tmp_path: Path
) -> None:
    run_script("numpy", tmp_path, "--redis-url", server.url, "--job", "done", "--epochs", "1")
    env = {**os.environ, "COHORT_JOB": "done", "COHORT_REDIS_URL": server.url}
    late = subprocess.run(
        [sys.executable, SCRIPT, "numpy", str(tmp_path / "late")],
        env={**env, "COHORT_WORKER_ID": "late"}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert late.returncode == 0, late.stderr
    assert "Traceback" not in late.stderr
    said = [line for line in late.stderr.splitlines() if "nothing to train" in line]
    assert len(said) == 1 and "job 'done' finished at step" in said[0]
    report = json.loads(late.stdout.split("WHOAMI ", 1)[1])
    assert report["trained"] == [] and report["saved"] is False
    assert not (tmp_path / "late").exists()
    quiet = subprocess.run(
        [sys.executable, SCRIPT, "numpy", str(tmp_path / "late")],
        env={**env, "COHORT_WORKER_ID": "late-2", "COHORT_LOG_LEVEL": "error"},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert quiet.returncode == 0 and "cohort:" not in quiet.stderr  # $COHORT_LOG_LEVEL
