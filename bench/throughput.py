"""Training throughput: `cohort.torch.ElasticJob` against plain DDP over gloo, same run.

Each cell trains the same model for the same steps on synthetic data, with N ranks as real
processes on this machine: plain `DistributedDataParallel` over gloo (the peer), and the
five-line elastic loop (`ElasticJob`, gradients averaged through Redis by a real
coordinator's job). The figure is samples per second over the timed steps (after a warm-up)
and its ratio to DDP's.

    python -m bench.throughput [--ranks 2,4] [--models 1m,25m] [--steps 60]
    python -m bench.throughput rank ...      # one rank's program (internal)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

from cohort.localredis import LocalRedis
from cohort.processes import stop_all

from .fleet import coordinator
from .results import Section, verdict

BATCH = 64
WARMUP = 5
MODELS = {"1m": (784, (1024, 256), 10), "25m": (2240, (2240,) * 4, 2240)}
"""name: (inputs, hidden widths, outputs): 1.07M and 25.1M parameters."""


def build(name: str) -> Any:
    import torch

    inputs, hidden, outputs = MODELS[name]
    torch.manual_seed(0)
    layers: list[Any] = []
    width = inputs
    for h in hidden:
        layers += [torch.nn.Linear(width, h), torch.nn.ReLU()]
        width = h
    layers.append(torch.nn.Linear(width, outputs))
    return torch.nn.Sequential(*layers)


def dataset(name: str, size: int) -> Any:
    import torch
    from torch.utils.data import TensorDataset

    inputs, _, outputs = MODELS[name]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(size, inputs, generator=gen)
    return TensorDataset(x, torch.randint(0, outputs, (size,), generator=gen))


def rank_program(args: argparse.Namespace) -> None:
    """One rank: train `steps` steps; rank 0 prints the timed seconds of the last steps."""
    import torch

    torch.set_num_threads(1)
    model = build(args.model)
    data = dataset(args.model, args.steps * args.world * BATCH)
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH)
    if args.route == "ddp":
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        store = dist.TCPStore(
            "127.0.0.1", args.port, args.world, args.rank == 0, timeout=timedelta(seconds=120)
        )
        dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.world)
        ddp = DistributedDataParallel(model)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
        times = []
        for i in range(args.steps):
            times.append(time.perf_counter())  # as the elastic loop: the batch is built inside
            first = (i * args.world + args.rank) * BATCH
            x, y = loader.collate_fn([data[j] for j in range(first, first + BATCH)])
            loss = torch.nn.functional.cross_entropy(ddp(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        dist.barrier()
        times.append(time.perf_counter())
        if args.rank == 0:
            print(json.dumps({"seconds": times[-1] - times[WARMUP]}), flush=True)
        dist.destroy_process_group()
        os._exit(0)
    import cohort

    backend = "gloo" if args.route == "gloo" else None
    job = cohort.torch.ElasticJob(
        args.job, backend=backend, redis_url=args.redis_url, digest_every=0
    )
    model, sgd = job.wrap(model, torch.optim.SGD(model.parameters(), lr=0.01))
    times = []
    for _ in job.epochs(1):
        for x, y in job.batches(loader):
            times.append(time.perf_counter())
            loss = torch.nn.functional.cross_entropy(model(x), y)
            sgd.zero_grad()
            loss.backward()
            sgd.step()
    times.append(time.perf_counter())
    print(json.dumps({"seconds": times[-1] - times[WARMUP], "steps": len(times) - 1}), flush=True)


def _ranks(argv: list[str], world: int, env: dict[str, str]) -> float:
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "bench.throughput", "rank", *argv, "--rank", str(r)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )  # fmt: skip
        for r in range(world)
    ]
    seconds = []
    for proc in procs:
        out, err = proc.communicate(timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"a rank failed ({proc.returncode}): {err[-2000:]}")
        lines = [line for line in out.splitlines() if line.startswith("{")]
        if lines:
            seconds.append(json.loads(lines[-1])["seconds"])
    return max(seconds)  # the world is as fast as its slowest rank


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cell(model: str, world: int, steps: int) -> dict[str, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    common = ["--model", model, "--world", str(world), "--steps", str(steps)]
    ddp = _ranks([*common, "--route", "ddp", "--port", str(_free_port())], world, env)
    with tempfile.TemporaryDirectory(prefix="cohort-bench-tp-"), LocalRedis() as server:
        job = f"tp-{model}-{world}"
        leader = coordinator(
            server.url, job, "--min-workers", str(world), "--dataset-size",
            str(steps * world * BATCH), "--batch-size", str(BATCH),
        )  # fmt: skip
        try:
            where = ["--job", job, "--redis-url", server.url]
            elastic = _ranks([*common, "--route", "redis", *where], world, env)
            server.client().delete(*server.client().keys(f"cohort:{{{job}}}*"))
        finally:
            stop_all([leader])
    with tempfile.TemporaryDirectory(prefix="cohort-bench-tp-"), LocalRedis() as server:
        job = f"tp-{model}-{world}-gloo"
        leader = coordinator(
            server.url, job, "--min-workers", str(world), "--dataset-size",
            str(steps * world * BATCH), "--batch-size", str(BATCH),
        )  # fmt: skip
        try:
            where = ["--job", job, "--redis-url", server.url]
            gloo = _ranks([*common, "--route", "gloo", *where], world, env)
        finally:
            stop_all([leader])
    samples = (steps - WARMUP) * world * BATCH
    return {"ddp": samples / ddp, "redis": samples / elastic, "gloo": samples / gloo}


def measure(ranks: tuple[int, ...], models: tuple[str, ...], steps: int, runs: int) -> Section:
    section = Section(
        key="throughput",
        title="Training throughput: ElasticJob against plain DDP (gloo), same run",
        command=(
            f"python -m bench.throughput --ranks {','.join(map(str, ranks))} "
            f"--models {','.join(models)} --steps {steps} --runs {runs}"
        ),
        header=[
            "model",
            "ranks",
            "DDP samples/s",
            "ElasticJob (Redis) samples/s",
            "ratio",
            "target",
            "",
        ],  # fmt: skip
    )
    raw: dict[str, Any] = {}
    for model in models:
        for world in ranks:
            results = [cell(model, world, steps) for _ in range(runs)]
            ddp = statistics.median(r["ddp"] for r in results)
            for route, target in (
                ("torch.distributed (gloo, DDP)", 0.95),
                ("Redis", 0.8 if model == "1m" else None),
            ):
                key = "gloo" if route.startswith("torch") else "redis"
                mine = statistics.median(r[key] for r in results)
                section.rows.append(
                    [
                        model, str(world), route, f"{ddp:,.0f}", f"{mine:,.0f}",
                        f"{mine / ddp:.2f}", f">= {target}" if target else "report",
                        verdict(mine / ddp, target) if target else "",
                    ]
                )  # fmt: skip
            raw[f"{model}/{world}"] = results
    section.notes = [
        f"Synthetic data, batches of {BATCH} per rank, SGD; every rank a process with one "
        f"torch thread on this machine; the first {WARMUP} steps are not timed. ElasticJob "
        "here averages gradients through Redis (one bucketed allreduce in optimizer.step(), "
        "after backward) and waits for each step's commit; DDP overlaps its gloo allreduce "
        "with backward.",
    ]
    section.raw = raw
    return section


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "rank":
        parser = argparse.ArgumentParser(prog="python -m bench.throughput rank")
        parser.add_argument("--model", choices=sorted(MODELS), required=True)
        parser.add_argument("--world", type=int, required=True)
        parser.add_argument("--rank", type=int, required=True)
        parser.add_argument("--steps", type=int, required=True)
        parser.add_argument("--route", choices=("ddp", "redis", "gloo"), required=True)
        parser.add_argument("--port", type=int, default=0)
        parser.add_argument("--job", default="")
        parser.add_argument("--redis-url", default=None)
        rank_program(parser.parse_args(sys.argv[2:]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--models", default="1m,25m")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()
    ranks = tuple(int(r) for r in args.ranks.split(","))
    models = tuple(m for m in args.models.split(","))
    print(measure(ranks, models, args.steps, args.runs).markdown())


if __name__ == "__main__":
    main()
