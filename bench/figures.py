"""What a script's figures cost a step: `job.record` of five scalars, `job.mean` of one.

One job, two ranks of a small torch model, through Redis and through gloo. Its steps
run in rounds of three phases of PHASE steps each: plain steps (the peer), steps that
also `job.record` five scalars, steps that also take `job.mean` of the loss. Each
phase's time per step is measured by rank 0 between its first and last step; the rounds
interleave the phases, so drift on a shared machine falls on all three alike.

    python -m bench.figures [--rounds 3] [--phase 100]
    python -m bench.figures rank ...      # one rank (started by the benchmark)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from bench.fleet import coordinator
from bench.results import Section
from cohort.localredis import LocalRedis
from cohort.processes import end, stop_all

PHASES = ("plain", "record", "mean")
BATCH = 32


def rank_program(args: argparse.Namespace) -> None:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import cohort

    torch.set_num_threads(1)
    torch.manual_seed(0)
    steps = args.rounds * len(PHASES) * args.phase
    data = TensorDataset(torch.randn(steps * 2 * BATCH, 32), torch.randn(steps * 2 * BATCH, 1))
    job = cohort.torch.ElasticJob(
        args.job, redis_url=args.redis_url, worker_id=f"r{args.rank}", dataset=data,
        backend=None if args.route == "redis" else args.route,
    )  # fmt: skip
    net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    model, sgd = job.wrap(net, torch.optim.SGD(net.parameters(), lr=0.01))
    marks: dict[str, list[tuple[int, float]]] = {phase: [] for phase in PHASES}
    for _ in job.epochs():
        for x, y in job.batches(DataLoader(data, batch_size=BATCH)):
            step = job.step
            assert step is not None  # inside a step
            phase = PHASES[(step // args.phase) % len(PHASES)]
            loss = torch.nn.functional.mse_loss(model(x), y)
            sgd.zero_grad()
            loss.backward()
            sgd.step()
            if phase == "record":
                value = loss.item()
                job.record(loss=value, lr=0.01, accuracy=value, grad_norm=value, tokens=BATCH)
            elif phase == "mean":
                job.mean(loss.item())
            if not job.aborted:
                marks[phase].append((step, time.perf_counter()))
    print(json.dumps({phase: per_step(marks[phase], args.phase) for phase in PHASES}))


def per_step(marks: list[tuple[int, float]], phase: int) -> list[float]:
    """Seconds per step of each run of `phase` consecutive steps (first to last mark)."""
    runs: dict[int, list[float]] = {}
    for step, at in marks:
        runs.setdefault(step // phase, []).append(at)
    return [(ats[-1] - ats[0]) / (len(ats) - 1) for ats in runs.values() if len(ats) > 1]


def run(route: str, rounds: int, phase: int) -> dict[str, float]:
    """One job through `route`: each phase's median seconds per step."""
    steps = rounds * len(PHASES) * phase
    with LocalRedis(appendonly=False) as server:
        job = f"figures-{route}"
        leader = coordinator(
            server.url, job, "--min-workers", "2", "--max-steps", str(steps),
            "--batch-size", str(BATCH), "--dataset-size", str(steps * 2 * BATCH),
        )  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "COHORT_LOG_LEVEL": "warning"}
        argv = [
            sys.executable, "-m", "bench.figures", "rank", "--route", route, "--job", job,
            "--redis-url", server.url, "--rounds", str(rounds), "--phase", str(phase),
        ]  # fmt: skip
        procs: list[subprocess.Popen[str]] = []
        try:
            for r in range(2):
                procs.append(
                    subprocess.Popen(
                        [*argv, "--rank", str(r)], stdout=subprocess.PIPE, text=True, env=env
                    )
                )
            outs = [proc.communicate(timeout=900)[0] for proc in procs]
        finally:
            end(procs, sig=0)  # a rank still running when another failed
            stop_all([leader])
    if any(proc.returncode for proc in procs):
        raise RuntimeError(f"a rank failed: {[p.returncode for p in procs]}")
    result = json.loads([line for line in outs[0].splitlines() if line.startswith("{")][-1])
    return {name: statistics.median(times) for name, times in result.items()}


def measure(rounds: int = 3, phase: int = 100) -> Section:
    section = Section(
        key="figures",
        title="A script's figures: job.record of five scalars, job.mean of one, per step",
        command=f"python -m bench.figures --rounds {rounds} --phase {phase}",
        header=["route", "plain step, ms (peer)", "with record(5 scalars), ms", "ratio",
                "with mean(loss), ms", "ratio"],
    )  # fmt: skip
    for route in ("redis", "gloo"):
        got = run(route, rounds, phase)
        section.raw[route] = got
        plain, record, mean = (got[name] * 1e3 for name in PHASES)
        section.rows.append(
            [route, f"{plain:.2f}", f"{record:.2f}", f"{record / plain:.2f}", f"{mean:.2f}",
             f"{mean / plain:.2f}"]
        )  # fmt: skip
    section.notes = [
        "Two ranks of a 33k-parameter MLP, batches of 32, coordinator and Redis on the same "
        "2 cores. Each figure is the median over the rounds of a phase's seconds per step, "
        "phases interleaved in one job.",
        "`record` rides in the StepDone each rank sends anyway: its cost is building and "
        "validating the figures. `mean` is one gather among the world's ranks through Redis "
        "(a notice from each, read by all): a round trip the step waits for.",
    ]
    return section


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", nargs="?", default="bench", choices=("bench", "rank"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--phase", type=int, default=100)
    parser.add_argument("--route", default="redis")
    parser.add_argument("--job", default="")
    parser.add_argument("--redis-url", default="")
    parser.add_argument("--rank", type=int, default=0)
    args = parser.parse_args()
    if args.mode == "rank":
        rank_program(args)
        return
    print(measure(args.rounds, args.phase).markdown())


if __name__ == "__main__":
    main()
