"""A plain DDP script, as torchrun runs it on any backend: tests/integration/test_torchrun.py
launches it with `--rdzv-backend=cohort`. Nothing in it knows about cohort.

Each step appends a JSON line (time, pid, rank, world size, step, restart count) to
$TRAIN_LOG, which is how the test sees who trains with whom. It trains $TRAIN_STEPS steps
and, while the file $TRAIN_UNTIL is missing, on: the test says when the job may end.
"""

from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    steps = int(os.environ.get("TRAIN_STEPS", "50"))
    until = os.environ.get("TRAIN_UNTIL")
    pace = float(os.environ.get("TRAIN_PACE", "0.02"))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    with open(os.environ["TRAIN_LOG"], "a") as log:
        step = 0
        while step < steps or (until and not os.path.exists(until)):
            loss = model(torch.randn(16, 8)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            line = {"t": time.time(), "pid": os.getpid(), "rank": rank, "world": world,
                    "step": step, "restart": restart}  # fmt: skip
            log.write(json.dumps(line) + "\n")
            log.flush()
            step += 1
            time.sleep(pace)  # stands in for compute
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
