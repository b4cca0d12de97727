"""`cohort.torch`: PyTorch on cohort (needs the `torch` extra; imported on first use).

`ElasticJob` is the loop most scripts want (cohort/worker/pytorch/elastic.py). The pieces
it is made of stay public for loops that need their own shape (cohort/worker/pytorch/sync.py):
gradient averaging (exact or compressed: `compressor`), `allreduce` of tensors on any
device, state broadcast and blobs, local
SGD / DiLoCo.
"""

from __future__ import annotations

from cohort.worker.collective.compressors import compressor
from cohort.worker.pytorch.elastic import ElasticJob, TorchState, params_of
from cohort.worker.pytorch.sync import (
    LocalSGD,
    StateError,
    allreduce,
    broadcast_state,
    load_state_blob,
    load_state_tensors,
    state_blob,
    state_tensors,
    sync_gradients,
)

__all__ = [
    "ElasticJob",
    "LocalSGD",
    "StateError",
    "TorchState",
    "allreduce",
    "broadcast_state",
    "compressor",
    "load_state_blob",
    "load_state_tensors",
    "params_of",
    "state_blob",
    "state_tensors",
    "sync_gradients",
]
