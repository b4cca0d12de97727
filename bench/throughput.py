"""Training throughput: `cohort.torch.ElasticJob` against plain DDP over gloo, same run.

Each cell trains the same model for the same steps on synthetic data, with N ranks as real
processes on this machine: plain `DistributedDataParallel` over gloo (the peer), and the
five-line elastic loop (`ElasticJob`) by both of its gradient routes, torch.distributed
(gloo, a process group per world, DDP) and Redis, each against a real coordinator whose job
ends after the measured steps. The figure is samples per second over the timed steps (after
a warm-up); the ratio is taken against the DDP run of the same round, and the routes of a
round run back to back in an order that rotates from round to round, so that load from
other work on the machine falls on both sides of a ratio.

    python -m bench.throughput [--ranks 2,4] [--models 1m,25m] [--runs 3] [--steps N]
    python -m bench.throughput rank ...      # one rank's program (internal)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from cohort.localredis import LocalRedis, free_port
from cohort.processes import stop_all

from .fleet import coordinator
from .results import Section, verdict

BATCH = 64
WARMUP = 5
ROUTES = ("ddp", "gloo", "redis")
"""The peer, then ElasticJob through torch.distributed (gloo), then through Redis."""
ROUTE_NAMES = {"gloo": "torch.distributed (gloo, DDP)", "redis": "Redis"}
TARGETS = {("gloo", "1m"): 0.95, ("gloo", "25m"): 0.95, ("redis", "1m"): 0.8}
"""Issue 17's: the gloo route as fast as DDP within 5 %; the Redis route is reported."""


@dataclass(frozen=True)
class Model:
    inputs: int
    hidden: tuple[int, ...]
    outputs: int
    steps: int
    """Steps a run trains by default (the timed ones follow WARMUP)."""


MODELS = {
    "1m": Model(784, (1024, 256), 10, steps=100),  # 1.07M parameters
    "25m": Model(2240, (2240,) * 4, 2240, steps=25),  # 25.1M parameters
}


def build(name: str) -> Any:
    import torch

    spec = MODELS[name]
    torch.manual_seed(0)
    layers: list[Any] = []
    width = spec.inputs
    for h in spec.hidden:
        layers += [torch.nn.Linear(width, h), torch.nn.ReLU()]
        width = h
    layers.append(torch.nn.Linear(width, spec.outputs))
    return torch.nn.Sequential(*layers)


def dataset(name: str, size: int) -> Any:
    import torch
    from torch.utils.data import TensorDataset

    spec = MODELS[name]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(size, spec.inputs, generator=gen)
    return TensorDataset(x, torch.randint(0, spec.outputs, (size,), generator=gen))


def rank_program(args: argparse.Namespace) -> None:
    """One rank: train `steps` steps; print the seconds from the start of step WARMUP to
    the start of step `steps` (or to the loop's end), and the steps it saw committed."""
    import torch

    torch.set_num_threads(1)
    model = build(args.model)
    data = dataset(args.model, args.steps * args.world * BATCH)
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH)
    if args.route == "ddp":
        _ddp(args, model, data, loader)
        return
    import cohort

    backend = "gloo" if args.route == "gloo" else None
    job = cohort.torch.ElasticJob(
        args.job, backend=backend, redis_url=args.redis_url, digest_every=0
    )
    model, sgd = job.wrap(model, torch.optim.SGD(model.parameters(), lr=0.01))
    starts: dict[int, float] = {}
    for _ in job.epochs():
        for x, y in job.batches(loader):
            assert job.current is not None
            starts[job.current.step] = time.perf_counter()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            sgd.zero_grad()
            loss.backward()
            sgd.step()
        ended = time.perf_counter()  # the last step committed; leaving the job is not timed
    # a rank may build one step past the job's last before it sees the end: the timing
    # stops where that step starts
    end = starts.get(args.steps, ended)
    print(json.dumps({"seconds": end - starts[WARMUP], "steps": job.steps_done}), flush=True)


def _ddp(args: argparse.Namespace, model: Any, data: Any, loader: Any) -> None:
    """The peer: plain DDP over gloo on the same batches, the same loop."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    store = dist.TCPStore(
        "127.0.0.1", args.port, args.world, args.rank == 0, timeout=timedelta(seconds=120)
    )
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.world)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    starts = []
    for i in range(args.steps):
        starts.append(time.perf_counter())  # as the elastic loop: the batch is built inside
        first = (i * args.world + args.rank) * BATCH
        x, y = loader.collate_fn([data[j] for j in range(first, first + BATCH)])
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    dist.barrier()  # as the elastic loop's end: every rank's last step is done
    ended = time.perf_counter()
    print(json.dumps({"seconds": ended - starts[WARMUP], "steps": args.steps}), flush=True)
    dist.destroy_process_group()
    os._exit(0)  # torch's teardown may abort at exit


def _ranks(argv: list[str], world: int, steps: int) -> float:
    """Start `world` ranks with `argv`; the seconds of the slowest (the world's pace)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "bench.throughput", "rank", *argv, "--rank", str(r)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(world)
    ]
    seconds = []
    for rank, proc in enumerate(procs):
        out, err = proc.communicate(timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"rank {rank} failed ({proc.returncode}): {err[-2000:]}")
        lines = [line for line in out.splitlines() if line.startswith("{")]
        if not lines:
            raise RuntimeError(f"rank {rank} printed no result: {err[-2000:]}")
        result = json.loads(lines[-1])
        if result["steps"] != steps:
            raise RuntimeError(f"rank {rank} saw {result['steps']} of {steps} steps commit")
        seconds.append(result["seconds"])
    return max(seconds)


def run(route: str, model: str, world: int, steps: int) -> float:
    """Samples per second of one run of `route` (ddp, gloo or redis)."""
    common = ["--model", model, "--world", str(world), "--steps", str(steps), "--route", route]
    if route == "ddp":
        seconds = _ranks([*common, "--port", str(free_port())], world, steps)
    else:
        with LocalRedis(appendonly=False) as server:
            job = f"tp-{model}-{world}-{route}"
            leader = coordinator(
                server.url, job, "--min-workers", str(world), "--max-steps", str(steps),
                "--dataset-size", str(steps * world * BATCH), "--batch-size", str(BATCH),
            )  # fmt: skip
            try:
                seconds = _ranks([*common, "--job", job, "--redis-url", server.url], world, steps)
            finally:
                stop_all([leader])
    return (steps - WARMUP) * world * BATCH / seconds


def cell(model: str, world: int, steps: int, runs: int, routes: tuple[str, ...]) -> list[dict]:
    """`runs` rounds, each every route once (DDP among them), the order rotating."""
    order = ("ddp", *routes)
    rounds = []
    for i in range(runs):
        turn = order[i % len(order) :] + order[: i % len(order)]
        rounds.append({route: run(route, model, world, steps) for route in turn})
    return rounds


def measure(
    ranks: tuple[int, ...],
    models: tuple[str, ...],
    runs: int,
    steps: int | None = None,
    routes: tuple[str, ...] = ("gloo", "redis"),
) -> Section:
    unknown = [m for m in models if m not in MODELS] + [r for r in routes if r not in ROUTE_NAMES]
    if unknown:
        raise ValueError(f"unknown model(s) or route(s) {unknown}: models {sorted(MODELS)}, "
                         f"routes {sorted(ROUTE_NAMES)}")  # fmt: skip
    if steps is not None and steps <= WARMUP:
        raise ValueError(f"--steps {steps}: more than the {WARMUP} warm-up steps are needed")
    command = (
        f"python -m bench.throughput --ranks {','.join(map(str, ranks))} "
        f"--models {','.join(models)} --runs {runs}"
    )
    if steps is not None:
        command += f" --steps {steps}"
    if routes != ("gloo", "redis"):
        command += f" --routes {','.join(routes)}"
    section = Section(
        key="throughput",
        title="Training throughput: ElasticJob against plain DDP (gloo), same run",
        command=command,
        header=["model", "ranks", "steps", "ElasticJob's gradients", "DDP samples/s",
                "ElasticJob samples/s", "ratio (median of rounds)", "target", ""],
    )  # fmt: skip
    raw: dict[str, Any] = {}
    for model in models:
        for world in ranks:
            n = steps or MODELS[model].steps
            rounds = cell(model, world, n, runs, routes)
            raw[f"{model}/{world}"] = rounds
            ddp = statistics.median(r["ddp"] for r in rounds)
            for route in routes:
                mine = statistics.median(r[route] for r in rounds)
                ratio = statistics.median(r[route] / r["ddp"] for r in rounds)
                target = TARGETS.get((route, model))
                section.rows.append(
                    [
                        model, str(world), str(n), ROUTE_NAMES[route], f"{ddp:,.0f}",
                        f"{mine:,.0f}", f"{ratio:.2f}", f">= {target}" if target else "report",
                        verdict(ratio, target) if target else "",
                    ]
                )  # fmt: skip
    section.notes = [
        f"Synthetic data, batches of {BATCH} per rank, SGD; every rank a process with one "
        f"torch thread on this machine; the first {WARMUP} steps are not timed, and a run "
        "ends at its last step's commit (DDP: a barrier). A round runs DDP and each route "
        "once, back to back, the order rotating from round to round; a ratio is that of "
        f"one round, the table gives the median of {runs} rounds.",
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
        parser.add_argument("--route", choices=ROUTES, required=True)
        parser.add_argument("--port", type=int, default=0)
        parser.add_argument("--job", default="")
        parser.add_argument("--redis-url", default=None)
        rank_program(parser.parse_args(sys.argv[2:]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--models", default="1m,25m")
    parser.add_argument("--routes", default="gloo,redis")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--steps", type=int, default=None, help="steps per run (default: the model's own)"
    )
    args = parser.parse_args()
    try:
        section = measure(
            tuple(int(r) for r in args.ranks.split(",")),
            tuple(args.models.split(",")),
            args.runs,
            args.steps,
            tuple(args.routes.split(",")),
        )
    except ValueError as exc:
        parser.error(str(exc))
    print(section.markdown())


if __name__ == "__main__":
    main()
