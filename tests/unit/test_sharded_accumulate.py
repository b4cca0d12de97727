"""A sharded model's micro-batches (worker/pytorch/sharded.py `accumulate`), in one process
FSDP-sharded over a one-rank gloo group: every micro-batch but a step's last reduces
nothing, what they accumulate is kept out of the script's reach and rescaled for the next
micro-batch's size, as `MicroBatches` does for an unsharded model; and a module an
evaluation left unsharded is sharded again before its state is read (`shards.resharded`)."""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator

import pytest

if os.environ.get("CI") == "true":
    import torch  # CI installs torch's CPU build: a missing torch must fail, not skip
else:
    torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from cohort.worker.pytorch import shards  # noqa: E402
from cohort.worker.pytorch.sharded import accumulate  # noqa: E402


def mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


@pytest.fixture
def models() -> Iterator[tuple[torch.nn.Module, torch.nn.Module]]:
    """The same MLP unsharded, and sharded over a one-rank gloo group of this process: its
    first layer a unit of its own, the last layer's parameters the root's (which FSDP keeps
    gathered between a forward and its backward)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        plain = mlp()
        sharded = copy.deepcopy(plain)
        mesh = init_device_mesh("cpu", (1,))
        fully_shard(sharded[0], mesh=mesh)
        fully_shard(sharded, mesh=mesh)
        yield plain, sharded
    finally:
        dist.destroy_process_group()


def test_micro_batches_reduce_once_and_weigh_each_by_its_size(
    models: tuple[torch.nn.Module, torch.nn.Module],
) -> None:
    """Micro-batches of 3 samples and 1: the script's loss is each one's mean, and its
    `zero_grad()` comes between its forward and its backward, where the root's gathered
    parameters are the module's. The step's gradient is W / 1 (W: every sample's sum), what
    the unsharded route's parked gradients make before the world's mean weighs them."""
    plain, sharded = models
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    loss = torch.nn.functional.mse_loss
    sizes = (3, 1)
    for index, (xs, ys) in enumerate(zip(x.split(sizes), y.split(sizes), strict=True)):
        carry = sizes[index - 1] / sizes[index] if index else 0.0
        accumulate(sharded, carry, sync=index == len(sizes) - 1)
        out = sharded(xs)
        sharded.zero_grad()  # as a script may: the accumulated gradients are out of reach
        loss(out, ys, reduction="mean").backward()
        if index == 0:
            assert all(p.grad is None for p in sharded.parameters())  # nothing reduced yet
    loss(plain(x), y, reduction="sum").div(2).backward()  # mse's mean over 2 outputs
    for (name, want), got in zip(plain.named_parameters(), sharded.parameters(), strict=True):
        assert got.grad is not None, name
        torch.testing.assert_close(got.grad.full_tensor(), want.grad, rtol=1e-6, atol=1e-6)


def test_a_new_step_drops_what_an_unfinished_one_accumulated(
    models: tuple[torch.nn.Module, torch.nn.Module],
) -> None:
    plain, sharded = models
    x, y = torch.randn(2, 4), torch.randn(2, 2)
    accumulate(sharded, 0.0, sync=False)
    torch.nn.functional.mse_loss(sharded(x * 5), y).backward()  # a step cut short
    accumulate(sharded, 0.0, sync=True)  # the next step's first and last micro-batch
    torch.nn.functional.mse_loss(sharded(x), y).backward()
    torch.nn.functional.mse_loss(plain(x), y).backward()
    for want, got in zip(plain.parameters(), sharded.parameters(), strict=True):
        torch.testing.assert_close(got.grad.full_tensor(), want.grad, rtol=1e-6, atol=1e-6)


def test_an_evaluation_s_gathered_root_is_sharded_again_before_its_state_is_read(
    models: tuple[torch.nn.Module, torch.nn.Module],
) -> None:
    _, sharded = models
    optimizer = torch.optim.AdamW(sharded.parameters(), lr=0.01)
    sharded(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    with torch.no_grad():
        sharded(torch.randn(2, 4))  # an evaluation: no backward reshards the root
    assert not all(isinstance(p, DTensor) for p in sharded.parameters())
    state = shards.flat(sharded, optimizer)
    assert all(isinstance(p, DTensor) for p in sharded.parameters())
    assert set(state["optim"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
