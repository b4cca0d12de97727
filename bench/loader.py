"""The data loader's cost per step: cohort's step-following loader against a plain DataLoader.

Three ways to feed the same steps (batch 32, a dataset whose samples each cost `--decode`
microseconds to build, as decoding an image does), same run, same options
(`num_workers=2, persistent_workers=True`):

- plain: a torch DataLoader iterated once over the epoch, the peer (what a script without
  cohort does; no elasticity);
- per step: a DataLoader re-iterated at every step over that step's indices, what
  `job.batches` did before (prefetching stops at every step);
- cohort: `worker/pytorch/loader.py`'s StepLoader, whose batch sampler follows the job's
  plan, so the loader's workers prefetch across steps.

Each figure is the training loop's wait for data per step (the model's work is a sleep
of `--compute` ms, which prefetching can hide); the ratio is against plain in the run.

    python -m bench.loader [--steps 200] [--decode 100] [--compute 2] [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from bench.results import Section
from cohort.events import models as m
from cohort.events.shards import Shard
from cohort.worker.membership.view import View, fold
from cohort.worker.pytorch.loader import StepLoader

BATCH, WORKERS = 32, 2


class _Decoded:
    """Samples that each take `decode` microseconds of CPU to build."""

    def __init__(self, size: int, decode_us: float) -> None:
        self.size, self.decode = size, decode_us / 1e6

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Any:
        import torch

        end = time.perf_counter() + self.decode
        while time.perf_counter() < end:
            pass
        return torch.full((16,), float(index))


class _Member:
    """The part of a Worker a StepLoader reads: a view with one plan, this worker rank 0."""

    def __init__(self, size: int) -> None:
        facts: list[m.Fact] = [
            m.JobConfigured(at=0, job="b", config=m.JobConfig(dataset_size=size, batch_size=BATCH)),
            m.WorldChanged(
                at=0, job="b", version=1, start_step=0, epoch=0, ranks=("me",),
                shards=(Shard(ranges=((0, size),)),),
            ),
        ]  # fmt: skip
        self.view = fold(facts, View(worker="me"))


def _loader(dataset: _Decoded, **more: Any) -> Any:
    from torch.utils.data import DataLoader

    options = {"batch_size": BATCH, "num_workers": WORKERS, "persistent_workers": True}
    return DataLoader(dataset, **options, **more)  # type: ignore[arg-type]


def _waits(batches: Any, steps: int, compute: float) -> float:
    """Median seconds the loop waited for a batch, over `steps` steps."""
    waited = []
    it = iter(batches)
    for _ in range(steps):
        start = time.perf_counter()
        next(it)
        waited.append(time.perf_counter() - start)
        time.sleep(compute)
    return statistics.median(waited[WORKERS:])  # the first batches start the workers


def run(steps: int, decode_us: float, compute_ms: float, runs: int) -> Section:
    import torch

    torch.set_num_threads(1)
    size = steps * BATCH
    dataset = _Decoded(size, decode_us)
    compute = compute_ms / 1000
    member = _Member(size)
    order = member.view.config.order(0, member.view.dataset)  # type: ignore[union-attr]
    results: dict[str, list[float]] = {"plain": [], "per step": [], "cohort": []}
    for _ in range(runs):
        results["plain"].append(_waits(_loader(dataset), steps, compute))

        def per_step() -> Any:
            loader = _loader(dataset, sampler=None)
            for step in range(steps):
                ids = order.samples(((step * BATCH, (step + 1) * BATCH),)).tolist()
                loader.batch_sampler.sampler = ids  # the old way: the step's indices only
                yield next(iter(loader))

        results["per step"].append(_waits(per_step(), steps, compute))
        twin = StepLoader(_loader(dataset), member)  # type: ignore[arg-type]
        fetched = (twin.fetch((1, step, 0)) for step in range(steps))
        results["cohort"].append(_waits(fetched, steps, compute))
    plain = statistics.median(results["plain"])
    rows = []
    for name, values in results.items():
        wait = statistics.median(values)
        rows.append([name, f"{wait * 1e3:.2f}", f"{wait / plain:.2f}x" if plain else "-"])
    return Section(
        key="loader",
        title="Data loader per step",
        command=f"python -m bench.loader --steps {steps} --decode {decode_us:g} "
        f"--compute {compute_ms:g} --runs {runs}",
        notes=[
            f"Wait for a batch of {BATCH} per step, median of {runs} runs of {steps} steps, "
            f"`num_workers={WORKERS}, persistent_workers=True`, samples costing "
            f"{decode_us:g} us each, {compute_ms:g} ms of compute per step. Peer: a plain "
            "DataLoader over the epoch in the same run."
        ],
        header=["loader", "wait per step (ms)", "vs plain"],
        rows=rows,
        raw={"steps": steps, "wait_s": dict(results)},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--decode", type=float, default=100.0, help="microseconds per sample")
    parser.add_argument("--compute", type=float, default=5.0, help="ms of compute per step")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    print(run(args.steps, args.decode, args.compute, args.runs).markdown())


if __name__ == "__main__":
    main()
