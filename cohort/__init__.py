"""cohort: elastic data-parallel training coordinated through Redis Streams.

Everything a training script needs is here::

    import cohort

    conn = cohort.connect(cohort.RedisSettings.resolve())   # --redis-url / $COHORT_REDIS_URL
    worker = cohort.Worker(conn, "mnist")
    collective = cohort.Collective(conn, "mnist", worker)
    ...
    except cohort.WorldChangedError: ...

`cohort.checkpoints` writes and reads checkpoint files (through fsspec). `cohort.torch`
holds the PyTorch helpers (gradient averaging, state broadcast, local SGD) and
`cohort.Rendezvous` keeps torch.distributed with cohort as its membership service; both
need the `torch` extra and import torch only when first used. Names load on first use,
so `import cohort` (and the `cohort` command) stays quick.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cohort.events.connection import RedisSettings, connect
    from cohort.events.models import Dataset, Node
    from cohort.events.shards import Range, Shard
    from cohort.worker.collective.hierarchy import HierarchicalCollective
    from cohort.worker.collective.redis_collective import Collective
    from cohort.worker.errors import (
        ActivationTimeout,
        CollectiveError,
        CollectiveTimeout,
        CommitTimeout,
        JoinRefusedError,
        JoinTimeout,
        NotAssigned,
        RedisUnreachable,
        Removed,
        Stopped,
        WaitTimeout,
        WorkerError,
        WorldChangedError,
    )
    from cohort.worker.loop import checkpoints
    from cohort.worker.loop.elastic import ElasticJob
    from cohort.worker.loop.evaluator import Evaluator
    from cohort.worker.membership.client import Worker
    from cohort.worker.membership.view import Assignment, GpuAdvice
    from cohort.worker.pytorch import api as torch
    from cohort.worker.pytorch.dist import Rendezvous

__all__ = [
    "ActivationTimeout",
    "Assignment",
    "Collective",
    "CollectiveError",
    "CollectiveTimeout",
    "CommitTimeout",
    "Dataset",
    "ElasticJob",
    "Evaluator",
    "Finished",
    "GpuAdvice",
    "HierarchicalCollective",
    "JoinRefusedError",
    "JoinTimeout",
    "Node",
    "NotAssigned",
    "Range",
    "RedisSettings",
    "RedisUnreachable",
    "Removed",
    "Rendezvous",
    "Shard",
    "Stopped",
    "WaitTimeout",
    "Worker",
    "WorkerError",
    "WorldChangedError",
    "checkpoints",
    "connect",
    "torch",
]

_HOMES = {
    "RedisSettings": "cohort.events.connection",
    "connect": "cohort.events.connection",
    "Dataset": "cohort.events.models",
    "Node": "cohort.events.models",
    "Range": "cohort.events.shards",
    "Shard": "cohort.events.shards",
    "Worker": "cohort.worker.membership.client",
    "Collective": "cohort.worker.collective.redis_collective",
    "ElasticJob": "cohort.worker.loop.elastic",
    "Evaluator": "cohort.worker.loop.evaluator",
    "HierarchicalCollective": "cohort.worker.collective.hierarchy",
    "CollectiveError": "cohort.worker.errors",
    "CollectiveTimeout": "cohort.worker.errors",
    "ActivationTimeout": "cohort.worker.errors",
    "CommitTimeout": "cohort.worker.errors",
    "Finished": "cohort.worker.errors",
    "JoinRefusedError": "cohort.worker.errors",
    "JoinTimeout": "cohort.worker.errors",
    "NotAssigned": "cohort.worker.errors",
    "RedisUnreachable": "cohort.worker.errors",
    "Removed": "cohort.worker.errors",
    "Stopped": "cohort.worker.errors",
    "WaitTimeout": "cohort.worker.errors",
    "WorkerError": "cohort.worker.errors",
    "WorldChangedError": "cohort.worker.errors",
    "Assignment": "cohort.worker.membership.view",
    "GpuAdvice": "cohort.worker.membership.view",
    "Rendezvous": "cohort.worker.pytorch.dist",
}
_MODULES = {"torch": "cohort.worker.pytorch.api", "checkpoints": "cohort.worker.loop.checkpoints"}


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        value: Any = importlib.import_module(_MODULES[name])
    elif name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name]), name)
    else:
        raise AttributeError(f"module 'cohort' has no attribute {name!r}")
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
