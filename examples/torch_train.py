"""An elastic PyTorch training loop on cohort (CPU): an MLP on synthetic data.

    pip install -e '.[torch]'
    cohort coordinator --job torch-demo --min-workers 2 --dataset-size 4096 --batch-size 32 &
    python examples/torch_train.py --job torch-demo --steps 200 &   # start 2 or more
    python examples/torch_train.py --job torch-demo --steps 200

What makes it elastic (as cohort/example.py for numpy):

- every new world starts with `broadcast_state` of rank 0's model and optimizer, so a
  joiner (or a survivor) continues from exactly the same weights and momentum; when no
  rank survived, rank 0 first loads the checkpoint the world names;
- after every `--checkpoint-every` steps the worker the coordinator asks writes the model,
  optimizer and RNG state in the background (with `--checkpoint-uri` on the coordinator);
- the state before a step is kept until the step commits; a step aborted by a world change
  (a peer failed or joined) is rolled back;
- gradients are averaged over the ranks by `sync_gradients` through Redis, as DDP would.

Kill a worker (`kill -9`): the others raise WorldChangedError within a second of the
coordinator's decision and continue in the new world; start another: it joins at a step.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import cohort

log = logging.getLogger("cohort.torch_train")
POLL = 0.5
FEATURES, HIDDEN, CLASSES = 16, 64, 4


class Data:
    """A fixed synthetic classification set: labels of a random teacher network."""

    def __init__(self, size: int, seed: int = 1234) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, FEATURES, generator=gen)
        teacher = torch.randn(FEATURES, CLASSES, generator=gen)
        self.y = (self.x @ teacher).argmax(dim=1)

    def take(self, samples: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The inputs and labels of `samples` (ids: a step's `worker.samples(step)`)."""
        index = torch.as_tensor(samples, dtype=torch.long)
        return self.x[index], self.y[index]


def build(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, CLASSES)
    )


def optimizer_for(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of this rank's batch (0 for an empty batch, e.g. an epoch's end)."""
    if len(y) == 0:
        return sum(p.sum() for p in model.parameters()) * 0.0  # type: ignore[return-value]
    return torch.nn.functional.cross_entropy(model(x), y)


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    collective: cohort.Collective,
    data: Data,
    samples: Any,
    step: int,
    world: int | None = None,
) -> float:
    """One synchronous data-parallel step on this rank's `samples`; this rank's loss."""
    x, y = data.take(samples)
    optimizer.zero_grad()
    loss = loss_of(model, x, y)
    loss.backward()
    # the mean gradient, as DDP; refused if the worker moved to a world it has not synced
    cohort.torch.sync_gradients(model, collective, step, world=world)
    optimizer.step()
    return float(loss)


def run(
    worker: cohort.Worker,
    collective: cohort.Collective,
    steps: int,
    lr: float = 0.05,
    seed: int = 0,
    stop: threading.Event | None = None,
) -> tuple[dict[str, Any], torch.nn.Module]:
    """Train until the job's step `steps - 1` committed (or stopped, or removed); then leave."""
    stop = stop or worker.stopping
    worker.join()
    config = worker.view.config
    assert config is not None, "the journal has no JobConfigured"
    data = Data(config.dataset_size)
    model = build(seed)
    optimizer = optimizer_for(model, lr)
    worker.ready(step=max(worker.view.last_committed, 0))
    summary: dict[str, Any] = {"worker": worker.id, "steps": 0, "world_changes": 0, "loss": None}
    world = step = 0
    writer: cohort.checkpoints.CheckpointWriter | None = None
    try:
        while worker.view.last_committed < steps - 1 and not stop.is_set():
            try:
                assignment = worker.wait_active(POLL)
            except cohort.WaitTimeoutError:
                continue
            if assignment.world_version != world:  # a new world: everyone takes rank 0's state
                try:
                    bring_weights(model, optimizer, assignment, seed, lr)
                    cohort.torch.broadcast_state(
                        model,
                        optimizer,
                        collective,
                        assignment.start_step,
                        world=assignment.world_version,
                    )
                except cohort.WorldChangedError:
                    continue
                summary["world_changes"] += world != 0
                world, step = assignment.world_version, assignment.start_step
            step = max(step, worker.next_step)
            before = (copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()))
            started = time.monotonic()
            try:
                loss = train_step(
                    model, optimizer, collective, data, worker.samples(step), step, world
                )
            except cohort.WorldChangedError:
                rollback(model, optimizer, before)
                continue
            worker.step_done(step, step_time=time.monotonic() - started, loss=loss)
            if not worker.committed(step, stop):
                rollback(model, optimizer, before)
                continue
            request = cohort.checkpoints.pending(worker.view.requested, step)
            if request is not None:  # the state is copied now, written in the background
                blob = cohort.torch.state_blob(model, optimizer, {"rng": torch.get_rng_state()})
                writer = writer or cohort.checkpoints.CheckpointWriter(worker)
                writer.submit(request, functools.partial(bytes, blob), None)
            summary["steps"] += 1
            summary["loss"] = round(loss, 6)
            if step % 20 == 0:
                log.info("%s step %d loss %.4f", worker.id, step, loss)
            step += 1
    except cohort.RemovedError as exc:
        summary["removed"] = exc.reason
        worker.stop()
        return summary, model
    finally:
        if writer is not None:
            writer.close()
    worker.leave(reason="done" if worker.view.last_committed >= steps - 1 else "stopped")
    return summary, model


def bring_weights(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    assignment: cohort.Assignment,
    seed: int,
    lr: float,
) -> None:
    """Rank 0's part of a world start: keep its state (a survivor's), start over from the
    initial weights, or load the checkpoint the world names."""
    weights = assignment.weights
    if assignment.rank != 0 or weights is None or weights.source == "rank":
        return
    if weights.source == "initial":
        model.load_state_dict(build(seed).state_dict())
        optimizer.load_state_dict(optimizer_for(model, lr).state_dict())
        return
    assert weights.uri is not None
    saved = cohort.checkpoints.read(weights.uri, weights.sha256)
    extra = cohort.torch.load_state_blob(model, optimizer, saved.payload)
    torch.set_rng_state(extra["rng"])
    log.info("rank 0 loaded the state of step %d from %s", saved.step, weights.uri)


def rollback(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: Any) -> None:
    model.load_state_dict(state[0])
    optimizer.load_state_dict(state[1])


def params_of(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {name: p.detach().numpy().copy() for name, p in model.named_parameters()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--redis-url", default=os.environ.get("COHORT_REDIS_URL"))
    parser.add_argument("--job", default=os.environ.get("COHORT_JOB"), required=False)
    parser.add_argument("--id", default=None, help="worker id (default host-pid-random)")
    parser.add_argument("--steps", type=int, default=200, help="train until the job's step N-1")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--save", type=Path, help="write the final parameters here (.npz)")
    args = parser.parse_args(argv)
    if not args.job:
        parser.error("--job (or COHORT_JOB) is required")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    conn = cohort.connect(cohort.RedisSettings.resolve(args.redis_url))
    worker = cohort.Worker(conn, args.job, worker_id=args.id)
    worker.install_signal_handlers()
    summary, model = run(
        worker, cohort.Collective(conn, args.job, worker), args.steps, args.lr, args.seed
    )
    if args.save:
        np.savez(args.save, **params_of(model))
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
