"""The membership protocol, rule by rule (docs/design.md "Membership")."""

from __future__ import annotations

from cohort.coordinator.audit import audit
from cohort.coordinator.state import dump, load, state_hash
from cohort.events.models import (
    GpuAdviceIssued,
    GpuDevice,
    GpuReading,
    JoinRefused,
    StepCommitted,
    StepDone,
    TrainingPaused,
    WeightsDiverged,
    WorkerFailed,
    WorldChanged,
)
from tests.unit.job import Job, types


def test_training_starts_once_min_workers_have_loaded_weights() -> None:
    job = Job(min_workers=2, dataset_size=100, batch_size=10)
    assert types(job.start("a")) == ["WorkerJoined", "WorkerSynced"]
    assert job.state.paused and not job.state.ranks
    facts = job.start("b")
    assert types(facts) == [
        "WorkerJoined",
        "WorkerSynced",
        "WorkerActivated",
        "WorkerActivated",
        "WorldChanged",
        "TrainingResumed",
    ]
    world = facts[4]
    assert isinstance(world, WorldChanged)
    assert world.ranks == ("a", "b") and world.start_step == 0 and world.epoch == 0
    assert [s.ranges for s in world.shards] == [((0, 50),), ((50, 100),)]


def test_join_beyond_max_workers_is_refused_with_a_reason() -> None:
    job = Job(min_workers=2, max_workers=2)
    job.start("a", "b")
    (refusal,) = job.join("c")
    assert isinstance(refusal, JoinRefused)
    assert "max_workers=2" in refusal.reason and refusal.worker == "c"
    assert "c" not in job.state.members


def test_a_repeated_command_changes_nothing() -> None:
    job = Job()
    job.start("a")
    before = job.state
    assert job.join("a") == ()
    assert job.ready("a") == ()
    assert job.state == before


def test_joiner_is_activated_at_the_next_step_boundary() -> None:
    job = Job(dataset_size=1000, batch_size=10)
    job.start("a")
    job.step()
    job.start("b")
    assert job.state.members["b"].status == "ready" and job.state.ranks == ("a",)
    facts = job.step()
    assert types(facts) == ["StepCommitted", "WorkerActivated", "WorldChanged"]
    world = facts[-1]
    assert isinstance(world, WorldChanged)
    assert world.ranks == ("a", "b") and world.start_step == 2
    # a used [0, 20) in steps 0 and 1; the rest of the epoch is split over both.
    assert [s.ranges for s in world.shards] == [((20, 510),), ((510, 1000),)]


def test_step_commits_only_when_every_rank_has_reported_it() -> None:
    job = Job(min_workers=2)
    job.start("a", "b")
    assert job.done("a") == ()
    assert types(job.done("b")) == ["StepCommitted"]
    assert job.state.last_committed == 0


def test_reports_from_an_older_world_do_not_commit() -> None:
    job = Job()
    job.start("a")
    job.start("b")  # paused? no: a is running, b waits for the boundary
    job.step()
    old = job.state.world_version - 1
    assert job.done("a", world=old) == ()
    assert job.done("b", world=old) == ()
    assert job.state.last_committed == 0


def test_heartbeat_progress_completes_a_step_a_new_leader_missed() -> None:
    job = Job(min_workers=2)
    job.start("a", "b")
    job.done("a")
    assert types(job.heartbeat("b", step=0, world=job.state.world_version)) == ["StepCommitted"]


def test_silent_worker_fails_and_its_shard_is_reassigned_without_loss() -> None:
    job = Job(
        min_workers=2, heartbeat_interval=1, heartbeat_timeout=5, dataset_size=90, batch_size=5
    )
    job.start("a", "b", "c")
    job.step()  # a and b ran step 0; c is activated at its end
    job.done("a")  # step 1 is running: only a finished it
    for _ in range(5):
        job.alive("a", "b")
        assert job.advance(1.0) == ()
    job.alive("a", "b")
    facts = job.advance(1.0)
    # a finished step 1, so every rank contributed to it: it commits, then c is gone.
    assert types(facts) == ["StepCommitted", "WorkerFailed", "WorldChanged"]
    failed, world = facts[1], facts[2]
    assert isinstance(failed, WorkerFailed) and failed.worker == "c" and failed.timeout == 5
    assert isinstance(world, WorldChanged) and world.ranks == ("a", "b") and world.start_step == 2
    # step 0 used 10 of 90 samples, step 1 another 15; the 65 left are split again.
    assert sum(s.size for s in world.shards) == 65
    assert audit(job.journal).ok


def test_failure_aborts_a_step_no_rank_finished() -> None:
    job = Job(min_workers=1, max_workers=4)
    job.start("a")
    job.start("b")
    job.step()  # b is activated at this boundary
    assert job.state.ranks == ("a", "b")
    job.alive("a")
    job.now += 3
    job.alive("a")
    facts = job.advance(3)
    assert types(facts) == ["WorkerFailed", "WorldChanged"]
    assert job.state.last_committed == 0 and job.state.next_step == 1
    assert job.state.ranks == ("a",)


def test_a_joiner_decided_from_a_backlog_is_judged_by_its_latest_heartbeat_not_its_join() -> None:
    """Workers started long before any coordinator: each Join is decided as of its arrival,
    then the heartbeats behind it (sent while the worker waited), then time is judged."""
    job = Job(min_workers=2, heartbeat_interval=1, heartbeat_timeout=5)
    joined_at = job.now
    job.join("a")
    job.join("b")
    for _ in range(40):  # eight timeouts of waiting, all in the backlog
        job.now += 1
        job.alive("a", "b")
    assert job.advance(0.5) == ()
    assert {w: m.joined_at for w, m in job.state.members.items()} == {
        "a": joined_at,
        "b": joined_at,
    }
    job.now += 1
    job.alive("a")  # b stops
    facts = job.advance(5)
    assert types(facts) == ["WorkerFailed"]
    failed = facts[0]
    assert isinstance(failed, WorkerFailed) and failed.worker == "b"
    assert failed.last_seen == joined_at + 40  # its last heartbeat, not its Join


def test_a_joiner_that_gave_up_waiting_leaves_instead_of_failing() -> None:
    """A worker stopped before any coordinator answered takes its Join back with a Leave:
    the leader that decides both later lets it go at once."""
    job = Job(heartbeat_timeout=5)
    job.join("a")
    job.now += 60
    assert types(job.leave("a", reason="gave up joining")) == ["WorkerLeft"]
    assert job.advance(10) == ()
    assert "a" not in job.state.members and "a" not in job.core.seen.last_seen


def test_a_refused_joiner_that_heartbeated_in_the_backlog_is_never_judged() -> None:
    job = Job(min_workers=1, max_workers=1, heartbeat_timeout=5)
    job.start("a")
    assert types(job.join("b")) == ["JoinRefused"]
    for _ in range(3):
        job.now += 1
        job.alive("a", "b")  # b heartbeated while its Join waited in the backlog
    for _ in range(10):  # then b learns of the refusal and stops
        job.alive("a")
        assert job.advance(1) == ()
    assert list(job.state.members) == ["a"]


def test_leave_drains_until_its_step_commits() -> None:
    job = Job(min_workers=2)
    job.start("a", "b")
    assert types(job.leave("b", after_step=1)) == ["WorkerLeaving"]
    job.start("c")  # keeps the world at min_workers after b leaves
    assert types(job.step()) == ["StepCommitted", "WorkerActivated", "WorldChanged"]
    facts = job.step()
    assert types(facts) == ["StepCommitted", "WorkerLeft", "WorldChanged"]
    assert job.state.ranks == ("a", "c") and "b" not in job.state.members


def test_leave_of_a_worker_not_yet_in_the_world_is_immediate() -> None:
    job = Job()
    job.start("a")
    job.join("b")
    assert types(job.leave("b")) == ["WorkerLeft"]


def test_falling_below_min_workers_pauses_and_a_ready_joiner_resumes() -> None:
    job = Job(min_workers=2)
    job.start("a", "b")
    facts = job.leave("b")
    assert types(facts) == ["WorkerLeft", "WorldChanged", "TrainingPaused"]
    assert isinstance(facts[-1], TrainingPaused) and facts[-1].min_workers == 2
    assert job.step() == ()  # no commits while paused
    job.join("c")
    facts = job.ready("c")
    assert types(facts) == ["WorkerSynced", "WorkerActivated", "WorldChanged", "TrainingResumed"]
    assert job.state.ranks == ("a", "c") and not job.state.paused


def test_epoch_ends_when_every_shard_is_used_and_the_next_splits_the_whole_dataset() -> None:
    job = Job(min_workers=2, dataset_size=40, batch_size=10)
    job.start("a", "b")
    job.step()
    facts = job.step()
    assert types(facts) == ["StepCommitted", "EpochFinished", "EpochStarted"]
    assert job.state.epoch == 1 and job.state.base_step == 2
    report = audit(job.journal)
    assert report.ok and report.epochs[0].finished and report.epochs[0].used == 40


def test_every_sample_used_once_across_join_leave_and_failure() -> None:
    job = Job(min_workers=2, dataset_size=103, batch_size=4, heartbeat_timeout=5)
    job.start("a", "b")
    job.step()
    job.start("c")
    job.step()
    job.leave("a", after_step=job.state.next_step)
    job.step()
    job.done("b")
    job.alive("b")
    job.now += 4
    job.alive("b")
    assert "WorkerFailed" in types(job.advance(2))  # c fails
    job.start("d")  # back to min_workers
    committed_epochs = 0
    for _ in range(40):
        if any(isinstance(f, StepCommitted) for f in job.step()):
            committed_epochs = job.state.counters.epochs_finished
    assert committed_epochs >= 1
    report = audit(job.journal)
    assert report.ok, report
    assert report.epochs[0].used == 103


def test_straggler_is_flagged_after_a_streak_and_cleared_after_recovering() -> None:
    job = Job(min_workers=3, straggler_factor=1.5, straggler_steps=3)
    job.start("a", "b", "c")
    slow = {"a": 1.0, "b": 1.0, "c": 2.0}
    assert "StragglerDetected" not in types(job.step(slow) + job.step(slow))
    facts = job.step(slow)
    assert "StragglerDetected" in types(facts)
    assert job.state.members["c"].straggler
    assert "StragglerCleared" not in types(job.step() + job.step())
    assert "StragglerCleared" in types(job.step())
    assert not job.state.members["c"].straggler


def test_replay_of_the_journal_equals_the_live_state_and_snapshots_round_trip() -> None:
    job = Job(min_workers=2, dataset_size=50, batch_size=3)
    job.start("a", "b")
    for _ in range(5):
        job.step()
    job.leave("a", after_step=job.state.next_step)
    job.step()
    assert job.replayed() == job.state
    assert load(dump(job.state)) == job.state
    assert state_hash(load(dump(job.state))) == state_hash(job.state)


def test_a_thousand_workers_starting_at_once_get_one_world_with_a_bounded_reason() -> None:
    job = Job(min_workers=1000, max_workers=1000, dataset_size=10_000)
    names = [f"w{i:04d}" for i in range(1000)]
    for name in names:
        job.join(name)
    facts = ()
    for name in names:
        facts = job.ready(name)
    world = next(f for f in facts if isinstance(f, WorldChanged))
    assert world.ranks == tuple(names)
    assert "and 992 more joined" in world.reason


def test_ranks_reporting_different_weight_digests_after_a_commit_are_named() -> None:
    job = Job(min_workers=3)
    job.start("a", "b", "c")
    job.step()
    job.send(StepDone(at=job.now, job="unit", worker="a", step=1, world=1, digest="aa" * 8))
    job.send(StepDone(at=job.now, job="unit", worker="b", step=1, world=1, digest="aa" * 8))
    facts = job.send(StepDone(at=job.now, job="unit", worker="c", step=1, world=1, digest="bb" * 8))
    assert types(facts)[:2] == ["StepCommitted", "WeightsDiverged"]
    diverged = facts[1]
    assert isinstance(diverged, WeightsDiverged) and diverged.step == 1
    assert diverged.groups == {"aa" * 8: ("a", "b"), "bb" * 8: ("c",)}
    agreeing = [
        StepDone(at=job.now, job="unit", worker=w, step=2, world=1, digest="cc" * 8) for w in "abc"
    ]
    assert "WeightsDiverged" not in types([f for c in agreeing for f in job.send(c)])


def _reading(job: Job, worker: str, used: int, temperature: float = 50.0):  # type: ignore[no-untyped-def]
    device = GpuDevice(
        index=0, name="A100", memory_total=100, memory_used=used, temperature=temperature
    )
    return job.send(GpuReading(at=job.now, job="unit", worker=worker, devices=(device,)))


def test_gpu_memory_pressure_gets_reduce_prefetch_advice_that_clears_with_hysteresis() -> None:
    job = Job()
    job.start("a")
    issued = _reading(job, "a", used=92)
    assert "GpuAdviceIssued" in types(issued)
    advice = next(
        f for f in issued if isinstance(f, GpuAdviceIssued) and f.action == "reduce_prefetch"
    )
    assert (advice.worker, advice.device, advice.factor, advice.value) == ("a", 0, 0.5, 92.0)
    assert _reading(job, "a", used=93) == ()  # still hot: nothing new
    assert _reading(job, "a", used=83) == ()  # inside the hysteresis band: holds
    cleared = _reading(job, "a", used=60)
    assert {type(f).__name__ for f in cleared} == {"GpuAdviceCleared"}
    assert job.state.advice == frozenset()
    assert job.replayed() == job.state


def test_a_departing_worker_takes_its_gpu_advice_with_it() -> None:
    job = Job()
    job.start("a")
    _reading(job, "a", used=92)
    assert job.state.advice
    job.leave("a")
    assert job.state.advice == frozenset()


def test_the_first_world_waits_for_start_workers_so_step_0_is_trained_by_all() -> None:
    """`cohort run -n 3` gives start_workers=3: the first ready rank does not train step 0
    alone (issue 47, item 4)."""
    job = Job(start_workers=3, dataset_size=90, batch_size=10)
    assert "WorldChanged" not in types(job.start("a") + job.start("b"))
    assert job.state.paused and not job.state.started
    world = [f for f in job.start("c") if isinstance(f, WorldChanged)]
    assert [w.ranks for w in world] == [("a", "b", "c")] and world[0].start_step == 0


def test_the_first_world_starts_with_those_ready_once_start_wait_runs_out() -> None:
    """A rank that cannot start holds the job up for start_wait seconds, no longer, and the
    world says who is missing."""
    job = Job(start_workers=3, start_wait=10.0, heartbeat_timeout=60.0)
    job.start("a", "b")
    assert "WorldChanged" not in types(job.advance(9.0))
    world = [f for f in job.advance(1.0) if isinstance(f, WorldChanged)]
    assert [w.ranks for w in world] == [("a", "b")]
    assert "1 of start_workers=3 did not come within start_wait=10 s" in world[0].reason
    assert job.replayed() == job.state  # the journal tells the same story
