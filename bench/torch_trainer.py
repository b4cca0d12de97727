"""The training script torchrun runs in bench/peer_death.py: a small model, gloo allreduce.

Each finished step appends one JSON line (time, step, pid, restart count) to
$BENCH_LOG, which is how the benchmark sees when training runs again.
"""

from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    pace = float(os.environ.get("BENCH_PACE", "0.05"))
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    with open(os.environ["BENCH_LOG"], "a") as log:
        for step in range(10**9):
            started = time.perf_counter()
            x = torch.randn(32, 16)
            loss = model(x).pow(2).mean()
            loss.backward()
            for p in model.parameters():
                assert p.grad is not None
                dist.all_reduce(p.grad)
                p.grad /= world
            optimizer.step()
            optimizer.zero_grad()
            line = {"t": time.time(), "step": step, "pid": os.getpid(), "restart": restart}
            log.write(json.dumps(line) + "\n")
            log.flush()
            time.sleep(max(0.0, pace - (time.perf_counter() - started)))  # stands in for compute


if __name__ == "__main__":
    main()
