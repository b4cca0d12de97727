"""A sharded world starts from the shards its ranks held (worker/pytorch/regather.py).
Grown: 2 ranks train an MLP sharded over both with AdamW, a third joins, and each of the 3
puts together exactly the whole state the 2 held (model and optimizer, pieces joined in the
old ranks' order) and rank 0's settings and extra state, with no checkpoint. Healed in
place: HSDP 2 x 2 loses a rank to a newcomer in its place; the 3 others keep their shards,
only the lost shard moves (from its holder in the other copy), and every rank's module
and optimizer hold exactly its copy's state. A world missing an old rank's pieces is
refused by name, before any piece moves. Real processes (spawned, gloo)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("CI") == "true":
    import torch  # CI installs torch's CPU build: a missing torch must fail, not skip
else:
    torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from cohort.worker.errors import WorkerError  # noqa: E402
from cohort.worker.pytorch import regather  # noqa: E402
from cohort.worker.pytorch.handover import Handover  # noqa: E402
from cohort.worker.pytorch.sharded import optimizer_settings, world_mesh  # noqa: E402
from tests.helpers import spawned_done  # noqa: E402
from tests.unit.test_shards import mlp  # noqa: E402


class Unguarded:
    """The waits `Handover` asks of a world's guard, done plainly (no watchdog here)."""

    def wait(self, work: Any, step: int) -> None:
        work.wait()

    def fence(self, works: list[Any], completion: Any, step: int) -> None:
        for work in works:
            work.wait()


def _handover(src: int) -> Handover:
    cpu = torch.device("cpu")
    return Handover(Unguarded(), cpu, cpu, None, step=0, src=src)


def _trained(rank: int, tmp: Path) -> regather.Pieces:
    """Ranks 0 and 1 of a first world: the MLP sharded over both, 3 AdamW steps."""
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp}/store-1", rank=rank, world_size=2)
    model = mlp()
    fully_shard(model, mesh=world_mesh("cpu", 2, 1).shards)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    torch.manual_seed(rank)
    for _ in range(3):
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    whole = _full(model, optimizer)  # a collective: every rank gathers
    if rank == 0:
        torch.save(whole, tmp / "held.pt")
    held = regather.pieces(model, optimizer, rank, 2)
    dist.destroy_process_group()
    return held


def _grown(rank: int, tmp: Path, lost: bool) -> None:
    """3 ranks: 0 and 1 held the first world's shards (unless `lost`: 1's are gone), 2
    joined with none."""
    mine = _trained(rank, tmp) if rank < 2 else None
    if lost and rank == 1:
        mine = None
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store-2", rank=rank, world_size=3)
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5 if rank == 0 else 0.01)
    settings = optimizer_settings(optimizer, [[n for n, _ in model.named_parameters()]])
    try:
        got = regather.regather(_handover, mine, rank, 3, settings, {"from": f"rank {rank}"})
    except WorkerError as exc:
        got = None
        (tmp / f"refused-{rank}").write_text(str(exc))
    dist.destroy_process_group()
    if got is not None:
        assert got.model is not None and got.optim is not None and got.pieces is None
        whole = dict(got.model)
        for name, values in got.optim["state"].items():
            whole.update({f"optim.{name}.{key}": value for key, value in values.items()})
        torch.save((whole, got.settings, got.taken, got.moved), tmp / f"grown-{rank}.pt")
    spawned_done()


def test_every_rank_of_a_grown_world_puts_together_the_whole_state_its_survivors_held(
    tmp_path: Path,
) -> None:
    mp.start_processes(_grown, args=(tmp_path, False), nprocs=3, start_method="spawn")
    held = torch.load(tmp_path / "held.pt")
    assert any(".exp_avg_sq" in key for key in held)
    for rank in range(3):
        whole, groups, taken, moved = torch.load(tmp_path / f"grown-{rank}.pt")
        assert whole.keys() == held.keys()
        for key in held:
            assert torch.equal(whole[key], held[key]), (rank, key)
        assert [g["lr"] for g in groups] == [0.5]  # the new rank 0's settings
        assert taken == {"from": "rank 0"}  # and its extra state
        assert moved == (0, 1)  # every shard, to be put together whole


def test_a_world_missing_a_survivors_pieces_is_refused_by_name(tmp_path: Path) -> None:
    mp.start_processes(_grown, args=(tmp_path, True), nprocs=3, start_method="spawn")
    for rank in range(3):
        said = (tmp_path / f"refused-{rank}").read_text()
        assert "hold shards [0] of [2] of the last world's model: not every shard" in said


def _full(model: Any, optimizer: Any) -> dict[str, Any]:
    """The whole model and optimizer state of this rank's copy, gathered over its shards."""
    whole = {k: v.full_tensor() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for param, values in optimizer.state.items():
        for key, value in values.items():
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            whole[f"optim.{names[id(param)]}.{key}"] = full
    return whole


def _copy(rank: int, tmp: Path, world: int) -> tuple[Any, Any, Any]:
    """World `world` of 4 ranks, HSDP 2 x 2: this rank's copy of the MLP sharded over its
    group, with AdamW."""
    from torch.distributed.fsdp import fully_shard

    init = f"file://{tmp}/store-{world}"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=4)
    mesh = world_mesh("cpu", 4, world, group=2)
    model = mlp()
    fully_shard(model, mesh=mesh.shards)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01), mesh


def _healed(rank: int, tmp: Path) -> None:
    """World 1: two copies trained alike (each group's ranks see the same batches as the
    other group's). World 2: rank 3 is a newcomer in the lost rank's place."""
    model, optimizer, _ = _copy(rank, tmp, 1)
    torch.manual_seed(rank % 2)  # shard i of each copy trains on the same batches
    for _ in range(3):
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    held = _full(model, optimizer)
    if rank == 0:
        torch.save(held, tmp / "held.pt")
    mine = regather.pieces(model, optimizer, rank % 2, 2) if rank != 3 else None
    dist.destroy_process_group()

    model, optimizer, mesh = _copy(rank, tmp, 2)
    settings = optimizer_settings(optimizer, [[n for n, _ in model.named_parameters()]])
    place, count = mesh.shards.get_local_rank(), mesh.shards.size()
    got = regather.regather(_handover, mine, place, count, settings, {})
    assert got.pieces is not None and got.model is None
    regather.load(model, optimizer, got.pieces)
    torch.save((_full(model, optimizer), got.moved, got.pieces is mine), tmp / f"healed-{rank}.pt")
    dist.destroy_process_group()
    spawned_done()


def test_an_hsdp_copy_heals_in_place_moving_only_the_lost_shard(tmp_path: Path) -> None:
    mp.start_processes(_healed, args=(tmp_path,), nprocs=4, start_method="spawn")
    held = torch.load(tmp_path / "held.pt")
    assert any(".exp_avg_sq" in key for key in held)
    for rank in range(4):
        whole, moved, kept = torch.load(tmp_path / f"healed-{rank}.pt")
        assert moved == (1,)  # the newcomer's place only: shard 1, from rank 1
        assert kept == (rank != 3)  # the survivors' own pieces, not copies of them
        assert whole.keys() == held.keys()
        for key in held:
            assert torch.equal(whole[key], held[key]), (rank, key)
