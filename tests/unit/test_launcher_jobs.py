"""A torchrun job (`--rdzv-backend=cohort`): its agents are members that train no step of
cohort's, so the journal holds their joins, failures, leaves and rendezvous rounds, and
status and the audit say that, instead of a world that never formed."""

from __future__ import annotations

from cohort.coordinator.audit import LAUNCHER_COVERS, audit
from cohort.coordinator.replay import view
from cohort.events.models import AGENT_SUCCEEDED, Join, RendezvousRound, RoundStarted
from tests.unit.job import JOB, Job, types


def _agent(job: Job, *agents: str) -> None:
    for agent in agents:
        job.send(Join(at=job.now, job=JOB, worker=agent, role="agent"))


def _round(job: Job, by: str, round_: int, *agents: str):  # type: ignore[no-untyped-def]
    return job.send(RoundStarted(at=job.now, job=JOB, worker=by, round=round_, agents=agents))


def _silence(job: Job, survivors: tuple[str, ...], seconds: float = 6.0) -> None:
    """Everyone but `survivors` stops heartbeating; the heartbeat timeout is 5 s."""
    for _ in range(int(seconds)):
        job.alive(*survivors)
        job.advance(1.0)


def _b_restarts_after_a_is_lost() -> Job:
    """Agents a and b start round 0; a falls silent and fails; b's workers restart alone in
    round 1."""
    job = Job(heartbeat_timeout=5.0)
    _agent(job, "a", "b")
    _round(job, "a", 0, "a", "b")
    _silence(job, ("b",))
    _round(job, "b", 1, "b")
    return job


def test_a_round_is_journaled_once_as_its_first_agent_reports_it() -> None:
    job = Job(heartbeat_timeout=5.0)
    _agent(job, "a", "b")
    (fact,) = _round(job, "b", 0, "b", "a")
    assert isinstance(fact, RendezvousRound) and fact.agents == ("b", "a") and fact.worker == "b"
    assert _round(job, "a", 0, "b", "a") == ()  # the other agent says the same
    assert types(_round(job, "a", 2, "a")) == ["RendezvousRound"]
    assert _round(job, "b", 1, "a", "b") == ()  # late: round 2 is journaled already
    assert job.state.rendezvous.round == 2 and job.replayed() == job.state


def test_only_an_agent_member_reports_rounds() -> None:
    job = Job()
    job.join("t")  # a trainer
    assert _round(job, "t", 0, "t") == ()
    assert _round(job, "stranger", 0, "stranger") == ()
    assert job.state.rendezvous is None and job.state.counters.rounds == 0


def test_rounds_count_restarts_within_a_run_and_a_new_run_after_every_agent_went() -> None:
    job = Job(heartbeat_timeout=5.0)
    _agent(job, "a", "b")
    _round(job, "a", 0, "a", "b")
    _silence(job, ("b",))  # a is lost: b's workers restart in round 1
    _round(job, "b", 1, "b")
    job.leave("b", reason=AGENT_SUCCEEDED)
    _agent(job, "c")  # a new run on the same id, one round on
    _round(job, "c", 2, "c")
    launcher = view(job.state)["launcher"]
    assert (launcher["rounds"], launcher["runs"], launcher["restarts"]) == (3, 2, 1)
    assert launcher["agents"] == ["c"] and launcher["round_agents"] == ["c"]
    assert view(job.state)["phase"] == "running"
    job.leave("c", reason=AGENT_SUCCEEDED)
    assert view(job.state)["phase"] == "ended"


def test_a_job_cohort_trains_has_no_launcher_view() -> None:
    job = Job()
    job.start("a")
    assert view(job.state)["launcher"] is None and view(job.state)["phase"] == "running"


def test_the_audit_says_it_covers_membership_and_fails_a_run_whose_agents_all_failed() -> None:
    job = Job(heartbeat_timeout=5.0)
    _agent(job, "a", "b")
    _round(job, "a", 0, "a", "b")
    _silence(job, ())  # both nodes lost
    report = audit(job.journal)
    assert report.launcher is not None and report.launcher.covers == LAUNCHER_COVERS
    assert "no steps, data or weights" in LAUNCHER_COVERS
    assert report.launcher.ended == {
        "a": "failed: silent 5 s (no heartbeat)",
        "b": "failed: silent 5 s (no heartbeat)",
    }
    assert not report.ok and "no agent whose workers succeeded" in report.problems[0]


def test_the_audit_passes_a_run_an_agent_finished_and_says_how_each_ended() -> None:
    job = _b_restarts_after_a_is_lost()
    job.leave("b", reason=AGENT_SUCCEEDED)
    report = audit(job.journal)
    assert report.ok, report.problems
    assert report.launcher is not None and report.launcher.restarts == 1
    assert report.launcher.ended == {"a": "failed: silent 5 s (no heartbeat)", "b": AGENT_SUCCEEDED}


def test_the_audit_of_a_run_still_going_judges_no_outcome() -> None:
    job = Job(heartbeat_timeout=5.0)
    _agent(job, "a", "b")
    _round(job, "a", 0, "a", "b")
    _silence(job, ("b",))  # a failed, b trains on
    report = audit(job.journal)
    assert report.ok and report.launcher is not None and report.launcher.running == ["b"]


def test_a_run_whose_agents_left_with_failed_workers_fails_the_audit() -> None:
    job = Job()
    _agent(job, "a")
    _round(job, "a", 0, "a")
    job.leave("a", reason="torchrun agent shut down: its workers failed past --max-restarts")
    assert not audit(job.journal).ok


def test_status_and_the_audit_print_the_agents_rounds_and_what_the_audit_covers() -> None:
    from cohort.render import terminal

    job = _b_restarts_after_a_is_lost()
    with terminal.console.capture() as shown:
        terminal.status_table(view(job.state))
        terminal.audit_table(audit(job.journal))
    text = " ".join(shown.get().split())
    assert "(torchrun)" in text and "1 agent(s) in the job" in text and "world" not in text
    assert "round 1 with 1 agent(s) (b)" in text and "restarts 1" in text
    assert "failed: silent 5 s (no heartbeat)" in text and "audit passed" in text
    assert "exactly-once data and the weights' lineage are not audited" in text
