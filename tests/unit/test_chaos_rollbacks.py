"""The chaos benchmark's account of a failover (bench/rollbacks.py): which facts it took
back, who had acted on them, who noticed, and whether the journal left holds what the
workers did. Pure functions over recorded facts, reports and log text."""

from __future__ import annotations

from bench.rollbacks import disagreeing, diverged, noticed, rolled_back
from cohort.events.models import (
    LeaderElected,
    StepCommitted,
    StepDone,
    WeightsDiverged,
    WorldChanged,
)

JOB = "chaos"
GOOD, BAD = "a0" * 16, "b0" * 16


def commit(step: int, world: int = 1, digest: str | None = None) -> StepCommitted:
    return StepCommitted(at=1.0, job=JOB, step=step, world=world, digest=digest)


def done(worker: str, step: int, world: int = 1, digest: str | None = None) -> StepDone:
    return StepDone(at=1.0, job=JOB, worker=worker, step=step, world=world, digest=digest)


def world(version: int) -> WorldChanged:
    return WorldChanged(
        at=1.0, job=JOB, version=version, start_step=0, epoch=0, ranks=(), shards=()
    )


def test_a_lost_commit_is_acted_on_by_a_step_after_it_reported_before_it_is_decided_again() -> None:
    kept, lost = commit(5), commit(6)
    seen = {"100-0": kept, "110-0": lost}
    final = [("100-0", kept), ("130-0", commit(6))]  # the new leader commits step 6 again
    reports = [
        ("105-0", done("early", 7)),  # before the lost commit: not resting on it
        ("120-0", done("w1", 7)),  # trained step 7 on the lost commit of 6
        ("121-0", done("w3", 6)),  # step 6 itself rests on the commit of 5
        ("140-0", done("w2", 7)),  # after step 6 was committed again
    ]
    (gone,) = rolled_back(seen, final, reports)
    assert (gone.entry, gone.fact, gone.acted_on_by) == ("110-0", lost, ("w1",))


def test_a_lost_world_is_acted_on_by_its_reports_until_a_world_of_its_version_is_journaled() -> (
    None
):
    lost = world(4)
    final = [("90-0", world(3)), ("150-0", world(4))]
    reports = [("120-0", done("w1", 9, world=4)), ("160-0", done("w2", 10, world=4))]
    (gone,) = rolled_back({"90-0": world(3), "110-0": lost}, final, reports)
    assert gone.acted_on_by == ("w1",)


def test_facts_the_final_journal_holds_are_not_rolled_back_and_others_need_no_worker() -> None:
    elected = LeaderElected(at=1.0, job=JOB, coordinator="c1", epoch=3)
    final = [("100-0", commit(5))]
    gone = rolled_back({"100-0": commit(5), "101-0": elected}, final, [("102-0", done("w1", 9))])
    assert [(g.entry, g.acted_on_by) for g in gone] == [("101-0", ())]
    # the same ID holding another fact (a reused ID) counts as taken back too
    assert rolled_back({"100-0": commit(5, digest=GOOD)}, final, [])[0].entry == "100-0"


def test_a_report_disagrees_only_with_the_digest_its_own_step_and_world_committed() -> None:
    final = [("1-0", commit(5, world=2, digest=GOOD)), ("2-0", commit(6, world=2))]
    reports = [
        ("3-0", done("w1", 5, world=2, digest=GOOD)),
        ("3-1", done("w2", 5, world=2, digest=BAD)),
        ("3-2", done("w3", 5, world=1, digest=BAD)),  # another world: another commit
        ("3-3", done("w4", 6, world=2, digest=GOOD)),  # committed without a digest
        ("3-4", done("w5", 7, world=2, digest=GOOD)),  # never committed
    ]
    assert [r.worker for _, r in disagreeing(final, reports)] == ["w2"]
    split = WeightsDiverged(at=1.0, job=JOB, step=5, world=2, groups={GOOD: ("w1",), BAD: ("w2",)})
    assert diverged([*final, ("4-0", split)]) == 1


def test_the_logs_say_who_noticed_which_lost_entries_and_which_leader_stepped_down() -> None:
    coordinators = {
        "c1": "x ERROR cohort.coordinator: the journal of job 'chaos' no longer holds entry "
        "17-3, which c1 had folded: Redis lost acknowledged writes (a failover ...). Folding "
        "the journal again from the start and stepping down. See docs/redis-ha.md\n",
        "c2": "x ERROR cohort.coordinator: the journal of job 'chaos' no longer holds entry "
        "17-2, which c2 had folded: Redis lost ... Folding the journal again from the start."
        " See docs/redis-ha.md\n",
        "c1#2": "nothing to see\n",
    }
    workers = {
        "w1": "x ERROR cohort.worker: worker w1: the journal of job 'chaos' lost entry 17-3 "
        "and later ones (a Redis failover ...); folding it again from the start\n",
        "w2": "",
    }
    found = noticed(coordinators, workers)
    assert found.coordinators == {"c1": ["17-3"], "c2": ["17-2"]}
    assert found.workers == {"w1": ["17-3"]}
    assert found.leaders == 1
    assert found.entries == {"17-2", "17-3"}
