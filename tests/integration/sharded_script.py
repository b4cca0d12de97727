"""A small MLP sharded with FSDP2 over every rank, on `cohort.torch.ElasticJob(backend=
"gloo")`, for tests/integration/test_sharded.py: cohort shards a fresh copy of the model in
each world (`wrap(shard=...)`); every step's whole-model digest is reported
(`digest_every=1`), so the leader compares the ranks' gathered weights at every step.

    python sharded_script.py OUT [ddp]

Writes OUT/final.pt through `job.save` (a whole state dict of the unsharded model), and
each rank's batch of each step as OUT/batch-STEP-RANK.pt (x, y): what one process replays
to check either route's update. With `ddp`, the same model trains unsharded, under DDP.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.distributed.fsdp import fully_shard

import cohort


def shard(module: torch.nn.Module, mesh: object) -> None:
    for layer in module:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(module, mesh=mesh)


def main() -> None:
    out = Path(sys.argv[1])
    torch.manual_seed(0)
    job = cohort.torch.ElasticJob(backend="gloo", digest_every=1)
    model: torch.nn.Module = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
        torch.nn.Linear(32, 1),
    )  # fmt: skip
    optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    sharded = sys.argv[2:] != ["ddp"]
    model, optimizer = job.wrap(model, optimizer, shard=shard if sharded else None)
    data = torch.utils.data.TensorDataset(torch.randn(257, 8), torch.randn(257, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=job.batch_size)
    for _ in job.epochs():
        for x, y in job.batches(loader):
            torch.save((x, y), out / f"batch-{job.step}-{job.rank}.pt")
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    if job.is_chief:
        job.save(out / "final.pt")


if __name__ == "__main__":
    main()
