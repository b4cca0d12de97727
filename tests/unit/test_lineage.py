"""Weight lineage and checkpoints, rule by rule (invariant 9 of docs/design.md).

Every world says which weights it starts from; when no rank holds the last committed
ones, the leader rewinds to the latest checkpoint (data position included) or pauses
until an operator resumes. The audit checks exactly-once on the lineage the final
model descends from.
"""

from __future__ import annotations

from typing import Any

from cohort.coordinator.audit import audit
from cohort.coordinator.state import dump, load
from cohort.events.models import (
    CheckpointExpired,
    CheckpointRequested,
    CheckpointSaved,
    DataPosition,
    Rewound,
    StepCommitted,
    TrainingPaused,
    Weights,
    WeightsLost,
    WorldChanged,
)
from cohort.events.shards import Shard
from tests.unit.job import Job, types

URI = "file:///ckpt/job"


def checkpointed(**config: Any) -> Job:
    return Job(
        **{
            "dataset_size": 100,
            "batch_size": 10,
            "heartbeat_timeout": 3,
            "heartbeat_interval": 1,
            "checkpoint_uri": URI,
            "checkpoint_every": 2,
            **config,
        }
    )


def of(kind: type, facts: Any) -> list[Any]:
    return [f for f in facts if isinstance(f, kind)]


def steps(job: Job, count: int, digest: str = "d0d0d0d0") -> list[Any]:
    facts: list[Any] = []
    for _ in range(count):
        for worker in job.state.ranks:
            facts += job.done(worker, digest=digest)
    return facts


def all_fail(job: Job) -> list[Any]:
    job.now += 10  # nobody heartbeats: every member is silent past the timeout
    return list(job.advance(0))


def test_every_world_names_the_weights_it_starts_from() -> None:
    job = checkpointed()
    (first,) = of(WorldChanged, job.start("a"))
    assert first.weights == Weights(step=-1, source="initial")
    steps(job, 3, digest="abcd1234")
    job.start("b")
    (second,) = of(WorldChanged, steps(job, 1, digest="abcd1234"))
    assert second.ranks == ("a", "b")
    assert second.weights == Weights(step=3, source="rank", digest="abcd1234")
    assert job.state.holders == {
        "a"
    }  # b got a's weights by broadcast; it holds them once it commits


def test_a_step_commits_with_the_digest_its_ranks_agree_on() -> None:
    job = checkpointed(min_workers=2)
    job.start("a", "b")
    job.done("a", digest="aaaa0000")
    (commit,) = of(StepCommitted, job.done("b", digest="aaaa0000"))
    assert commit.digest == "aaaa0000"
    job.done("a", digest="aaaa1111")
    (commit,) = of(StepCommitted, job.done("b", digest="bbbb1111"))
    assert commit.digest is None and job.state.last_digest is None


def test_a_holder_is_asked_to_checkpoint_every_n_steps_with_the_data_position() -> None:
    job = checkpointed(min_workers=2)
    job.start("a", "b")
    facts = steps(job, 4)
    requests = of(CheckpointRequested, facts)
    assert [r.step for r in requests] == [1, 3]
    assert all(r.worker == "a" for r in requests)
    assert requests[0].uri == f"{URI}/step-000000000001.ckpt"
    # after step 1 each rank used 2 batches of 10 from its half of [0, 100)
    assert requests[0].position == DataPosition(epoch=0, rest=Shard(ranges=((20, 50), (70, 100))))


def test_a_written_checkpoint_is_indexed_and_the_oldest_beyond_keep_expire() -> None:
    job = checkpointed(checkpoint_keep=2)
    job.start("a")
    facts = steps(job, 6)
    requests = of(CheckpointRequested, facts)
    saved = [f for r in requests for f in job.checkpoint_written(r, digest="d0d0d0d0")]
    assert types(saved) == [
        "CheckpointSaved",
        "CheckpointSaved",
        "CheckpointSaved",
        "CheckpointExpired",
    ]
    expired = saved[-1]
    assert isinstance(expired, CheckpointExpired)
    assert expired.step == 1 and expired.worker == "a"  # the newest writer deletes it
    assert [c.step for c in job.state.checkpoints] == [3, 5] and job.state.requested == ()


def test_an_unrequested_or_repeated_checkpoint_report_is_ignored() -> None:
    job = checkpointed()
    job.start("a")
    (request,) = of(CheckpointRequested, steps(job, 2))
    forged = request.model_copy(update={"worker": "mallory"})
    assert job.checkpoint_written(forged) == ()
    assert types(job.checkpoint_written(request)) == ["CheckpointSaved"]
    assert job.checkpoint_written(request) == ()


def test_when_every_rank_died_the_next_world_rewinds_to_the_latest_checkpoint() -> None:
    job = checkpointed(min_workers=2)
    job.start("a", "b")
    facts = steps(job, 5)  # steps 0-4; checkpoints asked after 1 and 3
    for request in of(CheckpointRequested, facts):
        job.checkpoint_written(request, digest="d0d0d0d0")
    all_fail(job)
    assert job.state.ranks == () and job.state.last_committed == 4
    facts = list(job.start("c", "d"))
    (rewind,) = of(Rewound, facts)
    assert (rewind.from_step, rewind.to_step, rewind.source) == (4, 3, "checkpoint")
    assert rewind.uri == f"{URI}/step-000000000003.ckpt"
    (world,) = of(WorldChanged, facts)
    assert world.ranks == ("c", "d") and world.start_step == 4
    assert world.weights is not None and world.weights.source == "checkpoint"
    assert world.weights.uri == rewind.uri and world.weights.step == 3
    # step 4's samples are back: the world holds everything after step 3
    assert [s.ranges for s in world.shards] == [((40, 50),), ((90, 100),)]
    assert not job.state.paused
    steps(job, 1)
    report = audit(job.journal)
    assert report.ok, report.problems
    assert report.rewinds == [(4, 3, "checkpoint")] and report.discarded == 1


def test_the_lineage_audit_holds_through_a_rewind_to_the_end_of_the_epoch() -> None:
    job = checkpointed(min_workers=2)
    job.start("a", "b")
    facts = steps(job, 5)
    for request in of(CheckpointRequested, facts):
        job.checkpoint_written(request)
    all_fail(job)
    job.start("c", "d")
    steps(job, 6)  # the 2 x 10 samples left after step 3, then a new epoch
    report = audit(job.journal)
    assert report.ok, report.problems
    assert report.epochs[0].finished and report.epochs[0].used == 100
    assert report.epochs[1].used == 100  # steps 5-9 of epoch 1, 2 x 10 each


def test_the_audit_counts_a_rewound_jobs_steps_and_epochs_on_its_lineage_once() -> None:
    """A resumed run rewinds to its checkpoint and commits some steps (and an epoch's end)
    again: its length is the lineage's, not the journal's counters (issue 47, item 9)."""
    job = checkpointed(min_workers=2)
    job.start("a", "b")
    facts = steps(job, 7)  # 5 steps an epoch: epoch 0 ends at step 4
    for request in of(CheckpointRequested, facts):
        if request.step <= 3:  # step 5's checkpoint never lands
            job.checkpoint_written(request)
    all_fail(job)
    job.start("c", "d")  # back to step 3: steps 4-6 are done again, and epoch 0's end
    steps(job, 6)  # steps 4-9: epoch 0 ends again, then epoch 1
    report = audit(job.journal)
    assert report.ok, report.problems
    counters = job.state.counters
    assert (counters.steps_committed, counters.epochs_finished) == (13, 3)
    assert (report.steps, report.epochs_finished, report.discarded) == (10, 2, 3)
    assert report.steps == job.state.last_committed + 1


def test_without_a_checkpoint_a_lost_world_pauses_until_resumed_from_scratch() -> None:
    job = checkpointed(checkpoint_uri=None)
    job.start("a")
    steps(job, 3)
    all_fail(job)
    facts = list(job.start("b"))
    (lost,) = of(WeightsLost, facts)
    assert lost.step == 2
    (pause,) = of(TrainingPaused, facts)
    assert "weights of step 2 are lost" in pause.reason and "--from-scratch" in pause.reason
    (world,) = of(WorldChanged, facts)
    assert world.ranks == () and "weights of step 2 are lost" in world.reason
    assert "cohort resume" in world.reason and job.state.paused
    steps(job, 1)
    assert job.state.last_committed == 2  # nobody trains on fresh weights
    facts = list(job.resume())
    (rewind,) = of(Rewound, facts)
    assert (rewind.to_step, rewind.source) == (-1, "scratch")
    (world,) = of(WorldChanged, facts)
    assert world.ranks == ("b",) and world.start_step == 0 and world.epoch == 0
    assert world.weights == Weights(step=-1, source="initial")
    assert types(facts)[-1] == "TrainingResumed"
    steps(job, 10)
    report = audit(job.journal)
    assert report.ok, report.problems
    assert report.epochs[0].finished and report.discarded == 3


def test_resume_from_a_checkpoint_file_continues_at_its_step_and_position() -> None:
    job = checkpointed(checkpoint_uri=None)
    job.start("a")
    steps(job, 3)
    all_fail(job)
    job.start("b")
    position = DataPosition(epoch=0, rest=Shard(ranges=((20, 100),)))
    facts = list(
        job.resume(
            uri="file:///elsewhere/step-1.ckpt",
            step=1,
            digest="d0d0d0d0",
            sha256="cd" * 32,
            position=position,
        )  # fmt: skip
    )
    (world,) = of(WorldChanged, facts)
    assert world.start_step == 2 and world.shards[0].ranges == ((20, 100),)
    assert world.weights is not None and world.weights.uri == "file:///elsewhere/step-1.ckpt"
    assert world.weights.sha256 == "cd" * 32


def test_a_resume_while_nothing_is_lost_is_ignored() -> None:
    job = checkpointed()
    job.start("a")
    steps(job, 2)
    assert job.resume() == ()
    assert job.state.last_committed == 1


def test_joiners_do_not_inherit_weights_their_holders_took_with_them() -> None:
    job = checkpointed(checkpoint_uri=None)
    job.start("a")
    steps(job, 2)
    job.start("b")
    job.step()  # b activated at the boundary of step 2, before it committed anything
    assert job.state.ranks == ("a", "b") and job.state.holders == {"a"}
    job.now += 10
    job.alive("b")
    facts = job.advance(0)  # a is silent: it fails; b alone cannot start from its weights
    assert of(WeightsLost, facts) and job.state.ranks == ()


def test_a_rank_of_a_surviving_holder_keeps_the_lineage_without_a_checkpoint() -> None:
    job = checkpointed(checkpoint_uri=None, min_workers=2)
    job.start("a", "b")
    steps(job, 2)
    job.now += 10
    job.alive("b")
    (world,) = of(WorldChanged, job.advance(0))
    assert world.ranks == ("b",) and world.weights is not None
    assert world.weights.source == "rank" and world.weights.step == 1


def test_the_audit_flags_a_world_that_starts_from_weights_nobody_holds() -> None:
    job = checkpointed(checkpoint_uri=None, min_workers=2)
    job.start("a", "b")
    steps(job, 2)
    forged = WorldChanged(
        at=job.now, job=job.state.job, version=job.state.world_version + 1, start_step=2,
        epoch=0, ranks=("z",), shards=(Shard(ranges=((40, 100),)),), reason="forged",
        weights=Weights(step=1, source="rank"),
    )  # fmt: skip
    report = audit([*job.journal, forged])
    assert not report.ok
    assert any("'z' does not hold the weights" in p for p in report.problems)


def test_lineage_state_survives_a_snapshot_round_trip() -> None:
    job = checkpointed(min_workers=2)
    job.start("a", "b")
    for request in of(CheckpointRequested, steps(job, 4)):
        job.checkpoint_written(request)
    state = job.state
    assert state.checkpoints and state.holders
    assert load(dump(state)) == state
    assert isinstance(state.checkpoints[0], CheckpointSaved)


def test_joiners_waiting_when_every_rank_dies_start_at_once_from_the_checkpoint() -> None:
    job = checkpointed(min_workers=2)
    job.start("a", "b")
    for request in of(CheckpointRequested, steps(job, 3)):
        job.checkpoint_written(request)
    job.start("c", "d")  # ready, waiting for the next step boundary
    job.now += 10
    job.alive("c", "d")
    facts = job.advance(0)  # a and b are silent: both fail; c and d are all there is
    assert types(facts) == [
        "WorkerFailed",
        "WorkerFailed",
        "WorldChanged",
        "TrainingPaused",
        "WorkerActivated",
        "WorkerActivated",
        "Rewound",
        "WorldChanged",
        "TrainingResumed",
    ]
    world = of(WorldChanged, facts)[-1]
    assert world.ranks == ("c", "d") and world.weights is not None
    assert world.weights.source == "checkpoint" and world.start_step == 2
