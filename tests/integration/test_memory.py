"""Gradients never starve the control plane: a real redis-server with a small maxmemory
(noeviction), a real coordinator, tensors too big for it. The step is refused on every rank
within seconds, naming maxmemory; nothing of it stays; the journal keeps taking facts; a
step whose tensors fit trains on."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from cohort.coordinator.election import FencedJournal, RedisLease, load_library
from cohort.events.codec import encode
from cohort.events.connection import RedisSettings, connect
from cohort.events.keys import Keys
from cohort.events.models import Heartbeat, WorkerJoined, WorldChanged
from cohort.events.streams import Inbox
from cohort.localredis import LocalRedis
from cohort.worker.collective.redis_collective import Collective
from cohort.worker.errors import MemoryBudgetError
from cohort.worker.membership.client import Worker
from cohort.worker.membership.retry import Link, with_retry
from tests.helpers import require_redis_server, wait_until
from tests.integration.cluster import Cluster

pytestmark = [pytest.mark.redis_server, pytest.mark.slow]

MIB = 2**20


@pytest.fixture
def small(tmp_path: Path) -> Iterator[LocalRedis]:
    """A redis-server with 64 MiB of maxmemory and the policy the coordinator requires."""
    args = ("--maxmemory", "64mb", "--maxmemory-policy", "noeviction")
    with LocalRedis(appendonly=True, extra_args=args, binary=require_redis_server()) as server:
        yield server


def on_ranks(body: Callable[[int], Any], n: int = 2) -> list[Any]:
    """`body(rank)` on `n` threads at once; each result, or the exception it raised."""
    results: list[Any] = [None] * n

    def run(rank: int) -> None:
        try:
            results[rank] = body(rank)
        except BaseException as exc:
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return results


def gradient_keys(conn: redis.Redis, job: str) -> list[bytes]:
    """The job's gradient blobs on the server (not the notice streams)."""
    return [k for k in conn.scan_iter(match=f"cohort:{{{job}}}:grad:*") if b":events" not in k]


def test_a_step_too_big_for_maxmemory_is_refused_at_once_and_the_job_goes_on(
    small: LocalRedis, tmp_path: Path
) -> None:
    job = Cluster(url=small.url, conn=small.client(), job="mem", tmp=tmp_path)
    try:
        job.coordinator("c1", "--min-workers", "2", "--heartbeat-interval", "0.5",
                        "--heartbeat-timeout", "3", "--lease", "1")  # fmt: skip
        conns = [connect(RedisSettings(url=small.url)) for _ in range(3)]
        workers = [Worker(conns[r], "mem", worker_id=f"w{r}") for r in range(2)]
        for worker in workers:
            worker.join(timeout=30)
            worker.ready()
        for worker in workers:
            worker.wait_active(30)
        assert job.conn.exists(Keys("mem").memory), "the leader publishes no memory budget"
        facts_before = [f for _, f in (job.pull() and job.facts)]
        collectives = [Collective(conns[r], "mem", workers[r]) for r in range(2)]

        big = {"w": np.ones(4 * MIB, dtype=np.float32)}  # 16 MiB a rank: 64 MiB live > 48
        started = time.monotonic()
        refused = on_ranks(lambda r: collectives[r].allreduce(big, step=0))
        took = time.monotonic() - started
        for error in refused:
            assert isinstance(error, MemoryBudgetError), error
            assert "maxmemory" in str(error) and "step 0" in str(error), error
        assert took < 5.0, f"the refusal took {took:.1f} s"
        assert not gradient_keys(job.conn, "mem"), "a refused step left blobs behind"

        # The control plane was never starved: nobody was failed, and a new worker joins.
        late = Worker(conns[2], "mem", worker_id="w2")
        late.join(timeout=30)
        job.until(lambda s: "w2" in s.members, 30, "w2 joined after the refusal")
        assert [f for _, f in job.facts][: len(facts_before)] == facts_before, "a fact was lost"
        assert job.of_type(WorkerJoined)[-1][1].worker == "w2"
        assert sorted(job.state.ranks) == ["w0", "w1"], "a worker was failed meanwhile"
        late.leave(timeout=10)

        fits = [{"w": np.full(256 * 1024, r + 1.0, dtype=np.float32)} for r in range(2)]
        means = on_ranks(lambda r: collectives[r].allreduce(fits[r], step=1))
        for mean in means:
            assert not isinstance(mean, BaseException), mean
            np.testing.assert_array_equal(mean["w"], np.full(256 * 1024, 1.5, dtype=np.float32))
        print(f"refused on both ranks in {took:.2f} s; worlds: {len(job.of_type(WorldChanged))}")
        for worker in workers:
            worker.stop()
    finally:
        job.stop()


class _Rank:
    """A fixed rank of a fixed world: no coordinator, so no budget is published."""

    def __init__(self, rank: int, size: int) -> None:
        self.id, self.rank, self.world_size = f"w{rank}", rank, size
        self.world_version, self.assignment = 1, None

    @property
    def ranks(self) -> tuple[str, ...]:
        return tuple(f"w{r}" for r in range(self.world_size))


def test_a_server_over_maxmemory_still_takes_the_journal_and_refuses_gradients_clearly(
    small: LocalRedis,
) -> None:
    conn = small.client()
    keys = Keys("full")
    load_library(conn)
    token = RedisLease(conn, keys, 60_000).acquire("n")
    assert token is not None
    for i in range(5):  # 40 MiB of something else, then maxmemory lowered below it
        conn.set(f"filler:{i}", b"x" * (8 * MIB))
    conn.config_set("maxmemory", "32mb")
    with pytest.raises(redis.OutOfMemoryError):
        conn.xadd(keys.inbox, {"e": b"x"})  # every ordinary write is refused now

    store = FencedJournal(conn, keys)
    fact = WorkerJoined(at=1.0, job="full", worker="w")
    ids = store.append(token, "0-0", [encode(fact)], cursor="1-0")  # allow-oom
    assert [i.decode() for i, _ in conn.xrange(keys.journal)] == ids

    # A worker's command waits for memory instead of being dropped (back-pressure).
    beat = Heartbeat(at=2.0, job="full", worker="w")
    sent: list[str] = []
    link = Link(logging.getLogger("test.memory"), small.url)
    sender = threading.Thread(
        target=lambda: sent.append(
            with_retry(lambda: Inbox(conn, keys.inbox).send(beat), threading.Event(), link,
                       "sending Heartbeat", wait_for_memory=True)
        )
    )  # fmt: skip
    sender.start()

    clients = [connect(RedisSettings(url=small.url)) for _ in range(2)]
    collectives = [Collective(clients[r], "full", _Rank(r, 2)) for r in range(2)]
    tensors = {"w": np.ones(64 * 1024, dtype=np.float32)}
    started = time.monotonic()
    refused = on_ranks(lambda r: collectives[r].allreduce(tensors, step=0))
    took = time.monotonic() - started
    for error in refused:
        assert isinstance(error, MemoryBudgetError), error
        assert "out of memory" in str(error) and "maxmemory" in str(error), error
    assert took < 5.0, f"the refusal took {took:.1f} s"

    assert not sent, "the heartbeat was written over maxmemory?"
    conn.delete(*(f"filler:{i}" for i in range(5)))
    wait_until(lambda: conn.info("memory")["used_memory"] < 16 * MIB, 10, message="memory freed")
    sender.join(10)
    assert sent and [i.decode() for i, _ in conn.xrange(keys.inbox)] == sent
    means = on_ranks(lambda r: collectives[r].allreduce(tensors, step=1))
    assert all(isinstance(m, dict) and float(m["w"][0]) == 1.0 for m in means), means
