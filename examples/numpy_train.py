"""Logistic regression on synthetic data, elastic, with numpy alone: run it with `cohort run`.

    cohort run -n 3 --epochs 4 examples/numpy_train.py

`cohort run` tells each copy its job and Redis through the environment; the job deals
every step's samples, averages the gradients over the ranks and keeps going when a rank
dies or joins. Each copy ends with one JSON line: its worker id, the steps it trained,
its last batch's loss and a digest of its weights (the same on every rank).
"""

from __future__ import annotations

import hashlib
import json

import numpy as np

import cohort

SAMPLES, FEATURES, LR = 4096, 16, 0.5


def data(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The same data set on every rank: points and the side of a hyperplane they lie on."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(SAMPLES, FEATURES))
    y = (x @ rng.normal(size=FEATURES) > 0).astype(np.float64)
    return x, y


def gradients(w: np.ndarray, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
    """The mean gradient and loss of the logistic loss over the batch (a rank may get an
    empty batch at an epoch's end: zero gradient, no loss)."""
    if len(y) == 0:
        return np.zeros_like(w), float("nan")
    p = 1.0 / (1.0 + np.exp(-(x @ w)))
    loss = -np.mean(y * np.log(p + 1e-12) + (1 - y) * np.log(1 - p + 1e-12))
    return x.T @ (p - y) / len(y), float(loss)


def main() -> None:
    x, y = data()
    job = cohort.NumpyElasticJob(dataset=cohort.Dataset(size=SAMPLES, fingerprint="numpy-lr"))
    params = job.wrap({"w": np.zeros(FEATURES)})
    loss = float("nan")
    for step in job.steps():
        with job.attempt(step):
            grad, batch_loss = gradients(params["w"], x[step.samples], y[step.samples])
            mean = job.allreduce({"w": grad})
            params["w"] -= LR * mean["w"]
            if batch_loss == batch_loss:  # not NaN: the rank had samples this step
                loss = batch_loss
                job.record(loss=loss)
    job.close()
    digest = hashlib.sha256(params["w"].tobytes()).hexdigest()[:16]
    print(json.dumps({"worker": job.worker.id, "steps": job.steps_done, "loss": loss,
                      "weights": digest}))  # fmt: skip


if __name__ == "__main__":
    main()
