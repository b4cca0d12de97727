"""`cohort example-worker`: one worker of a real elastic training job (numpy MLP).

The loop is the one a user writes with `cohort.NumpyElasticJob`: wrap the parameters, walk
`job.steps()`, compute this rank's gradients on the step's samples, average them with
`job.allreduce`, apply. What makes it elastic lives in the job, not here:

- every new world starts from the weights the journal names (rank 0's, the initial ones,
  or a checkpoint rank 0 loads and checks against the journaled digest), broadcast;
- a step is applied only once its allreduce completed in its world, and a world change
  inside it (`job.attempt`) retries it in the new world: an aborted step leaves no trace;
- after every `--checkpoint-every` steps (and after the last) the worker the leader asks
  writes the weights in the background while training goes on;
- the job ends when the leader says it finished (`--max-steps`/`--epochs` of its
  coordinators), every worker with the same final weights;
- gradients travel as sums with the sample count, so unequal batches (the last steps
  of an epoch, re-split shards) still give the global batch's mean.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from cohort import mlp
from cohort.events.models import CheckpointSaved, Rewound
from cohort.worker.collective import tensors
from cohort.worker.errors import RemovedError
from cohort.worker.loop import checkpoints
from cohort.worker.loop.elastic import NumpyElasticJob

log = logging.getLogger("cohort.example")


def run(
    job: NumpyElasticJob,
    steps: int | None = None,
    lr: float = 0.2,
    seed: int = 0,
    pace: float = 0.0,
) -> dict[str, Any]:
    """Train until the job finishes (or until its step `steps - 1` committed, or stopped,
    or removed); then leave. Returns a summary with the final parameters.

    `steps` counts the job's steps, not this worker's: every worker still in the world
    stops after the same step, with the same weights. `pace` makes each step take at
    least that long, standing in for a larger model's compute.
    """
    params = job.wrap(mlp.init(seed))
    dataset = job.worker.view.dataset
    data = mlp.dataset(dataset.size if dataset is not None else 1)
    summary: dict[str, Any] = {
        "worker": job.worker.id,
        "steps": 0,
        "world_changes": 0,
        "loss": None,
        "accuracy": None,
        "removed": None,
        "finished": None,
    }

    def world_changed(old: int, new: int) -> None:
        summary["world_changes"] += old != 0

    job.on_world_change(world_changed)
    try:
        for step in job.steps():
            if steps is not None and step.step >= steps:
                break
            started = time.monotonic()
            with job.attempt(step):
                loss = _train(job, params, data, step.samples, lr)
                job.record(loss=loss)
                if pace:  # simulated compute
                    job.worker.stopping.wait(max(0.0, pace - (time.monotonic() - started)))
                summary["loss"] = loss
                if step.step % 20 == 0:
                    log.info("%s step %d loss %.4f", job.worker.id, step.step, loss)
    except RemovedError as exc:
        summary["removed"] = exc.reason
    finally:
        job.close()
    summary["steps"] = job.steps_done
    summary["finished"] = job.worker.view.finished
    return _finish(summary, params, data)


def _train(
    job: NumpyElasticJob, params: mlp.Params, data: mlp.Dataset, samples: np.ndarray, lr: float
) -> float:
    """One synchronous data-parallel step on this rank's `samples`, applied to `params` in
    place: the global mean loss. Raises WorldChangedError (nothing applied) if the world
    moved meanwhile."""
    x, y = data.take(samples)
    grads, loss, correct = mlp.gradients(params, x, y)
    stats = np.array([len(y), loss, correct], dtype=np.float64)
    mean = job.allreduce({**grads, "_stats": stats})
    count = float(mean["_stats"][0])  # the mean count over ranks: every sum divided alike
    if count == 0:
        return 0.0
    update = {k: mean[k] / count for k in grads}
    params.update(mlp.sgd(params, update, lr))
    return float(mean["_stats"][1] / count)


def _finish(summary: dict[str, Any], params: mlp.Params, data: mlp.Dataset) -> dict[str, Any]:
    loss, accuracy = mlp.evaluate(params, data)
    summary.update(
        loss=round(loss, 6),
        accuracy=round(accuracy, 4),
        weights_digest=mlp.digest(params),
        params=params,
    )
    return summary


def reference(facts: Any, lr: float = 0.2, seed: int = 0) -> mlp.Params:
    """The weights one process gets training on the committed global batches of the lineage
    the final model descends from.

    For each StepCommitted, in order, the global batch is the union of the ranks' batches
    (recomputed from the facts alone, each position mapped to its sample through the
    epoch's order, as the workers map them); its summed gradient over its size is applied. A
    rewind goes back to this process's own weights after the rewind's step, or, for a
    checkpoint from outside the lineage, to what the checkpoint file holds (from scratch:
    the initial weights).
    """
    from cohort.coordinator.audit import committed_batches

    params = mlp.init(seed)
    history: dict[int, mlp.Params] = {-1: params}
    indexed: set[str] = set()  # checkpoints this lineage wrote (its own weights are known)
    data: mlp.Dataset | None = None
    for fact, state, batches in committed_batches(facts):
        if isinstance(fact, CheckpointSaved):
            indexed.add(fact.uri)
        if isinstance(fact, Rewound):
            if fact.uri is None or fact.uri in indexed:
                params = history[fact.to_step]
            else:
                params = _load(fact.uri, fact.sha256)
            history = {s: p for s, p in history.items() if s <= fact.to_step}
            continue
        if batches is None:
            continue
        assert state.dataset is not None
        if data is None:
            data = mlp.dataset(state.dataset.size)
        order = state.order()
        x, y = data.take(order.samples(r for ranges in batches for r in ranges))
        if len(y):
            grads, _, _ = mlp.gradients(params, x, y)
            params = mlp.sgd(params, {k: g / len(y) for k, g in grads.items()}, lr)
        history[state.next_step] = params  # the committed step is the one after `state`
    return params


def _load(uri: str, sha256: str | None) -> mlp.Params:
    """The example's parameters from the checkpoint at `uri`."""
    payload = checkpoints.read(uri, sha256).payload
    return {k: np.array(v, dtype=np.float64) for k, v in tensors.unpack(payload).items()}
