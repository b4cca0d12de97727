"""The job's ACL users on a real redis-server: every forbidden action is refused by Redis itself.

docs/design.md "Two streams": a worker can write only the inbox and its collective's keys, so a
fact forged with worker credentials never reaches the journal. The same users run the real
code paths: a coordinator leads, two workers train with allreduce, the viewer runs the CLI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis
from redis.exceptions import NoPermissionError

from cohort import acl
from cohort.coordinator.election import load_library
from cohort.coordinator.service import Coordinator, ServiceSettings
from cohort.events.codec import encode
from cohort.events.connection import RedisSettings, connect
from cohort.events.keys import Keys
from cohort.events.models import JobConfig, Join, WorkerJoined
from cohort.events.streams import Inbox, Journal
from cohort.example import run as train
from cohort.localredis import LocalRedis
from cohort.worker.loop.elastic import NumpyElasticJob
from tests.helpers import require_redis_server, wait_until

pytestmark = pytest.mark.redis_server

JOB = "acl"
OTHER = "other"
KEYS = Keys(JOB)
PASSWORDS: dict[acl.Role, str] = {
    "coordinator": "coord-secret",
    "worker": "worker-secret",
    "viewer": "viewer secret with spaces",
}


@pytest.fixture(scope="module")
def server() -> Iterator[LocalRedis]:
    redis_server = LocalRedis(appendonly=True, binary=require_redis_server())
    redis_server.start()
    yield redis_server
    redis_server.stop()


@pytest.fixture
def admin(server: LocalRedis) -> Iterator[redis.Redis]:
    """The server's default user, with the job's ACL users (re)applied on an empty server."""
    conn = server.client()
    conn.flushall()
    conn.function_flush()
    for name in conn.acl_users():
        text = name.decode() if isinstance(name, bytes) else str(name)
        if text != "default":
            conn.acl_deluser(text)
    acl.apply(conn, JOB, PASSWORDS)
    acl.apply(conn, OTHER, PASSWORDS)
    load_library(conn)
    yield conn
    conn.close()


def url(server: LocalRedis, role: acl.Role, job: str = JOB) -> str:
    return acl.role_url(server.url, job, role, PASSWORDS[role])


def as_role(server: LocalRedis, role: acl.Role) -> redis.Redis:
    return connect(RedisSettings(url=url(server, role), client_name=f"test-{role}"))


@pytest.fixture
def worker_conn(server: LocalRedis, admin: redis.Redis) -> Iterator[redis.Redis]:
    conn = as_role(server, "worker")
    yield conn
    conn.close()


@pytest.fixture
def viewer_conn(server: LocalRedis, admin: redis.Redis) -> Iterator[redis.Redis]:
    conn = as_role(server, "viewer")
    yield conn
    conn.close()


@pytest.fixture
def coordinator_conn(server: LocalRedis, admin: redis.Redis) -> Iterator[redis.Redis]:
    conn = as_role(server, "coordinator")
    yield conn
    conn.close()


def refused(conn: redis.Redis, *command: Any) -> None:
    with pytest.raises(NoPermissionError):
        conn.execute_command(*command)


def _cohort(*args: str, env: dict[str, str] | None = None, stdin: str | None = None) -> Any:
    return subprocess.run(
        [sys.executable, "-m", "cohort", *args],
        capture_output=True,
        text=True,
        timeout=120,
        input=stdin,
        env={**os.environ, **(env or {})},
    )


# ---------------------------------------------------------------- the rules, pure


def test_rules_deny_everything_first_and_grant_only_the_job_s_patterns() -> None:
    for role in acl.ROLES:
        rules = acl.rules(JOB, role)
        assert rules[:3] == ["resetkeys", "resetchannels", "-@all"]
        patterns = [r for r in rules if "~" in r]
        assert patterns and all("cohort:{acl}:" in p or "cohort:{acl/g*}:" in p for p in patterns)
    worker = acl.rules(JOB, "worker")
    assert "+fcall" not in worker and "+fcall_ro" not in worker
    assert "(%W~cohort:{acl}:inbox +xadd)" in worker and "%R~cohort:{acl}:journal" in worker
    assert "+waitaof" in acl.rules(JOB, "coordinator", (7, 2))
    assert "+waitaof" not in acl.rules(JOB, "coordinator", (7, 0))


def test_setuser_commands_carry_a_hash_never_the_password() -> None:
    commands = acl.setuser_commands(JOB, PASSWORDS)
    assert [c[2] for c in commands] == [
        "cohort-acl-coordinator",
        "cohort-acl-worker",
        "cohort-acl-viewer",
    ]
    for command in commands:
        assert command[:2] == ["ACL", "SETUSER"] and command[3:5] == ["reset", "on"]
        assert not any(p in " ".join(command) for p in PASSWORDS.values())


# ---------------------------------------------------------------- worker


def test_worker_writes_the_inbox_and_its_gradients_and_reads_the_journal(
    worker_conn: redis.Redis, coordinator_conn: redis.Redis
) -> None:
    Inbox(worker_conn, KEYS.inbox).send(Join(at=0, job=JOB, worker="w1"), maxlen=1000)
    grad = KEYS.grad(1, 0, 0, 0, "w1")
    assert worker_conn.set(grad, b"blob", px=60_000)
    assert worker_conn.get(grad) == b"blob"
    assert worker_conn.pexpire(grad, 1000)
    assert worker_conn.unlink(grad) == 1
    spread = KEYS.grad(1, 0, 0, 0, "w1", "g17")  # a chunk placed on another cluster primary
    assert worker_conn.set(spread, b"blob", px=60_000) and worker_conn.unlink(spread) == 1
    events = KEYS.step_events(1, 0, "allreduce", "w1")
    worker_conn.xadd(events, {"r": "0"})
    assert worker_conn.xread({events: "0-0", KEYS.journal: "0-0"}, block=1)
    assert worker_conn.set(KEYS.weights(0, "w1"), b"w", px=60_000)
    coord = Coordinator.on_redis(
        coordinator_conn, ServiceSettings(job=JOB, coordinator="c1", block_ms=10)
    )
    coord.start()
    coord.step()
    assert coord.leading
    journal = Journal(worker_conn, KEYS.journal)
    assert journal.length() >= 2 and journal.last_id() != "0-0"
    assert [type(f).__name__ for _, f in journal.facts()][:2] == ["JobConfigured", "LeaderElected"]
    assert worker_conn.xrevrange(KEYS.journal, count=1)


def test_a_fact_forged_with_worker_credentials_never_reaches_the_journal(
    worker_conn: redis.Redis, coordinator_conn: redis.Redis
) -> None:
    coord = Coordinator.on_redis(
        coordinator_conn, ServiceSettings(job=JOB, coordinator="c1", block_ms=10)
    )
    coord.start()
    coord.step()
    before: Any = coordinator_conn.xrange(KEYS.journal)
    forged = encode(WorkerJoined(at=0, job=JOB, worker="mallory"))
    refused(worker_conn, "XADD", KEYS.journal, "*", "e", forged)
    refused(worker_conn, "FCALL", "cohort_append", 4, KEYS.leader, KEYS.journal, KEYS.cursor,
            KEYS.dead, "1:x", "0-0", "", 1, 100, forged)  # fmt: skip
    refused(worker_conn, "FCALL_RO", "cohort_version", 0)
    refused(worker_conn, "EVAL", "return redis.call('XADD', KEYS[1], '*', 'e', ARGV[1])", 1,
            KEYS.journal, forged)  # fmt: skip
    refused(worker_conn, "FUNCTION", "LOAD", "REPLACE", "#!lua name=cohort\n")
    refused(worker_conn, "FUNCTION", "FLUSH")
    refused(worker_conn, "SET", KEYS.journal, forged)
    refused(worker_conn, "DEL", KEYS.journal)
    refused(worker_conn, "UNLINK", KEYS.journal)
    refused(worker_conn, "XTRIM", KEYS.journal, "MAXLEN", 0)
    refused(worker_conn, "XDEL", KEYS.journal, before[0][0])
    refused(worker_conn, "RENAME", KEYS.grad(1, 0, 0, 0, "w1"), KEYS.journal)
    refused(worker_conn, "COPY", KEYS.grad(1, 0, 0, 0, "w1"), KEYS.journal)
    assert coordinator_conn.xrange(KEYS.journal) == before


@pytest.mark.parametrize("key", ["leader", "cursor", "snapshot", "epoch", "status"])
def test_worker_cannot_read_or_write_the_leader_s_keys(worker_conn: redis.Redis, key: str) -> None:
    name = getattr(KEYS, key)
    refused(worker_conn, "GET", name)
    refused(worker_conn, "SET", name, "1:forged")
    refused(worker_conn, "DEL", name)
    refused(worker_conn, "PEXPIRE", name, 1)


def test_worker_cannot_touch_the_dead_letters_or_read_the_inbox(worker_conn: redis.Redis) -> None:
    refused(worker_conn, "XADD", KEYS.dead, "*", "reason", "x")
    refused(worker_conn, "XRANGE", KEYS.dead, "-", "+")
    refused(worker_conn, "XRANGE", KEYS.inbox, "-", "+")  # other workers' commands
    refused(worker_conn, "XREAD", "STREAMS", KEYS.inbox, "0-0")
    # XADD alone on the inbox: test_acl_hardening.py refuses every other command on it. Not
    # refusable: XADD's own MAXLEN/MINID trims and an explicit ID moves the stream's last ID
    # (ACLs cannot restrict arguments); the leader repairs that (docs/identity.md).


def test_worker_cannot_touch_another_job(worker_conn: redis.Redis) -> None:
    other = Keys(OTHER)
    refused(worker_conn, "XADD", other.inbox, "*", "e", "x")
    refused(worker_conn, "XRANGE", other.journal, "-", "+")
    refused(worker_conn, "SET", other.grad(1, 0, 0, 0, "w1"), "x")
    refused(worker_conn, "GET", other.grad(1, 0, 0, 0, "w1"))
    refused(worker_conn, "GET", "cohort:{acl2}:grad:1:0:0:0")  # a job whose name extends ours
    refused(worker_conn, "SET", other.grad(1, 0, 0, 0, "w1", "g3"), "x")
    refused(worker_conn, "SET", "cohort:{acl/x}:grad:1", "x")  # not a placement tag
    refused(worker_conn, "SET", "unrelated", "x")


def test_worker_holds_its_job_s_presence_and_the_coordinator_counts_it(
    server: LocalRedis, worker_conn: redis.Redis, coordinator_conn: redis.Redis
) -> None:
    """A worker may subscribe to its job's presence channels (and no other channel, nor
    publish on them); the coordinator may count them and do nothing else with channels."""
    pubsub = worker_conn.pubsub()
    pubsub.ssubscribe(KEYS.presence("w1"))
    assert pubsub.get_message(timeout=5)["type"] == "ssubscribe"
    counted = coordinator_conn.execute_command("PUBSUB", "SHARDNUMSUB", KEYS.presence("w1"))
    assert counted == [KEYS.presence("w1").encode(), 1]
    pubsub.close()
    for channel in (Keys(OTHER).presence("w1"), "unrelated"):
        other = as_role(server, "worker").pubsub()
        with pytest.raises(NoPermissionError):
            other.ssubscribe(channel)
            other.get_message(timeout=5)
    refused(worker_conn, "SPUBLISH", KEYS.presence("w1"), "x")
    refused(coordinator_conn, "SPUBLISH", KEYS.presence("w1"), "x")


@pytest.mark.parametrize(
    "command",
    [
        ("FLUSHALL",),
        ("FLUSHDB",),
        ("CONFIG", "GET", "*"),
        ("CONFIG", "SET", "appendonly", "no"),
        ("KEYS", "*"),
        ("SCAN", "0"),
        ("ACL", "LIST"),
        ("ACL", "SETUSER", "mallory", "on", "nopass", "+@all", "~*"),
        ("SWAPDB", "0", "1"),
        ("BGSAVE",),
        ("REPLICAOF", "NO", "ONE"),
        ("SHUTDOWN", "NOSAVE"),
        ("MONITOR",),
        ("CLIENT", "KILL", "TYPE", "normal"),
        ("INFO",),
        ("SUBSCRIBE", "x"),
        ("PUBLISH", "x", "y"),
    ],
)
def test_worker_and_viewer_are_refused_dangerous_commands(
    worker_conn: redis.Redis, viewer_conn: redis.Redis, command: tuple[str, ...]
) -> None:
    refused(worker_conn, *command)
    refused(viewer_conn, *command)


def test_coordinator_is_refused_what_it_does_not_need(coordinator_conn: redis.Redis) -> None:
    for command in (
        ("FLUSHALL",),
        ("CONFIG", "GET", "*"),
        ("ACL", "LIST"),
        ("KEYS", "*"),
        ("FUNCTION", "FLUSH"),
        ("FUNCTION", "DELETE", "cohort"),
        ("EVAL", "return 1", 0),
        ("SWAPDB", "0", "1"),
        ("SHUTDOWN", "NOSAVE"),
        ("GET", Keys(OTHER).leader),
        ("XADD", Keys(OTHER).journal, "*", "e", "x"),
    ):
        refused(coordinator_conn, *command)


def test_coordinator_runs_every_step_of_its_loop_and_nothing_is_refused(
    coordinator_conn: redis.Redis, worker_conn: redis.Redis, admin: redis.Redis
) -> None:
    admin.function_flush()  # so the coordinator loads the library itself (FUNCTION LOAD)
    admin.acl_log_reset()
    settings = ServiceSettings(
        job=JOB,
        coordinator="c1",
        block_ms=10,
        snapshot_every=1,
        config=JobConfig(dataset_size=1000),
    )
    coord = Coordinator.on_redis(coordinator_conn, settings)
    coord.start()  # INFO persistence, FUNCTION LOAD, the snapshot, the journal
    coord.step()
    assert coord.leading
    Inbox(worker_conn, KEYS.inbox).send(Join(at=0, job=JOB, worker="w1"))
    coord._trimmed_at = -1e9  # trim the inbox on this turn
    coord.step()  # renew, read the inbox, append, snapshot, status, trim
    assert coord.state.members and admin.get(KEYS.snapshot) and admin.get(KEYS.status)
    coord.close()  # release
    assert admin.get(KEYS.leader) is None
    assert admin.acl_log() == []


# ---------------------------------------------------------------- viewer


def test_viewer_reads_the_job_and_writes_nothing(
    viewer_conn: redis.Redis, coordinator_conn: redis.Redis
) -> None:
    coord = Coordinator.on_redis(
        coordinator_conn, ServiceSettings(job=JOB, coordinator="c1", block_ms=10)
    )
    coord.start()
    coord.step()
    coord._publish_status()
    assert viewer_conn.xrange(KEYS.journal)
    assert viewer_conn.get(KEYS.status)
    assert viewer_conn.get(KEYS.leader)
    assert viewer_conn.xlen(KEYS.inbox) == 0 and viewer_conn.xrange(KEYS.dead) == []
    for command in (
        ("SET", KEYS.status, "x"),
        ("XADD", KEYS.inbox, "*", "e", "x"),
        ("XADD", KEYS.journal, "*", "e", "x"),
        ("DEL", KEYS.journal),
        ("PEXPIRE", KEYS.leader, 1),
        ("SET", KEYS.grad(1, 0, 0, 0, "w1"), "x"),
        ("FCALL", "cohort_release", 1, KEYS.leader, "x"),
        ("GET", Keys(OTHER).status),
        ("XRANGE", Keys(OTHER).journal, "-", "+"),
        ("RANDOMKEY",),
        ("DBSIZE",),
    ):
        refused(viewer_conn, *command)


# ---------------------------------------------------------------- the real code paths


def test_a_job_trains_with_coordinator_and_worker_credentials_and_the_viewer_runs_the_cli(
    server: LocalRedis, admin: redis.Redis, tmp_path: Path
) -> None:
    settings = ServiceSettings(
        job=JOB,
        coordinator="c1",
        config=JobConfig(min_workers=2, dataset_size=512, batch_size=16, max_steps=4),
        block_ms=20,
        status_interval=0.2,
    )
    admin.acl_log_reset()
    coordinator_conn = as_role(server, "coordinator")
    stop = threading.Event()
    coordinator = threading.Thread(
        target=Coordinator.on_redis(coordinator_conn, settings).run, args=(stop,), daemon=True
    )
    coordinator.start()
    results: dict[str, Any] = {}

    def one_worker(name: str) -> Callable[[], None]:
        def body() -> None:
            conn = as_role(server, "worker")
            job = NumpyElasticJob(JOB, conn=conn, worker_id=name, signals=False)
            try:
                results[name] = train(job)
            except BaseException as exc:
                results[name] = exc
            finally:
                job.worker.stop()
                conn.close()

        return body

    workers = [threading.Thread(target=one_worker(n), daemon=True) for n in ("w1", "w2")]
    for t in workers:
        t.start()
    # the leader's view, read by the viewer while the leader publishes it (it expires a few
    # seconds after the leader ends, which a loaded machine's `cohort status` may not beat)
    viewing = as_role(server, "viewer")
    try:
        wait_until(lambda: viewing.get(KEYS.status), 60, 0.05, "the leader's view published")
        leader_view = msgpack.unpackb(viewing.get(KEYS.status) or b"\x80", raw=False)
    finally:
        viewing.close()
    for t in workers:
        t.join(60)
        assert not t.is_alive(), "a worker did not finish"
    try:
        for name in ("w1", "w2"):
            result = results[name]
            if isinstance(result, BaseException):
                raise result
            assert result["steps"] == 4 and result["removed"] is None
            assert result["finished"] == "max_steps=4 reached"
        assert results["w1"]["weights_digest"] == results["w2"]["weights_digest"]
        viewer = url(server, "viewer")
        status = _cohort("status", "--job", JOB, "--json", "--redis-url", viewer)
        assert status.returncode == 0, status.stderr
        body = json.loads(status.stdout)
        assert body["last_committed"] == 3 and body["phase"] == "finished"
        assert leader_view.get("coordinator") == "c1"
        coordinator.join(30)  # the job finished and its workers left: the coordinator ends
        assert not coordinator.is_alive() and admin.get(KEYS.leader) is None  # lease given back
        replay = _cohort(
            "replay", "--job", JOB, "--audit", "--quiet", env={"COHORT_REDIS_URL": viewer}
        )
        assert replay.returncode == 0, replay.stderr
        out = tmp_path / "job.cohort"
        exported = _cohort("export", "--job", JOB, "-o", str(out), "--redis-url", viewer)
        assert exported.returncode == 0, exported.stderr
        # nothing any of them did was refused, not even a call whose error was swallowed
        assert admin.acl_log() == []
    finally:
        stop.set()
        coordinator.join(10)
        coordinator_conn.close()


# ---------------------------------------------------------------- the command


def test_printed_commands_are_redis_cli_ready_and_apply_creates_working_users(
    server: LocalRedis, admin: redis.Redis
) -> None:
    env = {f"COHORT_ACL_{r.upper()}_PASSWORD": p for r, p in PASSWORDS.items()}
    printed = _cohort("acl", "--job", "cli-job", "--redis-url", server.url, env=env)
    assert printed.returncode == 0, printed.stderr
    lines = printed.stdout.splitlines()
    assert len(lines) == 3 and all(line.startswith("ACL SETUSER cohort-cli-job-") for line in lines)
    assert "cohort-cli-job-worker" in printed.stderr  # the URLs go to stderr: stdout pipes
    assert "worker-secret" not in printed.stdout + printed.stderr  # given, so not shown
    cli = subprocess.run(
        ["redis-cli", "-p", str(server.port)], input=printed.stdout, capture_output=True, text=True
    )
    assert cli.stdout.split() == ["OK", "OK", "OK"], cli.stdout + cli.stderr
    viewer = connect(RedisSettings(url=url(server, "viewer", "cli-job")))
    try:
        assert viewer.ping()
        refused(viewer, "SET", Keys("cli-job").status, "x")
    finally:
        viewer.close()

    applied = _cohort(
        "acl", "--job", "cli-job", "--role", "worker", "--apply", "--redis-url", server.url
    )
    assert applied.returncode == 0, applied.stderr
    assert "applied ACL user cohort-cli-job-worker" in applied.stdout
    shown = next(line for line in applied.stdout.splitlines() if line.startswith("# worker: "))
    generated = shown.split()[2]
    conn = connect(RedisSettings(url=generated))
    try:
        assert conn.ping()  # the URL shown once is the one to use
        Inbox(conn, Keys("cli-job").inbox).send(Join(at=0, job="cli-job", worker="w"))
    finally:
        conn.close()


def test_apply_without_acl_rights_names_the_fix(server: LocalRedis, admin: redis.Redis) -> None:
    done = _cohort("acl", "--job", JOB, "--apply", "--redis-url", url(server, "worker"))
    assert done.returncode == 3
    assert "must be allowed ACL SETUSER" in done.stderr
