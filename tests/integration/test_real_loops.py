"""A plain training loop, as users write it, under `cohort run` (issue 47): a scheduler
stepped in every micro-batch, a GradScaler, a compiled model, an inf on one rank.

tests/integration/loop_script.py runs the loop; each job cuts a step of 16 samples into
micro-batches of 4, so a rank's loop body runs several times per update.
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

from cohort.errors import Exit  # noqa: E402
from tests.helpers import wait_until  # noqa: E402
from tests.integration.launch import Launch, training, worker_of  # noqa: E402
from tests.integration.loop_script import Net  # noqa: E402

pytestmark = [pytest.mark.slow]

SCRIPT = str(Path(__file__).with_name("loop_script.py"))
STEPS = 5
JOB = (
    "--dataset-size", "256", "--batch-size", "4", "--global-batch", "16",
    "--placement", "strided", "--max-steps", str(STEPS),
)  # fmt: skip
WARNING = "the learning rate changed in a micro-batch whose optimizer.step() applied no update"


def run(tmp_path: Path, ranks: int, *flags: str) -> tuple[Launch, Path]:
    out = tmp_path / "out"
    out.mkdir()
    launch = Launch(
        "-n", str(ranks), "--min-workers", str(ranks), "--node", "n", *JOB, SCRIPT, str(out),
        *flags, cwd=tmp_path,
    )  # fmt: skip
    assert launch.wait(300) == Exit.OK, launch.output[-3000:]
    return launch, out


def traced(out: Path, worker: str) -> dict[str, Any]:
    return json.loads((out / f"{worker}.json").read_text())  # type: ignore[no-any-return]


def test_a_scheduler_handed_to_wrap_steps_once_per_update_of_several_micro_batches(
    tmp_path: Path,
) -> None:
    launch, out = run(tmp_path, 1)
    seen = traced(out, "n-0")
    assert seen["split"]  # the loop body did run several times per update
    assert [t["lr"] for t in seen["trace"]] == [0.1 * (1 / (n + 1)) for n in range(STEPS)]
    assert WARNING not in launch.output


def test_a_scheduler_not_handed_over_that_counts_micro_batches_is_named_once(
    tmp_path: Path,
) -> None:
    launch, out = run(tmp_path, 1, "--scheduler", "own")
    assert launch.output.count(WARNING) == 1, launch.output[-3000:]
    assert "job.wrap(model, optimizer, scheduler=scheduler)" in launch.output
    rates = [t["lr"] for t in traced(out, "n-0")["trace"]]
    assert rates[1] < 0.1 / 2  # it did count micro-batches: the warning was right


def test_a_compiled_model_is_saved_with_the_plain_model_s_keys(tmp_path: Path) -> None:
    _, out = run(tmp_path, 1, "--compile")
    saved = torch.load(out / "final.pt")
    plain = Net()
    assert sorted(saved) == sorted(plain.state_dict())  # no "_orig_mod." prefix
    plain.load_state_dict(saved)


def test_an_inf_on_one_rank_skips_the_step_on_every_rank_and_the_scale_backs_off_alike(
    tmp_path: Path,
) -> None:
    """Rank n-1's loss is inf at step 2: the gradients every rank unscales are the world's
    mean, so every rank's GradScaler finds the inf, skips the update, and halves its scale;
    the scheduler, handed over, does not step for the skipped update."""
    _, out = run(tmp_path, 2, "--scaler", "--poison", "2:n-1")
    first, second = traced(out, "n-0")["trace"], traced(out, "n-1")["trace"]
    assert first == second
    assert [t["step"] for t in first] == list(range(STEPS))  # the skipped step still counts
    assert [t["scale"] for t in first] == [1024.0, 1024.0, 512.0, 512.0, 512.0]
    assert [t["lr"] for t in first] == [0.1 * (1 / n) for n in (1, 2, 3, 3, 4)]
    mine, theirs = torch.load(out / "n-0.pt"), torch.load(out / "n-1.pt")
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert all(torch.isfinite(v).all() for v in mine.values())


@pytest.mark.parametrize("compiled", ["before", "after"])
def test_a_compiled_model_runs_compiled_under_ddp_once_for_every_world(
    tmp_path: Path, compiled: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the gloo route each world has a DDP of its own around the module the script calls:
    compiled before `wrap`, DDP goes outside the compiled module; compiled after, the
    compiled call goes through cohort's wrapper to DDP. Either way the forward is one graph,
    made once: a world change (a rank SIGKILLed, its replacement back) compiles nothing new."""
    monkeypatch.setenv("COHORT_TORCH_BACKEND", "gloo")
    out = tmp_path / "out"
    out.mkdir()
    launch = Launch(
        "-n", "2", "--min-workers", "1", "--node", "n", "--dataset-size", "256",
        "--batch-size", "4", "--global-batch", "16", "--placement", "strided",
        "--max-steps", "40", SCRIPT, str(out), "--compile", compiled, "--pace", "0.02",
        cwd=tmp_path,
    )  # fmt: skip
    watch = launch.journal()
    wait_until(lambda: training(watch, 2, steps=3), 240, message="two ranks training")
    chief, victim = watch.state.ranks[:2]
    (pid,) = [p for p in launch.ranks(SCRIPT) if worker_of(p) == victim]
    os.kill(pid, signal.SIGKILL)
    assert launch.wait(300) == Exit.OK, launch.output[-3000:]
    survivor = traced(out, chief)
    assert len(survivor["worlds"]) >= 2, survivor["worlds"]  # it trained in a later world
    assert survivor["graphs"] == 1
