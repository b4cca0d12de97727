"""A sharded model's checkpoints (worker/pytorch/shards.py): every rank writes the shards
it holds, a world of any size reads them back (each rank its own parts, DCP resharding),
one process reads the whole model alone, and the manifest's sha256 of every shard file is
what a reader trusts. Real processes (spawned, gloo)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

if os.environ.get("CI") == "true":
    import torch  # CI installs torch's CPU build: a missing torch must fail, not skip
else:
    torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from cohort.worker.loop import checkpoints  # noqa: E402
from cohort.worker.loop.checkpoints import CheckpointError  # noqa: E402
from cohort.worker.pytorch import shards  # noqa: E402
from cohort.worker.pytorch.elastic import TorchState  # noqa: E402
from cohort.worker.pytorch.sharded import world_mesh  # noqa: E402
from tests.helpers import spawned_done  # noqa: E402

STEPS = 3


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)  # 33 rows: no world size here divides them evenly
    return torch.nn.Sequential(torch.nn.Linear(8, 33), torch.nn.ReLU(), torch.nn.Linear(33, 5))


def _sharded(
    rank: int, size: int, store: Path, world: int
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size)
    model = mlp()
    mesh = world_mesh("cpu", size, world).shards
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _whole(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The model's and Adam's state gathered whole on every rank, by name."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {f"model.{k}": v.full_tensor() for k, v in model.state_dict().items()}
    for param, values in optimizer.state.items():
        for key, value in values.items():
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            out[f"optim.{names[id(param)]}.{key}"] = full
    return out


def _write(rank: int, size: int, tmp: Path) -> None:
    model, optimizer = _sharded(rank, size, tmp / "store-write", 1)
    torch.manual_seed(rank)
    for _ in range(STEPS):
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    files = shards.save(model, optimizer, str(tmp / "shards"))
    whole = _whole(model, optimizer)
    if rank == 0:
        torch.save(whole, tmp / "written.pt")
        (tmp / "files").write_text("\n".join(files))
    dist.destroy_process_group()
    spawned_done()


def _read(rank: int, size: int, tmp: Path) -> None:
    model, optimizer = _sharded(rank, size, tmp / f"store-read-{size}", 2)
    shards.load(model, optimizer, str(tmp / "shards"))
    whole = _whole(model, optimizer)
    if rank == 0:
        torch.save(whole, tmp / f"read-{size}.pt")
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()  # the loaded state trains on: every rank's Adam state fits its shards
    dist.destroy_process_group()
    spawned_done()


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shards of an MLP trained STEPS steps with AdamW by 2 ranks."""
    tmp = tmp_path_factory.mktemp("shards")
    mp.start_processes(_write, args=(2, tmp), nprocs=2, start_method="spawn")
    return tmp


def test_each_rank_writes_its_own_shards_and_rank_0_the_metadata(written: Path) -> None:
    files = (written / "files").read_text().split("\n")
    assert files == ["__0_0.distcp", "__1_0.distcp", shards.METADATA]
    assert all((written / "shards" / name).stat().st_size > 0 for name in files)


@pytest.mark.parametrize("size", [3, 1])
def test_shards_written_by_2_ranks_load_at_another_world_size(written: Path, size: int) -> None:
    mp.start_processes(_read, args=(size, written), nprocs=size, start_method="spawn")
    want, got = torch.load(written / "written.pt"), torch.load(written / f"read-{size}.pt")
    assert got.keys() == want.keys()
    assert any(".exp_avg_sq" in key for key in got)  # the optimizer's state came too
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_one_process_reads_the_whole_model_alone(written: Path) -> None:
    whole = shards.whole_model(mlp(), str(written / "shards"))
    want = torch.load(written / "written.pt")
    assert whole.keys() == {k.removeprefix("model.") for k in want if k.startswith("model.")}
    for name, tensor in whole.items():
        assert torch.equal(tensor, want[f"model.{name}"]), name
    assert not torch.equal(whole["0.weight"], mlp().state_dict()["0.weight"])  # trained


def _manifest(written: Path, tmp: Path) -> tuple[str, bytes]:
    """A checkpoint file's URI under `tmp` and the manifest of a copy of `written`'s shards
    beside it."""
    import shutil

    step_uri = str(tmp / "step-000000000007.ckpt")
    relative = shards.relative_location(step_uri, 4)
    location = shards.absolute(step_uri, relative)
    shutil.copytree(written / "shards", location)
    files = (written / "files").read_text().split("\n")
    return step_uri, shards.manifest(location, relative, files, b"state")


def test_the_manifest_names_the_shards_beside_its_file_and_checks_each(
    written: Path, tmp_path: Path
) -> None:
    step_uri, payload = _manifest(written, tmp_path)
    assert shards.is_manifest(payload)
    found = shards.read_manifest(step_uri, payload)
    assert found.location == f"{tmp_path}/step-000000000007.ckpt.shards/world4"
    assert sorted(found.files) == sorted(["__0_0.distcp", "__1_0.distcp", shards.METADATA])
    assert found.blob == b"state"
    # the checkpoint moved elsewhere with its shards still loads: the location is relative
    moved = tmp_path / "moved"
    (tmp_path / "step-000000000007.ckpt.shards").rename(tmp_path / "elsewhere")
    moved.mkdir()
    (tmp_path / "elsewhere").rename(moved / "step-000000000007.ckpt.shards")
    again = shards.read_manifest(str(moved / "step-000000000007.ckpt"), payload)
    assert again.location.startswith(str(moved))


def test_a_changed_or_missing_shard_file_is_refused_by_name(written: Path, tmp_path: Path) -> None:
    step_uri, payload = _manifest(written, tmp_path)
    shard = Path(shards.read_manifest(step_uri, payload).location) / "__1_0.distcp"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp has sha256 .* not the manifest's"):
        shards.read_manifest(step_uri, payload)
    shard.unlink()
    with pytest.raises(CheckpointError, match=r"cannot read checkpoint shard .*__1_0\.distcp"):
        shards.read_manifest(step_uri, payload)


def test_deleting_a_checkpoint_deletes_its_shards(written: Path, tmp_path: Path) -> None:
    step_uri, payload = _manifest(written, tmp_path)
    Path(step_uri).write_bytes(b"the checkpoint file")
    assert checkpoints.delete(step_uri)
    assert not Path(step_uri).exists()
    assert list(tmp_path.iterdir()) == []  # the shards of every world went with it


def test_an_unsharded_model_refuses_a_sharded_checkpoint_with_the_fix(
    written: Path, tmp_path: Path
) -> None:
    _, payload = _manifest(written, tmp_path)
    model = mlp()
    state = TorchState(model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(CheckpointError, match=r"sharded model.*shard=\.\.\."):
        state.load(payload)
