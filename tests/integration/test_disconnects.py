"""A dead process is noticed from its connections, with real processes and real signals.

A rank SIGKILLed is failed because its connections closed, long before a 30 s heartbeat
timeout could act; a worker whose connections drop and come back within the grace (a
middlebox restarting: the test's proxy closes them both ways) is not failed; a stopped
worker (SIGSTOP: its sockets stay open, it says nothing) is failed by its silence. The same
kill on a Redis Cluster, where the job's slot owner holds the presence subscriptions. Under
`cohort run` the launcher, which sees its rank's process end, says so at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
from redis.cluster import RedisCluster

from cohort.coordinator.audit import audit
from cohort.events.keys import Keys
from cohort.events.models import StepCommitted, WorkerFailed
from cohort.localredis import LocalCluster, LocalRedis
from tests.helpers import wait_until
from tests.integration.cluster import Cluster, ms
from tests.integration.launch import Launch, training, worker_of
from tests.integration.proxy import Proxy

pytestmark = [pytest.mark.redis_server]

LONG = 30.0
"""The heartbeat timeout where only the connections may fail anyone within the test."""
RUN_SCRIPT = str(Path(__file__).with_name("run_script.py"))


def killed_rank_is_failed_by_its_connections(job: Cluster) -> None:
    """Three ranks train; one is SIGKILLed; it is failed for its closed connections well
    inside the heartbeat timeout, and the other two commit again."""
    for name in ("c1", "c2"):
        job.trainer_coordinator(name, workers=1, interval=1.0, timeout=LONG)
    workers = {name: job.example_worker(name, None, "--pace", "0.05") for name in "abc"}
    job.until(lambda s: len(s.ranks) == 3 and s.last_committed >= 10, 90, "three ranks train")
    killed_at = workers["b"].kill(signal.SIGKILL)
    job.until(lambda s: "b" not in s.members, LONG / 2, "b failed, long before its timeout")
    failed_id, failed = job.of_type(WorkerFailed)[-1]
    assert failed.worker == "b" and failed.cause == "disconnected", failed
    assert failed.closed_at is not None and failed.grace == 0.3
    assert failed.last_seen <= failed.closed_at <= failed.at
    assert ms(failed_id) - killed_at < LONG / 4, "failed by the timeout, not the connections"
    job.until(
        lambda s: any(isinstance(f, StepCommitted) and i > failed_id for i, f in job.facts),
        30,
        "the survivors commit again",
    )
    facts = [f for _, f in job.facts]
    assert audit(facts).ok, audit(facts).problems


def test_a_sigkilled_rank_is_failed_by_its_closed_connections(cluster: Cluster) -> None:
    try:
        killed_rank_is_failed_by_its_connections(cluster)
    finally:
        cluster.stop()


def test_connections_dropped_and_back_within_the_grace_fail_nobody(
    cluster: Cluster, server: LocalRedis
) -> None:
    grace = 4.0  # ample on loaded machines: what is tested is that a return within it counts
    cluster.trainer_coordinator(
        "c1", "--disconnect-grace", str(grace), workers=2, interval=1.0, timeout=LONG
    )
    cluster.example_worker("a", None, "--pace", "0.05")
    presence = Keys(cluster.job).presence("b")

    def subscribers() -> int:
        return int(cluster.conn.execute_command("PUBSUB", "SHARDNUMSUB", presence)[1])

    def leader_sees() -> str | None:
        """What the leader's published view says of b's connections."""
        raw = cluster.conn.get(Keys(cluster.job).status)
        view = msgpack.unpackb(raw) if raw else {}
        return view.get("workers", {}).get("b", {}).get("connections")

    with Proxy(server.port) as proxy:
        cluster.python("b", "-m", "cohort", "--redis-url", proxy.url, "example-worker",
                       "--job", cluster.job, "--id", "b", "--pace", "0.05")  # fmt: skip
        cluster.until(lambda s: len(s.ranks) == 2 and s.last_committed >= 10, 90, "2 ranks train")
        cluster.until(lambda s: leader_sees() == "open", 10, "the leader sees b connected")
        proxy.drop()  # every connection of b closes, at Redis's end too
        dropped_at = time.time()
        cluster.until(lambda s: leader_sees() == "closed", grace, "the leader sees them closed")
        proxy.restore()
        cluster.until(lambda s: subscribers() == 1, grace, "b connects again within the grace")
        assert time.time() - dropped_at < grace
        judged = time.time() + grace + 1.0  # the leader judged b past the grace by then
        cluster.until(
            lambda s: any(
                isinstance(f, StepCommitted) and ms(i) > judged for i, f in cluster.facts
            ),
            60,
            "the job commits past the grace",
        )
        assert not cluster.of_type(WorkerFailed), "a worker back within the grace was failed"
        assert set(cluster.state.ranks) == {"a", "b"}
    cluster.stop()


def stopped_worker_is_failed_by_its_silence(job: Cluster) -> None:
    """A SIGSTOPped rank keeps its sockets open, so its connections tell nothing: its
    silence fails it after the heartbeat timeout."""
    timeout = 3.0
    job.trainer_coordinator("c1", workers=1, interval=0.5, timeout=timeout)
    workers = {name: job.example_worker(name, None, "--pace", "0.05") for name in "ab"}
    job.until(lambda s: len(s.ranks) == 2 and s.last_committed >= 10, 90, "2 ranks train")
    workers["b"].kill(signal.SIGSTOP)
    job.until(lambda s: "b" not in s.members, timeout + 10, "b failed by its silence")
    (_, failed), *_ = job.of_type(WorkerFailed)
    assert (failed.worker, failed.cause, failed.closed_at) == ("b", "silent", None)
    assert failed.reason == f"silent {timeout:g} s (no heartbeat)"


def test_a_stopped_worker_is_failed_by_its_silence(cluster: Cluster) -> None:
    try:
        stopped_worker_is_failed_by_its_silence(cluster)
    finally:
        cluster.stop()


@pytest.fixture
def cluster_job(redis_cluster: LocalCluster, tmp_path: Path) -> Iterator[Cluster]:
    conn: RedisCluster = redis_cluster.client()
    name = f"death-{uuid.uuid4().hex[:8]}"  # the cluster is the module's: a job per test
    job = Cluster(url=redis_cluster.url, conn=conn, job=name, tmp=tmp_path)  # type: ignore[arg-type]
    yield job
    job.stop()
    conn.close()


@pytest.mark.slow
def test_a_sigkilled_rank_on_a_redis_cluster_is_failed_by_its_closed_connections(
    cluster_job: Cluster,
) -> None:
    """On a cluster the presence subscriptions live on the primary that owns the job's slot,
    where the leader counts them."""
    killed_rank_is_failed_by_its_connections(cluster_job)


@pytest.mark.slow
@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "signed"])
def test_a_launcher_s_word_that_its_rank_died_fails_it_at_once(
    server: LocalRedis, tmp_path: Path, signed: bool
) -> None:
    """`cohort run` sees its rank's process end and says so (ProcessExited, signed in the
    rank's name where the job signs commands): with no connection watch and a 30 s timeout,
    only that word can fail the rank within the test."""
    job = f"exited-{'signed' if signed else 'unsigned'}"
    run = Launch(
        "--redis-url", server.url, "--job", job, "--node", "x", "-n", "2",
        "--heartbeat-timeout", str(LONG), "--disconnect-grace", "0", "--batch-size", "16",
        "--epochs", "1000", *(["--worker-credentials"] if signed else []),
        RUN_SCRIPT, "0.03", cwd=tmp_path,
    )  # fmt: skip
    watch = run.journal()
    wait_until(lambda: training(watch, 2), 90, message="two ranks training")
    victim = next(pid for pid in run.ranks(RUN_SCRIPT) if worker_of(pid) == "x-0")
    os.kill(victim, signal.SIGKILL)
    killed_at = time.time()

    def failed() -> list[WorkerFailed]:
        watch.pull(100)
        return [f for _, f in watch.facts if isinstance(f, WorkerFailed) and f.worker == "x-0"]

    (fact,) = wait_until(failed, LONG / 2, message="x-0 failed on its launcher's word")
    assert (fact.cause, fact.how) == ("exited", "killed by SIGKILL")
    assert fact.reason == "process exited (killed by SIGKILL)"
    assert fact.at - killed_at < LONG / 4
    assert server.client().xlen(Keys(job).dead) == 0  # the word was taken, signed or not
    run.popen.send_signal(signal.SIGINT)
    run.wait()


FORKING_WORKER = """
import logging, os, sys, threading, time
import redis
from cohort.worker.membership.presence import PresenceThread
presence = PresenceThread(redis.Redis.from_url(sys.argv[1]), sys.argv[2], threading.Event(),
                          logging.getLogger("presence"))
threading.Thread(target=presence.run, daemon=True).start()
presence.subscribed.wait(10)
child = os.fork()
if child == 0:  # a DataLoader worker, say: it outlives a killed parent for a while
    time.sleep(120)
    os._exit(0)
print(child, flush=True)
time.sleep(120)
"""


def test_a_forked_child_does_not_keep_a_killed_worker_s_presence(
    cluster: Cluster, server: LocalRedis
) -> None:
    channel = Keys(cluster.job).presence("w1")
    parent = cluster.python("forking", "-c", FORKING_WORKER, server.url, channel)
    child = int(wait_until(lambda: parent.output().strip(), 30, message="the child forked"))
    try:
        assert int(cluster.conn.execute_command("PUBSUB", "SHARDNUMSUB", channel)[1]) == 1
        parent.kill(signal.SIGKILL)
        wait_until(
            lambda: int(cluster.conn.execute_command("PUBSUB", "SHARDNUMSUB", channel)[1]) == 0,
            3,
            message="the subscription gone with the worker, though its child lives",
        )
        os.kill(child, 0)  # (it does live)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


@pytest.mark.slow
def test_a_stopped_worker_on_a_redis_cluster_is_failed_by_its_silence(
    cluster_job: Cluster,
) -> None:
    stopped_worker_is_failed_by_its_silence(cluster_job)
