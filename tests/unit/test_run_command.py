"""`cohort run -n`: a number of ranks, or one per GPU NVML sees (a fake NVML here);
`--spares`: a number of warm spares."""

from __future__ import annotations

import pytest

from cohort.commands.run import _ranks, _spares, _start_with_every_rank, gpu_count
from cohort.commands.settings import JobSettings
from tests.unit.test_gpu_probe import FakeGpu, FakeNvml


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


def test_gpu_is_one_rank_per_gpu_nvml_sees() -> None:
    assert gpu_count(FakeNvml(FakeGpu(), FakeGpu(), FakeGpu())) == 3
    assert _ranks("gpu", lambda: 3) == 3


def test_gpu_without_a_driver_is_refused_saying_so(capsys: pytest.CaptureFixture[str]) -> None:
    nvml = FakeNvml(FakeGpu())
    nvml.driver_loaded = False
    assert gpu_count(nvml) == 0
    with pytest.raises(SystemExit) as exited:
        _ranks("gpu", lambda: gpu_count(nvml))
    assert exited.value.code == 2
    assert "NVML sees no GPU on this machine" in capsys.readouterr().err


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
