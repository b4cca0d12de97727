"""Checkpoint files through fsspec: whole or absent, self-describing, checked on load."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from cohort.events.models import DataPosition
from cohort.events.shards import Shard
from cohort.worker.collective import tensors
from cohort.worker.loop import checkpoints
from cohort.worker.loop.checkpoints import CheckpointError

POSITION = DataPosition(epoch=2, rest=Shard(ranges=((10, 40), (70, 90))))


def write(uri: str, payload: bytes = b"weights" * 100) -> checkpoints.Written:
    return checkpoints.write(uri, "job", 41, "ab12cd34", POSITION, payload)


def test_a_written_checkpoint_reads_back_with_its_header_and_payload(tmp_path: Path) -> None:
    params = {"w": np.arange(12, dtype=np.float64).reshape(3, 4), "b": np.ones(4)}
    uri = f"file://{tmp_path}/ckpt/step-41.ckpt"
    written = checkpoints.write(
        uri, "job", 41, "ab12cd34", POSITION, checkpoints.tensors_payload(params)()
    )
    assert (
        written.sha256 == hashlib.sha256((tmp_path / "ckpt/step-41.ckpt").read_bytes()).hexdigest()
    )
    assert written.bytes == (tmp_path / "ckpt/step-41.ckpt").stat().st_size
    loaded = checkpoints.read(uri, written.sha256)
    assert (loaded.job, loaded.step, loaded.digest, loaded.position) == (
        "job",
        41,
        "ab12cd34",
        POSITION,
    )
    back = tensors.unpack(loaded.payload)
    assert set(back) == {"w", "b"} and np.array_equal(back["w"], params["w"])


def test_a_plain_path_works_as_well_as_a_file_url(tmp_path: Path) -> None:
    written = write(str(tmp_path / "a" / "b.ckpt"))
    assert checkpoints.read(str(tmp_path / "a" / "b.ckpt"), written.sha256).step == 41


def test_nothing_but_the_target_is_left_after_a_write(tmp_path: Path) -> None:
    write(f"{tmp_path}/step.ckpt")
    assert [p.name for p in tmp_path.iterdir()] == ["step.ckpt"]


def test_a_file_changed_or_cut_short_since_it_was_written_is_refused(tmp_path: Path) -> None:
    uri = str(tmp_path / "step.ckpt")
    written = write(uri)
    raw = (tmp_path / "step.ckpt").read_bytes()
    (tmp_path / "step.ckpt").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CheckpointError, match="changed or cut short"):
        checkpoints.read(uri, written.sha256)
    with pytest.raises(CheckpointError, match="cut short|unreadable"):
        checkpoints.read(uri)  # without the journal's sha256, the header itself is torn


def test_a_file_that_is_no_checkpoint_is_named(tmp_path: Path) -> None:
    (tmp_path / "x.ckpt").write_bytes(b"PK\x03\x04 a zip file")
    with pytest.raises(CheckpointError, match="is not a cohort checkpoint"):
        checkpoints.read(str(tmp_path / "x.ckpt"))


def test_a_missing_checkpoint_is_an_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="nothing.ckpt"):
        checkpoints.read(str(tmp_path / "nothing.ckpt"))


def test_an_unknown_filesystem_is_refused_with_what_to_do() -> None:
    with pytest.raises(CheckpointError, match="nosuchfs://bucket/x.ckpt.*fsspec"):
        write("nosuchfs://bucket/x.ckpt")


def test_delete_removes_and_says_whether_there_was_a_file(tmp_path: Path) -> None:
    uri = str(tmp_path / "step.ckpt")
    write(uri)
    assert checkpoints.delete(uri) is True
    assert checkpoints.delete(uri) is False
    assert list(tmp_path.iterdir()) == []
