"""A script that asks the job who it is, as a user's does: its rank, world, step and epoch
inside and between its loops, and saves the final model once (run by `cohort run`).

    python whoami_script.py numpy|torch OUT_DIR

Prints one JSON line of what it saw; OUT_DIR/final.npz (numpy) or final.pt (torch) is
written by the chief of the final world alone.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

import cohort

SAMPLES, FEATURES, VALIDATION = 256, 4, 50


def seen(job: Any) -> dict[str, Any]:
    return {
        "rank": job.rank, "world_size": job.world_size, "is_chief": job.is_chief,
        "step": job.step, "epoch": job.epoch,
    }  # fmt: skip


def numpy_route(out: Path) -> tuple[Any, dict[str, Any]]:
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(SAMPLES, FEATURES)), rng.normal(size=SAMPLES)
    job = cohort.NumpyElasticJob(dataset=cohort.Dataset(size=SAMPLES, fingerprint="whoami"))
    params = job.wrap({"w": np.zeros(FEATURES)})
    report: dict[str, Any] = {"before": seen(job), "agree": True, "trained": [], "given": []}
    for step in job.steps():
        report["given"].append(step.step)
        with job.attempt(step):
            mine = [step.step, step.rank, step.world_size, step.epoch]
            report["agree"] &= mine == [job.step, job.rank, job.world_size, job.epoch]
            xs, ys = x[step.samples], y[step.samples]
            grad = xs.T @ (xs @ params["w"] - ys) / max(len(ys), 1)
            params["w"] -= 0.1 * job.allreduce({"w": grad})["w"]
            report["trained"].append(step.step)
    job.close()
    report["after"] = seen(job)
    report["saved"] = job.save(out / "final.npz")
    report["weights"] = params["w"].tolist()
    return job, report


def torch_route(out: Path) -> tuple[Any, dict[str, Any]]:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(SAMPLES, FEATURES), torch.randn(SAMPLES, 1))
    job = cohort.torch.ElasticJob(dataset=data)
    model = torch.nn.Linear(FEATURES, 1)
    model, sgd = job.wrap(model, torch.optim.SGD(model.parameters(), lr=0.05))
    report: dict[str, Any] = {"before": seen(job), "agree": True, "epochs": [], "trained": []}
    report["given"], report["validations"] = [], []
    for epoch in job.epochs():
        for x, y in job.batches(DataLoader(data, batch_size=8)):
            report["given"].append(job.step)
            report["agree"] &= job.epoch == epoch and job.rank is not None
            loss = torch.nn.functional.mse_loss(model(x), y)
            sgd.zero_grad()
            loss.backward()
            sgd.step()
            if not job.aborted:
                report["trained"].append(job.step)
        report["epochs"].append([epoch, seen(job)])  # after the epoch's loop: that epoch's
        report["validations"].append(validate(job))
    report["after"] = seen(job)
    report["process_group"] = torch.distributed.is_initialized()  # the job closed: destroyed
    report["saved"] = job.save(out / "final.pt")
    report["weights"] = [p.detach().flatten().tolist() for p in model.parameters()]
    return job, report


def validate(job: Any) -> dict[str, Any]:
    """A validation set of VALIDATION samples sharded over the world, the findings
    reduced: every rank must see every sample counted once."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    mine = job.shard(DataLoader(TensorDataset(torch.arange(VALIDATION)), batch_size=7))
    ids = [int(i) for (batch,) in mine for i in batch]
    return {
        "count": job.sum(len(ids)), "ids": job.sum(torch.tensor(sum(ids))).item(),
        "top": job.max(float(max(ids))), "ranks": job.mean(float(job.rank)),
        "world_size": job.world_size,
    }  # fmt: skip


def main() -> None:
    route, out = sys.argv[1], Path(sys.argv[2])
    job, report = numpy_route(out) if route == "numpy" else torch_route(out)
    report.update(worker_id=job.worker_id, local_rank=job.local_rank)
    print("WHOAMI " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
