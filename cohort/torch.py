"""`cohort.torch`: PyTorch on cohort, for `import cohort.torch` and
`from cohort.torch import ElasticJob` (needs the `torch` extra).

The names live in cohort/worker/pytorch/api.py, which says what each is; `cohort.torch`
as an attribute of `cohort` is this same module.
"""

from __future__ import annotations

from cohort.worker.pytorch.api import (
    ElasticJob,
    LocalSGD,
    StateError,
    TorchState,
    broadcast_state,
    compressor,
    load_state_blob,
    load_state_tensors,
    params_of,
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
