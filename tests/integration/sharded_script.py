"""A small MLP sharded with FSDP2 over every rank, on `cohort.torch.ElasticJob(backend=
"gloo")`, for tests/integration/test_sharded.py: cohort shards a fresh copy of the model in
each world (`wrap(shard=...)`); every step's whole-model digest is reported
(`digest_every=1`), so the leader compares the ranks' gathered weights at every step.

    python sharded_script.py OUT [ddp]

Writes OUT/final.pt through `job.save` (a whole state dict of the unsharded model), and
each rank's batch of each step as OUT/batch-STEP-RANK-I.pt (x, y), I its micro-batch (0
but with a constant global batch; a stand-in, where the rank has no sample, is not
written): what one process replays to check either route's update. With `ddp`, the same
model trains unsharded, under DDP (otherwise sharded: in groups where `cohort run
--shard-group` says). Each mesh the model is sharded over leaves OUT/mesh-SIZE.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

import cohort

OUT = Path(sys.argv[1])
MODE = sys.argv[2] if len(sys.argv) > 2 else "sharded"


def shard(module: torch.nn.Module, mesh: DeviceMesh) -> None:
    (OUT / f"mesh-{mesh.size()}").touch()
    for layer in module:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(module, mesh=mesh)


def main() -> None:
    out = OUT
    torch.manual_seed(0)
    job = cohort.torch.ElasticJob(backend="gloo", digest_every=1)
    model: torch.nn.Module = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
        torch.nn.Linear(32, 1),
    )  # fmt: skip
    optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    sharded = MODE != "ddp"
    model, optimizer = job.wrap(model, optimizer, shard=shard if sharded else None)
    data = torch.utils.data.TensorDataset(torch.randn(257, 8), torch.randn(257, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=job.batch_size)
    micro: dict[tuple[int, int | None], int] = {}  # (world, step): its micro-batches so far
    for _ in job.epochs():
        for x, y in job.batches(loader):
            index = micro[job.world, job.step] = micro.get((job.world, job.step), -1) + 1
            if not job.stand_in:
                torch.save((x, y), out / f"batch-{job.step}-{job.rank}-{index}.pt")
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    if job.is_chief:
        job.save(out / "final.pt")


if __name__ == "__main__":
    main()
