"""A world's state from rank 0 to every rank through its process group
(worker/pytorch/handover.py): real gloo groups of forked processes, the watchdog's guard
stood in for by plain waits."""

from __future__ import annotations

import multiprocessing
import os
import traceback
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("CI") == "true":
    import torch  # CI installs torch's CPU build: a missing torch must fail, not skip
else:
    torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

from cohort.worker.pytorch.completion import HostCompletion  # noqa: E402
from cohort.worker.pytorch.elastic import TorchState  # noqa: E402
from cohort.worker.pytorch.handover import ALIGN, Entry, Handover, buckets  # noqa: E402


def entry(path: str, numel: int, dtype: torch.dtype = torch.float32) -> Entry:
    return Entry(path, dtype, (numel,), "cpu")


def test_buckets_keep_the_order_stay_under_the_limit_and_a_bigger_tensor_goes_alone() -> None:
    items = [entry("a", 10), entry("b", 300), entry("c", 3), entry("d", 0), entry("e", 5)]
    got = [[e.path for e in bucket] for bucket in buckets(items, limit=256)]
    assert got == [["a"], ["b"], ["c", "e"]]  # 48 B; 1200 B alone; d has no bytes


def test_every_place_in_a_bucket_is_aligned_for_any_dtype() -> None:
    assert entry("x", 3, torch.bfloat16).nbytes == 6
    assert ALIGN % torch.float64.itemsize == 0


class PlainRdzv:
    """The world's guarded waits without a watchdog: the data is there once they return."""

    def wait(self, work: Any, step: int) -> None:
        work.wait()

    def fence(self, works: Any, completion: Any, step: int) -> None:
        completion.fence(works)


def trained_state(seed: int) -> tuple[TorchState, dict[str, Any]]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 40), torch.nn.BatchNorm1d(40), torch.nn.Linear(40, 2)
    ).to(torch.float32)
    model[2].to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    extra: dict[str, Any] = {"epoch": seed, "mask": torch.rand(7) > 0.5, "ema": torch.randn(3)}
    for _ in range(seed):
        optimizer.zero_grad()
        out = model[:2](torch.randn(8, 6))
        model[2](out.to(torch.bfloat16)).float().sum().backward()
        optimizer.step()
        scheduler.step()
    return TorchState(model, optimizer, scheduler, extra), extra


def handed_over(rank: int, size: int, store: str, limit: int, out: Any) -> None:
    try:
        dist.init_process_group(
            "gloo", store=dist.FileStore(store, size), rank=rank, world_size=size
        )
        state, extra = trained_state(3 if rank == 0 else 1 + rank * 10)
        handover = Handover(PlainRdzv(), torch.device("cpu"), torch.device("cpu"),
                            HostCompletion(), step=5)  # fmt: skip
        handover.limit = limit
        state.spread(handover, chief=rank == 0)
        out.put((rank, state.digest(), state.snapshot(), torch.rand(4).tolist(),
                 extra["epoch"], extra["mask"].tolist()))  # fmt: skip
        dist.destroy_process_group()
    except Exception:
        out.put((rank, traceback.format_exc()))


@pytest.mark.parametrize("limit", [64 * 1024 * 1024, 512])
def test_every_rank_ends_with_rank_0s_whole_state(tmp_path: Path, limit: int) -> None:
    """Weights, buffers, AdamW's moments and step counts, the scheduler, the RNG and the
    script's extra (a bool mask, a counter), bf16 beside fp32; in one bucket, and in many
    (a tensor bigger than the bucket received in place)."""
    context = multiprocessing.get_context("spawn")  # a fork of a process that ran torch can hang
    out = context.Queue()
    size = 3
    ranks = [
        context.Process(target=handed_over, args=(r, size, str(tmp_path / "store"), limit, out))
        for r in range(size)
    ]
    for process in ranks:
        process.start()
    results = dict((row[0], row[1:]) for row in (out.get(timeout=120) for _ in ranks))
    for process in ranks:
        process.join(30)
    for rank, row in results.items():
        assert len(row) > 1, f"rank {rank} failed:\n{row[0]}"
    for rank in range(1, size):
        assert results[rank] == results[0]  # digest, whole snapshot, next draws, extra
    assert results[1][3] == 3  # rank 0's epoch counter
