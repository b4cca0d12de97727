"""What a script learns over its world: `job.mean`, `job.sum`, `job.max` and `job.shard`.

The reductions gather every rank's numbers through Redis (one notice each, the numbers as
`float.hex`, so exactly) among the ranks of the step's world, which the job may already
have replaced: only a rank of it leaving or failing stops them.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import fakeredis
import numpy as np
import pytest

from cohort.events import models as m
from cohort.events.errors import InvalidValueError
from cohort.events.keys import Keys
from cohort.events.shards import Shard
from cohort.worker.collective.redis_collective import Collective, World
from cohort.worker.errors import JobFinishedError, WorkerError, WorldChangedError
from cohort.worker.loop.elastic import Step
from tests.helpers import wait_until
from tests.unit.test_capture_point import Number, commit, job  # noqa: F401  (job: the fixture)
from tests.unit.test_elastic_gate import ME, joined
from tests.unit.test_worker_client import fact


class Rank:
    """A rank of world 1 whose job may have moved on to world 2 meanwhile."""

    def __init__(self, rank: int, size: int, version: int = 1) -> None:
        self.id, self.rank, self.world_size = f"w{rank}", rank, size
        self.world_version, self.assignment = version, None

    @property
    def ranks(self) -> tuple[str, ...]:
        return tuple(f"w{r}" for r in range(self.world_size))


def gathered(values: list[list[float]], version: int = 1, standing: Any = lambda: True) -> Any:
    server = fakeredis.FakeServer()
    size = len(values)

    def rank(r: int) -> list[tuple[float, ...]]:
        collective = Collective(
            fakeredis.FakeRedis(server=server), "figs", Rank(r, size, version), timeout=10
        )
        return collective.gather(
            values[r], 7, World(1, r, size, tuple(f"w{i}" for i in range(size))), standing
        )

    with ThreadPoolExecutor(size) as pool:
        return [f.result(timeout=30) for f in [pool.submit(rank, r) for r in range(size)]]


def test_every_rank_gets_every_rank_s_numbers_exactly_in_rank_order() -> None:
    values = [[0.1, 1 / 3], [1e300, -0.0], [7.0, math.pi]]
    results = gathered(values)
    assert results == [[tuple(v) for v in values]] * 3
    assert math.copysign(1, results[0][1][1]) == -1  # even the sign of a zero


def test_a_newer_world_does_not_stop_a_gather_of_the_world_that_trained_the_step() -> None:
    assert gathered([[1.0], [2.0]], version=2) == [[(1.0,), (2.0,)]] * 2


def test_a_rank_gone_from_the_job_ends_the_wait_at_once() -> None:
    collective = Collective(fakeredis.FakeRedis(), "figs", Rank(0, 2, 2), timeout=30)
    with pytest.raises(WorldChangedError):
        collective.gather([1.0], 7, World(1, 0, 2, ("w0", "w1")), standing=lambda: False)


def test_a_rank_that_answered_and_then_left_still_counts() -> None:
    """The end of a job: the quicker rank's reduction completes (it read the other's
    answer), its loops end and it leaves; the other rank, still in the same reduction,
    finds the leaver's answer and completes too, rather than a WorldChangedError."""
    server = fakeredis.FakeServer()
    world = ("w0", "w1")

    def collective(rank: int) -> Collective:
        return Collective(fakeredis.FakeRedis(server=server), "figs", Rank(rank, 2), timeout=10)

    with ThreadPoolExecutor(1) as pool:
        quick = pool.submit(collective(1).gather, [2.0], 7, World(1, 1, 2, world), lambda: True)
        events = Keys("figs").step_events(1, 7, "gather", "w1")
        wait_until(lambda: fakeredis.FakeRedis(server=server).xlen(events), message="w1 answered")
        # w1 has answered and is now gone from the job before w0 reduces
        slow = collective(0).gather([1.0], 7, World(1, 0, 2, world), standing=lambda: False)
        assert slow == [(1.0,), (2.0,)]
        assert quick.result(timeout=30) == [(1.0,), (2.0,)]


def in_a_world_of_two(max_steps: int) -> tuple[Any, Any, Any]:
    """This worker's job at step 0 in world 1 of two ranks (the other, w-other, a peer
    whose answers never come): the leader, the job and its walk of steps."""
    leader, elastic = joined(m.JobConfig(dataset_size=16, batch_size=4, max_steps=max_steps))
    elastic.attach(Number())
    halves = (Shard(ranges=((0, 8),)), Shard(ranges=((8, 16),)))
    leader.say(
        fact(m.WorkerSynced, worker=ME, step=0),
        fact(m.WorkerActivated, worker=ME),
        fact(
            m.WorldChanged, version=1, start_step=0, epoch=0, ranks=(ME, "w-other"), shards=halves
        ),
    )
    walk = elastic.steps()
    next(walk)  # step 0, in a world of two
    return leader, elastic, walk


def test_a_rank_that_never_answers_a_finished_job_s_reduction_says_the_job_finished() -> None:
    leader, elastic, walk = in_a_world_of_two(max_steps=1)
    leader.say(
        fact(m.StepCommitted, step=0, world=1),
        fact(m.JobFinished, step=0, epoch=0, reason="max_steps=1 reached"),
    )
    elastic.worker.wait_for(lambda view: view.finished is not None, 3)
    with pytest.raises(JobFinishedError, match="finished .max_steps=1 reached"):
        elastic.sum(1.0)  # w-other is no member: it will never answer
    assert issubclass(JobFinishedError, WorldChangedError)  # caught where that is
    walk.close()
    elastic.worker.stop()


def test_a_rank_lost_before_it_answered_gives_nan_and_the_script_goes_on() -> None:
    """A peer of the step's world fails during the epoch's evaluation: it will never
    answer, so the reduction gives NaN of the kind it was given (a number, every element of
    an array), not an exception that would end every survivor's script and lose the
    weights the survivors hold; the next step is in the world without it."""
    leader, elastic, walk = in_a_world_of_two(max_steps=4)
    whole = (Shard(ranges=((0, 16),)),)
    leader.say(
        fact(m.StepCommitted, step=0, world=1),
        fact(m.WorkerFailed, worker="w-other", last_seen=0.0, timeout=5.0),
        fact(m.WorldChanged, version=2, start_step=1, epoch=0, ranks=(ME,), shards=whole),
    )
    elastic.worker.wait_for(lambda view: "w-other" not in view.members, 3)
    assert math.isnan(elastic.sum(1.0))
    got = elastic.mean(np.ones((2, 2)))
    assert got.shape == (2, 2) and np.isnan(got).all()
    walk.close()
    elastic.worker.stop()


def test_a_torch_reduction_cut_short_gives_nan_even_for_integers() -> None:
    torch = _torch()
    from cohort.worker.pytorch.elastic import ElasticJob

    bare = ElasticJob.__new__(ElasticJob)  # the conversion only: no Redis, no world
    _, rebuild = bare._numbers(torch.tensor([3, 4]), "sum")
    back = rebuild([math.nan, math.nan])
    assert back.dtype == torch.float64 and back.isnan().all()
    assert rebuild([7.0, 8.0]).dtype == torch.int64  # a sum that was made keeps its kind


# ---------------------------------------------------------------- the job's side (one rank)


def test_before_the_first_step_there_is_no_world_to_reduce_over(job) -> None:  # noqa: F811
    _, elastic, _ = job
    with pytest.raises(WorkerError, match="inside the loops"):
        elastic.mean(1.0)


def test_a_reduction_gives_back_the_kind_it_was_given(job) -> None:  # noqa: F811
    leader, elastic, _ = job
    walk = elastic.steps()
    next(walk)  # step 0: a world of one rank
    assert elastic.mean(3) == 3.0 and isinstance(elastic.sum(3), float)
    grid = np.arange(6.0).reshape(2, 3)
    np.testing.assert_array_equal(elastic.max(grid), grid)
    assert elastic.mean(np.float32(0.5)) == 0.5
    with pytest.raises(InvalidValueError, match="at most 4096"):
        elastic.sum(np.zeros(5000))
    with pytest.raises(InvalidValueError, match="give a number"):
        elastic.mean("high")
    next(walk)
    commit(leader, 0)
    walk.close()


def test_tensors_come_back_as_tensors_of_their_shape_and_kind() -> None:
    torch = _torch()
    from cohort.worker.pytorch.elastic import ElasticJob

    bare = ElasticJob.__new__(ElasticJob)  # the conversion only: no Redis, no world
    numbers, rebuild = bare._numbers(torch.tensor([[1, 2], [3, 4]]), "sum")
    assert numbers == [1.0, 2.0, 3.0, 4.0]
    back = rebuild([2.0, 4.0, 6.0, 8.0])
    assert back.dtype == torch.int64 and back.shape == (2, 2) and back[1, 1] == 8
    _, as_mean = bare._numbers(torch.tensor([1, 2]), "mean")
    assert as_mean([1.5, 2.0]).dtype == torch.float64


def test_the_parts_of_a_world_s_ranks_hold_every_sample_once(job) -> None:  # noqa: F811
    _, elastic, _ = job
    parts = []
    for rank in range(3):
        elastic._given = Step(0, 1, 0, rank, 3, (), elastic.worker.view.config.order(0, None))
        parts.append(elastic.shard(10).tolist())
    assert parts == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert sorted(sum(parts, [])) == list(range(10))


def _torch() -> Any:
    if os.environ.get("CI") == "true":
        import torch

        return torch
    return pytest.importorskip("torch")
