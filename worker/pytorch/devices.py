"""The device a rank trains on, decided from what its process was given.

`cohort run` gives each of a node's processes (spares too) one GPU of its own through
`CUDA_VISIBLE_DEVICES`, so the process sees exactly one: `cuda:0`. Started otherwise (torchrun,
a scheduler's own launcher) a process may see every GPU of its node: it takes the one its local
rank names (`COHORT_LOCAL_RANK`, else torchrun's `LOCAL_RANK`), modulo their count. With no CUDA
device, the CPU. `choose` is the decision, kept free of torch so the tests drive it with the
facts faked.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


def choose(local: int | None, visible: int) -> int | None:
    """The CUDA index a rank opens among the `visible` devices its process sees: None without
    any, the local rank's modulo their count otherwise (0 for a process given one GPU)."""
    if visible <= 0:
        return None
    return (local or 0) % visible


def rank_device(local: int) -> torch.device:
    """The device the process of local rank `local` trains on (see the module doc)."""
    index = choose(local, torch.cuda.device_count())
    return torch.device("cpu") if index is None else torch.device("cuda", index)


def current(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Make `device` CUDA's current device in this thread for a while: a thread cohort starts
    (DDP's bucket agreement) inherits none, and CUDA's default, device 0, is another rank's
    where the process sees several GPUs. Nothing for other devices."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
