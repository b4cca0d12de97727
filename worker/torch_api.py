"""`cohort.torch`: PyTorch on cohort (needs the `torch` extra; imported on first use).

`ElasticJob` is the loop most scripts want (cohort/worker/torch_elastic.py). The pieces
it is made of stay public for loops that need their own shape (cohort/worker/torch_sync.py):
gradient averaging (exact or compressed: `compressor`), state broadcast and blobs, local
SGD / DiLoCo.
"""

from __future__ import annotations

from .feedback import compressor
from .torch_elastic import ElasticJob, TorchState, params_of
from .torch_sync import (
    LocalSGD,
    StateError,
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
    "broadcast_state",
    "compressor",
    "load_state_blob",
    "load_state_tensors",
    "params_of",
    "state_blob",
    "state_tensors",
    "sync_gradients",
]
