"""One rank of a hierarchical allreduce, in a process of its own:
`python -m tests.integration.hier_rank URL JOB RANK HOSTS OUT MODE [MIB]`.

HOSTS names the host of every rank, comma-separated; MODE is `hier` or `flat` (the same
allreduce without the shared memory stage), or `bcast`: rank 1's tensors broadcast, then a
barrier, through the hierarchy. Prints `entered` before the call; the mean goes to
OUT (npz) and the call's seconds to stdout; a call a world change aborts exits 3."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass

import numpy as np

import cohort
from cohort.worker.collective.hierarchy import HierarchicalCollective
from cohort.worker.collective.redis_collective import Collective
from cohort.worker.errors import WorldChangedError
from cohort.worker.membership.view import Assignment

ABORTED = 3


@dataclass
class Rank:
    id: str
    rank: int
    world_size: int
    world_version: int = 1
    assignment: Assignment | None = None

    @property
    def ranks(self) -> tuple[str, ...]:
        return tuple(f"w{r}" for r in range(self.world_size))


def tensors(rank: int, mib: float) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(rank)
    big = max(1, int(mib * 2**20 / 4))
    return {
        "w": rng.normal(size=big).astype(np.float32),
        "b": rng.normal(size=(17, 3)),
    }


def main(url: str, job: str, rank: int, hosts: list[str], out: str, mode: str, mib: float) -> int:
    conn = cohort.connect(cohort.RedisSettings.resolve(url))
    me = Rank(f"w{rank}", rank, len(hosts))
    flat = Collective(conn, job, me)
    hier = HierarchicalCollective(flat, hosts=lambda: hosts)
    mine = tensors(rank, mib)
    print("entered", flush=True)
    started = time.perf_counter()
    try:
        if mode == "hier":
            result = hier.allreduce(mine, step=0, timeout=60)
        elif mode == "flat":
            result = flat.allreduce(mine, step=0, timeout=60)
        else:  # the hierarchy's broadcast from rank 1 (which leads no host), then a barrier
            result = hier.broadcast(mine if rank == 1 else None, root=1, step=1, timeout=60)
            hier.barrier(step=2, timeout=60)
        seconds = time.perf_counter() - started
    except WorldChangedError:
        print("aborted", flush=True)
        return ABORTED
    print(json.dumps({"seconds": seconds}), flush=True)
    np.savez(out, **result)
    return 0


if __name__ == "__main__":
    argv = sys.argv[1:]
    mib = float(argv[6]) if len(argv) > 6 else 0.01
    sys.exit(main(argv[0], argv[1], int(argv[2]), argv[3].split(","), argv[4], argv[5], mib))
