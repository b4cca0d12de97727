"""Compressed allreduce through one Redis server (int8 blocks, PowerSGD) vs exact and gloo.

Each rank is a process with its own connection to a private redis-server (AOF off). The
gradient is a list of layer matrices (64 MiB: 16 x 1024x1024 float32), each a shared
low-rank signal with a decaying spectrum (what the ranks agree on) plus each rank's own
noise, changing every step. A run is a barrier, then one averaging of the gradient: exact
float32 through Redis, int8 blocks with error feedback, or PowerSGD rank r with error
feedback (two allreduces, P then Q); its time is the slowest rank's, and includes
compressing and decoding. gloo's exact all_reduce of the same bytes runs in the same
session. Bytes through Redis are the server's INFO deltas (total_net_input_bytes +
total_net_output_bytes) over the cell, per call.

The error columns compare rank 0's result with the exact mean: after one step, and the sum
of all steps' results with the sum of the exact means (error feedback: what one step leaves
out comes back in the next ones). Convergence: the model of examples/torch_train.py
trained by 3 ranks through Redis for the same steps on the same batches, exact and with
each compressor; final loss and accuracy on the whole data set.

    python -m bench.compress [--ranks 2,4] [--layers 16] [--dim 1024] [--runs 5]
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from bench.allreduce import (
    MIB,
    Fixed,
    Places,
    run_ranks,
    slowest_median,
    time_gloo,
    torch_available,
)
from bench.hierarchy import through
from bench.results import Section, verdict
from cohort.events.connection import RedisSettings, connect
from cohort.localredis import LocalRedis
from cohort.worker.collective.compressors import Compressor, Int8Feedback, PowerSGD
from cohort.worker.collective.redis_collective import Collective

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("float32", "int8", "powersgd-4", "powersgd-16")
BLAS_THREADS = "OPENBLAS_NUM_THREADS"
SIGNAL_RANK = 8
DRIFT = 0.2
"""How much of the signal's left factor changes from one step to the next."""
NOISE = 0.3
"""Each rank's noise per value (the signal's values have a standard deviation of about 1.15)."""


def make(method: str) -> Compressor | None:
    """The compressor a method names (None: exact float32 through Redis)."""
    if method == "float32":
        return None
    if method == "int8":
        return Int8Feedback()
    return PowerSGD(int(method.split("-")[1]))


def layer_gradient(layer: int, dim: int, rank: int, step: int) -> np.ndarray:
    """Rank `rank`'s gradient of one layer at `step`: a rank-8 signal with singular values
    about 1, 1/2, 1/4, ... (the same on every rank, drifting a little every step, as
    consecutive gradients of a model are alike) plus each rank's noise."""
    base, drift = np.random.default_rng([layer]), np.random.default_rng([layer, step])
    u = base.standard_normal((dim, SIGNAL_RANK), dtype=np.float32)
    u += np.float32(DRIFT) * drift.standard_normal((dim, SIGNAL_RANK), dtype=np.float32)
    v = base.standard_normal((SIGNAL_RANK, dim), dtype=np.float32)
    u *= (0.5 ** np.arange(SIGNAL_RANK)).astype("<f4")
    g = u @ v
    noise = np.random.default_rng([layer, step, 1000 + rank])
    g += np.float32(NOISE) * noise.standard_normal((dim, dim), dtype=np.float32)
    return g


def gradient(layers: int, dim: int, rank: int, step: int) -> dict[str, np.ndarray]:
    return {f"layer{i:02d}": layer_gradient(i, dim, rank, step) for i in range(layers)}


class Timed(Collective):
    """A Collective that adds up the seconds its allreduce calls take (the Redis part,
    with the int8 transport's encoding and decoding of chunks)."""

    spent = 0.0

    def allreduce(self, *args: Any, **kwargs: Any) -> dict[str, np.ndarray]:
        start = time.perf_counter()
        try:
            return super().allreduce(*args, **kwargs)
        finally:
            self.spent += time.perf_counter() - start


def _rank(
    tag: str,
    url: str,
    n: int,
    rank: int,
    layers: int,
    dim: int,
    runs: int,
    method: str,
    out: Any,
) -> None:
    conn = connect(RedisSettings(url=url, socket_timeout=120))
    # a job per cell: (world, step) names one call, and a cell of another size on the same
    # server would read this one's notices of the same step
    job = f"compress-{n}-{method}-{layers}x{dim}-{tag}"
    collective = Timed(conn, job, Fixed(f"w{rank}", rank, n))
    comp = make(method)
    if comp is not None:
        comp.reset(0)
    times, inside = [], []
    results = []
    for run in range(runs + 1):  # run 0 warms up: it counts for the error, not the time
        grads = gradient(layers, dim, rank, run)
        collective.barrier(step=3 * run, timeout=120)
        collective.spent = 0.0
        start = time.perf_counter()
        if comp is None:
            got = collective.allreduce(grads, 3 * run + 1, timeout=120)
        else:
            got = comp.allreduce(collective, grads, (3 * run + 1, 3 * run + 2), out=grads)
        times.append(time.perf_counter() - start)
        inside.append(collective.spent)
        if rank == 0:
            results.append(got)
        del grads
    report = errors(results, layers, dim, n) if rank == 0 else {}
    out.put((rank, times[1:], inside[1:], report))
    conn.close()


def errors(results: list[dict[str, np.ndarray]], layers: int, dim: int, n: int) -> dict[str, float]:
    """Relative (Frobenius) error of the first step's result, and of the sum of every
    step's result against the sum of the exact means."""
    first = summed = norm_first = norm_summed = 0.0
    for layer in range(layers):
        applied = np.zeros((dim, dim))
        exact_sum = np.zeros((dim, dim))
        for step, got in enumerate(results):
            exact = sum(layer_gradient(layer, dim, r, step).astype(np.float64) for r in range(n))
            exact = np.asarray(exact) / n
            if step == 0:
                first += float(np.sum((got[f"layer{layer:02d}"] - exact) ** 2))
                norm_first += float(np.sum(exact**2))
            applied += got[f"layer{layer:02d}"]
            exact_sum += exact
        summed += float(np.sum((applied - exact_sum) ** 2))
        norm_summed += float(np.sum(exact_sum**2))
    return {"first": math.sqrt(first / norm_first), "summed": math.sqrt(summed / norm_summed)}


def time_method(
    url: str, n: int, layers: int, dim: int, runs: int, method: str, places: Places = None
) -> dict[str, Any]:
    """One cell: median of the slowest rank's seconds, the Redis part of it, the errors,
    and the bytes written to / moved through Redis per averaging (each rank on its
    simulated host, with `places`)."""
    conn = connect(RedisSettings(url=url))
    before = through(conn)
    # one BLAS thread per rank, as one torch thread: ranks share the cores
    saved = os.environ.get(BLAS_THREADS)
    os.environ[BLAS_THREADS] = "1"  # read by each spawned rank's numpy as it loads
    try:
        tag = uuid.uuid4().hex[:8]
        args = [(tag, url, n, r, layers, dim, runs, method) for r in range(n)]
        per_rank = run_ranks(_rank, args, places)
    finally:
        if saved is None:
            del os.environ[BLAS_THREADS]
        else:
            os.environ[BLAS_THREADS] = saved
    after = through(conn)
    conn.close()
    written, read = (a - b for a, b in zip(after, before, strict=True))
    calls = runs + 1
    return {
        "s": slowest_median({r: t for r, (t, _, _) in per_rank.items()}),
        "redis_s": slowest_median({r: i for r, (_, i, _) in per_rank.items()}),
        "written": written / calls,
        "through": (written + read) / calls,
        **per_rank[0][2],
    }


# ------------------------------------------------------------------ convergence
def load_example(name: str) -> ModuleType:
    """examples/NAME.py as a module (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def convergence(
    url: str,
    compression: str | None,
    rank: int = 4,
    steps: int = 300,
    n: int = 3,
    batch: int = 32,
    lr: float = 0.05,
    size: int = 4096,
) -> dict[str, Any]:
    """Train examples/torch_train.py's model with `n` ranks (threads, each with its own
    Redis connection) for `steps` synchronous steps, gradients averaged through Redis by
    `sync_gradients` (exact, or with `compression`); every rank sees the same batches in
    every run. Returns the final loss and accuracy on the whole data set and whether every
    rank ended with the same parameters, bit for bit."""
    import torch

    from cohort.worker.collective.compressors import compressor
    from cohort.worker.pytorch.sync import sync_gradients

    torch.set_num_threads(1)
    ex = load_example("torch_train")
    data = ex.Data(size)
    order = np.random.default_rng(0).permutation(np.arange(steps * n * batch) % size)
    job = f"converge-{compression}-{rank}-{time.monotonic_ns()}"
    finals: list[dict[str, np.ndarray] | None] = [None] * n
    models = [ex.build(0) for _ in range(n)]  # built here: torch.manual_seed is global

    def train(r: int) -> None:
        conn = connect(RedisSettings(url=url))
        collective = Collective(conn, job, Fixed(f"w{r}", r, n))
        model = models[r]
        optimizer = ex.optimizer_for(model, lr)
        comp = compressor(compression, rank)
        if comp is not None:
            comp.reset(0)
        for step in range(steps):
            at = (step * n + r) * batch
            x, y = data.take(order[at : at + batch])
            optimizer.zero_grad()
            ex.loss_of(model, x, y).backward()
            sync_gradients(model, collective, step, compressor=comp)
            optimizer.step()
        finals[r] = ex.params_of(model)
        conn.close()

    _in_threads(n, train)
    loss, accuracy = _scored(models[0], data)
    return {"loss": loss, "accuracy": accuracy, "identical": _identical(finals)}


def _in_threads(n: int, train: Callable[[int], None]) -> None:
    """`train(r)` for every rank r, each in a thread of its own; the first failure is raised."""
    failures: list[BaseException] = []

    def guarded(r: int) -> None:
        try:
            train(r)
        except BaseException as exc:  # reported by the caller
            failures.append(exc)

    threads = [threading.Thread(target=guarded, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise failures[0]


def _scored(model: Any, data: Any) -> tuple[float, float]:
    """(loss, accuracy) of `model` on the whole data set."""
    import torch

    with torch.no_grad():
        logits = model(data.x)
        loss = float(torch.nn.functional.cross_entropy(logits, data.y))
        accuracy = float((logits.argmax(dim=1) == data.y).float().mean())
    return loss, accuracy


def _identical(finals: list[dict[str, np.ndarray] | None]) -> bool:
    """Whether every rank ended with the same parameters, bit for bit."""
    first = finals[0]
    assert first is not None
    return all(f is not None and all(np.array_equal(first[k], f[k]) for k in first) for f in finals)


# ------------------------------------------------------------------ the section
def measure(
    worlds: tuple[int, ...] = (2, 4),
    layers: int = 16,
    dim: int = 1024,
    runs: int = 5,
    methods: tuple[str, ...] = METHODS,
    steps: int = 300,
) -> Section:
    size = layers * dim * dim * 4
    gloo = torch_available()
    section = Section(
        key="compress",
        title="Compressed allreduce through one Redis server (int8, PowerSGD) vs gloo",
        command=f"python -m bench.compress --ranks {','.join(map(str, worlds))} "
        f"--layers {layers} --dim {dim} --runs {runs} --steps {steps}",
        header=["ranks", "MiB", "transport", "ms", "Redis part ms", "MiB through Redis",
                "fewer bytes", "gloo ms", "x gloo", "target <= 1.0x gloo", "",
                "rel. error 1 step", f"rel. error of the sum, {runs + 1} steps"],
    )  # fmt: skip
    raw: dict[str, Any] = {"cells": [], "convergence": {}}
    with LocalRedis(appendonly=False) as server:
        for n in worlds:
            g = time_gloo(n, size, runs) if gloo else float("nan")
            for row, cell in _cells(server.url, n, layers, dim, runs, methods, g):
                section.rows.append(row)
                raw["cells"].append(cell)
                print(" | ".join(section.rows[-1]), flush=True)
        if gloo:
            for name, comp, r in (("exact", None, 4), ("int8", "int8", 4),
                                  ("powersgd-4", "powersgd", 4)):  # fmt: skip
                raw["convergence"][name] = convergence(server.url, comp, r, steps)
    section.notes = _notes(layers, dim, steps, gloo, raw)
    section.raw = raw
    return section


def _cells(
    url: str,
    n: int,
    layers: int,
    dim: int,
    runs: int,
    methods: tuple[str, ...],
    g: float,
) -> Iterator[tuple[list[str], dict[str, Any]]]:
    """Each method's row and raw cell at `n` ranks, timed as it is asked for; `g` is gloo's
    seconds for the same bytes."""
    size = layers * dim * dim * 4
    exact_through = None
    for method in methods:
        cell = time_method(url, n, layers, dim, runs, method)
        if method == "float32":
            exact_through = cell["through"]
        fewer = exact_through / cell["through"] if exact_through else float("nan")
        ratio = cell["s"] / g
        met = verdict(ratio, 1.0, False) if size >= 64 * MIB else "report"
        row = [str(n), str(size // MIB), method, f"{cell['s'] * 1e3:.1f}",
               f"{cell['redis_s'] * 1e3:.1f}", f"{cell['through'] / MIB:.1f}",
               f"{fewer:.1f}x", f"{g * 1e3:.1f}", f"{ratio:.2f}", "<= 1.0x", met,
               f"{cell['first']:.1e}", f"{cell['summed']:.1e}"]  # fmt: skip
        yield row, {"ranks": n, "mib": size // MIB, "method": method, "gloo_s": g, **cell}


def _notes(layers: int, dim: int, steps: int, gloo: bool, raw: dict[str, Any]) -> list[str]:
    """What the columns measure, then convergence, PowerSGD's misses and a missing gloo."""
    notes = [
        f"The gradient: {layers} layers of {dim}x{dim} float32, each a rank-{SIGNAL_RANK} "
        f"signal (singular values halving, drifting by {DRIFT} a step) shared by the ranks "
        f"plus {NOISE} noise per value of each rank's own, new every step. "
        "ms: median over runs of the slowest rank's time for one averaging, compressing "
        "and decoding included; the Redis part is the "
        "time inside Collective.allreduce (for int8 that includes encoding and decoding "
        "chunks; the rest is the compressor's numpy work: error feedback, P = MQ, "
        "orthonormalising, Q = M^T P, P Q^T). MiB through Redis: INFO "
        "total_net_input_bytes + total_net_output_bytes per averaging (barriers and notices "
        "included).",
        "Errors: Frobenius norm of (rank 0's result - the exact mean) over the exact mean's, "
        "after one step; and of (the sum of every step's result - the sum of the exact means) "
        "over the latter's: error feedback brings back what a step left out, so the sum's "
        "error falls as steps accumulate. Every rank's result is the same bits (the contract "
        "tests check it with np.array_equal).",
    ]
    if raw["convergence"]:
        notes.append(_convergence_note(steps, raw["convergence"]))
    misses = [
        f"{c['method']} on {c['ranks']} ranks {c['s'] / c['gloo_s']:.2f}x gloo, of which "
        f"{(c['s'] - c['redis_s']) * 1e3:.0f} of {c['s'] * 1e3:.0f} ms outside Redis"
        for c in raw["cells"]
        if c["method"].startswith("powersgd") and c["s"] > c["gloo_s"] and c["mib"] >= 64
    ]
    if misses:
        notes.append(
            "Missed by PowerSGD: " + "; ".join(misses) + ". What is left is the "
            "compressor's numpy work, memory-bound passes over the 64 MiB on the cores the "
            "ranks share (a py-spy/timeit breakdown at 2 ranks, one BLAS thread: M = g + "
            "error 8 ms, M Q 8 ms, M^T P 10 ms, P Q^T 13 ms, the new error 5 ms); on hosts "
            "of their own, or with the matrices on a GPU, it no longer adds up."
        )
    if not gloo:
        notes.append("torch is not installed here: the gloo columns are empty.")
    return notes


def _convergence_note(steps: int, runs: dict[str, dict[str, Any]]) -> str:
    """Each compressor's final loss and accuracy, against exact averaging's."""
    exact = runs["exact"]
    return (
        f"Convergence (examples/torch_train.py's model, 3 ranks x 32 samples, {steps} "
        "steps of SGD with momentum through Redis, the same batches): "
        + "; ".join(
            f"{name} loss {c['loss']:.4f} accuracy {c['accuracy']:.4f}"
            + (
                ""
                if name == "exact"
                else f" ({(c['loss'] / exact['loss'] - 1) * 100:+.1f}% loss, "
                f"{(c['accuracy'] - exact['accuracy']) * 100:+.2f} points)"
            )
            + ("" if c["identical"] else " RANKS DIFFER")
            for name, c in runs.items()
        )  # fmt: skip
        + "."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4", help="world sizes")
    parser.add_argument("--layers", type=int, default=16, help="layer matrices")
    parser.add_argument("--dim", type=int, default=1024, help="each layer is dim x dim")
    parser.add_argument("--runs", type=int, default=5, help="timed runs per cell (median)")
    parser.add_argument("--steps", type=int, default=300, help="training steps (convergence)")
    args = parser.parse_args()
    worlds = tuple(int(r) for r in args.ranks.split(","))
    print(measure(worlds, args.layers, args.dim, args.runs, steps=args.steps).markdown())


if __name__ == "__main__":
    main()
