"""`cohort run -n`: a number of ranks, or one per GPU a process can open (a fake NVML here);
`--spares`: a number of warm spares; each process's own GPU, or a refusal naming what fits."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from cohort.cli import main
from cohort.commands.run import (
    _placement,
    _ranks,
    _spares,
    _start_with_every_rank,
    _whole_groups,
    node_gpus,
)
from cohort.commands.settings import JobSettings
from cohort.events.models import JobConfig
from cohort.launcher.gpus import NodeGpus
from tests.unit.test_gpu_probe import FakeGpu, FakeNvml, mig


def test_a_number_of_ranks_is_taken_as_it_is() -> None:
    assert _ranks("3") == 3


@pytest.mark.parametrize("text", ["0", "-1", "two", ""])
def test_a_number_below_one_or_not_a_number_is_refused_by_name(
    text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        _ranks(text)
    assert exited.value.code == 2
    assert f"-n {text}: give a number of ranks of 1 or more, or `gpu`" in capsys.readouterr().err


def test_a_number_of_spares_of_0_or_more_is_taken_as_it_is() -> None:
    assert (_spares("0"), _spares("2")) == (0, 2)


@pytest.mark.parametrize("text", ["-1", "one", "1.5", ""])
def test_spares_that_are_not_a_count_are_refused_by_name(
    text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        _spares(text)
    assert exited.value.code == 2
    assert f"--spares {text}: give a number of spares of 0 or more" in capsys.readouterr().err


def test_more_spares_than_max_workers_allow_beside_the_ranks_are_refused_by_name(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert _spares("1", ranks=3, max_workers=4) == 1
    with pytest.raises(SystemExit) as exited:
        _spares("2", ranks=3, max_workers=4)
    assert exited.value.code == 2
    said = capsys.readouterr().err
    assert "--spares 2: 3 rank(s) and 2 spare(s)" in said and "max_workers=4" in said


def test_ranks_in_whole_shard_groups_or_no_groups_are_taken() -> None:
    groups = [JobConfig(shard_group=2), JobConfig(shard_group=4), JobConfig()]
    assert [
        _whole_groups(4, groups[0]),
        _whole_groups(4, groups[1]),
        _whole_groups(3, groups[2]),
    ] == [4, 4, 3]


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("0", "shard_group=0: Input should be greater than or equal to 1"),
        ("-2", "shard_group=-2: Input should be greater than or equal to 1"),
        ("two", "Invalid value for '--shard-group': 'two' is not a valid integer"),
        ("1.5", "Invalid value for '--shard-group': '1.5' is not a valid integer"),
    ],
)
def test_a_shard_group_that_is_not_a_count_is_refused_by_name(
    text: str, said: str, tmp_path: Path
) -> None:
    """--shard-group is a job setting (journaled, checked as the others are): a bad one
    exits 2 naming it, before anything starts."""
    runner = CliRunner()
    result = runner.invoke(
        main, ["run", "-n", "4", "--run-dir", str(tmp_path / "run"), "--shard-group", text,
               "train.py"],
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    assert said in result.output
    assert not (tmp_path / "run").exists()


def test_a_shard_group_that_does_not_divide_the_nodes_ranks_is_refused_with_the_fix(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        _whole_groups(3, JobConfig(shard_group=2))
    assert exited.value.code == 2
    said = capsys.readouterr().err
    assert "--shard-group 2 with -n 3: this node's ranks must be whole shard groups" in said
    assert "give -n a multiple of 2" in said


def test_gpu_is_one_rank_per_gpu_nvml_sees_each_given_by_uuid() -> None:
    gpus = node_gpus({}, FakeNvml(FakeGpu(), FakeGpu(), FakeGpu()))
    assert gpus == NodeGpus(("GPU-fake-0", "GPU-fake-1", "GPU-fake-2"), "NVML sees 3 GPU(s)")
    assert _ranks("gpu", lambda: gpus) == 3


def test_gpu_with_spares_leaves_each_spare_a_gpu_of_its_own() -> None:
    gpus = node_gpus({}, FakeNvml(*(FakeGpu() for _ in range(4))))
    assert _ranks("gpu", lambda: gpus, spares=1) == 3


def test_gpu_counts_the_devices_cuda_visible_devices_leaves_not_nvml_s() -> None:
    nvml = FakeNvml(*(FakeGpu() for _ in range(8)))
    given = node_gpus({"CUDA_VISIBLE_DEVICES": "4,5"}, nvml)
    assert given == NodeGpus(("4", "5"), "CUDA_VISIBLE_DEVICES='4,5'")
    assert nvml.init_calls == 0  # an inherited list is trusted as given
    assert _ranks("gpu", lambda: given) == 2


def test_gpu_counts_each_mig_instance_a_process_can_open() -> None:
    nvml = FakeNvml(FakeGpu(), FakeGpu(migs=[mig("MIG-x"), mig("MIG-y"), mig("MIG-z")]))
    gpus = node_gpus({}, nvml)
    assert gpus.devices == ("GPU-fake-0", "MIG-x", "MIG-y", "MIG-z")
    assert gpus.source == "NVML sees 2 GPU(s), 3 MIG instance(s)"
    assert _ranks("gpu", lambda: gpus) == 4


def test_gpu_without_a_driver_is_refused_saying_so(capsys: pytest.CaptureFixture[str]) -> None:
    nvml = FakeNvml(FakeGpu())
    nvml.driver_loaded = False
    gpus = node_gpus({}, nvml)
    assert gpus == NodeGpus((), "the NVIDIA driver is not loaded")
    with pytest.raises(SystemExit) as exited:
        _ranks("gpu", lambda: gpus)
    assert exited.value.code == 2
    assert (
        "-n gpu: this node has no GPU (the NVIDIA driver is not loaded); give a number of ranks"
        in capsys.readouterr().err
    )


def test_gpu_where_cuda_visible_devices_hides_them_all_is_refused_saying_so(
    capsys: pytest.CaptureFixture[str],
) -> None:
    gpus = node_gpus({"CUDA_VISIBLE_DEVICES": "-1"}, FakeNvml(FakeGpu()))
    with pytest.raises(SystemExit):
        _ranks("gpu", lambda: gpus)
    assert "this node has no GPU (CUDA_VISIBLE_DEVICES='-1')" in capsys.readouterr().err


def test_gpu_with_as_many_spares_as_gpus_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    gpus = node_gpus({"CUDA_VISIBLE_DEVICES": "0,1"})
    with pytest.raises(SystemExit) as exited:
        _ranks("gpu", lambda: gpus, spares=2)
    assert exited.value.code == 2
    assert "2 spare(s) leave none for a rank; keep at most 1 spare(s)" in capsys.readouterr().err


def test_a_cpu_machine_gives_its_ranks_no_gpu() -> None:
    nvml = FakeNvml(FakeGpu())
    nvml.driver_loaded = False
    assert _placement(node_gpus({}, nvml), 4, 1) == ()
    assert _placement(node_gpus({"CUDA_VISIBLE_DEVICES": ""}), 4, 1) == ()


def test_a_plan_with_more_processes_than_gpus_exits_2_naming_what_fits(
    capsys: pytest.CaptureFixture[str],
) -> None:
    gpus = node_gpus({"CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b"})
    assert _placement(gpus, 1, 1) == ("GPU-a", "GPU-b")
    with pytest.raises(SystemExit) as exited:
        _placement(gpus, 2, 1)
    assert exited.value.code == 2
    assert "give -n 1 --spares 1" in capsys.readouterr().err


def _settings(**flags: object) -> JobSettings:
    return JobSettings(None, None, {"start_workers": None, "min_workers": None, **flags})


def test_run_on_its_own_redis_waits_for_every_rank_before_the_first_world() -> None:
    given = _settings()
    _start_with_every_rank(given, 3)
    assert "--start-workers" in given.argv() and given.flags["start_workers"] == 3


@pytest.mark.parametrize(
    ("ranks", "flags"), [(1, {}), (3, {"min_workers": 1}), (3, {"start_workers": 2})]
)
def test_run_leaves_the_first_world_s_size_to_what_it_was_told(
    ranks: int, flags: dict[str, int]
) -> None:
    given = _settings(**flags)
    _start_with_every_rank(given, ranks)
    assert given.flags["start_workers"] == flags.get("start_workers")


def test_a_launcher_s_own_first_world_wait_is_no_conflict_with_the_journaled_job() -> None:
    """Each node's launcher gives --start-workers from its own -n; once the job is journaled
    its first world's wait is the journal's, and no coordinator is refused over it."""
    from cohort.coordinator.errors import ConfigConflictError
    from cohort.events.models import JobConfig

    journaled = JobConfig(start_workers=3, batch_size=8)
    given = JobConfig(start_workers=2, start_wait=5.0, batch_size=8)
    names = {"start_workers", "start_wait", "batch_size"}
    assert ConfigConflictError.between("j", journaled, given, names) is None
    other = JobConfig(start_workers=2, batch_size=16)
    conflict = ConfigConflictError.between("j", journaled, other, names)
    assert conflict is not None and "--batch-size 16" in str(conflict)
