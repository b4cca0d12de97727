"""Rotating a job's key and un-revoking a worker, on a real redis-server (docs/identity.md).

`cohort acl --rotate --grace S` makes a new job key; for S seconds the leader accepts
signatures under either key and every worker's user takes either password, while running
workers read their new secret and move to it by themselves. Training never notices. After
the grace only the new key and passwords work. `cohort acl --unrevoke W` gives a revoked
name its voice back.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from cohort import acl
from cohort.coordinator.election import load_library
from cohort.coordinator.service import Coordinator, ServiceSettings
from cohort.events import identity
from cohort.events.codec import decode_command
from cohort.events.connection import RedisSettings, connect
from cohort.events.keys import Keys
from cohort.events.models import (
    Heartbeat,
    JobConfig,
    Join,
    StepCommitted,
    WorkerFailed,
    WorkerJoined,
    WorkerLeft,
)
from cohort.events.streams import Inbox, Journal
from cohort.example import run as train
from cohort.localredis import LocalRedis
from cohort.worker.loop.elastic import NumpyElasticJob
from tests.helpers import wait_until

pytestmark = pytest.mark.redis_server

JOB = "rot"
KEYS = Keys(JOB)
PASSWORDS: dict[acl.Role, str] = {"coordinator": "c-pw", "worker": "w-pw", "viewer": "v-pw"}


def _cohort(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cohort", *args], capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )  # fmt: skip


@pytest.fixture
def admin(server: LocalRedis) -> Iterator[redis.Redis]:
    conn = server.client()
    acl.apply(conn, JOB, PASSWORDS)
    load_library(conn)
    yield conn
    conn.close()


def own_url(server: LocalRedis, worker: str, secret: str) -> str:
    return acl.url_as(server.url, identity.worker_user(JOB, worker), secret)


def facts(admin: redis.Redis) -> list[Any]:
    return [f for _, f in Journal(admin, KEYS.journal).facts()]


def committed(admin: redis.Redis) -> int:
    return max((f.step for f in facts(admin) if isinstance(f, StepCommitted)), default=-1)


def dead(admin: redis.Redis) -> list[tuple[str, Any]]:
    rows: Any = admin.xrange(KEYS.dead)
    return [(f[b"reason"].decode(), decode_command(f[b"raw"])) for _, f in rows]


def leader(server: LocalRedis, stop: threading.Event, **config: Any) -> threading.Thread:
    settings = ServiceSettings(
        job=JOB, coordinator="c1", config=JobConfig(**config), block_ms=20, status_interval=0.2
    )
    conn = connect(RedisSettings(url=acl.role_url(server.url, JOB, "coordinator", "c-pw")))
    thread = threading.Thread(
        target=Coordinator.on_redis(conn, settings).run, args=(stop,), daemon=True
    )
    thread.start()
    return thread


# ---------------------------------------------------------------- rotation


def test_a_rotation_during_training_loses_no_step_and_after_the_grace_the_old_key_is_dead(
    server: LocalRedis, admin: redis.Redis
) -> None:
    old = acl.issue(admin, JOB, ["a", "b"])
    old_key: Any = admin.get(KEYS.identity)
    stop = threading.Event()
    coordinator = leader(
        server, stop, min_workers=2, dataset_size=512, batch_size=8, max_steps=100_000,
        heartbeat_timeout=5.0,
    )  # fmt: skip
    jobs: dict[str, NumpyElasticJob] = {}
    results: dict[str, Any] = {}

    def trainer(name: str) -> Callable[[], None]:
        def body() -> None:
            conn = connect(RedisSettings(url=own_url(server, name, old[name]), client_name=name))
            jobs[name] = NumpyElasticJob(JOB, conn=conn, worker_id=name, signals=False)
            try:
                results[name] = train(jobs[name], pace=0.05)
            except BaseException as exc:
                results[name] = exc
            finally:
                jobs[name].worker.stop()
                conn.close()

        return body

    threads = [threading.Thread(target=trainer(n), daemon=True) for n in ("a", "b")]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: committed(admin) >= 3, 60, 0.05, "training under the old key")
        rotated = _cohort(
            "--redis-url", server.url, "acl", "--job", JOB, "--rotate", "--grace", "10"
        )  # fmt: skip  (waits out the grace, then finishes)
        assert rotated.returncode == 0, rotated.stderr
        assert "rotated job rot's key: 2 worker user(s)" in rotated.stdout
        assert "rotation of job rot's key finished" in rotated.stdout
        new_key: Any = admin.get(KEYS.identity)
        assert new_key != old_key and admin.exists(KEYS.identity_previous) == 0
        for name in ("a", "b"):  # each moved to its new secret without a restart
            signer = jobs[name].worker.inbox.signer
            assert signer is not None and signer.secret == identity.secret_of(new_key, name)
        # the old passwords log in no more; every worker connection made from now on uses
        # the new one: cut them all and training goes on
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=server.port, username="cohort-rot-w-a", password=old["a"]).ping()
        for name in ("a", "b"):
            admin.execute_command("CLIENT", "KILL", "USER", identity.worker_user(JOB, name))
        after_grace = committed(admin)
        wait_until(lambda: committed(admin) >= after_grace + 10, 60, 0.05, "steps after it")
        # a command signed with the old secret after the grace is refused
        stale = Inbox(admin, KEYS.inbox, identity.Signer("a", old["a"]))
        stale.send(Heartbeat(at=0, job=JOB, worker="a"))
        wait_until(lambda: dead(admin), 10, 0.05, "the stale command's dead letter")
        assert dead(admin) == [
            ("signature does not verify for worker 'a'", Heartbeat(at=0, job=JOB, worker="a"))
        ]
        for job in jobs.values():
            job.worker.stopping.set()
        for t in threads:
            t.join(60)
            assert not t.is_alive(), "a worker did not stop"
        for name in ("a", "b"):
            assert not isinstance(results[name], BaseException), results[name]
            assert results[name]["world_changes"] == 0 and results[name]["removed"] is None
        seen = facts(admin)
        assert not [f for f in seen if isinstance(f, WorkerFailed)]
        left = [i for i, f in enumerate(seen) if isinstance(f, WorkerLeft)]
        last_commit = max(i for i, f in enumerate(seen) if isinstance(f, StepCommitted))
        assert len(left) == 2 and min(left) > last_commit  # they left when told to, not before
    finally:
        stop.set()
        coordinator.join(10)


def test_a_second_rotation_waits_for_the_first_and_finishing_twice_is_harmless(
    server: LocalRedis, admin: redis.Redis
) -> None:
    acl.issue(admin, JOB, ["a"])
    first = _cohort("--redis-url", server.url, "acl", "--job", JOB, "--rotate", "--no-wait")
    assert first.returncode == 0, first.stderr
    assert "--finish-rotation" in first.stdout
    assert 0 < admin.pttl(KEYS.identity_previous) <= 60_000  # it vanishes by itself
    assert admin.pttl(KEYS.credential("a")) > 0
    again = _cohort("--redis-url", server.url, "acl", "--job", JOB, "--rotate")
    assert again.returncode == 2 and "a rotation of job 'rot''s key is under way" in again.stderr
    assert "cohort acl --job rot --finish-rotation" in again.stderr
    for _ in range(2):
        done = _cohort("--redis-url", server.url, "acl", "--job", JOB, "--finish-rotation")
        assert done.returncode == 0, done.stderr
    assert not admin.exists(KEYS.identity_previous, KEYS.credential("a"))
    key: Any = admin.get(KEYS.identity)
    user: Any = admin.acl_getuser(identity.worker_user(JOB, "a"))
    assert user["passwords"] == [acl.password_hash(identity.secret_of(key, "a"))[1:]]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--rotate", "--grace", "3"), "--grace 3 is too short"),
        (("--rotate", "--revoke", "a"), "--revoke goes alone: not with --rotate"),
        (("--rotate", "--apply"), "--rotate acts on the server by itself: drop --apply"),
        (("--unrevoke", "nobody"), "worker 'nobody' is not revoked in job 'rot' (revoked: none)"),
        (("--unrevoke", "bad name"), "worker name 'bad name' is not valid"),
    ],
)
def test_cohort_acl_refuses_a_bad_rotation_or_unrevoke_in_one_line(
    server: LocalRedis, admin: redis.Redis, args: tuple[str, ...], says: str
) -> None:
    acl.issue(admin, JOB, ["a"])
    done = _cohort("--redis-url", server.url, "acl", "--job", JOB, *args)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], done.stderr


def test_rotating_a_job_without_a_key_names_the_fix(server: LocalRedis, admin: redis.Redis) -> None:
    done = _cohort("--redis-url", server.url, "acl", "--job", JOB, "--rotate")
    assert done.returncode == 2 and "has no identity key yet" in done.stderr


# ---------------------------------------------------------------- un-revoking


def test_an_unrevoked_worker_is_heard_again_and_gets_its_user_back_only_if_asked(
    server: LocalRedis, admin: redis.Redis
) -> None:
    acl.issue(admin, JOB, ["a", "b"])
    stop = threading.Event()
    coordinator = leader(server, stop, min_workers=5, dataset_size=64)
    try:
        for worker in ("a", "b"):
            assert _cohort("--redis-url", server.url, "acl", "--job", JOB, "--revoke", worker
                           ).returncode == 0  # fmt: skip
        plain = _cohort("--redis-url", server.url, "acl", "--job", JOB, "--unrevoke", "a")
        assert plain.returncode == 0, plain.stderr
        assert plain.stdout.startswith("un-revoked worker a: the leader accepts its signatures")
        assert "cohort acl --job rot --worker a --apply" in plain.stdout
        assert admin.smembers(KEYS.revoked) == {b"b"}
        assert admin.acl_getuser(identity.worker_user(JOB, "a")) is None  # not asked for
        applied = _cohort("--redis-url", server.url, "acl", "--job", JOB, "--unrevoke", "b",
                          "--apply")  # fmt: skip
        assert applied.returncode == 0, applied.stderr
        shown = next(line for line in applied.stdout.splitlines() if "# worker b: " in line)
        conn = connect(RedisSettings(url=shown.split()[3]))  # b's new user, as printed
        key: Any = admin.get(KEYS.identity)
        as_b = Inbox(conn, KEYS.inbox, identity.Signer("b", identity.secret_of(key, "b")))

        def b_joined() -> bool:  # from the leader's next read of the revoked set on
            as_b.send(Join(at=0, job=JOB, worker="b", host="h", pid=1))
            return any(isinstance(f, WorkerJoined) and f.worker == "b" for f in facts(admin))

        try:
            wait_until(b_joined, 10, 0.2, "b's Join decided")
        finally:
            conn.close()
        assert {reason for reason, _ in dead(admin)} <= {"worker 'b''s credential is revoked"}
        assert admin.smembers(KEYS.revoked) == set()
    finally:
        stop.set()
        coordinator.join(10)
