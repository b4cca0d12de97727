"""A plain Accelerate script, as `accelerate launch` or torchrun runs it on any rendezvous
backend: tests/integration/test_ecosystem.py launches it with `--rdzv-backend=cohort`
(`--rdzv_backend cohort` to accelerate launch). Nothing in it knows about cohort.

`Accelerator()` finds torchrun's variables; the script resumes from the last complete
`save_state` in $CKPT_DIR, a directory every node reaches, since torchrun restarts every
worker of the job: each save goes to a directory of its own, and only once every process
has written its part does the main process point `latest` at it, so a node lost in the
middle of a save leaves the one before in force. Each step appends a JSON line (time, pid,
rank, world size, step, restart count) to $TRAIN_LOG, which is how the test sees who trains
with whom; it trains $TRAIN_STEPS steps in all, across restarts.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

SAVE_EVERY = 5


class Progress:
    """The step count, saved and loaded with the rest of the state."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


def save(accelerator: Accelerator, root: Path, step: int) -> None:
    """Save the whole state for `step`, then make it the one a restart resumes from."""
    name = f"step-{step}"
    accelerator.save_state(str(root / name))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (root / "latest.tmp").write_text(name)
        os.replace(root / "latest.tmp", root / "latest")
        for old in root.glob("step-*"):
            if old.name != name:
                shutil.rmtree(old, ignore_errors=True)


def main() -> None:
    accelerator = Accelerator()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(4096, 8), torch.randn(4096, 1))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer, loader = accelerator.prepare(
        model, optimizer, DataLoader(data, batch_size=16)
    )
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    root = Path(os.environ["CKPT_DIR"])
    if (root / "latest").exists():
        accelerator.load_state(str(root / (root / "latest").read_text()))
    steps = int(os.environ.get("TRAIN_STEPS", "60"))
    pace = float(os.environ.get("TRAIN_PACE", "0.05"))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    with open(os.environ["TRAIN_LOG"], "a") as log:
        while progress.step < steps:
            for x, y in loader:
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                progress.step += 1
                line = {"t": time.time(), "pid": os.getpid(), "rank": accelerator.process_index,
                        "world": accelerator.num_processes, "step": progress.step,
                        "restart": restart}  # fmt: skip
                log.write(json.dumps(line) + "\n")
                log.flush()
                time.sleep(pace)  # stands in for compute
                if progress.step % SAVE_EVERY == 0:
                    save(accelerator, root, progress.step)
                if progress.step >= steps:
                    break
    accelerator.end_training()


if __name__ == "__main__":
    main()
