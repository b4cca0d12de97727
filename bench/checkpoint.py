"""Checkpoints: what they cost the training loop, and how fast a job trains again after
losing every worker.

Cost: a worker asked for a checkpoint copies its state on the training loop's path and
hands the copy to a background thread, which serialises it and writes it through fsspec.
The peer, measured in the same run on the same state, is what a careful torchrun user
writes: `torch.save` of the model and optimizer state dicts on rank 0, blocking the step
(for the numpy example, `np.savez`). Both write to the same local disk. The table gives
the time on the training loop's path per checkpoint, and the time of a training step while
a background write runs against one without.

Recovery: a real coordinator and two `cohort example-worker` processes checkpoint every
20 steps; both are SIGKILLed after a checkpoint, two new workers start at once (as a
scheduler restarting the job would); the figure is SIGKILL to the first step committed
after the rewind to the checkpoint. Its floor is `--heartbeat-timeout` (2 s here): the
coordinator must first be sure the workers are dead.

    python -m bench.checkpoint [--runs 3]
"""

from __future__ import annotations

import argparse
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from cohort import mlp
from cohort.events.models import DataPosition, Rewound, StepCommitted
from cohort.events.shards import Shard
from cohort.events.streams import id_ms
from cohort.localredis import LocalRedis
from cohort.processes import Proc, stop_all
from cohort.worker import checkpoints

from .fleet import Fleet, coordinator, spawn
from .results import Section

POSITION = DataPosition(epoch=0, rest=Shard(ranges=((0, 100),)))
WIDTH, LAYERS, BATCH = 2240, 5, 64  # 5 x (2240 x 2240 + 2240) = 25.1M parameters


def _median_time(fn: Any, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _torch_model() -> tuple[Any, Any, Any]:
    import torch

    torch.manual_seed(0)
    layers: list[Any] = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(BATCH, WIDTH)

    def step() -> None:
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()

    step()  # momentum buffers exist, as in a running job
    return model, optimizer, step


def _numpy_cost(tmp: Path, runs: int) -> dict[str, float]:
    params = mlp.init(0)

    def cohort_path() -> None:
        checkpoints.tensors_payload(params)  # the copy the loop makes; packing is background

    def peer() -> None:
        arrays: dict[str, Any] = dict(params)
        np.savez(tmp / "peer.npz", **arrays)

    def background() -> None:
        checkpoints.write(str(tmp / "x.ckpt"), "bench", 1, None, POSITION,
                          checkpoints.tensors_payload(params)())  # fmt: skip

    return {
        "cohort_path": _median_time(cohort_path, runs * 20),
        "peer": _median_time(peer, runs * 20),
        "background": _median_time(background, runs * 20),
        "bytes": (tmp / "x.ckpt").stat().st_size,
    }


def _torch_cost(tmp: Path, runs: int) -> dict[str, float]:
    import torch

    from cohort.worker import torch_sync

    model, optimizer, step = _torch_model()
    blob: dict[str, bytes] = {}

    def cohort_path() -> None:
        blob["state"] = torch_sync.state_blob(model, optimizer, {"rng": torch.get_rng_state()})

    def peer() -> None:
        torch.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, tmp / "peer.pt")

    def write() -> None:
        checkpoints.write(str(tmp / "x.ckpt"), "bench", 1, None, POSITION, blob["state"])

    cost = {
        "cohort_path": _median_time(cohort_path, runs),
        "peer": _median_time(peer, runs),
        "background": _median_time(write, runs),
        "bytes": (tmp / "x.ckpt").stat().st_size,
        "params": sum(p.numel() for p in model.parameters()),
    }
    quiet = _median_time(step, runs * 3)
    writing = threading.Event()

    def writer() -> None:
        while not writing.is_set():
            write()

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        busy = _median_time(step, runs * 3)
    finally:
        writing.set()
        thread.join()
    cost.update(step=quiet, step_during_write=busy)
    return cost


def _recovery(runs: int) -> list[float]:
    """SIGKILL of every worker to the first step committed after the rewind, seconds."""
    times = []
    for _ in range(runs):
        with (
            tempfile.TemporaryDirectory(prefix="cohort-bench-ckpt-") as tmp,
            LocalRedis() as server,
        ):
            times.append(_recover_once(server, Path(tmp)))
    return times


def _recover_once(server: LocalRedis, tmp: Path) -> float:
    url, job = server.url, "bench"
    procs = [
        coordinator(
            url,
            job,
            "--min-workers",
            "2",
            "--dataset-size",
            "2048",
            "--batch-size",
            "32",
            "--heartbeat-interval",
            "0.5",
            "--heartbeat-timeout",
            "2",
            "--checkpoint-uri",
            str(tmp / "ckpt"),
            "--checkpoint-every",
            "20",
        )  # fmt: skip
    ]
    try:
        first = [_trainer(url, job, name) for name in "ab"]
        procs += first
        fleet = Fleet(server.client(), job, 0)
        fleet.until(
            lambda s: bool(s.checkpoints) and s.last_committed > s.checkpoints[-1].step + 3,
            120,
            "a checkpoint and steps after it",
        )
        for proc in first:
            proc.signal(signal.SIGKILL)
        killed_at = time.time()
        procs += [_trainer(url, job, name) for name in "cd"]
        seen = len(fleet.watch.facts)
        fleet.until(
            lambda s: _after_rewind(fleet.watch.facts[seen:]) is not None,
            120,
            "a step committed after the rewind",
        )
        committed = _after_rewind(fleet.watch.facts[seen:])
        assert committed is not None
        return id_ms(committed) / 1000 - killed_at
    finally:
        stop_all(procs)


def _trainer(url: str, job: str, name: str) -> Proc:
    return spawn(url, name, "example-worker", "--job", job, "--id", name, "--steps", "100000",
                 "--pace", "0.05")  # fmt: skip


def _after_rewind(facts: list[tuple[str, Any]]) -> str | None:
    """The entry ID of the first StepCommitted after the Rewound among `facts`."""
    rewound = False
    for entry_id, fact in facts:
        rewound = rewound or isinstance(fact, Rewound)
        if rewound and isinstance(fact, StepCommitted):
            return str(entry_id)
    return None


def measure(runs: int = 3) -> Section:
    with tempfile.TemporaryDirectory(prefix="cohort-bench-ckpt-") as tmp:
        numpy_cost = _numpy_cost(Path(tmp), runs)
        torch_cost = _torch_cost(Path(tmp), runs)
    recovery = _recovery(runs)
    section = Section(
        key="checkpoint",
        title="Checkpoints: cost on the training loop, and recovery after losing every worker",
        command=f"python -m bench.checkpoint --runs {runs}",
        header=["what", "cohort", "peer (same run)", "ratio"],
    )
    for label, cost, scale in (
        ("numpy example (MLP), ms", numpy_cost, 1e3),
        (f"torch, {torch_cost['params'] / 1e6:.1f}M parameters + momentum, s", torch_cost, 1),
    ):
        section.rows.append(
            [
                f"{label}: on the loop's path per checkpoint (peer: blocking save)",
                f"{cost['cohort_path'] * scale:.3g}",
                f"{cost['peer'] * scale:.3g}",
                f"{cost['cohort_path'] / cost['peer']:.2f}",
            ]
        )
        section.rows.append(
            [
                f"{label}: background write ({cost['bytes'] / 1e6:.1f} MB file)",
                f"{cost['background'] * scale:.3g}",
                "",
                "",
            ]
        )
    section.rows.append(
        [
            "torch: a training step while a checkpoint is written in the background, s",
            f"{torch_cost['step_during_write']:.3f}",
            f"{torch_cost['step']:.3f} (no write)",
            f"{torch_cost['step_during_write'] / torch_cost['step']:.2f}",
        ]
    )
    every = 100
    section.rows.append(
        [
            f"torch: overhead per step with a checkpoint every {every} steps",
            f"{100 * torch_cost['cohort_path'] / every / torch_cost['step']:.2f} %",
            f"{100 * torch_cost['peer'] / every / torch_cost['step']:.2f} %",
            "",
        ]
    )
    section.rows.append(
        [
            "SIGKILL of every worker -> training again from the checkpoint, s",
            f"{statistics.median(recovery):.2f}",
            "",
            "",
        ]
    )
    section.notes = [
        "The loop's path is the copy of the state (for torch, `cohort.torch.state_blob`: model, "
        "optimizer and RNG state as one no-pickle blob); serialising the header, hashing and "
        "writing the file happen in the background thread. The peer blocks the step for the "
        "whole save. The step-during-write row shows what the background thread takes from "
        "training on this 2-core machine (disk and memory bandwidth, the GIL while hashing).",
        "Recovery: heartbeat_timeout 2 s (detection floor), then the new workers join, rank 0 "
        "loads the checkpoint and broadcasts it, and the first step commits. No peer is in "
        "this row: torchrun's restart-all from a checkpoint is measured by the goodput "
        "benchmark (issue 23).",
    ]
    section.raw = {"numpy": numpy_cost, "torch": torch_cost, "recovery_s": recovery}
    return section


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    print(measure(args.runs).markdown())


if __name__ == "__main__":
    main()
