"""What `cohort run` exits with: 0 only for a job that reached its length (README, "Exit
codes"); a job whose ranks' scripts all ended before it did exits 5, naming the fix."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace

from rich.console import Console

from cohort.coordinator.audit import Audit, EpochAudit
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


def summary(tmp_path: Path, report: Audit) -> str:
    run, out = launcher(tmp_path, finished=None)
    run.watch = SimpleNamespace(  # type: ignore[assignment]
        state=SimpleNamespace(finished=None, last_committed=-1), facts=[]
    )
    run._summarise(report, None, Exit.FAILED)
    return out.getvalue()


def test_a_job_that_committed_no_step_is_not_said_to_pass_the_audit(tmp_path: Path) -> None:
    said = summary(tmp_path, Audit())
    assert "0 steps committed" in said
    assert "passed" not in said
    assert "audit: nothing to audit (no step committed)" in said


def test_a_job_that_committed_steps_is_said_to_pass_the_audit_it_passed(tmp_path: Path) -> None:
    report = Audit(epochs={0: EpochAudit(epoch=0, steps=4)})
    said = summary(tmp_path, report)
    assert "4 steps committed" in said
    assert "audit (every sample exactly once per epoch): passed" in said
