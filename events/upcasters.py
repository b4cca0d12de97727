"""Old event versions, lifted to the current one before validation.

Each upcaster turns the dict of (type, v) into the dict of (type, v + 1); they
chain, so an entry written by any older producer reaches today's model. Every
upcaster has a stored fixture of the old version in tests/fixtures/events.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Body = dict[str, Any]
Upcaster = Callable[[Body], Body]

UPCASTERS: dict[tuple[str, int], Upcaster] = {}
UPCASTED: set[str] = set()
"""The types some upcaster applies to: a body of any other type is current as it is."""


def upcaster(type_: str, from_v: int) -> Callable[[Upcaster], Upcaster]:
    def register(fn: Upcaster) -> Upcaster:
        UPCASTERS[(type_, from_v)] = fn
        UPCASTED.add(type_)
        return fn

    return register


@upcaster("Join", 1)
def _join_name_became_worker(body: Body) -> Body:
    rest = {k: v for k, v in body.items() if k != "name"}
    return {**rest, "worker": body.get("name")}


@upcaster("Heartbeat", 1)
def _heartbeat_gained_progress(body: Body) -> Body:
    return {**body, "step": None, "world": None}


@upcaster("WorldChanged", 1)
def _world_gained_weights(body: Body) -> Body:
    return {**body, "weights": None}


@upcaster("JobConfigured", 1)
def _config_gained_shuffle(body: Body) -> Body:
    """A v1 job's epochs ran in index order: it keeps that meaning (today's default shuffles)."""
    config = body.get("config")
    if not isinstance(config, dict):
        return body  # validation refuses it as it is
    return {**body, "config": {**config, "shuffle": False}}


@upcaster("Join", 2)
@upcaster("WorkerJoined", 1)
def _node_and_dataset_unsaid(body: Body) -> Body:
    """Joins before v3 described no machine and declared no dataset (both default to None)."""
    return body


@upcaster("WorkerJoined", 2)
def _joined_as_a_trainer(body: Body) -> Body:
    """Members before v3 had no role in the journal: they read as trainers (the default),
    as the leader that journaled them treated them."""
    return body


@upcaster("Join", 3)
@upcaster("WorkerJoined", 3)
def _joined_as_no_spare(body: Body) -> Body:
    """Members before v4 were never spares (the default): each was ranked once ready."""
    return body


@upcaster("JobConfigured", 2)
def _config_gained_placement(body: Body) -> Body:
    """A v2 config dealt contiguously with no global batch (today's defaults for the new
    fields), and one that left out its dataset size meant v2's default of 60000 (today's
    None would wait for a worker to declare one)."""
    config = body.get("config")
    if not isinstance(config, dict) or "dataset_size" in config:
        return body
    return {**body, "config": {**config, "dataset_size": 60_000}}


@upcaster("StepDone", 1)
def _step_reported_no_metrics(body: Body) -> Body:
    """Reports before v2 carried no named figures besides the loss (None: none)."""
    return body


@upcaster("JobConfigured", 3)
def _config_gained_disconnect_grace(body: Body) -> Body:
    """A v3 job's workers did not show their connections: silence alone failed them."""
    config = body.get("config")
    if not isinstance(config, dict):
        return body
    return {**body, "config": {**config, "disconnect_grace": 0.0}}


@upcaster("JobConfigured", 4)
def _config_gained_start_workers(body: Body) -> Body:
    """A v4 job's first world started once `min_workers` were ready (start_workers None)."""
    return body


@upcaster("JobConfigured", 5)
def _config_gained_reduction(body: Body) -> Body:
    """A v5 job summed its gradients in floating point, and dealt a strided step item by
    item: reduction "float"."""
    config = body.get("config")
    if not isinstance(config, dict):
        return body
    return {**body, "config": {**config, "reduction": "float"}}


@upcaster("JobConfigured", 6)
def _config_gained_shard_group(body: Body) -> Body:
    """A v6 job's leader knew no shard groups: survivors closed up in rank order (None)."""
    return body


@upcaster("WorkerFailed", 1)
def _failure_was_silence(body: Body) -> Body:
    """Every failure before v2 was a silence of `timeout` s (the default cause)."""
    return body


def upcast(body: Body) -> Body:
    """Apply every upcaster from the body's version up to the newest one known."""
    type_, v = body.get("type"), body.get("v", 1)
    while isinstance(type_, str) and isinstance(v, int) and (type_, v) in UPCASTERS:
        body = {**UPCASTERS[(type_, v)](body), "v": v + 1}
        v += 1
    return body
