"""Warm spares under `cohort run --spares`: real launchers, real ranks, a real SIGKILL.

`cohort run -n 3 --spares 1` on tests/integration/transparent_script.py starts three ranks and
a spare that runs the script up to its first step and waits there, its loader's worker
process started (`job.warm`). A rank is SIGKILLed while
training runs: in the decision that fails it the leader promotes the spare (the job never
drops below its three ranks, so it never pauses), the spare trains in the next world from
its survivors' weights, and the launcher starts the dead rank's replacement as the new
spare. The run's audit passes and its final weights are the failure-free run's within the
transparency bound (tests/integration/test_transparency.py), every step trained with the
same learning rate and scheduler position (invariant 11 of docs/design.md).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("CI") == "true":
    import torch  # CI installs torch's CPU build: a missing torch must fail, not skip
else:
    torch = pytest.importorskip("torch")

from cohort.coordinator.replay import from_file  # noqa: E402
from cohort.errors import Exit  # noqa: E402
from cohort.events.models import (  # noqa: E402
    SparePromoted,
    TrainingPaused,
    WorkerJoined,
    WorldChanged,
)
from tests.helpers import processes_mentioning, wait_until  # noqa: E402
from tests.integration.launch import Launch, worker_of  # noqa: E402
from tests.integration.test_transparency import trained  # noqa: E402

pytestmark = [pytest.mark.slow]

SCRIPT = str(Path(__file__).with_name("transparent_script.py"))
STEPS = 24
# 72 samples, 12 a step whatever the world's size (a constant global batch, in 3 micro-batches
# of 4, one a rank): 6 steps an epoch, 24 in 4; the first world waits for the three ranks, the
# spare makes up none of them.
JOB = (
    "--min-workers", "3", "--dataset-size", "72", "--batch-size", "4", "--global-batch", "12",
    "--placement", "strided", "--epochs", "4",
    "--heartbeat-interval", "0.5", "--heartbeat-timeout", "2",
)  # fmt: skip
SETUP = (
    "--route", "redis", "--optimizer", "sgd", "--schedule", "step", "--pace", "0.3",
    "--loader-workers", "1",
)  # fmt: skip
HOLDS = ("--hold-at", "3:4", "--hold-at", "12:4")
"""The failure run's ranks wait inside step 3 until the spare has joined (so it is ready as
training runs), and inside step 12 until the job has four members again: the dead rank's
replacement has joined, as the new spare, before the job can end."""


def _facts(watch: Any, kind: type) -> list[Any]:
    watch.pull(100)
    return [fact for _, fact in watch.facts if isinstance(fact, kind)]


def _clean_run(out: Path, cwd: Path) -> None:
    """The same job with three ranks, no spare and no failure."""
    out.mkdir()
    run = Launch("-n", "3", *JOB, SCRIPT, str(out), *SETUP, cwd=cwd)
    assert run.wait(400) == Exit.OK, run.output[-3000:]


def _weights(out: Path) -> dict[str, Any]:
    return torch.load(out / "final.pt")  # type: ignore[no-any-return]


def test_a_spare_takes_a_killed_ranks_place_a_new_spare_starts_and_the_job_learns_the_same(
    tmp_path: Path,
) -> None:
    out = tmp_path / "spares"
    out.mkdir()
    run = Launch(
        "-n", "3", "--spares", "1", "--node", "n", *JOB, "--export", str(tmp_path / "run.export"),
        SCRIPT, str(out), *SETUP, *HOLDS, cwd=tmp_path,
    )  # fmt: skip
    assert run.run_json()["spares"] == 1
    watch = run.journal()

    def training_beside_a_ready_spare() -> bool:
        watch.pull(100)
        state = watch.state
        ready = [m.worker for m in state.spares if m.status == "ready"]
        return len(state.ranks) == 3 and state.last_committed >= 2 and len(ready) == 1

    wait_until(training_beside_a_ready_spare, 180, message="three ranks training, a spare ready")
    (spare,) = [m.worker for m in watch.state.spares]
    assert spare == "n-3" and spare not in watch.state.ranks
    (waiting,) = [p for p in run.ranks(SCRIPT) if worker_of(p) == spare]
    assert processes_mentioning(SCRIPT, parent=waiting), "the spare waits without its loader"
    victim = watch.state.ranks[1]
    (pid,) = [p for p in run.ranks(SCRIPT) if worker_of(p) == victim]
    os.kill(pid, signal.SIGKILL)

    promoted = wait_until(lambda: _facts(watch, SparePromoted), 60, message="the spare promoted")
    assert [(f.worker, f.replaces) for f in promoted] == [(spare, victim)]
    world = wait_until(
        lambda: [w for w in _facts(watch, WorldChanged) if spare in w.ranks], 10,
        message="a world with the spare",
    )[0]  # fmt: skip
    assert len(world.ranks) == 3 and world.ranks[-1] == spare  # survivors first, then it
    assert world.weights is not None and world.weights.source == "rank"

    def new_spare() -> list[str]:
        joined = _facts(watch, WorkerJoined)
        return [f.worker for f in joined if f.spare and f.worker != spare]

    (replacement,) = wait_until(new_spare, 120, message="the dead rank's replacement, a spare")
    assert replacement == f"{victim}.1"  # its slot's next process, started as a spare

    assert run.wait(400) == Exit.OK, run.output[-3000:]
    assert "audit (every sample exactly once per epoch): passed" in run.output
    assert "1 spare(s), 1 promoted" in run.output and "1 failure(s) survived" in run.output
    assert run.run_json()["promotions"] == 1
    journal = [fact for _, fact in from_file(tmp_path / "run.export").facts()]  # Redis is gone
    paused = [f for f in journal if isinstance(f, TrainingPaused)]
    assert paused == []  # a spare made up the three ranks in the decision that lost one
    assert sum(isinstance(f, SparePromoted) for f in journal) == 1

    lines = [json.loads(x) for x in (out / f"trace-{spare}.jsonl").read_text().splitlines()]
    assert lines and {(x["rank"], x["world_size"]) for x in lines} == {(2, 3)}  # it trained
    assert not (out / f"trace-{replacement}.jsonl").read_text().strip()  # a spare: no step

    clean = tmp_path / "clean"
    _clean_run(clean, tmp_path)
    expected, got = trained(clean), trained(out)
    assert sorted(got) == list(range(STEPS)) and got == expected
    ours, theirs = _weights(out), _weights(clean)
    worst = max(float((ours[k] - theirs[k]).abs().max()) for k in theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs), f"{worst:.2e} away"
