"""When a step's collective may start (Elastic.launchable), with the test as the leader.

Pipelined commits let a rank build step N before the commit of N-1 reaches it. That
commit may replace the plan N was built on (a new epoch, a new world, the end): a rank
must then start nothing for N, or its gradients would be averaged into the others'.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import fakeredis
import pytest

from cohort.events import models as m
from cohort.events.shards import Shard
from cohort.worker.errors import WorkerError, WorldChangedError
from cohort.worker.loop.elastic import Elastic, Step
from cohort.worker.membership.view import order_for
from tests.unit.test_worker_client import JOB, Leader, fact

ME = "w-me"


def joined(config: m.JobConfig) -> tuple[Leader, Elastic]:
    """A job configured with `config`, the test its leader, and ME joined to it (no rank)."""
    server = fakeredis.FakeServer()
    leader = Leader(server)
    leader.say(fact(m.JobConfigured, config=config))
    with ThreadPoolExecutor(1) as pool:
        joining = pool.submit(
            Elastic, JOB, conn=fakeredis.FakeRedis(server=server), worker_id=ME, signals=False
        )
        leader.expect("Join")
        leader.say(fact(m.WorkerJoined, worker=ME))
        return leader, joining.result(timeout=5)


@pytest.fixture
def job() -> Iterator[tuple[Leader, Elastic]]:
    leader, elastic = joined(m.JobConfig(dataset_size=16, batch_size=4))
    leader.say(
        fact(m.WorkerSynced, worker=ME, step=0),
        fact(m.WorkerActivated, worker=ME),
        fact(
            m.WorldChanged,
            version=1,
            start_step=0,
            epoch=0,
            ranks=(ME, "other"),
            shards=(Shard(ranges=((0, 8),)), Shard(ranges=((8, 16),))),
        ),
    )
    elastic.worker.wait_active(3)
    yield leader, elastic
    elastic.worker.stop()


def built(elastic: Elastic, step: int, epoch: int = 0) -> Step:
    """Step `step` as this rank builds it from what it knows now."""
    ranges = elastic.worker.batch(step)
    return Step(step, 1, epoch, 0, 2, ranges, order_for(elastic.worker.view, step))


def test_a_step_waits_for_the_one_before_and_starts_when_it_committed(job) -> None:
    leader, elastic = job
    step = built(elastic, 1)
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(elastic.launchable, step, 0, threading.Event())
        assert not answer.done()  # step 0 has not committed yet
        leader.say(fact(m.StepCommitted, step=0, world=1))
        assert answer.result(timeout=5) is True


def test_a_step_built_before_its_epoch_ended_does_not_start(job) -> None:
    leader, elastic = job
    leader.say(fact(m.StepCommitted, step=0, world=1))
    elastic.worker.wait_for(lambda v: v.last_committed == 0, 3)
    stale = built(elastic, 2)  # the epoch's shards are used up at step 2: no samples
    assert stale.ranges == ()
    leader.say(
        fact(m.StepCommitted, step=1, world=1),
        fact(m.EpochFinished, epoch=0, step=1),
        fact(
            m.EpochStarted,
            epoch=1,
            start_step=2,
            shards=(Shard(ranges=((0, 8),)), Shard(ranges=((8, 16),))),
        ),
    )
    assert elastic.launchable(stale, 1, threading.Event()) is False
    fresh = built(elastic, 2, epoch=1)  # built again: the new epoch's
    assert fresh.ranges == ((0, 4),) and elastic.launchable(fresh, 1, threading.Event())


def test_a_step_of_a_world_that_ended_does_not_start(job) -> None:
    leader, elastic = job
    step = built(elastic, 1)
    leader.say(
        fact(m.WorkerFailed, worker="other", last_seen=0.0, timeout=5.0),
        fact(
            m.WorldChanged,
            version=2,
            start_step=0,
            epoch=0,
            ranks=(ME,),
            shards=(Shard(ranges=((0, 16),)),),
        ),
    )
    assert elastic.launchable(step, 0, threading.Event()) is False


def test_a_cancelled_wait_gives_up(job) -> None:
    _, elastic = job
    cancelled = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(elastic.launchable, built(elastic, 1), 0, cancelled)
        cancelled.set()
        assert answer.result(timeout=5) is False


# ---------------------------------------------------------------- attempt(step)


def test_a_world_change_inside_an_attempt_aborts_the_step_and_goes_no_further(job) -> None:
    _, elastic = job
    step = elastic.current = built(elastic, 0)
    with elastic.attempt(step):
        raise WorldChangedError(0, None)
    assert elastic.aborted


def test_any_other_error_inside_an_attempt_reaches_the_script(job) -> None:
    _, elastic = job
    step = elastic.current = built(elastic, 0)
    with pytest.raises(ZeroDivisionError), elastic.attempt(step):
        _ = 1 / 0
    assert not elastic.aborted


def test_an_attempt_at_a_step_that_is_not_the_current_one_is_refused(job) -> None:
    _, elastic = job
    elastic.current = built(elastic, 1)
    refused = "takes the step job.steps\\(\\) gave last \\(step 1\\)"
    with pytest.raises(WorkerError, match=refused), elastic.attempt(built(elastic, 0)):
        pass


def test_the_old_name_step_of_still_works_and_says_the_new_one(job) -> None:
    _, elastic = job
    step = elastic.current = built(elastic, 0)
    with pytest.warns(DeprecationWarning, match="now named job.attempt"), elastic.step_of(step):
        raise WorldChangedError(0, None)
    assert elastic.aborted
