"""Warm spares, the protocol's rules: a spare syncs like any joiner, waits outside every world,
and takes a lost rank's place in the decision that loses it (invariant 11 of
docs/design.md). The leader's state, a replay of its journal and a worker's view agree."""

from __future__ import annotations

import io

from rich.console import Console

from cohort.coordinator.audit import audit
from cohort.coordinator.metrics import Metrics
from cohort.coordinator.replay import view
from cohort.coordinator.spares import replacing
from cohort.coordinator.state import Member
from cohort.events import models as m
from cohort.events.models import Join, Node, SparePromoted, WorkerActivated
from cohort.render.page import render
from cohort.render.terminal import status_view
from cohort.worker.membership.view import View
from cohort.worker.membership.view import fold as view_fold
from tests.unit.job import JOB, Job, types

HOSTS = {"a": "h1", "b": "h2", "c": "h3", "s1": "h2", "s2": "h1", "s3": "h3"}


def _job(**config: object) -> Job:
    """A job whose workers each say which machine they run on (HOSTS)."""
    return Job(nodes=lambda worker: Node(host=HOSTS.get(worker, "h9")), **config)  # type: ignore[arg-type]


def _spare(job: Job, worker: str, ready: bool = True) -> None:
    job.send(Join(at=job.now, job=JOB, worker=worker, node=job.nodes(worker), spare=True))
    if ready:
        job.now += 1  # ready later than the one before: promoted after it
        job.ready(worker)


def _promoted(facts: tuple[m.Fact, ...]) -> list[tuple[str, str | None]]:
    return [(f.worker, f.replaces) for f in facts if isinstance(f, SparePromoted)]


def _training(**config: object) -> Job:
    """Ranks a, b, c training (min_workers 2), a ready spare s1 on b's machine."""
    job = _job(heartbeat_timeout=5.0, min_workers=2, **config)
    job.start("a", "b", "c")
    _spare(job, "s1")
    job.step()
    return job


def _terminal(body: dict[str, object]) -> str:
    """What `cohort status` prints of a state's view."""
    out = Console(width=200, record=True, file=io.StringIO())
    out.print(status_view(body))
    return out.export_text()


def _agrees(job: Job) -> None:
    """The leader's state is its journal's fold, the audit passes, and a worker's view of
    the journal says what the state says of it."""
    assert job.replayed() == job.state
    assert audit(job.journal).ok
    for worker, member in job.state.members.items():
        seen = view_fold(job.journal, View(worker=worker))
        assert (seen.status, seen.spare) == (member.status, member.spare), worker
        assert (seen.assignment is not None) == (worker in job.state.ranks), worker


def test_a_ready_spare_is_never_activated_at_a_step_boundary_and_counts_toward_no_world() -> None:
    job = _training()
    for _ in range(3):
        facts = job.step()
        assert not [f for f in facts if isinstance(f, WorkerActivated | SparePromoted)]
    state = job.state
    assert state.ranks == ("a", "b", "c") and state.members["s1"].status == "ready"
    assert state.members["s1"].spare and len(state.shards) == 3
    _agrees(job)


def test_a_failed_rank_is_replaced_by_a_spare_in_the_same_decision() -> None:
    job = _training()
    job.done("a")
    job.now += 3
    job.alive("a", "c", "s1")
    facts = job.advance(3)  # b silent for 6 s
    assert types(facts)[-3:] == ["WorkerFailed", "SparePromoted", "WorldChanged"]
    assert _promoted(facts) == [("s1", "b")]
    world = facts[-1]
    assert isinstance(world, m.WorldChanged)
    assert world.ranks == ("a", "c", "s1")  # survivors keep their order, the spare follows
    assert world.weights is not None and world.weights.source == "rank"  # from rank 0
    assert "spare s1 for b" in world.reason
    member = job.state.members["s1"]
    assert (member.status, member.spare, job.state.counters.promotions) == ("active", False, 1)
    assert not job.state.paused
    _agrees(job)


def test_a_rank_that_leaves_is_replaced_by_a_spare() -> None:
    job = _training()
    facts = job.leave("c")  # a rank leaving now (nothing to finish)
    assert types(facts) == ["WorkerLeft", "SparePromoted", "WorldChanged"]
    assert _promoted(facts) == [("s1", "c")] and job.state.ranks == ("a", "b", "s1")
    _agrees(job)


def test_a_drained_rank_is_replaced_at_the_boundary_it_leaves_at() -> None:
    job = _training()
    step, world = job.state.next_step, job.state.world_version
    assert types(job.leave("c", after_step=step)) == ["WorkerLeaving"]
    facts = job.step()
    assert _promoted(facts) == [("s1", "c")]
    assert job.state.ranks == ("a", "b", "s1") and job.state.world_version == world + 1
    _agrees(job)


def test_a_rank_removed_for_its_data_is_replaced_by_a_spare() -> None:
    job = _training()
    world, step = job.state.world_version, job.state.next_step
    job.send(m.DataRefused(at=job.now, job=JOB, worker="a", accused="c", world=world, step=step))
    facts = job.send(
        m.DataRefused(at=job.now, job=JOB, worker="b", accused="c", world=world, step=step)
    )
    assert types(facts) == ["WorkerLeft", "SparePromoted", "WorldChanged"]
    assert job.state.ranks == ("a", "b", "s1")
    _agrees(job)


def test_a_spare_on_the_lost_ranks_machine_goes_first_then_the_one_ready_longest() -> None:
    job = _job(heartbeat_timeout=5.0, min_workers=3)
    job.start("a", "b", "c")
    _spare(job, "s1")  # on h2, ready first
    _spare(job, "s2")  # on h1
    _spare(job, "s3")  # on h3, ready last
    job.step()
    state = job.state
    lost = [state.members["a"], state.members["b"]]  # on h1 and h2
    assert replacing(state, lost) == [("s2", "a"), ("s1", "b")]
    assert replacing(state, [state.members["c"]]) == [("s3", "c")]
    elsewhere = Node(host="h7")
    stranger = Member("x", "active", 0.0, node=elsewhere)
    assert replacing(state, [stranger]) == [("s1", "x")]  # ready longest
    job.now += 3
    job.alive("c", "s1", "s2", "s3")
    facts = job.advance(3)  # a and b fail at once: one spare each
    assert _promoted(facts) == [("s2", "a"), ("s1", "b")]
    assert job.state.ranks == ("c", "s1", "s2")  # newcomers follow, in the order they joined
    assert job.state.members["s3"].spare
    _agrees(job)


def test_with_fewer_ready_spares_than_lost_ranks_the_rest_of_the_world_shrinks() -> None:
    job = _training()
    _spare(job, "s2", ready=False)  # still syncing: not promoted
    job.now += 6
    job.alive("a", "s1", "s2")
    facts = job.advance(0.1)  # b and c fail
    assert _promoted(facts) == [("s1", "b")]
    assert job.state.ranks == ("a", "s1") and job.state.members["s2"].status == "syncing"
    _agrees(job)


def test_with_shard_groups_a_spare_takes_the_lost_ranks_place_and_every_other_keeps_its() -> None:
    """HSDP: a rank's place is its shard of its group's copy. With shard groups of 2 over
    a, b | c, d, b lost: the spare on b's machine becomes rank 1 (b's shard of the first
    copy) and c, d stay ranks 2 and 3, their copy untouched; without shard groups the
    survivors close up (test_a_failed_rank_is_replaced_by_a_spare_in_the_same_decision)."""
    job = _job(heartbeat_timeout=5.0, min_workers=2, shard_group=2)
    job.start("a", "b", "c", "d")
    _spare(job, "s1")  # on b's machine
    job.step()
    job.now += 3
    job.alive("a", "c", "d", "s1")
    facts = job.advance(3)  # b silent for 6 s
    assert _promoted(facts) == [("s1", "b")]
    assert job.state.ranks == ("a", "s1", "c", "d")
    _agrees(job)


def test_with_shard_groups_rank_0_lost_puts_a_whole_copy_first_and_keeps_every_shard() -> None:
    """Rank 0 starts a world from the weights it holds: a, b | c, d with a lost, its spare
    takes a's place (shard 0 of the first copy) and the copies swap, so c, d (a copy that
    holds the weights) lead; every rank keeps its shard of its copy."""
    job = _job(heartbeat_timeout=5.0, min_workers=4, shard_group=2)
    job.start("a", "b", "c", "d")
    _spare(job, "s2")  # on h1: a's machine
    job.step()
    job.now += 3
    job.alive("b", "c", "d", "s2")
    facts = job.advance(3)  # a silent for 6 s
    assert _promoted(facts) == [("s2", "a")]
    world = facts[-1]
    assert isinstance(world, m.WorldChanged) and world.ranks == ("c", "d", "s2", "b")
    assert world.weights is not None and world.weights.source == "rank"
    _agrees(job)


def test_with_shard_groups_only_the_first_copy_led_by_a_holder_moves_to_the_front() -> None:
    """Three copies, rank 0 lost: the second copy (led by a holder) goes first, and the
    others keep their order: each rank's place in its copy, its shard, is kept."""
    job = _job(heartbeat_timeout=5.0, min_workers=6, shard_group=2)
    job.start("a", "b", "c", "d", "e", "f")
    _spare(job, "s2")  # on h1: a's machine
    job.step()
    job.now += 3
    job.alive("b", "c", "d", "e", "f", "s2")
    facts = job.advance(3)
    assert _promoted(facts) == [("s2", "a")]
    assert job.state.ranks == ("c", "d", "s2", "b", "e", "f")
    _agrees(job)


def test_with_shard_groups_where_no_copy_begins_with_a_holder_the_stayers_close_up() -> None:
    job = _job(heartbeat_timeout=5.0, min_workers=2, shard_group=2)
    job.start("a", "b", "c")
    _spare(job, "s1")  # on h2, ready longest
    _spare(job, "s3")  # on h3: c's
    job.step()
    job.now += 6
    job.alive("b", "s1", "s3")
    facts = job.advance(0.1)  # a and c fail
    assert sorted(_promoted(facts)) == [("s1", "a"), ("s3", "c")]
    assert job.state.ranks == ("b", "s1", "s3")  # b holds the weights: rank 0
    _agrees(job)


def test_with_shard_groups_a_place_no_spare_fills_closes_up_and_a_joiner_follows() -> None:
    """No spare for a lost rank: the world goes on without its place (one copy over all
    its ranks, docs/sharded.md), and a later joiner is ranked after the others."""
    job = _job(heartbeat_timeout=5.0, min_workers=1, shard_group=2)
    job.start("a", "b", "c", "d")
    job.step()
    job.now += 6
    job.alive("a", "c", "d")
    job.advance(0.1)  # b fails: no spare
    assert job.state.ranks == ("a", "c", "d")  # 3 ranks: one copy over all until whole
    job.join("e")
    job.ready("e")
    job.step()  # activated at the boundary
    assert job.state.ranks == ("a", "c", "d", "e")
    _agrees(job)


def test_a_spare_that_fails_or_leaves_changes_no_world() -> None:
    job = _training()
    _spare(job, "s2")
    world = job.state.world_version
    assert types(job.leave("s2")) == ["WorkerLeft"]
    job.now += 6
    job.alive("a", "b", "c")
    assert types(job.advance(0.1)) == ["WorkerFailed"]  # s1, silent
    assert job.state.world_version == world and job.state.ranks == ("a", "b", "c")
    _agrees(job)


def test_a_job_paused_below_min_workers_resumes_with_ready_spares() -> None:
    job = _job(heartbeat_timeout=5.0, min_workers=3)
    job.start("a", "b", "c")
    _spare(job, "s1", ready=False)
    _spare(job, "s2", ready=False)
    job.step()
    job.now += 6
    job.alive("a", "s1", "s2")
    facts = job.advance(0.1)  # b and c fail; no spare is ready yet
    assert "TrainingPaused" in types(facts) and not _promoted(facts)
    assert types(job.ready("s1")) == ["WorkerSynced"]  # one is not enough for min_workers 3
    facts = job.ready("s2")
    assert _promoted(facts) == [("s1", None), ("s2", None)]
    assert job.state.ranks == ("a", "s1", "s2") and not job.state.paused
    _agrees(job)


def test_before_the_first_world_the_spares_wait_for_the_trainers() -> None:
    job = _job(min_workers=2)
    job.join("a")
    job.ready("a")
    _spare(job, "s1")
    assert job.state.ranks == () and job.state.paused  # the spare makes up nothing yet
    job.join("b")
    job.ready("b")
    assert job.state.ranks == ("a", "b") and job.state.members["s1"].status == "ready"
    _agrees(job)


def test_after_the_job_finished_nothing_is_promoted() -> None:
    job = _job(heartbeat_timeout=5.0, max_steps=2)
    job.start("a", "b")
    _spare(job, "s1")
    job.step()
    job.step()
    assert job.state.finished
    assert types(job.leave("a")) == ["WorkerLeft"]
    job.now += 6
    job.alive("s1")
    assert types(job.advance(0.1)) == ["WorkerFailed"]
    assert job.state.members["s1"].spare and job.state.counters.promotions == 0


def test_status_shows_the_spares_and_the_report_the_promotion() -> None:
    from cohort.coordinator.replay import Run
    from cohort.coordinator.series import series
    from cohort.events.codec import FIELD, encode
    from cohort.events.streams import Entry

    job = _training()
    _spare(job, "s2", ready=False)
    body = view(job.state)
    assert body["spares"] == {"ready": ["s1"], "syncing": ["s2"]}
    assert body["members"]["s1"]["spare"] is True and body["members"]["s1"]["rank"] is None
    assert "spares ready s1  syncing s2  promoted 0" in _terminal(body)
    job.leave("c")
    body = view(job.state)
    assert body["spares"] == {"ready": [], "syncing": ["s2"]}
    assert body["counters"]["promotions"] == 1 and body["members"]["s1"]["rank"] == 2
    assert "spares syncing s2  promoted 1" in _terminal(body)
    metrics = Metrics(JOB, "c1")
    metrics.update(job.state, True, 0.0, job.now)
    sample = metrics.registry.get_sample_value
    labels = {"job": JOB, "coordinator": "c1"}
    assert (sample("cohort_spares_ready", labels), sample("cohort_spare_promotions", labels)) == (
        0.0,
        1.0,
    )
    run = Run(
        JOB, journal=[Entry(f"{i + 1}-0", {FIELD: encode(f)}) for i, f in enumerate(job.journal)]
    )
    data = series(run)
    assert data.summary.promotions == 1
    assert [m.label for m in data.markers if m.kind == "promotion"] == ["spare s1 promoted for c"]
    promoted = [line for line in data.timeline if line.type == "SparePromoted"]
    assert promoted and promoted[0].membership and "replaces=c" in promoted[0].text
    page = render(data, "spares")
    assert ">spares</text>" in page and "spare s1 promoted for c" in page  # its lane, labelled
    assert '<th>spares promoted</th><td class="num">1</td>' in page
    assert "<td>SparePromoted</td><td>worker=s1 replaces=c</td>" in page  # the timeline
