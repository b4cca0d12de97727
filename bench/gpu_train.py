"""The GPU smoke suite's training script (bench/gpu.py): a small model on synthetic data, on
the rank's own device (`job.device`).

    cohort run -n 2 bench/gpu_train.py --model bn      # ElasticJob; $COHORT_TORCH_BACKEND
    torchrun --nproc-per-node 2 bench/gpu_train.py --ddp --steps 60   # plain DDP, the peer

`--model`: mlp, bn (Linear, BatchNorm1d, ReLU, Linear) or dropout (seeded steps), with
`--depth` more width x width layers before the last. With
`--times DIR` each rank writes `DIR/<pid>.json`: its device, the steps it timed after the
warm-up and their seconds (the suite's throughput row reads them).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

WARMUP = 5
FEATURES, CLASSES = 32, 4


def build(kind: str, width: int, depth: int = 0) -> torch.nn.Module:
    torch.manual_seed(0)
    middles: dict[str, list[torch.nn.Module]] = {
        "mlp": [torch.nn.ReLU()],
        "bn": [torch.nn.BatchNorm1d(width), torch.nn.ReLU()],
        "dropout": [torch.nn.ReLU(), torch.nn.Dropout(0.2)],
    }
    middle = middles[kind]
    hidden: list[torch.nn.Module] = []
    for _ in range(depth):  # width x width layers: a model big enough to time on a GPU
        hidden += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, width), *middle, *hidden, torch.nn.Linear(width, CLASSES)
    )


def data(samples: int) -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(samples, FEATURES, generator=gen)
    return torch.utils.data.TensorDataset(x, torch.randint(0, CLASSES, (samples,), generator=gen))


def write_times(out: str | None, device: torch.device, steps: int, seconds: float) -> None:
    if out is None:
        return
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    Path(out, f"{os.getpid()}.json").write_text(
        json.dumps({"device": str(device), "name": name, "steps": steps, "seconds": seconds})
    )


def compiled(
    model: torch.nn.Module, device: torch.device
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model compiled (on a GPU in CUDA graphs: "reduce-overhead"), and Adam holding its
    learning rate in a tensor, captured (`capturable`: its state and step stay on the GPU,
    and it reads the `.grad` tensors it was made with)."""
    cuda = device.type == "cuda"
    if cuda:
        model = torch.compile(model, mode="reduce-overhead")  # type: ignore[assignment]
    else:
        model = torch.compile(model, backend="eager")  # type: ignore[assignment]
    rate = torch.tensor(1e-3, device=device)
    optimizer = torch.optim.Adam(model.parameters(), lr=rate, capturable=cuda, foreach=cuda)
    return model, optimizer


def elastic(args: argparse.Namespace) -> None:
    import cohort

    job = cohort.torch.ElasticJob(gpu_interval=args.gpu_interval)
    model = build(args.model, args.width, args.depth).to(job.device)
    if args.compile:
        model, optimizer = compiled(model, job.device)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = job.wrap(model, optimizer)
    if args.model == "dropout":
        job.seed_steps(0)
    loader = torch.utils.data.DataLoader(data(args.samples), batch_size=args.batch)
    seen, timed, started = 0, 0, 0.0
    for _ in job.epochs():
        for x, y in job.batches(loader):
            x, y = x.to(job.device, non_blocking=True), y.to(job.device, non_blocking=True)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            job.record(loss=loss)
            if args.pace:
                time.sleep(args.pace)  # a step at least this long: time for a spare to be ready
            seen += 1
            if seen == WARMUP:
                _synchronize(job.device)
                started = time.perf_counter()
            elif seen > WARMUP:
                timed += 1
    _synchronize(job.device)
    if started:
        write_times(args.times, job.device, timed, time.perf_counter() - started)


def ddp(args: argparse.Namespace) -> None:
    """Plain DDP under torchrun on the same model and batch size: the throughput's peer."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = (
        torch.device("cuda", local % torch.cuda.device_count()) if cuda else torch.device("cpu")
    )
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    model: Any = build(args.model, args.width, args.depth).to(device)
    model = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    dataset = data(args.samples)
    rank, world = dist.get_rank(), dist.get_world_size()
    started = 0.0
    for step in range(args.steps):
        if step == WARMUP:
            _synchronize(device)
            started = time.perf_counter()
        first = ((step * world + rank) * args.batch) % max(1, len(dataset) - args.batch)
        x, y = dataset[first : first + args.batch]
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    _synchronize(device)
    write_times(args.times, device, args.steps - WARMUP, time.perf_counter() - started)
    dist.destroy_process_group()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("mlp", "bn", "dropout"), default="mlp")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=0, help="width x width hidden layers")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--times", default=None, help="a directory for each rank's timing")
    parser.add_argument("--gpu-interval", type=float, default=None, help="NVML readings")
    parser.add_argument("--pace", type=float, default=0.0, help="seconds slept each step")
    parser.add_argument("--compile", action="store_true", help="compiled, a captured Adam")
    parser.add_argument("--ddp", action="store_true", help="plain DDP under torchrun")
    parser.add_argument("--steps", type=int, default=60, help="--ddp's steps")
    args = parser.parse_args()
    if args.ddp:
        ddp(args)
    else:
        elastic(args)


if __name__ == "__main__":
    main()
