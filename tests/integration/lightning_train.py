"""A plain Lightning script, as torchrun runs it on any rendezvous backend:
tests/integration/test_ecosystem.py launches it with `--rdzv-backend=cohort`. Nothing in it
knows about cohort.

Lightning finds torchrun's variables (TorchElasticEnvironment); the script tells the Trainer
how many nodes this round has (`WORLD_SIZE // LOCAL_WORLD_SIZE`: torchrun may restart it in
a world of another size) and resumes from the last checkpoint in $CKPT_DIR, a directory every
node reaches, since torchrun restarts every worker of the job. Each step appends a JSON line
(time, pid, rank, world size, step, restart count) to $TRAIN_LOG, which is how the test sees
who trains with whom; it trains $TRAIN_STEPS steps in all, across restarts.

With --default-sigterm, SIGTERM kills a worker at once again (`DefaultSigterm`), which is how
a user spares each restart the wait below when a peer hangs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
        )

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class Progress(pl.Callback):
    """One JSON line a step in $TRAIN_LOG, then a pause that stands in for compute."""

    def __init__(self, path: str, pace: float) -> None:
        self.path = path
        self.pace = pace
        self.restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
        line = {"t": time.time(), "pid": os.getpid(), "rank": trainer.global_rank,
                "world": trainer.world_size, "step": trainer.global_step,
                "restart": self.restart}  # fmt: skip
        with open(self.path, "a") as log:
            log.write(json.dumps(line) + "\n")
        time.sleep(self.pace)


class DefaultSigterm(pl.Callback):
    """SIGTERM's default action back once training starts (Lightning installs its handler
    just before). torchrun restarts workers with SIGTERM and SIGKILLs those still alive 30 s
    later; Lightning's handler does not end a worker that waits in a collective on a peer
    that hangs, so without this every such restart waits those 30 s."""

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--default-sigterm", action="store_true")
    extra = [DefaultSigterm()] if parser.parse_args().default_sigterm else []
    world, local = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(4096, 8), torch.randn(4096, 1))
    checkpoints = ModelCheckpoint(
        dirpath=os.environ["CKPT_DIR"], save_last=True, every_n_train_steps=5
    )
    trainer = pl.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=local,
        num_nodes=world // local,
        max_steps=int(os.environ.get("TRAIN_STEPS", "60")),
        callbacks=[
            *extra,
            checkpoints,
            Progress(os.environ["TRAIN_LOG"], float(os.environ.get("TRAIN_PACE", "0.05"))),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regression(), DataLoader(data, batch_size=16), ckpt_path="last")


if __name__ == "__main__":
    main()
