"""cohort on a real Redis Cluster (3 primaries, 3 replicas, redis-server processes): a job's
control keys in one slot, gradient chunks spread over every primary, the fenced Functions
through FCALL, and a training job that loses a worker to SIGKILL."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from redis.cluster import RedisCluster

from cohort.coordinator.audit import audit
from cohort.coordinator.election import FencedJournal, RedisLease, load_library
from cohort.coordinator.errors import Conflict, Fenced
from cohort.events.connection import RedisSettings, connect, primaries
from cohort.events.keys import Keys
from cohort.events.models import Join, StepCommitted, WorkerFailed
from cohort.localredis import LocalCluster
from cohort.worker.collective.redis_collective import Collective, placement
from tests.integration.cluster import Cluster

pytestmark = [pytest.mark.redis_server, pytest.mark.slow]

INTERVAL, TIMEOUT = 0.5, 2.0


@pytest.fixture
def conn(redis_cluster: LocalCluster) -> Iterator[RedisCluster]:
    client = redis_cluster.client()
    assert isinstance(client, RedisCluster)
    yield client
    client.close()


def _owner(conn: RedisCluster, key: str) -> str:
    return str(conn.get_node_from_key(key).name)


def test_a_jobs_control_keys_share_one_slot_and_many_jobs_spread_over_the_primaries(
    conn: RedisCluster,
) -> None:
    keys = Keys("itest")
    control = [
        keys.inbox, keys.journal, keys.leader, keys.epoch, keys.cursor, keys.snapshot,
        keys.dead, keys.status, keys.step_events(3, 7, "allreduce", "w1"),
        keys.step_events(3, 7, "broadcast", "w2"),
    ]  # fmt: skip
    assert len({conn.keyslot(k) for k in control}) == 1
    owners = {_owner(conn, Keys(f"job-{i}").journal) for i in range(40)}
    assert owners == {node.name for node in conn.get_primaries()}


def test_the_chunks_of_one_step_are_spread_over_every_primary(conn: RedisCluster) -> None:
    keys = Keys("itest")
    tags = placement.Placement(conn, keys).tags()
    names = sorted(node.name for node in conn.get_primaries())
    assert len(tags) == len(names) == 3
    for chunk in range(9):  # chunk i on primary i mod 3, for every kind of chunk key
        tag = placement.tag_of(tags, chunk)
        for key in (
            keys.grad(4, 11, 2, chunk, "w1", tag),
            keys.grad_reduced(4, 11, chunk, "w1", tag),
            keys.grad_broadcast(4, 11, chunk, "w1", tag),
        ):
            assert _owner(conn, key) == names[chunk % 3]
    # every rank computes the same tags from the same slot map
    assert placement.Placement(connect(RedisSettings(url=_url(conn))), keys).tags() == tags


def _url(conn: RedisCluster) -> str:
    return "redis+cluster://" + ",".join(n.name for n in conn.get_primaries())


def test_the_fenced_functions_run_through_fcall_on_the_cluster(conn: RedisCluster) -> None:
    keys = Keys("fenced")
    assert load_library(conn) >= 1
    for name, server in primaries(conn):  # the library is on every primary
        listed = server.function_list(library="cohort")
        assert listed, f"primary {name} has no cohort library"
    lease = RedisLease(conn, keys, lease_ms=5000)
    token = lease.acquire()
    assert token is not None and lease.holder() == token
    store = FencedJournal(conn, keys)
    ids = store.append(token, "0-0", [b"fact-1", b"fact-2"], cursor="5-0")
    assert len(ids) == 2 and store.cursor() == "5-0"
    with pytest.raises(Conflict):
        store.append(token, "0-0", [b"again"], cursor=None)
    assert lease.release(token)
    other = lease.acquire()
    assert other is not None and other != token
    with pytest.raises(Fenced):
        store.append(token, ids[-1], [b"stale"], cursor=None)
    assert conn.xlen(keys.journal) == 2


def test_a_function_lost_on_the_jobs_primary_is_loaded_again_by_the_next_fcall(
    conn: RedisCluster,
) -> None:
    keys = Keys("reload")
    load_library(conn)
    owner = conn.get_redis_connection(conn.get_node_from_key(keys.leader))
    owner.function_delete("cohort")
    token = RedisLease(conn, keys, lease_ms=5000).acquire()
    assert token is not None
    assert owner.function_list(library="cohort")


def test_wait_replicas_confirms_each_append_on_a_replica(conn: RedisCluster) -> None:
    keys = Keys("waited")
    token = RedisLease(conn, keys, lease_ms=30_000).acquire()
    assert token is not None
    store = FencedJournal(conn, keys, wait_replicas=1, wait_ms=10_000)
    last = "0-0"
    for n in range(5):
        last = store.append(token, last, [f"fact-{n}".encode()], cursor=None)[-1]
        assert store.acked is not None and store.acked.replicas == 1


class _Rank:
    def __init__(self, rank: int, size: int) -> None:
        self.id, self.rank, self.world_size = f"w{rank}", rank, size
        self.world_version, self.assignment = 1, None

    @property
    def ranks(self) -> tuple[str, ...]:
        return tuple(f"w{r}" for r in range(self.world_size))


def _ranks(url: str, n: int, body: Any, **options: Any) -> list[Any]:
    results: list[Any] = [None] * n

    def run(rank: int) -> None:
        client = connect(RedisSettings(url=url))
        try:
            results[rank] = body(Collective(client, "coll", _Rank(rank, n), **options), rank)
        except BaseException as exc:
            results[rank] = exc
        finally:
            client.close()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def test_allreduce_across_the_primaries_equals_the_numpy_mean(
    redis_cluster: LocalCluster, conn: RedisCluster
) -> None:
    n = 3
    rng = np.random.default_rng(7)
    inputs = [
        {"w": rng.standard_normal((512, 100)).astype("<f4"), "b": rng.standard_normal(5)}
        for _ in range(n)
    ]
    held: dict[str, set[str]] = {}

    def body(collective: Collective, rank: int) -> Any:
        out = collective.allreduce(inputs[rank], step=1, timeout=30)
        collective.barrier(step=2, timeout=30)  # every rank is done reading step 1's keys
        if rank == 0:  # step 1's chunks are still there (unlinked after a later call)
            for name, server in primaries(conn):
                held[name] = {k.decode() for k in server.keys("cohort:{coll/*}:grad:1:1:*")}
        rows = {f"w{i}": out["w"][i * 16 : (i + 1) * 16] for i in range(6)}  # 6 KiB each
        got = collective.broadcast(rows if rank == 0 else None, root=0, step=3, timeout=30)
        return out, {"w": np.concatenate([got[f"w{i}"] for i in range(6)])}

    # max_value_bytes small enough for several chunks per rank (16 KiB of data each)
    results = _ranks(redis_cluster.url, n, body, max_value_bytes=80 * 1024)
    for name in ("w", "b"):
        want = np.mean([x[name].astype(np.float64) for x in inputs], axis=0)
        for out, _ in results:
            np.testing.assert_allclose(out[name], want.astype(out[name].dtype), rtol=1e-6)
    for _, got in results:  # 3 pieces of 2 tensors each, one on each primary
        np.testing.assert_array_equal(got["w"], results[0][0]["w"][:96])
    assert len(held) == 3 and all(held.values()), f"chunks not on every primary: {held}"


def test_four_ranks_put_an_even_share_of_a_steps_bytes_on_each_of_three_primaries(
    redis_cluster: LocalCluster, conn: RedisCluster
) -> None:
    """One chunk per rank would put 2 of 4 ranks' chunks on one primary (i mod 3): half the
    bytes on one of three servers. Each rank's part (1 MiB) is cut into 3 pieces on a
    cluster, so every primary holds a third of the scattered and reduced bytes."""
    n = 4
    inputs = [{"g": np.full(2**20, float(r), dtype="<f4")} for r in range(n)]  # 4 MiB each
    held: dict[str, int] = {}

    def body(collective: Collective, rank: int) -> Any:
        out = collective.allreduce(inputs[rank], step=1, timeout=60)
        collective.barrier(step=2, timeout=60)
        if rank == 0:
            for name, server in primaries(conn):
                keys = server.keys("cohort:{coll/*}:grad:1:1:*")
                held[name] = sum(int(server.strlen(k)) for k in keys)  # type: ignore[arg-type]
        return out

    results = _ranks(redis_cluster.url, n, body)
    for out in results:
        np.testing.assert_array_equal(out["g"], np.full(2**20, 1.5, dtype="<f4"))
    assert len(held) == 3 and min(held.values()) > 0.95 * max(held.values()), held


def test_a_training_job_on_the_cluster_survives_a_sigkilled_worker(
    redis_cluster: LocalCluster, conn: RedisCluster, tmp_path: Path
) -> None:
    job = Cluster(url=redis_cluster.url, conn=conn, job="clustertrain", tmp=tmp_path)
    try:
        for name in ("c1", "c2"):
            job.trainer_coordinator(
                name, "--wait-replicas", "1", interval=INTERVAL, timeout=TIMEOUT
            )
        workers = {name: job.example_worker(name, 120, save=True) for name in ("a", "b", "c")}
        job.until(
            lambda s: len(s.ranks) == 3 and s.last_committed >= 15,
            timeout=60,
            message="three workers training on the cluster",
        )
        workers["b"].kill(signal.SIGKILL)
        job.until(lambda s: "b" not in s.members, timeout=TIMEOUT + 10, message="b failed")
        failed_id = job.of_type(WorkerFailed)[0][0]
        job.until(
            lambda s: any(isinstance(f, StepCommitted) and i > failed_id for i, f in job.facts),
            timeout=30,
            message="survivors commit again",
        )
        for name in ("a", "c"):
            assert job.finished(workers[name], 120) == 0, workers[name].output()[-3000:]
        ends = [workers["a"].summary(), workers["c"].summary()]
        assert ends[0]["weights_digest"] == ends[1]["weights_digest"]
        assert ends[0]["accuracy"] > 0.9
        job.pull()
        report = audit(f for _, f in job.facts)
        assert report.ok, report
        logs = "".join(p.output() for p in job.procs if p.name != "b")
        assert "Traceback" not in logs and "WAIT:" not in logs
        replay = subprocess.run(
            [sys.executable, "-m", "cohort", "--redis-url", redis_cluster.url,
             "replay", "--job", job.job, "--audit", "--quiet"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert replay.returncode == 0, replay.stderr
        status = subprocess.run(
            [sys.executable, "-m", "cohort", "--redis-url", redis_cluster.url,
             "status", "--job", job.job, "--json"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["lease_token"]
    finally:
        job.stop()


def test_a_bad_cluster_url_is_named_by_the_cli_without_a_traceback() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "cohort", "--redis-url", "redis+cluster://127.0.0.1:1,h:x",
         "status", "--job", "j"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "'x'" in done.stderr and "Traceback" not in done.stderr
    unreachable = subprocess.run(
        [sys.executable, "-m", "cohort", "--redis-url", "redis+cluster://127.0.0.1:1",
         "status", "--job", "j"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert unreachable.returncode == 3, unreachable.stderr
    assert "Traceback" not in unreachable.stderr


def test_a_worker_s_own_credential_lives_on_every_node_signs_and_is_revoked_on_every_node(
    redis_cluster: LocalCluster, conn: RedisCluster
) -> None:
    import redis

    from cohort import acl
    from cohort.events import identity
    from cohort.worker.membership.client import Worker

    job, nodes = "cluster-ident", [n.port for n in redis_cluster.nodes]
    secret = acl.issue(conn, job, ["w1"])["w1"]
    name = identity.worker_user(job, "w1")

    def users() -> list[bool]:
        found = []
        for port in nodes:
            node = redis.Redis(host="127.0.0.1", port=port)
            found.append(node.acl_getuser(name) is not None)
            node.close()
        return found

    assert users() == [True] * len(nodes)  # replicas too: one may be promoted
    own = connect(RedisSettings(url=acl.url_as(redis_cluster.url, name, secret)))
    try:
        worker = Worker(own, job)
        assert worker.id == "w1" and worker.inbox.signer == identity.Signer("w1", secret)
        worker.inbox.send(Join(at=0, job=job, worker="w1"))
        [(_, fields)] = conn.xrange(Keys(job).inbox)
        assert fields[identity.SIGNER] == b"w1"
        assert identity.verify(identity.Trust(conn.get(Keys(job).identity)), fields) is None
    finally:
        own.close()
    acl.revoke(conn, job, "w1")
    assert users() == [False] * len(nodes)
    assert conn.smembers(Keys(job).revoked) == {b"w1"}
