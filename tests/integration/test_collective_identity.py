"""A rank's collective data is its own (issue 33), on a real redis-server with ACLs.

Each worker connects as its own Redis user (`cohort acl --worker`), which reads every
rank's chunks and notices but writes only keys ending in `/<its worker>`; readers name
every key from the world's rank -> worker map. So worker A cannot place a notice in B's
stream (a forged abort, a notice pointing at A's keys), nor overwrite B's chunks, reduced
chunks, broadcast pieces or weights; what A writes under its own name is read as A's, and
a blob of the wrong size, dtype or format is a failure naming A at the step it happens.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from redis.exceptions import NoPermissionError

from cohort import acl
from cohort.events import identity
from cohort.events.connection import Client, RedisSettings, connect
from cohort.events.keys import Keys
from cohort.localredis import LocalRedis
from cohort.worker.collective import tensors as blobs
from cohort.worker.collective.layout import flatten
from cohort.worker.collective.redis_collective import Collective
from cohort.worker.errors import CorruptDataError, MemoryBudgetError
from cohort.worker.membership.view import Assignment

pytestmark = pytest.mark.redis_server

JOB = "coll-id"
KEYS = Keys(JOB)
WORKERS = ("a", "b", "c")
PASSWORDS: dict[acl.Role, str] = {"coordinator": "c-secret", "worker": "w-secret"}


@dataclass
class Rank:
    """A worker of a fixed world whose ranks are `ranks`."""

    id: str
    ranks: tuple[str, ...]
    world_version: int = 1
    assignment: Assignment | None = None

    @property
    def rank(self) -> int:
        return self.ranks.index(self.id)

    @property
    def world_size(self) -> int:
        return len(self.ranks)


@dataclass
class Job:
    server: LocalRedis
    admin: Client
    secrets: dict[str, str]

    def own(self, worker: str) -> Client:
        """A client with `worker`'s own credential, as its process would connect."""
        user = identity.worker_user(JOB, worker)
        url = acl.url_as(self.server.url, user, self.secrets[worker])
        return connect(RedisSettings(url=url, client_name=worker))

    def role(self) -> Client:
        """A client with the shared worker role's credential (no identity of its own)."""
        return connect(RedisSettings(url=acl.role_url(self.server.url, JOB, "worker", "w-secret")))


@pytest.fixture
def job(server: LocalRedis) -> Iterator[Job]:
    admin = server.client()
    acl.apply(admin, JOB, {"worker": PASSWORDS["worker"]})
    secrets = acl.issue(admin, JOB, WORKERS)
    admin.acl_log_reset()
    yield Job(server, admin, secrets)
    admin.close()


def run(
    job: Job, bodies: Mapping[str, Callable[[Collective], Any]], world: tuple[str, ...]
) -> dict:
    """Each worker's body on its own credential and thread; its result or exception."""
    results: dict[str, Any] = {}

    def one(name: str) -> None:
        conn = job.own(name)
        try:
            results[name] = bodies[name](Collective(conn, JOB, Rank(name, world), timeout=20))
        except BaseException as exc:
            results[name] = exc
        finally:
            conn.close()

    threads = [threading.Thread(target=one, args=(name,)) for name in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a rank did not finish"
    return results


def values(rank: int) -> dict[str, np.ndarray]:
    return {"w": np.full(12, float(rank + 1), "<f4"), "b": np.arange(5, dtype="<f8") * rank}


# ---------------------------------------------------------------- what Redis refuses A


@pytest.mark.parametrize(
    "key",
    [
        KEYS.grad(1, 0, 1, 0, "b"),  # b's part of a chunk
        KEYS.grad(1, 0, 1, 0, "b", "g3"),  # the same, spread over a cluster's primaries
        KEYS.grad_reduced(1, 0, 1, "b"),  # the mean b owns
        KEYS.grad_broadcast(1, 0, 0, "b"),  # a piece b broadcasts
        KEYS.weights(0, "b"),  # the weights b publishes
        KEYS.step_events(1, 0, "allreduce", "b") + "x",  # not b's, and not a's either
    ],
)
def test_a_s_credential_cannot_write_or_delete_b_s_collective_keys(job: Job, key: str) -> None:
    a, b = job.own("a"), job.own("b")
    try:
        for command in (("SET", key, "x", "PX", 60_000), ("UNLINK", key), ("PEXPIRE", key, 1)):
            with pytest.raises(NoPermissionError):
                a.execute_command(*command)
        if key.endswith("/b"):
            assert b.set(key, b"mine", px=60_000)  # b writes its own
            assert a.get(key) == b"mine"  # a reads it: it may sum it, not replace it
    finally:
        a.close()
        b.close()


def test_a_cannot_put_a_notice_in_b_s_stream_neither_an_abort_nor_one_naming_a_s_keys(
    job: Job,
) -> None:
    a = job.own("a")
    b_stream = KEYS.step_events(1, 0, "allreduce", "b")
    try:
        for fields in (
            {"p": "abort", "r": 1, "why": "forged"},
            {"p": "scatter", "r": 1, "l": "x", "t": "g0"},  # pointing readers at other keys
        ):
            with pytest.raises(NoPermissionError):
                a.xadd(b_stream, fields)  # type: ignore[arg-type]
        with pytest.raises(NoPermissionError):
            a.unlink(b_stream)
        assert a.xadd(KEYS.step_events(1, 0, "allreduce", "a"), {"p": "x", "r": 0})  # its own
        assert a.xrange(b_stream) == []  # and it reads b's
    finally:
        a.close()
    # with the forgeries refused, the step runs as if a had never tried
    world = ("a", "b", "c")
    bodies = {w: (lambda c, r=r: c.allreduce(values(r), 0)) for r, w in enumerate(world)}
    results = run(job, bodies, world)
    for got in results.values():
        assert not isinstance(got, BaseException), got
        np.testing.assert_allclose(got["w"], np.full(12, 2.0))
        np.testing.assert_allclose(got["b"], np.arange(5) * 1.0)


def test_a_notice_counts_as_the_rank_whose_stream_holds_it_whatever_its_fields_claim(
    job: Job,
) -> None:
    """An abort a writes in its own stream, claiming to be rank 1, ends b's call as a's."""
    a = job.own("a")
    try:
        a.xadd(KEYS.step_events(1, 0, "allreduce", "a"), {"p": "abort", "r": 1, "why": "me"})
    finally:
        a.close()
    results = run(job, {"b": lambda c: c.allreduce(values(1), 0)}, ("a", "b"))
    assert isinstance(results["b"], MemoryBudgetError)
    assert "rank 0 refused the step: me" in str(results["b"])


def test_the_role_user_without_identity_still_writes_every_rank_s_keys(job: Job) -> None:
    """Without per-worker credentials there is no authentication: docs/identity.md."""
    shared = job.role()
    try:
        assert shared.set(KEYS.grad(1, 0, 1, 0, "b"), b"x", px=60_000)
        assert shared.xadd(KEYS.step_events(1, 0, "allreduce", "b"), {"p": "x"})
    finally:
        shared.close()


# ---------------------------------------------------------------- what a reader refuses


@pytest.mark.parametrize(
    "blob, why",
    [
        (b"".join(map(bytes, blobs.pack({"<f4": np.zeros(3, "<f4")}))), "holds"),  # too short
        (b"".join(map(bytes, blobs.pack({"<f4": np.zeros(6, "<f8")}))), "holds"),  # a dtype
        (b"\x07garbage", "header"),  # not a blob at all
    ],
)
def test_a_malformed_chunk_a_writes_under_its_own_name_fails_the_step_naming_a(
    job: Job, blob: bytes, why: str
) -> None:
    """a scatters by hand: its part of the chunk b owns is not what the call cuts. b's call
    fails at this step with CorruptDataError naming rank 0, worker 'a' and the key."""
    world = ("a", "b")
    tensors = {"w": np.ones(12, "<f4")}
    key = KEYS.grad(1, 0, 0, 1, "a")  # b owns chunk 1 of 2

    def forge(c: Collective) -> None:
        c.conn.set(key, blob, px=60_000)
        c.conn.xadd(
            KEYS.step_events(1, 0, "allreduce", "a"),
            {"p": "scatter", "r": 0, "l": flatten(tensors)[0].digest, "t": ""},
        )

    results = run(job, {"a": forge, "b": lambda c: c.allreduce(tensors, 0)}, world)
    error = results["b"]
    assert isinstance(error, CorruptDataError), error
    assert (error.rank, error.worker, error.key) == (0, "a", key)
    assert why in str(error) and "rank 0's data failed verification" in str(error)


def test_a_broadcast_whose_piece_is_not_a_blob_fails_naming_the_root(job: Job) -> None:
    world = ("a", "b")
    key = KEYS.grad_broadcast(1, 0, 0, "a")

    def forge(c: Collective) -> None:
        c.conn.set(key, b"not a blob", px=60_000)
        c.conn.xadd(KEYS.step_events(1, 0, "broadcast", "a"), {"p": "sent", "r": 0, "n": 1})

    results = run(
        job, {"a": forge, "b": lambda c: c.broadcast(None, root=0, step=0, timeout=5)}, world
    )
    error = results["b"]
    assert isinstance(error, CorruptDataError) and (error.rank, error.worker) == (0, "a")
