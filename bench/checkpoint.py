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

from bench.fleet import Fleet, coordinator, spawn
from bench.results import Section, median_seconds
from cohort import mlp
from cohort.events.models import DataPosition, Rewound, StepCommitted
from cohort.events.shards import Shard
from cohort.events.streams import id_ms
from cohort.localredis import LocalRedis
from cohort.processes import Proc, stop_all
from cohort.worker.loop import checkpoints

POSITION = DataPosition(epoch=0, rest=Shard(ranges=((0, 100),)))
WIDTH, LAYERS, BATCH = 2240, 5, 64  # 5 x (2240 x 2240 + 2240) = 25.1M parameters
STEPS = 10  # training steps a checkpoint's cost is measured over (longer than one write)


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
        "cohort_path": median_seconds(cohort_path, runs * 20),
        "peer": median_seconds(peer, runs * 20),
        "background": median_seconds(background, runs * 20),
        "bytes": (tmp / "x.ckpt").stat().st_size,
    }


def _torch_cost(tmp: Path, runs: int, steps_per_run: int) -> dict[str, float]:
    """What one checkpoint costs a run of `steps_per_run` training steps, end to end: cohort's
    copy on the loop's path, then its background write competing with the steps (waited for at the
    end, if it outlasts them), against a blocking `torch.save` before the same steps. Once
    with CPU steps, once with steps that leave the CPU idle as long (as a GPU's would)."""
    import torch

    from cohort.worker.pytorch import sync as torch_sync

    model, optimizer, train = _torch_model()

    def copy() -> bytes:
        return torch_sync.state_blob(model, optimizer, {"rng": torch.get_rng_state()})

    def write(blob: bytes) -> None:
        checkpoints.write(str(tmp / "x.ckpt"), "bench", 1, None, POSITION, blob)

    def runs_of(step: Any) -> dict[str, float]:
        def steps() -> None:
            for _ in range(steps_per_run):
                step()

        def cohort_way() -> None:
            writer = threading.Thread(target=write, args=(copy(),))
            writer.start()
            steps()
            writer.join()

        def peer() -> None:
            state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
            torch.save(state, tmp / "peer.pt")
            steps()

        quiet = median_seconds(steps, runs)
        return {
            "step": quiet / steps_per_run,
            "cohort": median_seconds(cohort_way, runs) - quiet,
            "peer": median_seconds(peer, runs) - quiet,
        }

    on_cpu = runs_of(train)
    idle = threading.Event()
    on_gpu = runs_of(lambda: idle.wait(on_cpu["step"]))
    blob = copy()
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "step": on_cpu["step"],
        "cohort": on_cpu["cohort"],
        "peer": on_cpu["peer"],
        "gpu_cohort": on_gpu["cohort"],
        "gpu_peer": on_gpu["peer"],
        "cohort_path": median_seconds(copy, runs),
        "background": median_seconds(lambda: write(blob), runs),
        "bytes": (tmp / "x.ckpt").stat().st_size,
        "steps": steps_per_run,
    }


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
    flags = "--min-workers 2 --dataset-size 2048 --batch-size 32 --heartbeat-interval 0.5"
    flags += " --heartbeat-timeout 2 --checkpoint-every 20"
    procs = [coordinator(url, job, *flags.split(), "--checkpoint-uri", str(tmp / "ckpt"))]
    try:
        for name in "ab":  # one by one: those started are stopped if one fails
            procs.append(_trainer(url, job, name))
        first = procs[1:]
        fleet = Fleet(server.client(), job, 0)
        fleet.until(
            lambda s: bool(s.checkpoints) and s.last_committed > s.checkpoints[-1].step + 3,
            120,
            "a checkpoint and steps after it",
        )
        for proc in first:
            proc.signal(signal.SIGKILL)
        killed_at = time.time()
        for name in "cd":
            procs.append(_trainer(url, job, name))
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


def measure(runs: int = 3, steps: int = STEPS) -> Section:
    """`steps`: the training steps a torch checkpoint's cost is measured over."""
    with tempfile.TemporaryDirectory(prefix="cohort-bench-ckpt-") as tmp:
        numpy_cost = _numpy_cost(Path(tmp), runs)
        torch_cost = _torch_cost(Path(tmp), runs, steps)
    recovery = _recovery(runs)
    section = Section(
        key="checkpoint",
        title="Checkpoints: cost on the training loop, and recovery after losing every worker",
        command=f"python -m bench.checkpoint --runs {runs}"
        + (f" --steps {steps}" if steps != STEPS else ""),
        header=["what", "cohort", "peer (same run)", "ratio"],
    )
    section.rows += _numpy_rows(numpy_cost)
    section.rows += _torch_rows(torch_cost)
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
        "optimizer and RNG state as one no-pickle blob); the header, the sha256 and the file "
        "are written by a background thread while training goes on. The torch rows time "
        f"{steps} training steps with one checkpoint against the same steps without: the "
        "background thread competes with training for this machine's 2 cores (torch uses "
        "both), which a machine with a GPU or spare cores does not see. The peer blocks the "
        "steps for the whole save, as a torchrun script's rank 0 does.",
        "Recovery: heartbeat_timeout 2 s (detection floor), then the new workers join, rank 0 "
        "loads the checkpoint and broadcasts it, and the first step commits. No peer is in "
        "this row: torchrun's restart-all from a checkpoint is measured by the goodput "
        "benchmark (issue 23).",
    ]
    section.raw = {"numpy": numpy_cost, "torch": torch_cost, "recovery_s": recovery}
    return section


def _numpy_rows(cost: dict[str, float]) -> list[list[str]]:
    """The numpy example's cost on the loop's path (against np.savez) and in the background."""
    return [
        [
            "numpy example (MLP): on the loop's path per checkpoint, ms (peer: np.savez)",
            f"{cost['cohort_path'] * 1e3:.3g}",
            f"{cost['peer'] * 1e3:.3g}",
            f"{cost['cohort_path'] / cost['peer']:.2f}",
        ],
        [
            f"numpy example: background write ({cost['bytes'] / 1e3:.1f} kB), ms",
            f"{cost['background'] * 1e3:.3g}",
            "",
            "",
        ],
    ]


def _torch_rows(t: dict[str, float]) -> list[list[str]]:
    """A torch checkpoint's cost to CPU and idle-CPU steps against torch.save, its parts,
    and its overhead per step at one checkpoint every 100 steps."""
    every = 100
    return [
        [
            f"torch, {t['params'] / 1e6:.1f}M parameters + momentum ({t['bytes'] / 1e6:.0f} MB "
            f"file): one checkpoint's cost to {t['steps']:g} CPU training steps, s "
            "(peer: torch.save)",
            f"{t['cohort']:.3f}",
            f"{t['peer']:.3f}",
            f"{t['cohort'] / t['peer']:.2f}",
        ],
        [
            f"torch: the same with {t['steps']:g} steps that leave the CPU idle (as on a GPU), s",
            f"{t['gpu_cohort']:.3f}",
            f"{t['gpu_peer']:.3f}",
            f"{t['gpu_cohort'] / t['gpu_peer']:.2f}",
        ],
        ["torch: of which the copy on the loop's path, s", f"{t['cohort_path']:.3f}", "", ""],
        ["torch: the background write alone (sha256, file), s", f"{t['background']:.3f}", "", ""],
        [
            f"torch: overhead per step, a checkpoint every {every} steps "
            f"(CPU step {t['step'] * 1e3:.0f} ms; idle-CPU steps)",
            f"{100 * t['cohort'] / (every * t['step']):.2f} %; "
            f"{100 * t['gpu_cohort'] / (every * t['step']):.2f} %",
            f"{100 * t['peer'] / (every * t['step']):.2f} %; "
            f"{100 * t['gpu_peer'] / (every * t['step']):.2f} %",
            "",
        ],
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--steps", type=int, default=STEPS, help="training steps a torch checkpoint is priced over"
    )
    args = parser.parse_args()
    print(measure(args.runs, args.steps).markdown())


if __name__ == "__main__":
    main()
