"""A constant global batch in PyTorch: micro-batches accumulated in place give the gradient
of the rank's whole share, weighted for the world's mean (worker/pytorch/elastic.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from cohort.events.order import Order  # noqa: E402
from cohort.worker.loop.elastic import Step  # noqa: E402
from cohort.worker.pytorch.elastic import ElasticJob  # noqa: E402


def test_micro_batches_accumulate_to_the_share_s_gradient_times_its_weight() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    x, y = torch.randn(11, 5), torch.randint(0, 3, (11,))
    sizes = (4, 4, 3)  # a share of 11 in micro-batches of at most 4
    job = object.__new__(ElasticJob)  # the accumulation arithmetic alone, no job to join
    job._sizes = sizes
    step = Step(
        step=0,
        world=1,
        epoch=0,
        rank=0,
        world_size=3,
        ranges=((0, 11),),
        order=Order.identity(11),
        weight=11 * 3 / 30,
    )  # 11 of a step's 30 samples
    model.zero_grad()
    start = 0
    for index, size in enumerate(sizes):
        loss = torch.nn.functional.cross_entropy(
            model(x[start : start + size]), y[start : start + size]
        )
        loss.backward()
        start += size
        if index < len(sizes) - 1:
            job._carry(model, index)
    job._scale(model, job._last_factor(step))
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    # the share's summed gradient times n / total: its part of the world's mean
    for mine, whole in zip(got, (p.grad * 3 / 30 for p in model.parameters()), strict=True):
        assert torch.allclose(mine, whole, atol=1e-6)


def test_a_loader_over_an_iterable_dataset_is_refused_by_name() -> None:
    from torch.utils.data import DataLoader, IterableDataset

    from cohort.worker.errors import WorkerError
    from cohort.worker.pytorch.loader import StepLoader

    class Stream(IterableDataset):  # type: ignore[type-arg]
        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter(range(3))

    with pytest.raises(WorkerError, match="map-style dataset"):
        StepLoader(DataLoader(Stream()), worker=None)  # type: ignore[arg-type]
