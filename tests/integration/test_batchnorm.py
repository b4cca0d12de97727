"""A BatchNorm model trains under `cohort run` on both routes through a SIGKILL (issue 49).

Before, BatchNorm's 0-dim `num_batches_tracked` crashed the weights digest at step 0, and
once past it each rank's forwards moved its own running statistics, so the ranks' digests
differed at every step. tests/integration/batchnorm_script.py reports a digest at every
step; the leader journals WeightsDiverged at any step whose ranks disagree. 257 samples over
two ranks leave each epoch's last step one sample: one rank has none (under DDP it runs a
forward of the data set's first sample, whose statistics must leave no trace).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

if os.environ.get("CI") == "true":
    import torch  # CI installs torch's CPU build: a missing torch must fail, not skip
else:
    torch = pytest.importorskip("torch")

from cohort.coordinator.replay import from_file  # noqa: E402
from cohort.errors import Exit  # noqa: E402
from cohort.events.models import StepCommitted, WeightsDiverged, WorkerFailed  # noqa: E402
from tests.helpers import wait_until  # noqa: E402
from tests.integration.launch import Launch, worker_of  # noqa: E402

pytestmark = [pytest.mark.slow]

SCRIPT = str(Path(__file__).with_name("batchnorm_script.py"))
JOB = (
    "--min-workers", "2", "--dataset-size", "257", "--batch-size", "16", "--epochs", "3",
    "--heartbeat-interval", "0.5", "--heartbeat-timeout", "2",
)  # fmt: skip


@pytest.mark.parametrize("route", ["redis", "gloo"])
def test_a_batchnorm_model_trains_through_a_sigkill_with_every_rank_s_digest_agreeing(
    tmp_path: Path, route: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if route == "gloo":
        monkeypatch.setenv("COHORT_TORCH_BACKEND", "gloo")
    export = tmp_path / "run.export"
    run = Launch(
        "-n", "2", "--node", "n", *JOB, "--export", str(export), SCRIPT, str(tmp_path),
        cwd=tmp_path,
    )  # fmt: skip
    watch = run.journal()

    def training() -> bool:
        watch.pull(100)
        return len(watch.state.ranks) == 2 and watch.state.last_committed >= 3

    wait_until(training, 240, message="two ranks training")
    chief = watch.state.ranks[0]
    (pid,) = [p for p in run.ranks(SCRIPT) if worker_of(p) == chief]
    os.kill(pid, signal.SIGKILL)
    assert run.wait(300) == Exit.OK, run.output[-3000:]
    assert "audit (every sample exactly once per epoch): passed" in run.output

    journal = [fact for _, fact in from_file(export).facts()]
    assert [f.worker for f in journal if isinstance(f, WorkerFailed)] == [chief]
    assert [f for f in journal if isinstance(f, WeightsDiverged)] == []
    committed = [f for f in journal if isinstance(f, StepCommitted)]
    assert len(committed) >= 27  # 3 epochs of 9 steps, and steps redone after the kill
    assert all(f.digest is not None for f in committed)  # every rank reported alike
    saved = torch.load(tmp_path / "final.pt")
    assert int(saved["1.num_batches_tracked"]) > 0
