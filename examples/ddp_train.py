"""A plain DDP script for torchrun; with `--rdzv-backend=cohort` its nodes meet through Redis.

    torchrun --nnodes=1:4 --nproc-per-node=2 --rdzv-backend=cohort \\
        --rdzv-endpoint=redis://redis-host:6379/0 --rdzv-id=J examples/ddp_train.py --steps 500

Nothing in it knows about cohort. torchrun restarts every worker when a node fails or
joins, so the script resumes from its own checkpoint (`--checkpoint FILE`, written by rank
0 every `--every` steps; every rank resumes from rank 0's, so keep it on a volume all nodes
share). It ends with one JSON line per rank: rank, world size, its last step and loss.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

FEATURES, HIDDEN = 16, 64


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--checkpoint", help="resume from and save to this file")
    parser.add_argument("--every", type=int, default=50, help="steps between checkpoints")
    return parser.parse_args(argv)


def main() -> None:
    args = arguments()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 1)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    resume = torch.zeros(1, dtype=torch.int64)
    if rank == 0 and args.checkpoint and os.path.exists(args.checkpoint):
        saved = torch.load(args.checkpoint, weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        resume[0] = saved["step"]
    dist.broadcast(resume, src=0)  # every rank resumes where rank 0 does ...
    ddp = DistributedDataParallel(model)  # ... with rank 0's weights (DDP broadcasts them)
    step = int(resume.item())
    gen = torch.Generator().manual_seed(1000 * step + rank)
    loss = torch.tensor(float("nan"))
    while step < args.steps:
        x = torch.randn(32, FEATURES, generator=gen)
        loss = (ddp(x).squeeze(1) - x.sum(dim=1)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        if args.checkpoint and rank == 0 and step % args.every == 0:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            torch.save({**state, "step": step}, args.checkpoint + ".tmp")
            os.replace(args.checkpoint + ".tmp", args.checkpoint)
    print(json.dumps({"rank": rank, "world": world, "step": step, "loss": loss.item()}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
