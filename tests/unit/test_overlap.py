"""Gradients averaged while backward runs (worker/pytorch/overlap.py), ranks as threads sharing the
fake collective of test_torch_state: each bucket as soon as backward made it whole, in
the same order on every rank, with the same means as averaging after backward."""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np
import pytest

if os.environ.get("CI") == "true":
    import torch  # CI installs torch's CPU build: a missing torch must fail, not skip
else:
    torch = pytest.importorskip("torch")

from cohort.worker.errors import WorldChangedError  # noqa: E402
from cohort.worker.pytorch.overlap import AccumulationError, OverlappedGradients  # noqa: E402
from cohort.worker.pytorch.sync import GRADIENTS, call_id  # noqa: E402
from tests.helpers import wait_until  # noqa: E402
from tests.unit.test_torch_state import FakeCollective, FakeGroup  # noqa: E402


class Net(torch.nn.Module):
    """Two layers, and with `unused` a third that forward never calls."""

    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.last = torch.nn.Linear(4, 8), torch.nn.Linear(8, 3)
        self.spare = torch.nn.Linear(3, 3) if unused else None

    def forward(self, x: Any) -> Any:
        return self.last(torch.relu(self.first(x)))


def net(unused: bool = False) -> Net:
    return Net(unused)


def open_gate(cancelled: threading.Event) -> bool:
    return True


def batch(rank: int) -> Any:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(rank))


def local_grads(rank: int, unused: bool = False) -> list[np.ndarray]:
    model = net(unused)
    model(batch(rank)).sum().backward()
    return [
        (p.grad if p.grad is not None else torch.zeros_like(p)).numpy().copy()
        for p in model.parameters()
    ]


def test_each_bucket_is_averaged_during_backward_in_index_order_with_the_mean() -> None:
    group = FakeGroup(2)
    models = [net() for _ in range(2)]  # made here: torch's global RNG is not per thread

    def rank(collective: FakeCollective) -> list[np.ndarray]:
        model = models[collective.rank]
        overlapped = OverlappedGradients(model, collective, bucket_bytes=1)  # one tensor each
        assert [overlapped.buckets[0][0]] == [model.last.bias]  # backward makes it first
        overlapped.begin(step=3, world=1, gate=open_gate)
        model(batch(collective.rank)).sum().backward()
        # Nothing asked for the means yet: backward's hooks started every bucket.
        wait_until(lambda: len(group.log) == 4, 10, 0.01, "every bucket averaged")
        overlapped.finish()
        return [p.grad.numpy().copy() for p in model.parameters()]

    results = group.run(rank)
    assert group.log == [("allreduce", call_id(3, GRADIENTS, i)) for i in range(4)]
    mine = [local_grads(r) for r in range(2)]
    for got in results:
        for name, value in enumerate(got):
            np.testing.assert_allclose(value, (mine[0][name] + mine[1][name]) / 2, rtol=1e-6)


def test_a_parameter_backward_never_reached_is_averaged_as_zeros_at_the_step() -> None:
    group = FakeGroup(2)
    models = [net(unused=True) for _ in range(2)]

    def rank(collective: FakeCollective) -> list[np.ndarray]:
        model = models[collective.rank]
        overlapped = OverlappedGradients(model, collective, bucket_bytes=1)
        overlapped.begin(step=0, world=1, gate=open_gate)
        model(batch(collective.rank)).sum().backward()
        overlapped.finish()
        return [p.grad.numpy().copy() for p in model.parameters()]

    got = group.run(rank)
    mine = [local_grads(r, unused=True) for r in range(2)]
    for name, value in enumerate(got[0]):
        np.testing.assert_allclose(value, (mine[0][name] + mine[1][name]) / 2, rtol=1e-6)
    assert not got[0][-1].any()  # the spare layer's bias: zeros


def test_a_second_backward_in_one_step_is_refused_with_the_way_to_accumulate() -> None:
    group = FakeGroup(1)

    def rank(collective: FakeCollective) -> None:
        model = net()
        overlapped = OverlappedGradients(model, collective, bucket_bytes=1)
        overlapped.begin(step=0, world=1, gate=open_gate)
        model(batch(0)).sum().backward()
        model(batch(1)).sum().backward()
        with pytest.raises(AccumulationError, match="overlap=False"):
            overlapped.finish()

    group.run(rank)


class MovedOn:
    """A collective whose world has changed: every allreduce is cut short."""

    def allreduce(self, tensors: Any, call: int, world: int | None = None) -> Any:
        raise WorldChangedError(call, None)


def test_a_world_change_during_backward_aborts_the_step_it_belongs_to() -> None:
    model = net()
    overlapped = OverlappedGradients(model, MovedOn(), bucket_bytes=1)  # type: ignore[arg-type]
    overlapped.begin(step=7, world=2, gate=open_gate)
    model(batch(0)).sum().backward()
    with pytest.raises(WorldChangedError) as aborted:
        overlapped.finish()
    assert aborted.value.step == 7
    overlapped.begin(step=7, world=3, gate=open_gate)  # again, in the next world: a clean slate
    overlapped.cancel()


class Recording:
    """A collective that records the calls it was asked for and averages nothing."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def allreduce(self, tensors: Any, call: int, world: int | None = None) -> Any:
        self.calls.append(call)
        return dict(tensors)


def test_a_step_the_gate_closes_starts_no_collective_and_does_not_count() -> None:
    """A rank that built the step on a plan the previous commit replaced must not send its
    gradients: the others would average them with their own."""
    model, collective = net(), Recording()
    overlapped = OverlappedGradients(model, collective, bucket_bytes=1)  # type: ignore[arg-type]
    asked = threading.Event()

    def stale(cancelled: threading.Event) -> bool:
        asked.set()
        return False

    overlapped.begin(step=4, world=1, gate=stale)
    model(batch(0)).sum().backward()
    with pytest.raises(WorldChangedError) as aborted:
        overlapped.finish()
    assert asked.is_set() and collective.calls == [] and aborted.value.step == 4


def test_cancel_starts_none_of_the_buckets_backward_left_and_unblocks_a_waiting_gate() -> None:
    model, collective = net(), Recording()
    overlapped = OverlappedGradients(model, collective, bucket_bytes=1)  # type: ignore[arg-type]

    def waits_until_cancelled(cancelled: threading.Event) -> bool:
        return not cancelled.wait(10)  # the previous step never settles before the cancel

    overlapped.begin(step=5, world=1, gate=waits_until_cancelled)
    model(batch(0)).sum().backward()
    overlapped.cancel()
    assert collective.calls == []
    overlapped.begin(step=5, world=2, gate=open_gate)
    model(batch(0)).sum().backward()
    overlapped.finish()
    assert collective.calls == [call_id(5, GRADIENTS, i) for i in range(4)]
