"""A dead process is noticed from its connections, or its launcher's word (docs/design.md
"Membership").

Every running worker keeps a subscription to its presence channel; the leader counts them.
A member seen connected and then found with none, and silent since, is failed once
`disconnect_grace` passed: long before its heartbeat timeout. A member whose connection
comes back within the grace, or that speaks after the reading that missed it, stays; one
never seen connected (a worker that shows no connections) is judged by silence alone.
"""

from __future__ import annotations

import io

from rich.console import Console

from cohort.coordinator.audit import audit
from cohort.coordinator.metrics import Metrics
from cohort.coordinator.replay import view
from cohort.events.models import Fact, JobConfig, ProcessExited, WorkerFailed, WorldChanged
from cohort.render.terminal import status_view
from tests.unit.job import JOB, Job, types


def running(**config: float) -> Job:
    """Ranks a, b, c training, each seen connected; a 30 s heartbeat timeout, so that only
    the connections can fail anyone within these tests."""
    job = Job(min_workers=1, heartbeat_interval=1, heartbeat_timeout=30, **config)
    job.start("a", "b", "c")
    job.step()
    job.connections(a=1, b=1, c=1)
    return job


def test_a_member_whose_connections_closed_is_failed_after_the_grace() -> None:
    job = running()
    job.now += 0.1
    job.connections(a=1, b=1, c=0)
    closed_at = job.now
    assert job.advance(0.2) == ()  # within the grace: it may connect again
    facts = job.advance(0.1)
    assert types(facts) == ["WorkerFailed", "WorldChanged"]
    failed, world = facts
    assert isinstance(failed, WorkerFailed) and failed.worker == "c"
    assert (failed.cause, failed.closed_at, failed.grace) == ("disconnected", closed_at, 0.3)
    assert failed.reason == "connections closed (none back within 0.3 s)"
    assert isinstance(world, WorldChanged) and world.ranks == ("a", "b")
    assert audit(job.journal).ok


def test_a_connection_back_within_the_grace_fails_nobody() -> None:
    job = running()
    job.connections(a=1, b=1, c=0)
    job.now += 0.2
    job.connections(a=1, b=1, c=2)  # it came back (two connections now, say)
    assert job.advance(1.0) == ()
    assert job.state.ranks == ("a", "b", "c")


def test_a_member_heard_from_after_the_reading_that_missed_it_is_not_failed_by_it() -> None:
    """Its subscription is gone (a refused resubscribe, say), but its heartbeats come: alive."""
    job = running()
    job.connections(a=1, b=1, c=0)
    job.now += 0.1
    job.alive("c")
    assert job.advance(1.0) == ()


def test_a_member_never_seen_connected_is_judged_by_its_silence_alone() -> None:
    job = Job(min_workers=1, heartbeat_interval=1, heartbeat_timeout=5)
    job.start("old")
    job.connections(old=0)  # it shows no connections: an older worker, a simulated one
    assert job.advance(4.0) == ()
    facts = job.advance(1.5)
    assert types(facts)[0] == "WorkerFailed"
    assert isinstance(facts[0], WorkerFailed) and facts[0].cause == "silent"
    assert facts[0].reason == "silent 5 s (no heartbeat)"


def test_a_silent_member_with_its_connections_open_fails_by_the_heartbeat_timeout() -> None:
    """A stopped or hung process (SIGSTOP) keeps its sockets: only its silence tells."""
    job = Job(min_workers=1, heartbeat_interval=1, heartbeat_timeout=5)
    job.start("a", "b")
    job.connections(a=1, b=1)
    for _ in range(5):
        job.alive("a")
        job.connections(a=1, b=1)
        assert job.advance(1.0) == ()
    job.alive("a")
    facts = job.advance(0.5)
    assert isinstance(facts[0], WorkerFailed) and (facts[0].worker, facts[0].cause) == (
        "b",
        "silent",
    )


def test_another_server_answering_starts_the_count_again_instead_of_failing_everyone() -> None:
    """A restart or a failover drops every client at once: nobody is closed by the new
    server's first reading, and a member is watched again once it shows up there."""
    job = running()
    job.connections(server="server-2", a=0, b=0, c=0)
    assert job.advance(1.0) == ()
    job.connections(server="server-2", a=1, b=1, c=1)
    job.connections(server="server-2", a=1, b=1, c=0)
    assert types(job.advance(0.35)) == ["WorkerFailed", "WorldChanged"]


def test_a_job_without_a_grace_fails_by_silence_alone() -> None:
    job = running(disconnect_grace=0)
    job.connections(a=1, b=1, c=0)
    assert job.advance(10.0) == ()
    assert JobConfig(disconnect_grace=0).disconnect_grace == 0


def test_the_leader_s_own_outage_excuses_closings_seen_before_it() -> None:
    """While the leader could not reach Redis, workers may have lost their connections too:
    a closing seen before the outage counts from the first reading after it."""
    job = running()
    job.connections(a=1, b=1, c=0)
    job.core.seen.excuse(["a", "b", "c"], job.now + 0.5)
    job.now += 1.0
    assert job.advance(0.0) == ()
    job.connections(a=1, b=1, c=0)
    assert job.advance(0.2) == ()
    assert types(job.advance(0.1)) == ["WorkerFailed", "WorldChanged"]


def test_a_failed_member_is_forgotten_and_its_next_join_is_watched_afresh() -> None:
    job = running()
    job.connections(a=1, b=1, c=0)
    job.advance(0.35)
    assert "c" not in job.state.members and "c" not in job.core.seen.closed
    assert "c" not in job.core.seen.connected_once


# ---------------------------------------------------------------- a launcher's word


def exited(job: Job, worker: str, how: str = "killed by SIGKILL") -> tuple[Fact, ...]:
    return job.send(ProcessExited(at=job.now, job=job.state.job, worker=worker, how=how))


def test_a_launcher_s_word_that_a_rank_s_process_exited_fails_it_at_once() -> None:
    """No grace and no timeout: the launcher saw the process end (waitpid), a certainty."""
    job = running()
    job.now += 0.01
    facts = exited(job, "c")
    assert types(facts) == ["WorkerFailed", "WorldChanged"]
    failed = facts[0]
    assert isinstance(failed, WorkerFailed) and (failed.cause, failed.how) == (
        "exited",
        "killed by SIGKILL",
    )
    assert failed.reason == "process exited (killed by SIGKILL)"
    assert failed.last_seen < job.now  # the launcher's word is no sign of c's life
    assert audit(job.journal).ok


def test_a_rank_that_already_finished_the_running_step_lets_it_commit_before_the_failure() -> None:
    job = running()
    job.done("a")
    job.done("c")  # c finished step 1 and died: every rank's gradient is in it
    facts = exited(job, "c")
    assert types(facts) == ["StepCommitted", "WorkerFailed", "WorldChanged"]


def test_the_word_of_a_worker_that_is_no_member_changes_nothing() -> None:
    job = running()
    job.leave("c")
    assert exited(job, "c") == ()
    assert exited(job, "never-joined") == ()


def test_after_the_end_an_exited_member_fails_without_a_new_world() -> None:
    job = Job(min_workers=1, heartbeat_interval=1, heartbeat_timeout=30, max_steps=1)
    job.start("a", "b")
    job.step()
    assert job.state.finished
    assert types(exited(job, "b")) == ["WorkerFailed"]


def test_cohort_status_flags_a_member_whose_connections_closed() -> None:
    job = running()
    job.connections(a=1, b=1, c=0)
    body = view(job.state)
    seen = {"connections": "closed", "closed_at": job.now, "last_seen": job.now}
    body["leader_view"] = {"coordinator": "c1", "at": job.now, "workers": {"c": seen}}
    out = Console(width=200, record=True, file=io.StringIO())
    out.print(status_view(body))
    rows = {line.split()[0]: line for line in out.export_text().splitlines() if line.strip()}
    assert "connections closed" in rows["c"] and "connections closed" not in rows["a"]


def test_failures_are_counted_by_their_cause_in_the_state_and_the_metrics() -> None:
    job = running(disconnect_grace=0.3)
    job.start("d")
    job.step()
    exited(job, "c")
    job.connections(a=1, b=0, d=1)
    assert types(job.advance(0.5)) == ["WorkerFailed", "WorldChanged"]
    job.alive("a")
    job.now += 31
    job.alive("a")
    assert types(job.advance(0.1)) == ["WorkerFailed", "WorldChanged"]  # d fell silent
    counters = job.state.counters
    assert (counters.failed, counters.disconnected, counters.exited) == (3, 1, 1)
    assert job.replayed() == job.state
    metrics = Metrics(JOB, "c1")
    metrics.update(job.state, True, 0.0, job.now)
    labels = {"job": JOB, "coordinator": "c1"}
    by_cause = {
        cause: metrics.registry.get_sample_value(
            "cohort_workers_failed_by_cause", {**labels, "cause": cause}
        )
        for cause in ("silent", "disconnected", "exited")
    }
    assert by_cause == {"silent": 1.0, "disconnected": 1.0, "exited": 1.0}
    out = Console(width=200, record=True, file=io.StringIO())
    out.print(status_view(view(job.state)))
    assert "failed 3 (1 silent, 1 disconnected, 1 exited)" in out.export_text()
