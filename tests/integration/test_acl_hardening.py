"""Issue 33 on a real redis-server: a worker's credential cannot stop the job.

A worker's Redis user may XADD to the inbox and nothing else on it, may SELECT only its own
database, and `cohort acl --apply` says so loudly when Redis's `default` user leaves every
door open (`--lock-default` closes it). docs/identity.md's table of claims names these tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis
from redis.exceptions import NoPermissionError

from cohort import acl
from cohort.events import identity
from cohort.events.connection import RedisSettings, connect
from cohort.events.keys import Keys
from cohort.events.models import Join
from cohort.events.streams import Inbox
from cohort.localredis import LocalRedis

pytestmark = pytest.mark.redis_server

JOB = "hard"
KEYS = Keys(JOB)
PASSWORDS: dict[acl.Role, str] = {"coordinator": "c-pw", "worker": "w-pw", "viewer": "v-pw"}


def _cohort(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cohort", *args], capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), **(env or {})},
    )  # fmt: skip


def refused(conn: redis.Redis, *command: Any) -> None:
    with pytest.raises(NoPermissionError):
        conn.execute_command(*command)


def db_url(server: LocalRedis, db: int) -> str:
    return urlsplit(server.url)._replace(path=f"/{db}").geturl()


def as_user(server: LocalRedis, username: str, password: str, db: int = 0) -> redis.Redis:
    return connect(RedisSettings(url=acl.url_as(db_url(server, db), username, password)))


@pytest.fixture
def admin(server: LocalRedis) -> Iterator[redis.Redis]:
    """The default user, the job's roles applied and worker a's own credential issued."""
    conn = server.client()
    acl.apply(conn, JOB, PASSWORDS)
    yield conn
    conn.close()


@pytest.fixture
def workers(server: LocalRedis, admin: redis.Redis) -> Iterator[list[redis.Redis]]:
    """The worker role's user and worker a's own user, both as a worker runs."""
    secret = acl.issue(admin, JOB, ["a"])["a"]
    conns = [
        as_user(server, acl.user(JOB, "worker"), PASSWORDS["worker"]),
        as_user(server, identity.worker_user(JOB, "a"), secret),
    ]
    yield conns
    for conn in conns:
        conn.close()


# ---------------------------------------------------------------- the inbox: XADD only


def test_a_worker_may_xadd_to_the_inbox_and_nothing_else_on_it(
    workers: list[redis.Redis], admin: redis.Redis
) -> None:
    for conn in workers:
        entry = Inbox(conn, KEYS.inbox).send(Join(at=0, job=JOB, worker="a"), maxlen=1000)
        inbox, grad = KEYS.inbox, KEYS.grad(1, 0, 0, 0, "a")
        for command in (
            ("DEL", inbox), ("UNLINK", inbox), ("XTRIM", inbox, "MAXLEN", 0),
            ("XDEL", inbox, entry), ("XSETID", inbox, "9999999999999-0"),
            ("RENAME", inbox, grad), ("RENAME", grad, inbox),
            ("COPY", grad, inbox), ("PEXPIRE", inbox, 1), ("EXPIRE", inbox, 1),
            ("XLEN", inbox), ("XRANGE", inbox, "-", "+"), ("XREVRANGE", inbox, "+", "-"),
            ("XREAD", "STREAMS", inbox, "0-0"), ("SET", inbox, "x"), ("GET", inbox),
            ("EXISTS", inbox), ("XINFO", "STREAM", inbox), ("TYPE", inbox),
        ):  # fmt: skip
            refused(conn, *command)
    assert admin.xlen(KEYS.inbox) == 2  # both entries are there, untouched


# ---------------------------------------------------------------- one database


@pytest.mark.parametrize("db", [0, 2])
def test_every_role_selects_its_own_database_and_no_other(server: LocalRedis, db: int) -> None:
    admin = connect(RedisSettings(url=db_url(server, db)))
    try:
        acl.apply(admin, JOB, PASSWORDS)  # the admin's database is the users'
        secret = acl.issue(admin, JOB, ["a"])["a"]
        users = {acl.user(JOB, r): p for r, p in PASSWORDS.items()}
        users[identity.worker_user(JOB, "a")] = secret
        for name, password in users.items():
            conn = as_user(server, name, password, db)  # the URL's /db: SELECT db on connect
            try:
                assert conn.ping() and conn.execute_command("SELECT", db)
                for other in {0, 1, 2} - {db}:
                    refused(conn, "SELECT", other)
                refused(conn, "SWAPDB", db, 1 - min(db, 1))
                grad = KEYS.grad(1, 0, 0, 0, "a")
                refused(conn, "MOVE", grad, 1)
                refused(conn, "COPY", grad, grad, "DB", 1)
            finally:
                conn.close()
        other_db = connect(RedisSettings(url=db_url(server, 1)))
        assert other_db.dbsize() == 0  # nothing reached another database
        other_db.close()
    finally:
        admin.close()


def test_a_worker_in_its_database_cannot_write_into_another(
    workers: list[redis.Redis], admin: redis.Redis
) -> None:
    grad = KEYS.grad(1, 0, 0, 0, "a")
    for conn in workers:
        assert conn.set(grad, b"blob", px=60_000)
        refused(conn, "SELECT", 1)
        assert conn.set(grad, b"again", px=60_000)  # still in database 0
        refused(conn, "MOVE", grad, 1)
        refused(conn, "COPY", grad, grad, "DB", 1)
    assert admin.get(grad) == b"again"
    admin.select(1)
    assert admin.dbsize() == 0


# ---------------------------------------------------------------- the default user


def test_apply_warns_loudly_while_the_default_user_is_open(server: LocalRedis) -> None:
    done = _cohort("acl", "--job", JOB, "--apply", "--redis-url", server.url)
    assert done.returncode == 0, done.stderr
    assert "cohort: warning: Redis's `default` user is enabled without a password" in done.stderr
    assert "redis-cli --user admin --pass ADMIN_PASSWORD ACL SETUSER default off" in done.stderr
    assert f"cohort acl --job {JOB} --apply --lock-default" in done.stderr
    assert len(done.stderr.splitlines()) >= 6  # a paragraph, not a line lost in the output


def test_lock_default_from_a_url_logging_in_as_default_is_refused_before_anything(
    server: LocalRedis,
) -> None:
    conn = server.client()
    done = _cohort("acl", "--job", JOB, "--apply", "--lock-default", "--redis-url", server.url)
    assert done.returncode == 2
    assert "this --redis-url logs in as `default`" in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert conn.acl_getuser(acl.user(JOB, "worker")) is None  # nothing applied
    assert "on" in conn.acl_getuser("default")["flags"]
    assert _cohort("acl", "--job", JOB, "--lock-default").returncode == 2  # needs --apply
    conn.close()


def test_lock_default_turns_it_off_and_the_admin_s_own_user_goes_on(server: LocalRedis) -> None:
    conn = server.client()
    conn.execute_command("ACL", "SETUSER", "admin", "on", ">admin-pw", "~*", "&*", "+@all")
    admin_url = acl.url_as(server.url, "admin", "admin-pw")
    done = _cohort("acl", "--job", JOB, "--apply", "--lock-default", "--redis-url", admin_url)
    assert done.returncode == 0, done.stderr
    assert "locked the default user: it is off" in done.stdout
    assert "warning" not in done.stderr and "note" not in done.stderr
    assert "off" in conn.acl_getuser("default")["flags"]
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=server.port).ping()  # no user, no way in
    again = _cohort("acl", "--job", JOB, "--role", "viewer", "--apply", "--redis-url", admin_url)
    assert again.returncode == 0 and "warning" not in again.stderr
    conn.close()


def test_lock_default_with_a_password_keeps_it_on_behind_that_password(
    server: LocalRedis,
) -> None:
    env = {acl.DEFAULT_PASSWORD_ENV: "default-pw"}
    done = _cohort(
        "acl", "--job", JOB, "--apply", "--lock-default", "--redis-url", server.url, env=env
    )
    assert done.returncode == 0, done.stderr
    assert "it now needs the password from $COHORT_ACL_DEFAULT_PASSWORD" in done.stdout
    assert "default-pw" not in done.stdout + done.stderr
    assert "cohort: note:" in done.stderr and "warning" not in done.stderr
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=server.port).ping()
    assert redis.Redis(port=server.port, password="default-pw").ping()


# ---------------------------------------------------------------- a rotation's keys


def test_only_a_worker_s_own_user_reads_its_handed_out_secret_and_none_reads_the_previous_key(
    server: LocalRedis, workers: list[redis.Redis], admin: redis.Redis
) -> None:
    admin.set(KEYS.identity_previous, b"k" * 32)
    admin.set(KEYS.credential("a"), b"a's new secret")
    admin.set(KEYS.credential("b"), b"b's new secret")
    role, own = workers
    viewer = as_user(server, acl.user(JOB, "viewer"), PASSWORDS["viewer"])
    try:
        assert own.get(KEYS.credential("a")) == b"a's new secret"
        refused(own, "GET", KEYS.credential("b"))
        refused(own, "SET", KEYS.credential("a"), "x")
        for conn in (role, viewer):
            refused(conn, "GET", KEYS.credential("a"))
        for conn in (role, own, viewer):
            refused(conn, "GET", KEYS.identity_previous)
            refused(conn, "GET", KEYS.identity)
    finally:
        viewer.close()
