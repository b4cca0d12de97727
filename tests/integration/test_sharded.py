"""FSDP2 over every rank under `cohort run` on CPU/gloo (issue 50, phase 1): cohort shards
the model in each world (tests/integration/sharded_script.py), the ranks' whole-model
digests agree at every step, `job.save` writes the whole state dict; a rank SIGKILLed takes
its shard with it, so the job rewinds to its last checkpoint and finishes from there."""

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
from cohort.events.models import (  # noqa: E402
    Rewound,
    StepCommitted,
    WeightsDiverged,
    WorkerFailed,
)
from tests.helpers import wait_until  # noqa: E402
from tests.integration.launch import Launch, worker_of  # noqa: E402

pytestmark = [pytest.mark.slow]

SCRIPT = str(Path(__file__).with_name("sharded_script.py"))
FLAGS = (
    "--min-workers", "2", "--batch-size", "16", "--epochs", "2",
    "--heartbeat-interval", "0.5", "--heartbeat-timeout", "2",
)  # fmt: skip
JOB = ("--dataset-size", "257", *FLAGS)
"""Each epoch's last step gives one rank one sample and the other none."""


def unsharded_model() -> torch.nn.Sequential:
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
        torch.nn.Linear(32, 1),
    )  # fmt: skip


def journal_of(export: Path) -> list[object]:
    return [fact for _, fact in from_file(export).facts()]


def replayed(out: Path, steps: int, ranks: int = 2) -> dict[str, torch.Tensor]:
    """The script's model trained in one process on the batches its ranks wrote, each step
    on the ranks' mean gradient (a rank without samples adds zeros: each rank's batch counts
    alike, as under DDP): the update either route must apply."""
    torch.manual_seed(0)  # as the script: the same initial weights
    model = unsharded_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(steps):
        batches = [out / f"batch-{step}-{rank}.pt" for rank in range(ranks)]
        optimizer.zero_grad()
        losses = [torch.nn.functional.mse_loss(model(x), y)
                  for x, y in (torch.load(b) for b in batches if b.exists())]  # fmt: skip
        (torch.stack(losses).sum() / ranks).backward()
        optimizer.step()
    return model.state_dict()


def test_an_fsdp_model_trains_to_its_end_and_saves_its_whole_weights(tmp_path: Path) -> None:
    """...and they are DDP's: the same model, data and seed trained unsharded end equal
    (within float rounding), and both are one process's replay of the ranks' batches. JOB
    gives a rank no sample in each epoch's last step: its backward must add nothing of the
    step before (whose gradients a script that zeroes before backward leaves)."""
    export = tmp_path / "run.export"
    run = Launch(
        "-n", "2", "--node", "n", *JOB, "--export", str(export), SCRIPT, str(tmp_path),
        cwd=tmp_path,
    )  # fmt: skip
    assert run.wait(300) == Exit.OK, run.output[-3000:]
    ddp = tmp_path / "ddp"
    ddp.mkdir()
    reference = Launch("-n", "2", "--node", "n", *JOB, SCRIPT, str(ddp), "ddp", cwd=ddp)
    assert reference.wait(300) == Exit.OK, reference.output[-3000:]
    sharded, plain = torch.load(tmp_path / "final.pt"), torch.load(ddp / "final.pt")
    replay = replayed(ddp, 18)
    assert not (tmp_path / "batch-8-1.pt").exists()  # rank 1 had an empty step
    assert sharded.keys() == plain.keys() == replay.keys()
    for name in plain:
        torch.testing.assert_close(plain[name], replay[name], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(sharded[name], plain[name], rtol=1e-4, atol=1e-5)
    assert "audit (every sample exactly once per epoch): passed" in run.output
    journal = journal_of(export)
    assert [f for f in journal if isinstance(f, WeightsDiverged)] == []
    committed = [f for f in journal if isinstance(f, StepCommitted)]
    assert len(committed) == 18  # 2 epochs of 9 steps, the 9th of 1 sample
    assert all(f.digest is not None for f in committed)  # every rank's whole-model digest
    model = unsharded_model()
    model.load_state_dict(torch.load(tmp_path / "final.pt"))  # whole: loads unsharded
    assert not torch.equal(model[0].weight, unsharded_model()[0].weight)  # it trained


def test_a_rank_sigkilled_rewinds_the_sharded_job_to_its_checkpoint(tmp_path: Path) -> None:
    export = tmp_path / "run.export"
    store = tmp_path / "ckpt"
    run = Launch(
        "-n", "2", "--node", "n", *JOB, "--checkpoint-uri", str(store), "--checkpoint-every",
        "4", "--export", str(export), SCRIPT, str(tmp_path), cwd=tmp_path,
    )  # fmt: skip
    watch = run.journal()

    def checkpointed() -> bool:
        watch.pull(100)
        return bool(watch.state.checkpoints) and watch.state.last_committed >= 5

    wait_until(checkpointed, 240, message="a checkpoint written, training past it")
    victim = watch.state.ranks[1]
    (pid,) = [p for p in run.ranks(SCRIPT) if worker_of(p) == victim]
    os.kill(pid, signal.SIGKILL)
    assert run.wait(300) == Exit.OK, run.output[-3000:]
    assert "audit (every sample exactly once per epoch): passed" in run.output
    journal = journal_of(export)
    assert [f.worker for f in journal if isinstance(f, WorkerFailed)] == [victim]
    assert [f for f in journal if isinstance(f, Rewound)] != []  # the survivor held a shard
    assert [f for f in journal if isinstance(f, WeightsDiverged)] == []
    model = unsharded_model()
    model.load_state_dict(torch.load(tmp_path / "final.pt"))
