"""One GPU per process: which device each of a node's slots gets, decided from the node's GPUs.

Every process `cohort run` starts on a node (its N ranks, then its K spares) gets one device of
its own through `CUDA_VISIBLE_DEVICES`, so a spare promoted into a world never shares a GPU
with a rank of it (NCCL refuses: "Duplicate GPU detected"), and every process opens its
context on its own GPU only. A slot keeps its device for the run: the process that replaces
it gets the same one. A node without GPUs gives none, and its processes' environment is left
as it was. The node's devices are found by `cohort run` (an inherited `CUDA_VISIBLE_DEVICES`,
else NVML's devices, as UUIDs); this module only decides, so the tests give the facts.
"""

from __future__ import annotations

from dataclasses import dataclass

from cohort.errors import CohortError


class PlacementError(CohortError):
    """The node's GPUs cannot give each process one of its own; the message says what can."""


@dataclass(frozen=True)
class NodeGpus:
    """The devices this node's processes may use, one `CUDA_VISIBLE_DEVICES` entry each (an
    index, a GPU UUID or a MIG UUID), and where they come from, for messages."""

    devices: tuple[str, ...]
    source: str


def trainers_for(gpus: NodeGpus, spares: int) -> int:
    """`-n gpu`: the ranks that leave each of `spares` spares a GPU of its own (one per GPU
    where there are none), or PlacementError naming what the node has."""
    count = len(gpus.devices)
    if count == 0:
        raise PlacementError(
            f"-n gpu: this node has no GPU ({gpus.source}); give a number of ranks (-n 2)"
        )
    if spares >= count:
        raise PlacementError(
            f"-n gpu --spares {spares}: this node has {count} GPU(s) ({gpus.source}), one per "
            f"process: {spares} spare(s) leave none for a rank; keep at most {count - 1} "
            "spare(s)"
        )
    return count - spares


def place(gpus: NodeGpus, trainers: int, spares: int) -> tuple[str, ...]:
    """Each slot's `CUDA_VISIBLE_DEVICES` (slot i, the trainers' 0..N-1 then the spares',
    gets the i-th): () on a node without GPUs (nothing set), else PlacementError where the
    node has fewer GPUs than processes, naming the -n and --spares that fit."""
    if not gpus.devices:
        return ()
    count, wanted = len(gpus.devices), trainers + spares
    if wanted > count:
        fits_spares = min(spares, count - 1)
        raise PlacementError(
            f"-n {trainers} --spares {spares}: {wanted} processes need {wanted} GPUs, one "
            f"each; this node has {count} ({gpus.source}): give -n {count - fits_spares} "
            f"--spares {fits_spares}, or CUDA_VISIBLE_DEVICES= (empty) to run on the CPU"
        )
    return gpus.devices[:wanted]
