"""`cohort example-worker`: one worker of a real elastic training job (numpy MLP).

The loop a user writes: wait for a rank, take this rank's batch of the step,
compute gradients, average them with `allreduce`, apply them, report the step
and wait for it to commit. What makes it elastic:

- every new world starts with a `broadcast` of rank 0's weights (rank 0 is a
  survivor whenever one is left: survivors keep their ranks' order), so a
  joiner starts from exactly the survivors' weights; when no rank survived, the
  world names a checkpoint instead, which rank 0 loads first;
- after every `--checkpoint-every` steps the worker the leader asks writes the
  weights in the background (`CheckpointWriter`) while training goes on;
- the weights before a step are kept until the step commits; a step aborted by
  a world change is rolled back, so an aborted step leaves no trace;
- gradients travel as sums with the sample count, so unequal batches (the
  last steps of an epoch, re-split shards) still give the global batch's mean.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import numpy as np

from cohort.events.models import CheckpointSaved, Rewound
from cohort.worker import checkpoints, tensors
from cohort.worker.client import Worker
from cohort.worker.collective import Collective
from cohort.worker.errors import Removed, WaitTimeout, WorldChangedError
from cohort.worker.view import Assignment

from . import mlp

log = logging.getLogger("cohort.example")
POLL = 0.5


def train_step(
    params: mlp.Params,
    collective: Collective,
    data: mlp.Dataset,
    ranges: Any,
    step: int,
    lr: float,
    world: int | None = None,
) -> tuple[mlp.Params, float, int, int]:
    """One synchronous data-parallel step: (new params, global mean loss, samples, correct)."""
    x, y = data.take(ranges)
    grads, loss, correct = mlp.gradients(params, x, y)
    stats = np.array([len(y), loss, correct], dtype=np.float64)
    mean = collective.allreduce({**grads, "_stats": stats}, step, world=world)
    count = float(mean["_stats"][0])  # the mean count over ranks: every sum divided alike
    if count == 0:
        return params, 0.0, 0, 0
    update = {k: mean[k] / count for k in grads}
    total = mean["_stats"] / count
    return mlp.sgd(params, update, lr), float(total[1]), len(y), int(correct)


def run(
    worker: Worker,
    collective: Collective,
    steps: int,
    lr: float = 0.2,
    stop: threading.Event | None = None,
    seed: int = 0,
    pace: float = 0.0,
    join_timeout: float | None = None,
) -> dict[str, Any]:
    """Train until the job's step `steps - 1` committed (or stopped, or removed); then leave.

    `steps` counts the job's steps, not this worker's: every worker that is still in
    the world at the end stops after the same step, with the same weights. `pace` makes
    each step take at least that long, standing in for a larger model's compute. The join
    waits `join_timeout` s for a coordinator (None: until one answers, or `stop`).
    """
    stop = stop or worker.stopping
    worker.join(join_timeout, stop)
    config = worker.view.config
    assert config is not None, "the journal has no JobConfigured"
    data = mlp.dataset(config.dataset_size)
    params = mlp.init(seed)
    worker.ready(step=max(worker.view.last_committed, 0), digest=mlp.digest(params))
    summary: dict[str, Any] = {
        "worker": worker.id,
        "steps": 0,
        "world_changes": 0,
        "loss": None,
        "accuracy": None,
        "removed": None,
    }
    world = 0
    step = 0
    writer: checkpoints.CheckpointWriter | None = None
    lost_logged = False
    try:
        while worker.view.last_committed < steps - 1 and not stop.is_set():
            try:
                assignment = worker.wait_active(POLL)
            except WaitTimeout:
                lost = worker.view.weights_lost
                if lost is not None and not lost_logged:
                    log.warning(
                        "%s waits: the weights of step %d are lost (no member held them, no "
                        "checkpoint existed); continue with `cohort resume --job %s`",
                        worker.id,
                        lost,
                        worker.job,
                    )
                lost_logged = lost is not None
                continue
            if assignment.world_version != world:
                try:
                    params = _sync(collective, _start(params, assignment, seed), assignment)
                except WorldChangedError:
                    continue
                summary["world_changes"] += world != 0
                world = assignment.world_version
                step = assignment.start_step
            step = max(step, worker.next_step)
            before = params
            started = time.monotonic()
            try:
                params, loss, samples, _ = train_step(
                    params, collective, data, worker.batch(step), step, lr, world
                )
            except WorldChangedError:
                continue  # aborted before anything was applied
            if pace:
                stop.wait(max(0.0, pace - (time.monotonic() - started)))  # simulated compute
            worker.step_done(
                step,
                step_time=time.monotonic() - started,
                samples=samples,
                digest=mlp.digest(params),
                loss=loss,
            )
            if not worker.committed(step, stop):
                params = before  # the step was aborted: undo it
                continue
            request = checkpoints.pending(worker.view.requested, step)
            if request is not None:
                writer = writer or checkpoints.CheckpointWriter(worker)
                writer.submit(request, checkpoints.tensors_payload(params), mlp.digest(params))
            summary["steps"] += 1
            summary["loss"] = loss
            if step % 20 == 0:
                log.info("%s step %d loss %.4f", worker.id, step, loss)
            step += 1
    except Removed as exc:
        summary["removed"] = exc.reason
        worker.stop()
        return _finish(summary, params, data)
    finally:
        if writer is not None:
            writer.close()
    worker.leave(reason="done" if worker.view.last_committed >= steps - 1 else "stopped")
    return _finish(summary, params, data)


def _start(params: mlp.Params, assignment: Assignment, seed: int) -> mlp.Params:
    """The weights rank 0 brings to a new world: its own (a survivor holds the last
    committed ones), the initial ones, or the checkpoint the world names."""
    weights = assignment.weights
    if assignment.rank != 0 or weights is None or weights.source == "rank":
        return params
    if weights.source == "initial":
        return mlp.init(seed)
    assert weights.uri is not None
    params = _load(weights.uri, weights.sha256)
    if weights.digest is not None and mlp.digest(params) != weights.digest:
        raise checkpoints.CheckpointError(
            f"checkpoint {weights.uri!r} holds weights {mlp.digest(params)}, not the "
            f"journaled {weights.digest}"
        )
    log.info("rank 0 loaded the weights of step %d from %s", weights.step, weights.uri)
    return params


def _sync(collective: Collective, params: mlp.Params, assignment: Assignment) -> mlp.Params:
    """At the start of a world every rank takes rank 0's weights."""
    mine = params if assignment.rank == 0 else None
    got = collective.broadcast(
        mine, root=0, step=assignment.start_step, world=assignment.world_version
    )
    return {k: np.array(v, dtype=np.float64) for k, v in got.items()}


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
    (recomputed from the facts alone); its summed gradient over its size is applied. A
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
        if data is None:
            assert state.config is not None
            data = mlp.dataset(state.config.dataset_size)
        x, y = data.take(tuple(r for ranges in batches for r in ranges))
        if len(y):
            grads, _, _ = mlp.gradients(params, x, y)
            params = mlp.sgd(params, {k: g / len(y) for k, g in grads.items()}, lr)
        history[state.next_step] = params  # the committed step is the one after `state`
    return params


def _load(uri: str, sha256: str | None) -> mlp.Params:
    """The example's parameters from the checkpoint at `uri`."""
    payload = checkpoints.read(uri, sha256).payload
    return {k: np.array(v, dtype=np.float64) for k, v in tensors.unpack(payload).items()}
