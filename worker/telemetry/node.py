"""What a worker says of its machine when it joins (events.models.Node).

The host is the machine's name; the zone and region come from $COHORT_ZONE and
$COHORT_REGION (as a scheduler or a cloud's metadata would set them), the data read rate
from $COHORT_BANDWIDTH (bytes per second), the GPUs from NVML when it is there. What the
caller passes wins over all of it: `this_node(files=..., locality=...)` is how a worker says
which of the dataset's files its node holds.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterable, Mapping

from cohort.events.models import Node
from cohort.worker.errors import WorkerError
from cohort.worker.telemetry import gpu
from cohort.worker.telemetry.gpu import GpuProbe

ZONE_ENV, REGION_ENV, BANDWIDTH_ENV = "COHORT_ZONE", "COHORT_REGION", "COHORT_BANDWIDTH"


def probed_node(probe: GpuProbe | None, log: logging.Logger) -> Node:
    """This machine as a Node, its GPUs read with `probe`, or with a probe opened (and
    closed) here when none is given."""
    own = probe or gpu.probe(log)
    try:
        return this_node(own)
    finally:
        if own is not probe:
            own.close()


def this_node(
    probe: GpuProbe | None = None,
    env: Mapping[str, str] | None = None,
    files: Iterable[int] | Iterable[tuple[int, int]] = (),
    **given: object,
) -> Node:
    """This machine as a Node: its host, zone, region, GPUs (from `probe`), bandwidth, and
    the dataset files it holds (indices or half-open ranges of them)."""
    env = os.environ if env is None else env
    fields: dict[str, object] = {
        "host": socket.gethostname()[:255],
        "zone": env.get(ZONE_ENV, ""),
        "region": env.get(REGION_ENV, ""),
        "bandwidth": _bandwidth(env.get(BANDWIDTH_ENV, "")),
        "files": ranges_of(files),
    }
    if probe is not None and probe.available:
        devices = probe.sample()
        fields["gpus"] = len(devices)
        fields["gpu_memory"] = sum(d.memory_total for d in devices)
    fields.update(given)
    try:
        return Node(**fields)  # type: ignore[arg-type]
    except ValueError as exc:
        raise WorkerError(f"this node's description is not valid: {exc}") from None


def ranges_of(files: Iterable[int] | Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """File indices (or ranges of them) as sorted half-open ranges, runs joined."""
    indices: set[int] = set()
    for item in files:
        if isinstance(item, tuple):
            indices.update(range(item[0], item[1]))
        else:
            indices.add(int(item))
    out: list[tuple[int, int]] = []
    for index in sorted(indices):
        if out and out[-1][1] == index:
            out[-1] = (out[-1][0], index + 1)
        else:
            out.append((index, index + 1))
    return tuple(out)


def _bandwidth(text: str) -> int:
    if not text:
        return 0
    try:
        value = int(float(text))
    except ValueError:
        value = -1
    if value < 0:
        raise WorkerError(
            f"${BANDWIDTH_ENV}={text!r} is not a number of bytes per second; unset it or "
            "give one such as 1e9"
        )
    return value
