"""A failure is told as the journal has it, everywhere a person reads it: the report's
marker, the timeline (`cohort replay`, `cohort status`, the report), a torchrun agent's end
in the audit and the launcher's summary all say WorkerFailed.reason (its `cause`, `how`,
`timeout`, `grace`), and the summary says "survived" only of a job that finished."""

from __future__ import annotations

import pytest

from cohort.coordinator.audit import LauncherAudit
from cohort.coordinator.series import _marker
from cohort.coordinator.state import JobState, Member
from cohort.coordinator.timeline import failures_said, lines
from cohort.events.models import WorkerFailed

KILLED = WorkerFailed(
    at=2.0, job="j", worker="vm-1", last_seen=1.9, timeout=5.0, cause="exited",
    how="killed by SIGKILL",
)  # fmt: skip
CLOSED = WorkerFailed(
    at=3.0, job="j", worker="vm-2", last_seen=2.5, timeout=5.0, cause="disconnected",
    closed_at=2.6, grace=0.3,
)  # fmt: skip
SILENT = WorkerFailed(at=9.0, job="j", worker="vm-3", last_seen=4.0, timeout=5.0)


@pytest.mark.parametrize(
    "failed, says",
    [
        (KILLED, "process exited (killed by SIGKILL)"),
        (CLOSED, "connections closed (none back within 0.3 s)"),
        (SILENT, "silent 5 s (no heartbeat)"),
    ],
)
def test_a_failure_is_labelled_by_its_journaled_cause_in_the_report_and_the_timeline(
    failed: WorkerFailed, says: str
) -> None:
    marker = _marker("1-0", failed)
    assert marker is not None and marker.label == f"{failed.worker} failed: {says}"
    (line,) = lines([("1-0", failed)])
    assert line.text == f"worker={failed.worker} {says}"
    if failed.cause != "silent":
        assert "silent" not in marker.label + line.text


def test_a_torchrun_agents_failure_ends_its_run_as_journaled_in_the_audit() -> None:
    report = LauncherAudit()
    agent = Member(worker="vm-1", status="active", joined_at=0.0, role="agent")
    before = JobState(job="j", members={"vm-1": agent})
    report.follow(KILLED, before, before)
    assert report.ended == {"vm-1": "failed: process exited (killed by SIGKILL)"}


def test_a_runs_summary_says_survived_only_of_a_job_that_finished() -> None:
    finished = failures_said([KILLED], finished=True)
    assert finished == "1 failure(s) survived (vm-1 process exited (killed by SIGKILL))"
    crashed = failures_said([KILLED, CLOSED], finished=False)
    assert "survived" not in crashed
    assert crashed == (
        "2 failure(s) (vm-1 process exited (killed by SIGKILL); "
        "vm-2 connections closed (none back within 0.3 s))"
    )
    assert failures_said([], finished=True) == "no failures"
    many = failures_said([KILLED, CLOSED, SILENT, KILLED], finished=True)
    assert many.startswith("4 failure(s) survived") and many.endswith("; and 1 more)")
