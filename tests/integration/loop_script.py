"""A plain training loop on `cohort.torch.ElasticJob`, for tests/integration/test_real_loops.py:
a scheduler handed to `wrap` or not, a GradScaler, a compiled model, and a rank that can
poison one step's gradient with an inf.

    python loop_script.py OUT [--scheduler handed|own] [--scaler] [--compile [before|after]]
        [--poison STEP:WORKER] [--pace SECONDS]

Writes OUT/WORKER.json: each applied step's learning rate, the scaler's scale after it,
whether `job.sync_gradients` was seen False, the worlds it trained in (rank, size) and
the graphs torch.compile made; OUT/WORKER.pt, the model's state_dict as
the script sees it; and OUT/final.pt through `job.save`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch._dynamo.utils

import cohort


class Net(torch.nn.Module):
    """A model of the script's own class, as most are (torch.compile treats torch.nn's
    containers apart)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.outer = torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(torch.tanh(self.inner(x)))  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--scheduler", choices=("handed", "own"), default="handed")
    parser.add_argument("--scaler", action="store_true")
    parser.add_argument("--compile", nargs="?", const="before", choices=("before", "after"))
    parser.add_argument("--poison", default="", help="STEP:WORKER whose loss becomes inf")
    parser.add_argument("--pace", type=float, default=0.0, help="seconds each micro-batch")
    args = parser.parse_args()
    torch.manual_seed(0)
    job = cohort.torch.ElasticJob()
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda n: 1 / (n + 1))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, enabled=args.scaler)
    if args.compile == "before":
        model = torch.compile(model, backend="eager")  # type: ignore[assignment]
    handed = scheduler if args.scheduler == "handed" else None
    model, optimizer = job.wrap(model, optimizer, scheduler=handed, scaler=scaler)
    if args.compile == "after":
        model = torch.compile(model, backend="eager")  # type: ignore[assignment]
    data = torch.utils.data.TensorDataset(torch.randn(256, 4), torch.randn(256, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=job.batch_size)
    poison_step, _, poison_worker = args.poison.partition(":")
    trace: list[dict[str, float]] = []
    split = False
    worlds: list[tuple[int, int]] = []
    for _ in job.epochs():
        for x, y in job.batches(loader):
            split = split or not job.sync_gradients
            if not worlds or worlds[-1] != (job.rank, job.world_size):
                worlds.append((job.rank, job.world_size))
            time.sleep(args.pace)  # the workload's own time: a test's kill lands mid-job
            loss = torch.nn.functional.mse_loss(model(x), y)
            if str(job.step) == poison_step and job.worker_id == poison_worker:
                loss = loss * float("inf")
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            lr = optimizer.param_groups[0]["lr"]
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if job.sync_gradients and not job.aborted:
                trace.append({"step": job.step, "lr": lr, "scale": scaler.get_scale()})
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    seen = {"trace": trace, "split": split, "worlds": worlds, "graphs": graphs}
    (args.out / f"{job.worker_id}.json").write_text(json.dumps(seen))
    torch.save(model.state_dict(), args.out / f"{job.worker_id}.pt")
    job.save(args.out / "final.pt")


if __name__ == "__main__":
    main()
