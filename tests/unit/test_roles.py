"""Roles: an evaluator is a member without a rank, a shard, or a say in min_workers."""

from __future__ import annotations

from pathlib import Path

from cohort.coordinator.replay import view
from cohort.coordinator.series import series
from cohort.events.codec import decode_fact
from cohort.events.models import EvalDone, EvalReported, Join, WorkerJoined
from tests.unit.job import JOB, Job, types

FIXTURES = Path(__file__).parent.parent / "fixtures" / "events"


def _evaluator(job: Job, worker: str = "e") -> None:
    job.send(Join(at=job.now, job=JOB, worker=worker, role="evaluator"))


def _eval(job: Job, worker: str, step: int, **metrics: float):  # type: ignore[no-untyped-def]
    return job.send(EvalDone(at=job.now, job=JOB, worker=worker, step=step, metrics=metrics))


def test_an_evaluator_holds_no_rank_and_does_not_make_up_min_workers() -> None:
    job = Job(min_workers=2)
    _evaluator(job)
    job.join("a")
    job.ready("a")
    job.ready("e")  # even if it sent WeightsLoaded, it is not synced into a world
    state = job.state
    assert state.paused and state.ranks == () and state.members["e"].status == "evaluating"
    job.join("b")
    job.ready("b")
    assert job.state.ranks == ("a", "b") and job.state.chief == "a"
    assert job.state.members["e"].role == "evaluator" and len(job.state.shards) == 2


def test_a_silent_evaluator_fails_without_a_new_world_or_an_aborted_step() -> None:
    job = Job(heartbeat_timeout=5.0, min_workers=2)
    _evaluator(job)
    job.start("a", "b")
    world = job.state.world_version
    job.done("a")  # step 0 half done when the evaluator goes silent
    job.now += 3
    job.alive("a", "b")
    facts = job.advance(3)  # e silent for 6 s, a and b for 3
    assert types(facts) == ["WorkerFailed"] and facts[0].worker == "e"  # type: ignore[union-attr]
    assert job.state.world_version == world
    assert types(job.done("b", step=0))[0] == "StepCommitted"


def test_an_evaluators_metrics_of_a_committed_step_are_journaled_and_no_agents() -> None:
    job = Job()
    _evaluator(job)
    job.send(Join(at=job.now, job=JOB, worker="g", role="agent"))
    job.start("a")
    job.step()
    assert _eval(job, "e", 1, loss=0.5) == ()  # step 1 never committed
    assert _eval(job, "g", 0, loss=0.5) == ()  # a torchrun agent evaluates nothing
    (fact,) = _eval(job, "e", 0, loss=0.5, accuracy=0.9)
    assert isinstance(fact, EvalReported) and fact.metrics == {"loss": 0.5, "accuracy": 0.9}
    assert job.state.evals == (fact,) and job.replayed() == job.state
    body = view(job.state)
    assert body["evals"][0]["metrics"]["accuracy"] == 0.9 and body["chief"] == "a"


def test_an_evaluation_after_the_end_is_still_journaled() -> None:
    job = Job(max_steps=1)
    _evaluator(job)
    job.start("a")
    job.step()
    assert job.state.finished
    assert types(_eval(job, "e", 0, loss=0.1)) == ["EvalReported"]


def test_a_member_joined_before_v3_reads_as_a_trainer() -> None:
    joined = decode_fact((FIXTURES / "WorkerJoined.v2.msgpack").read_bytes())
    assert isinstance(joined, WorkerJoined)
    assert (joined.v, joined.worker, joined.role) == (4, "w-v2", "trainer")
    assert joined.node is not None and joined.node.zone == "z1"


def test_the_report_plots_each_evaluators_metrics() -> None:
    from cohort.coordinator.replay import Run
    from cohort.events.codec import FIELD, encode
    from cohort.events.streams import Entry

    job = Job()
    _evaluator(job)
    job.start("a")
    for step in range(3):
        job.step()
        job.now += 1
        _eval(job, "e", step, loss=1.0 / (step + 1))
    run = Run(
        JOB, journal=[Entry(f"{i + 1}-0", {FIELD: encode(f)}) for i, f in enumerate(job.journal)]
    )
    data = series(run)
    (line,) = data.evaluation
    assert line.label == "e loss" and [v for _, v in line.points] == [1.0, 0.5, 1 / 3]


def test_an_evaluators_bad_report_is_refused_naming_the_value() -> None:
    import fakeredis
    import pytest

    from cohort.worker.loop.evaluator import Evaluator

    evaluator = Evaluator(fakeredis.FakeRedis(), JOB, worker_id="e")
    with pytest.raises(ValueError, match="evaluation metrics.bad name='bad name': String"):
        evaluator.report(3, {"bad name": 1.0})
    with pytest.raises(ValueError, match="evaluation step=-1"):
        evaluator.report(-1, {"loss": 1.0})
    with pytest.raises(ValueError, match="every=0"):
        Evaluator(fakeredis.FakeRedis(), JOB, every=0)


def test_a_trainers_figures_after_its_last_step_are_journaled_and_plotted_with_its_own() -> None:
    """What a script records after the job's last step (the last epoch's validation) comes
    as EvalDone when its loops end: journaled after the end, shown in `status --json`'s
    evals and drawn in the report with the figures the trainer recorded with its steps."""
    from cohort.coordinator.replay import Run
    from cohort.events.codec import FIELD, encode
    from cohort.events.streams import Entry

    job = Job(max_steps=1)
    job.start("a")
    job.step()
    assert job.state.finished
    (fact,) = _eval(job, "a", 0, val_loss=0.25, loss=0.5)
    assert isinstance(fact, EvalReported)
    said = view(job.state)["evals"][-1]
    assert (said["worker"], said["step"], said["metrics"]) == ("a", 0, fact.metrics)
    run = Run(
        JOB, journal=[Entry(f"{i + 1}-0", {FIELD: encode(f)}) for i, f in enumerate(job.journal)]
    )
    data = series(run)
    assert data.evaluation == ()  # a trainer's figures are no evaluator's line
    ((name, (line,)),) = data.figures
    assert (name, line.label, [v for _, v in line.points]) == ("val_loss", "a", [0.25])
    (loss,) = data.loss
    assert (loss.label, [v for _, v in loss.points]) == ("a", [0.5])
