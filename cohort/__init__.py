"""cohort: elastic data-parallel training coordinated through Redis Streams.

Everything a training script needs is here::

    import cohort

    job = cohort.torch.ElasticJob()            # PyTorch: the job, its data and its steps
    job = cohort.NumpyElasticJob("mnist")      # the same for a dict of numpy arrays

    conn = cohort.connect(cohort.RedisSettings.resolve())   # --redis-url / $COHORT_REDIS_URL
    worker = cohort.Worker(conn, "mnist")                    # membership alone
    collective = cohort.Collective(conn, "mnist", worker)    # allreduce through Redis
    ...
    except cohort.WorldChangedError: ...       # every cohort exception is a cohort.CohortError

`cohort.checkpoints` writes and reads checkpoint files (through fsspec). `cohort.torch`
holds the PyTorch helpers (gradient averaging, state broadcast, local SGD) and
`cohort.ElasticProcessGroup` keeps torch.distributed with cohort as its membership service;
both need the `torch` extra and import torch only when first used (without it, they raise
ModuleNotFoundError naming `pip install 'cohort-elastic[torch]'`, and `from cohort import *`
leaves them out). Names load on first use,
so `import cohort` (and the `cohort` command) stays quick.

The public names are listed three times, for three readers: the imports under
TYPE_CHECKING (type checkers and editors), `__all__` (`from cohort import *` and the
docs), and `_HOMES` (where each name loads from at run time).
tests/unit/test_public_api.py holds the three to the same names and modules.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from cohort.errors import torch_missing
from cohort.events.renames import warn_renamed

if TYPE_CHECKING:
    from cohort import torch as torch
    from cohort.events.connection import RedisSettings, connect
    from cohort.events.errors import (
        CohortError,
        InvalidValueError,
        RedisUnavailableError,
        SettingsError,
    )
    from cohort.events.keys import JobNameError
    from cohort.events.models import Dataset, Node
    from cohort.events.shards import Range, Shard
    from cohort.worker.collective.hierarchy import HierarchicalCollective
    from cohort.worker.collective.redis_collective import Collective
    from cohort.worker.errors import (
        AccumulationError,
        ActivationTimeoutError,
        BlobError,
        CollectiveError,
        CollectiveTimeoutError,
        CommitTimeoutError,
        CorruptDataError,
        Finished,
        IdentityMismatchError,
        JobFinishedError,
        JoinRefusedError,
        JoinTimeoutError,
        MemoryBudgetError,
        NotAssignedError,
        OutageTooLongError,
        RedisUnreachableError,
        RemovedError,
        RendezvousError,
        StateError,
        Stopped,
        WaitTimeoutError,
        WeightsRefusedError,
        WorkerError,
        WorldChangedError,
    )
    from cohort.worker.loop import checkpoints as checkpoints
    from cohort.worker.loop.checkpoints import CheckpointError
    from cohort.worker.loop.elastic import NumpyElasticJob
    from cohort.worker.loop.evaluator import Evaluator
    from cohort.worker.membership.client import Worker
    from cohort.worker.membership.view import Assignment, GpuAdvice
    from cohort.worker.pytorch.dist import ElasticProcessGroup

    ElasticJob = NumpyElasticJob  # deprecated: cohort.NumpyElasticJob
    Rendezvous = ElasticProcessGroup  # deprecated: cohort.ElasticProcessGroup

__all__ = [
    "AccumulationError",
    "ActivationTimeoutError",
    "Assignment",
    "BlobError",
    "CheckpointError",
    "CohortError",
    "Collective",
    "CollectiveError",
    "CollectiveTimeoutError",
    "CommitTimeoutError",
    "CorruptDataError",
    "Dataset",
    "ElasticProcessGroup",
    "Evaluator",
    "Finished",
    "GpuAdvice",
    "HierarchicalCollective",
    "IdentityMismatchError",
    "InvalidValueError",
    "JobFinishedError",
    "JobNameError",
    "JoinRefusedError",
    "JoinTimeoutError",
    "MemoryBudgetError",
    "Node",
    "NotAssignedError",
    "NumpyElasticJob",
    "OutageTooLongError",
    "Range",
    "RedisSettings",
    "RedisUnavailableError",
    "RedisUnreachableError",
    "RendezvousError",
    "RemovedError",
    "SettingsError",
    "Shard",
    "StateError",
    "Stopped",
    "WaitTimeoutError",
    "WeightsRefusedError",
    "Worker",
    "WorkerError",
    "WorldChangedError",
    "checkpoints",
    "connect",
    "torch",
]

_HOMES: dict[str, tuple[str, ...]] = {
    "cohort.events.connection": ("RedisSettings", "connect"),
    "cohort.events.errors": (
        "CohortError",
        "InvalidValueError",
        "RedisUnavailableError",
        "SettingsError",
    ),
    "cohort.events.keys": ("JobNameError",),
    "cohort.events.models": ("Dataset", "Node"),
    "cohort.events.shards": ("Range", "Shard"),
    "cohort.worker.collective.hierarchy": ("HierarchicalCollective",),
    "cohort.worker.collective.redis_collective": ("Collective",),
    "cohort.worker.errors": (
        "AccumulationError",
        "ActivationTimeoutError",
        "BlobError",
        "CollectiveError",
        "CollectiveTimeoutError",
        "CommitTimeoutError",
        "CorruptDataError",
        "Finished",
        "IdentityMismatchError",
        "JobFinishedError",
        "JoinRefusedError",
        "JoinTimeoutError",
        "MemoryBudgetError",
        "NotAssignedError",
        "OutageTooLongError",
        "RedisUnreachableError",
        "RendezvousError",
        "RemovedError",
        "StateError",
        "Stopped",
        "WaitTimeoutError",
        "WeightsRefusedError",
        "WorkerError",
        "WorldChangedError",
    ),
    "cohort.worker.loop.checkpoints": ("CheckpointError",),
    "cohort.worker.loop.elastic": ("NumpyElasticJob",),
    "cohort.worker.loop.evaluator": ("Evaluator",),
    "cohort.worker.membership.client": ("Worker",),
    "cohort.worker.membership.view": ("Assignment", "GpuAdvice"),
    "cohort.worker.pytorch.dist": ("ElasticProcessGroup",),
}
"""Where each public class and function loads from: module -> names."""

_MODULES = {"checkpoints": "cohort.worker.loop.checkpoints", "torch": "cohort.torch"}
"""Public names that are modules: name -> module."""

_NEEDS_TORCH = ("ElasticProcessGroup", "torch")
"""Public names that need the `torch` extra."""

if importlib.util.find_spec("torch") is None:  # `from cohort import *` works without torch
    __all__ = [name for name in __all__ if name not in _NEEDS_TORCH]

_DEPRECATED: dict[str, tuple[str, str]] = {
    "ElasticJob": ("NumpyElasticJob", " (a PyTorch script wants cohort.torch.ElasticJob)"),
    "Rendezvous": (
        "ElasticProcessGroup",
        " (it is not torchrun's rendezvous: it makes a torch.distributed process group for "
        "every world)",
    ),
    **{
        old: (f"{old}Error", "")
        for old in (
            "ActivationTimeout",
            "CollectiveTimeout",
            "CommitTimeout",
            "IdentityMismatch",
            "JoinTimeout",
            "NotAssigned",
            "OutageTooLong",
            "RedisUnavailable",
            "RedisUnreachable",
            "Removed",
            "WaitTimeout",
        )
    },
}
"""Old names that still work, with a DeprecationWarning naming the new one."""

_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}


def __getattr__(name: str) -> Any:
    if name in _DEPRECATED:
        new, why = _DEPRECATED[name]
        warn_renamed(f"cohort.{name}", f"cohort.{new}", why)
        return __getattr__(new)
    try:
        if name in _MODULES:
            value: Any = importlib.import_module(_MODULES[name])
        elif name in _HOME_OF:
            value = getattr(importlib.import_module(_HOME_OF[name]), name)
        else:
            raise AttributeError(f"module 'cohort' has no attribute {name!r}")
    except ModuleNotFoundError as exc:
        raise torch_missing(f"cohort.{name}", exc) from exc
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
