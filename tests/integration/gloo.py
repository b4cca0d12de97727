"""What the torch tests' reference programs share: examples/ loaded as modules, and a
two-rank gloo group over a TCPStore (the peer cohort is measured against)."""

from __future__ import annotations

import importlib.util
import os
import sys
from datetime import timedelta
from types import ModuleType
from typing import NoReturn

from tests.integration.cluster import ROOT


def load_example(name: str) -> ModuleType:
    """examples/NAME.py as a module (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def join_gloo(rank: int, port: int, world: int = 2, timeout: float = 60) -> None:
    """This process as `rank` of a gloo group whose TCPStore rank 0 hosts on `port`."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=timeout))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)


def leave_gloo() -> NoReturn:
    """Wait for every rank, then exit 0 at once: torch's C++ teardown at exit sometimes
    aborts ("terminate called without an active exception") when the other rank, which may
    host the store, is gone already, and the result is saved by now."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)
