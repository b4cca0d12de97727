"""A rank that leaves cleanly (SIGTERM: it finishes its step and sends Leave) under `cohort
run`, on both gradient routes: the job goes on with the survivor, which never dies of it."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from cohort.coordinator.replay import from_file
from cohort.errors import Exit
from cohort.events.models import TrainingPaused, WeightsLost, WorkerLeft
from tests.helpers import require_torch, wait_until
from tests.integration.launch import Launch, training, worker_of

pytestmark = [pytest.mark.slow]

SCRIPT = str(Path(__file__).with_name("transparent_script.py"))
JOB = (
    "--min-workers", "1", "--dataset-size", "72", "--batch-size", "6", "--global-batch", "12",
    "--epochs", "20", "--max-restarts", "0",
    "--heartbeat-interval", "0.5", "--heartbeat-timeout", "2",
)  # fmt: skip


@pytest.mark.parametrize("route", ["gloo", "redis"])
def test_a_rank_sent_sigterm_leaves_and_the_survivor_finishes_the_job(
    route: str, tmp_path: Path
) -> None:
    require_torch()  # the ranks run transparent_script.py, a torch script
    out = tmp_path / "out"
    out.mkdir()
    run = Launch(
        "-n", "2", *JOB, "--export", str(tmp_path / "run.export"), SCRIPT, str(out),
        "--route", route, "--optimizer", "sgd", "--schedule", "step", "--pace", "0.05",
        cwd=tmp_path,
    )  # fmt: skip
    watch = run.journal()
    wait_until(lambda: training(watch, 2, steps=10), 180, message="two ranks training")
    survivor, victim = watch.state.ranks
    (pid,) = [p for p in run.ranks(SCRIPT) if worker_of(p) == victim]
    os.kill(pid, signal.SIGTERM)
    assert run.wait(400) == Exit.OK, run.output[-5000:]
    assert "audit (every sample exactly once per epoch): passed" in run.output
    journal = [fact for _, fact in from_file(tmp_path / "run.export").facts()]  # Redis is gone
    left = [(f.worker, f.reason) for f in journal if isinstance(f, WorkerLeft)]
    # its Leave after the step it reported: at once if that step had committed, else once
    # it does (drained); either way a clean leave, and the survivor goes on to the end
    assert left in ([(victim, "stopped"), (survivor, "finished")],
                    [(victim, "drained"), (survivor, "finished")]), left  # fmt: skip
    assert not [f for f in journal if isinstance(f, WeightsLost | TrainingPaused)]
