"""The ranks of a shard group agree, as a backward ends, whether its step was cut short
(worker/pytorch/sharded.py `GuardedComms.agree`). With HSDP a rank whose replica peer died
aborts its step while its shard-group peers' all-reduces held; a peer that went on to the
script's clip alone (DTensor's norm, a collective over the shard group) would wait there
for a rank that never comes, then raise: in a bench run both ranks of the intact group
died of it and the job lost its weights. Two ranks here are two threads of this process,
each with a gloo group of its own over one store."""

from __future__ import annotations

import datetime
import os
import threading
from collections.abc import Callable
from typing import Any

import pytest

if os.environ.get("CI") == "true":
    import torch  # CI installs torch's CPU build: a missing torch must fail, not skip
else:
    torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

from cohort.worker.errors import WorldChangedError  # noqa: E402
from cohort.worker.pytorch.sharded import GuardedComms  # noqa: E402


class Rendezvous:
    """What GuardedComms asks of a world: its watchdog's state, and a wait for a work that
    says WorldChangedError where the work fails (as `ElasticProcessGroup.fence` does once
    the journal explains the failure)."""

    def __init__(self) -> None:
        self.watchdog = type("Watchdog", (), {"tripped": threading.Event()})()

    def track(self, work: Any) -> None:
        pass

    def fence(self, works: list[Any], completion: Any, step: int) -> None:
        try:
            for work in works:
                work.wait()
        except RuntimeError as exc:
            raise WorldChangedError(step, None) from exc


def each_rank(ranks: int, body: Callable[[int, Any], bool], timeout_s: float = 30) -> list[bool]:
    """`body(rank, group)` on `ranks` threads, each with a gloo group over one store."""
    store = dist.HashStore()
    results: list[bool | None] = [None] * ranks

    def run(rank: int) -> None:
        group = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=2))
        results[rank] = body(rank, group)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
    assert all(result is not None for result in results), "a rank did not finish"
    return [bool(result) for result in results]


def comms(aborted: bool) -> GuardedComms:
    guard = GuardedComms(Rendezvous(), lambda: True, lambda: 7)
    guard.begin()
    guard.aborted = aborted
    return guard


def test_one_rank_cut_short_makes_the_whole_shard_group_drop_the_step() -> None:
    def body(rank: int, group: Any) -> bool:
        guard = comms(aborted=rank == 0)
        guard.agree(group)
        return guard.aborted

    assert each_rank(2, body) == [True, True]


def test_a_shard_group_whose_collectives_all_held_keeps_its_step() -> None:
    def body(rank: int, group: Any) -> bool:
        guard = comms(aborted=False)
        guard.agree(group)
        return guard.aborted

    assert each_rank(2, body) == [False, False]


def test_a_rank_whose_shard_group_peer_is_gone_drops_the_step() -> None:
    """Rank 1 never comes (it died): rank 0's agreement breaks, and it aborts rather than
    go on to a clip that would wait for rank 1."""

    def body(rank: int, group: Any) -> bool:
        if rank == 1:
            return True  # gone before the backward's end
        guard = comms(aborted=False)
        guard.agree(group)
        return guard.aborted

    assert each_rank(2, body) == [True, True]


def test_a_world_known_to_be_over_aborts_without_asking() -> None:
    guard = comms(aborted=False)
    guard.rdzv.watchdog.tripped.set()
    guard.agree(None)  # no group touched: it would raise
    assert guard.aborted
