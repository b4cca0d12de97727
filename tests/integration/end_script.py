"""A script for the end of a job (tests/integration/test_job_end.py), run as a user's is.

    python end_script.py numpy OUT_DIR [--hold-last-step N] [--quit-after K]
    python end_script.py torch OUT_DIR [--epochs N]

numpy: a linear model on 64 samples through `job.steps()`. `--hold-last-step N`: before
training step N, print `AT_LAST` and wait for OUT_DIR/go to exist (the test starts a late
process meanwhile). `--quit-after K`: stop after K steps, before the job's end.

torch: `job.epochs(--epochs)` over 4096 samples, one step at a time slowly; after each
epoch's batches prints whether `job.interrupted`, and runs the per-epoch code only if not.

Either prints one `END {json}` line: finished, has_final_weights, saved, the weights.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

import cohort

SAMPLES, FEATURES = 64, 4


def wait_for(path: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"{path} did not appear within {timeout} s")
        pause.wait(0.05)


def numpy_route(args: argparse.Namespace) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(SAMPLES, FEATURES)), rng.normal(size=SAMPLES)
    job = cohort.NumpyElasticJob(dataset=cohort.Dataset(size=SAMPLES, fingerprint="end"))
    params = job.wrap({"w": np.zeros(FEATURES)})
    for trained, step in enumerate(job.steps(), 1):
        if step.step == args.hold_last_step:
            print("AT_LAST", flush=True)
            wait_for(args.out / "go")
        with job.attempt(step):
            xs, ys = x[step.samples], y[step.samples]
            grad = xs.T @ (xs @ params["w"] - ys) / max(len(ys), 1)
            params["w"] -= 0.1 * job.allreduce({"w": grad})["w"]
        if trained == args.quit_after:
            break
    job.close()
    return {
        "finished": job.finished,
        "has_final_weights": job.has_final_weights,
        "saved": job.save(args.out / "final.npz"),
        "weights": params["w"].tolist(),
    }


def torch_route(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(4096, FEATURES), torch.randn(4096, 1))
    job = cohort.torch.ElasticJob(dataset=data)
    model = torch.nn.Linear(FEATURES, 1)
    model, sgd = job.wrap(model, torch.optim.SGD(model.parameters(), lr=0.01))
    epochs_done, pause = [], threading.Event()
    for epoch in job.epochs(args.epochs):
        for x, y in job.batches(DataLoader(data, batch_size=4)):
            torch.nn.functional.mse_loss(model(x), y).backward()
            sgd.step()
            sgd.zero_grad()
            pause.wait(0.01)  # a slow step: the test signals mid-epoch
        print(f"EPOCH_LOOP_ENDED interrupted={job.interrupted}", flush=True)
        if job.interrupted:
            break
        epochs_done.append(epoch)  # the per-epoch code: only for an epoch that ended
    return {
        "finished": job.finished,
        "interrupted": job.interrupted,
        "epochs_done": epochs_done,
        "has_final_weights": job.has_final_weights,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("route", choices=["numpy", "torch"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--hold-last-step", type=int)
    parser.add_argument("--quit-after", type=int)
    parser.add_argument("--epochs", type=int)
    args = parser.parse_args()
    report = numpy_route(args) if args.route == "numpy" else torch_route(args)
    print("END " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
