"""What `--wait-replicas` covers and what it does not (docs/redis-ha.md).

WAIT runs after the fenced append, on the leader's connection: it holds the leader until a
replica has the new facts. The journal's readers (workers' tails, followers) read the
primary, where the facts are from the moment the append ran. A replica slower than the
readers (a slow link, a stalled replica) lets a reader take a fact that no replica has yet;
if the primary's host then dies, the promoted replica never had it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from cohort.coordinator.election import FencedJournal, RedisLease
from cohort.events.codec import encode
from cohort.events.keys import Keys
from cohort.events.models import StepCommitted
from cohort.events.streams import Entry, Journal
from cohort.localredis import HOST, LocalRedis
from tests.helpers import require_redis_server, wait_until
from tests.integration.proxy import Proxy

pytestmark = pytest.mark.redis_server

JOB = "waitgap"


@dataclass
class Pair:
    """A primary and a replica that replicates through a proxy the test can stall."""

    primary: LocalRedis
    replica: LocalRedis
    link: Proxy


@pytest.fixture
def pair() -> Iterator[Pair]:
    binary = require_redis_server()
    # no 5 s wait for more replicas before the first full sync (repl-diskless-sync-delay)
    primary = LocalRedis(binary=binary, extra_args=("--repl-diskless-sync-delay", "0")).start()
    link = Proxy(primary.port)
    replica = LocalRedis(binary=binary).start()
    try:
        replica.client().replicaof(HOST, link.port)
        probe = replica.client()
        wait_until(
            lambda: probe.info("replication").get("master_link_status") == "up",
            15,
            0.05,
            "the replica in sync",
        )
        probe.close()
        yield Pair(primary, replica, link)
    finally:
        link.close()
        replica.stop()
        primary.stop()


def commit(step: int) -> bytes:
    return encode(StepCommitted(at=1.0, job=JOB, step=step, world=1))


def test_wait_holds_the_leader_but_a_reader_can_take_a_fact_the_failover_then_loses(
    pair: Pair,
) -> None:
    keys = Keys(JOB)
    conn = pair.primary.client()
    token = RedisLease(conn, keys, lease_ms=60_000).acquire()
    assert token is not None
    store = FencedJournal(conn, keys, wait_replicas=1, wait_ms=30_000)
    (first,) = store.append(token, "0-0", [commit(0)], cursor=None)
    assert store.acked is not None and store.acked.replicas == 1  # the replica has step 0

    pair.link.cut()  # the replica falls behind the readers
    outcome: list[object] = []

    def leader() -> None:
        try:
            outcome.append(store.append(token, first, [commit(1)], cursor=None))
        except Exception as exc:  # the primary dies under it
            outcome.append(exc)

    appending = threading.Thread(target=leader)
    appending.start()
    reader = Journal(pair.primary.client(), keys.journal)
    read: list[Entry] = wait_until(lambda: reader.tail(first, 100), 10, 0.01, "a reader's tail")
    assert Journal.decode(read[0]) == StepCommitted(at=1.0, job=JOB, step=1, world=1)
    assert appending.is_alive()  # while the leader still waits for a replica

    pair.primary.kill()  # its host dies: what it had not sent is gone
    pair.link.close()
    appending.join(30)
    assert outcome and isinstance(outcome[0], Exception)  # the leader never acted on step 1
    promoted = pair.replica.client()
    promoted.replicaof("NO", "ONE")  # what Sentinel does
    kept = Journal(promoted, keys.journal)
    held = [entry.id for page in kept.pages() for entry in page]
    assert held == [first] and read[0].id not in held  # step 1, which the reader took, is gone
    for client in (conn, reader.conn, promoted):
        client.close()
