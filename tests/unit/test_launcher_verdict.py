"""What `cohort run` exits with: 0 only for a job that reached its length (README, "Exit
codes"); a job whose ranks' scripts all ended before it did exits 5, naming the fix."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace

from rich.console import Console

from cohort.errors import Exit
from cohort.launcher.launcher import Launcher, LaunchSettings

PASSED = SimpleNamespace(ok=True)


def launcher(tmp_path: Path, finished: str | None) -> tuple[Launcher, io.StringIO]:
    out = io.StringIO()
    settings = LaunchSettings(job="j", command=("true",), ranks=2, node="n", run_dir=tmp_path)
    run = Launcher(settings, Console(file=out))
    run.watch = SimpleNamespace(state=SimpleNamespace(finished=finished))  # type: ignore[assignment]
    return run, out


def test_a_job_whose_scripts_ended_before_its_length_does_not_exit_0(tmp_path: Path) -> None:
    run, _ = launcher(tmp_path, finished=None)
    assert run._verdict(PASSED) is Exit.UNFINISHED  # type: ignore[arg-type]
    assert int(Exit.UNFINISHED) not in (0, 1, 2, 3, 4, 130)


def test_a_job_that_reached_its_length_exits_0(tmp_path: Path) -> None:
    run, _ = launcher(tmp_path, finished="epochs=2 finished")
    assert run._verdict(PASSED) is Exit.OK  # type: ignore[arg-type]
