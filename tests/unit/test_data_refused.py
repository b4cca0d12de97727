"""A rank whose collective data fails verification where its peers read it is removed by a
majority of them (issue 33): the readers name it (DataRefused), the leader journals its
removal and a new world without it, and the step is retried there. One rank's word removes
nobody in a world of three or more."""

from __future__ import annotations

from cohort.coordinator.service import Coordinator
from cohort.events.models import DataRefused, WorkerLeft, WorldChanged
from tests.unit.test_service import JOB, Setup, leader_of


def world_of(setup: Setup, *workers: str) -> Coordinator:
    leader = leader_of(setup, min_workers=len(workers))
    setup.join(*workers)
    leader.step()
    assert set(leader.state.ranks) == set(workers)
    return leader


def refuse(setup: Setup, reader: str, accused: str, world: int = 1) -> None:
    setup.log.send(
        DataRefused(
            at=0, job=JOB, worker=reader, accused=accused, world=world, step=0,
            reason=f"rank of {accused}: chunk 0 is 12 bytes, not 4096",
        )
    )  # fmt: skip


def removals(setup: Setup) -> list[WorkerLeft]:
    return [f for f in setup.log.facts() if isinstance(f, WorkerLeft)]


def test_a_majority_of_the_accused_s_peers_removes_it_and_a_new_world_starts() -> None:
    setup = Setup()
    leader = world_of(setup, "a", "b", "c")

    refuse(setup, "a", "c")
    leader.step()
    assert removals(setup) == []  # one of two peers: not a majority
    refuse(setup, "b", "c")
    leader.step()

    (removed,) = removals(setup)
    assert removed.worker == "c"
    assert removed.reason.startswith("removed: its data for step 0 failed verification by a, b")
    assert "chunk 0 is 12 bytes" in removed.reason
    world = [f for f in setup.log.facts() if isinstance(f, WorldChanged)][-1]
    assert set(world.ranks) == {"a", "b"} and "c removed" in world.reason


def test_in_a_world_of_two_one_refusal_removes_the_other() -> None:
    setup = Setup()
    leader = world_of(setup, "a", "b")

    refuse(setup, "a", "b")
    leader.step()

    assert [r.worker for r in removals(setup)] == ["b"]
    assert leader.state.ranks == ("a",)


def test_refusals_of_another_world_by_a_non_rank_or_of_oneself_remove_nobody() -> None:
    setup = Setup()
    leader = world_of(setup, "a", "b")
    refuse(setup, "a", "b", world=7)  # not the current world
    refuse(setup, "x", "b")  # not a rank
    refuse(setup, "a", "a")  # itself
    refuse(setup, "a", "y")  # not a rank either

    leader.step()

    assert removals(setup) == []
    assert set(leader.state.ranks) == {"a", "b"}
