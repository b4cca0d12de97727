"""A worker speaks only for itself (issue 24), on a real redis-server with ACLs.

Each worker connects as its own Redis user `cohort-J-w-W` (`cohort acl --worker`), whose
password signs every command it sends. Worker A's credential cannot make worker B leave,
fail, commit, diverge or stay alive: the leader dead-letters each such command with the
reason. A full job runs under these credentials without one refusal in the ACL LOG, and
`cohort acl --revoke` cuts a worker off: it fails by silence, the others go on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis
from redis.exceptions import NoPermissionError

from cohort import acl
from cohort.coordinator.election import load_library
from cohort.coordinator.service import Coordinator, ServiceSettings
from cohort.events import identity
from cohort.events.codec import decode_command, encode
from cohort.events.connection import RedisSettings, connect
from cohort.events.keys import Keys
from cohort.events.models import (
    GpuDevice,
    GpuReading,
    Heartbeat,
    JobConfig,
    Leave,
    StepCommitted,
    StepDone,
    WeightsDiverged,
    WorkerFailed,
    WorkerJoined,
    WorkerLeft,
)
from cohort.events.streams import Inbox, Journal
from cohort.example import run as train
from cohort.localredis import LocalRedis
from cohort.worker.loop.elastic import NumpyElasticJob
from tests.helpers import wait_until
from tests.integration.cluster import Cluster

pytestmark = pytest.mark.redis_server

JOB = "ident"
KEYS = Keys(JOB)
PASSWORDS: dict[acl.Role, str] = {
    "coordinator": "coord-secret",
    "worker": "worker-secret",
    "viewer": "viewer-secret",
}
WORKERS = ("a", "b", "c")


@dataclass
class Job:
    server: LocalRedis
    admin: redis.Redis
    secrets: dict[str, str]

    def role(self, role: acl.Role) -> str:
        return acl.role_url(self.server.url, JOB, role, PASSWORDS[role])

    def own(self, worker: str) -> str:
        """`worker`'s own credential, as `cohort acl --worker` prints it."""
        return acl.url_as(self.server.url, identity.worker_user(JOB, worker), self.secrets[worker])

    def connect(self, url: str) -> redis.Redis:
        return connect(RedisSettings(url=url, client_name="test"))

    def dead(self) -> list[tuple[str, Any]]:
        """(reason, command) of each dead letter."""
        rows: Any = self.admin.xrange(KEYS.dead)
        return [(f[b"reason"].decode(), decode_command(f[b"raw"])) for _, f in rows]

    def joined(self) -> set[str]:
        return {f.worker for f in self.facts() if isinstance(f, WorkerJoined)}

    def facts(self) -> list[Any]:
        return [f for _, f in Journal(self.admin, KEYS.journal).facts()]


@pytest.fixture
def job(server: LocalRedis) -> Iterator[Job]:
    """A server with the job's role users and workers a, b and c's own credentials."""
    admin = server.client()
    acl.apply(admin, JOB, PASSWORDS)
    secrets = acl.issue(admin, JOB, WORKERS)
    load_library(admin)
    admin.acl_log_reset()
    yield Job(server, admin, secrets)
    admin.close()


def refused(conn: redis.Redis, *command: Any) -> None:
    with pytest.raises(NoPermissionError):
        conn.execute_command(*command)


def _cohort(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cohort", *args], capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )  # fmt: skip


def _forged_in_status(job: Job) -> int:
    raw: Any = job.admin.get(KEYS.status)
    return int(msgpack.unpackb(raw)["counters"]["forged"]) if raw else -1


# ---------------------------------------------------------------- who may read the secret


def test_only_the_coordinator_reads_the_job_key_and_the_viewer_still_reads_the_rest(
    job: Job,
) -> None:
    coordinator = job.connect(job.role("coordinator"))
    viewer = job.connect(job.role("viewer"))
    worker = job.connect(job.role("worker"))
    own = job.connect(job.own("a"))
    try:
        key = coordinator.get(KEYS.identity)
        assert key is not None and len(key) == identity.JOB_KEY_BYTES
        assert identity.secret_of(key, "a") == job.secrets["a"]
        for conn in (viewer, worker, own):
            refused(conn, "GET", KEYS.identity)
            refused(conn, "DUMP", KEYS.identity)
        for conn in (worker, own):
            refused(conn, "SMEMBERS", KEYS.revoked)
            refused(conn, "SREM", KEYS.revoked, "a")
            refused(conn, "XRANGE", KEYS.inbox, "-", "+")  # no replaying another's entry
        job.admin.set(KEYS.status, b"x")
        for name in ("journal", "inbox", "dead", "leader", "epoch", "cursor", "snapshot",
                     "status", "memory", "rendezvous", "c10d_groups", "revoked"):  # fmt: skip
            viewer.execute_command("TYPE", getattr(KEYS, name))  # not refused
        assert viewer.get(KEYS.status) == b"x"
    finally:
        for conn in (coordinator, viewer, worker, own):
            conn.close()


# ---------------------------------------------------------------- A cannot speak for B


def test_a_s_credential_cannot_make_b_leave_fail_commit_diverge_or_stay_alive(
    job: Job,
) -> None:
    settings = ServiceSettings(
        job=JOB,
        coordinator="c1",
        config=JobConfig(
            min_workers=2, dataset_size=512, batch_size=8, max_steps=40, heartbeat_timeout=5.0
        ),
        block_ms=20,
        status_interval=0.2,
        stay=True,  # still leading once the job finished, so its status is there to read
    )
    coordinator_conn = job.connect(job.role("coordinator"))
    stop = threading.Event()
    leader = threading.Thread(
        target=Coordinator.on_redis(coordinator_conn, settings).run, args=(stop,), daemon=True
    )
    leader.start()
    results: dict[str, Any] = {}

    def trainer(name: str) -> Callable[[], None]:
        def body() -> None:
            conn = job.connect(job.own(name))
            elastic = NumpyElasticJob(JOB, conn=conn, worker_id=name, signals=False, digest_every=1)
            try:
                results[name] = train(elastic, pace=0.05)
            except BaseException as exc:
                results[name] = exc
            finally:
                elastic.worker.stop()
                conn.close()

        return body

    threads = [threading.Thread(target=trainer(n), daemon=True) for n in ("a", "b")]
    for t in threads:
        t.start()
    a_conn = job.connect(job.own("a"))
    try:
        wait_until(lambda: {"a", "b"} <= job.joined(), 30, 0.05, "the joins")
        world = 1  # the first world (it forms once both loaded the weights)
        as_a = Inbox(a_conn, KEYS.inbox, identity.Signer("a", job.secrets["a"]))
        forged = [
            Leave(at=0, job=JOB, worker="b", reason="forged"),
            StepDone(at=0, job=JOB, worker="b", step=0, world=world, digest="deadbeef"),
            Heartbeat(at=0, job=JOB, worker="b", step=0, world=world),
            GpuReading(at=0, job=JOB, worker="b", devices=(GpuDevice(index=0, temperature=99),)),
        ]
        for command in forged:
            as_a.send(command)
        # the signature is what counts, not the connection: b's name under a's MAC fails too
        as_b_by_a = Inbox(a_conn, KEYS.inbox, identity.Signer("b", job.secrets["a"]))
        as_b_by_a.send(Leave(at=0, job=JOB, worker="b", reason="relabelled"))
        expected = [
            ("command claims worker 'b' but was signed by worker 'a''s credential", command)
            for command in forged
        ] + [("signature does not verify for worker 'b'", Leave(
            at=0, job=JOB, worker="b", reason="relabelled"))]  # fmt: skip
        wait_until(lambda: len(job.dead()) == len(expected), 30, 0.05, "the dead letters")
        assert job.dead() == expected
        for t in threads:
            t.join(90)
            assert not t.is_alive(), "a worker did not finish"
        for name in ("a", "b"):
            result = results[name]
            if isinstance(result, BaseException):
                raise result
            assert result["removed"] is None and result["finished"] == "max_steps=40 reached"
        assert results["a"]["weights_digest"] == results["b"]["weights_digest"]
        facts = job.facts()
        assert not [f for f in facts if isinstance(f, WorkerFailed | WeightsDiverged)]
        left = [f for f in facts if isinstance(f, WorkerLeft)]
        assert {f.worker for f in left} == {"a", "b"}  # each at the end, by its own Leave
        commits = [f for f in facts if isinstance(f, StepCommitted)]
        assert commits[-1].step == 39
        assert len(job.dead()) == len(expected)  # nothing else was refused
        # the operator sees them: cohort status (with the viewer's credential) counts them
        viewer = job.role("viewer")
        wait_until(lambda: _forged_in_status(job) == len(expected), 10, 0.05, "the status")
        status = json.loads(_cohort("--redis-url", viewer, "status", "--job", JOB, "--json").stdout)
        assert status["leader_view"]["identity"] is True
        assert status["leader_view"]["counters"]["forged"] == len(expected)
        shown = _cohort("--redis-url", viewer, "status", "--job", JOB).stdout
        assert f"identity: signed commands only, {len(expected)} forged command(s)" in shown
    finally:
        stop.set()
        leader.join(10)
        a_conn.close()
        coordinator_conn.close()


# ---------------------------------------------------------------- real processes


def test_two_coordinators_and_three_workers_train_on_their_own_credentials_and_nothing_is_refused(
    job: Job, tmp_path: Path
) -> None:
    run = Cluster(url=job.role("coordinator"), conn=job.admin, job=JOB, tmp=tmp_path)
    try:
        coordinators = {
            name: run.trainer_coordinator(name, "--max-steps", "30", workers=3)
            for name in ("c1", "c2")
        }
        workers = {
            w: run.python(w, "-m", "cohort", "--redis-url", job.own(w), "example-worker",
                          "--job", JOB, "--id", w, "--pace", "0.05")
            for w in WORKERS
        }  # fmt: skip
        run.until(lambda s: len(s.ranks) == 3 and s.last_committed >= 3, 90, "three ranks")
        # the leader dies: the other one takes over, reads the job key and goes on
        token: Any = job.admin.get(KEYS.leader)
        leading = token.decode().split(":")[1]
        coordinators[leading].kill()
        for proc in workers.values():
            assert run.finished(proc, 120) == 0, proc.output()[-2000:]
            summary = proc.summary()
            assert summary["finished"] == "max_steps=30 reached" and summary["removed"] is None
        assert len({workers[w].summary()["weights_digest"] for w in WORKERS}) == 1
        other = next(p for name, p in coordinators.items() if name != leading)
        assert run.finished(other, 60) == 0
        state = run.pull()
        assert state.last_committed == 29 and state.counters.failed == 0
        assert state.counters.elections == 2
        assert job.dead() == []
        assert job.admin.acl_log() == []  # not one command of any of them was refused
    finally:
        run.stop()


def test_a_revoked_worker_is_cut_off_fails_by_silence_and_the_others_train_on(
    job: Job, tmp_path: Path
) -> None:
    run = Cluster(url=job.role("coordinator"), conn=job.admin, job=JOB, tmp=tmp_path)
    a_conn = job.connect(job.own("a"))
    try:
        run.trainer_coordinator("c1", "--max-steps", "60", workers=2)
        workers = {
            w: run.python(w, "-m", "cohort", "--redis-url", job.own(w), "example-worker",
                          "--job", JOB, "--id", w, "--pace", "0.05")
            for w in WORKERS
        }  # fmt: skip
        run.until(lambda s: len(s.ranks) == 3 and s.last_committed >= 3, 90, "three ranks")
        revoked = _cohort("--redis-url", job.server.url, "acl", "--job", JOB, "--revoke", "c")
        assert revoked.returncode == 0, revoked.stderr
        assert revoked.stdout.startswith("revoked worker c: user cohort-ident-w-c deleted")
        assert job.admin.acl_getuser(identity.worker_user(JOB, "c")) is None
        clients: Any = job.admin.client_list()
        assert not [c for c in clients if c.get("user") == identity.worker_user(JOB, "c")]
        # what c signed before it was cut off (still in flight) is refused, from the leader's
        # next read of the revoked set (within a second) on ...
        in_flight = identity.Signer("c", job.secrets["c"]).fields(
            encode(Heartbeat(at=0, job=JOB, worker="c"))
        )

        def refused_as_revoked() -> bool:
            job.admin.xadd(KEYS.inbox, in_flight)  # type: ignore[arg-type]
            return ("worker 'c''s credential is revoked", in_flight_command) in job.dead()

        in_flight_command = decode_command(in_flight[b"e"])
        wait_until(refused_as_revoked, 10, 0.2, "c's signature refused")
        # ... and a's credential cannot keep it alive: a heartbeat in c's name every 0.2 s
        as_a = Inbox(a_conn, KEYS.inbox, identity.Signer("a", job.secrets["a"]))

        def c_failed() -> bool:
            as_a.send(Heartbeat(at=0, job=JOB, worker="c"))
            return any(f.worker == "c" for _, f in run.of_type(WorkerFailed))

        wait_until(c_failed, 30, 0.2, "c failed by silence")
        for w in ("a", "b"):
            assert run.finished(workers[w], 120) == 0, workers[w].output()[-2000:]
            assert workers[w].summary()["finished"] == "max_steps=60 reached"
        reasons = {reason for reason, _ in job.dead()}
        assert reasons == {
            "worker 'c''s credential is revoked",
            "command claims worker 'c' but was signed by worker 'a''s credential",
        }
        assert job.admin.smembers(KEYS.revoked) == {b"c"}
    finally:
        a_conn.close()
        run.stop()


# ---------------------------------------------------------------- the command line


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_cohort_acl_worker_prints_a_url_whose_worker_signs_as_itself(job: Job) -> None:
    issued = _cohort("--redis-url", job.server.url, "acl", "--job", JOB, "--worker", "d", "--apply")
    assert issued.returncode == 0, issued.stderr
    assert "applied ACL user cohort-ident-w-d" in issued.stdout
    shown = next(line for line in issued.stdout.splitlines() if line.startswith("# worker d: "))
    conn = job.connect(shown.split()[3])
    try:
        from cohort.worker.membership.client import Worker

        worker = Worker(conn, JOB)  # no id given: its credential's
        assert worker.id == "d" and worker.inbox.signer is not None
        assert worker.inbox.signer.secret == identity.secret_of(job.admin.get(KEYS.identity), "d")
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--worker", "bad name", "--apply"), "worker name 'bad name' is not valid"),
        (("--worker", "operator", "--apply"), "'operator' is reserved"),
        (("--revoke", "nobody"), "worker 'nobody' has no credential in job 'ident'"),
        (("--revoke", "a", "--worker", "b"), "--revoke goes alone"),
    ],
)
def test_cohort_acl_refuses_a_bad_worker_in_one_line_naming_it(
    job: Job, args: tuple[str, ...], says: str
) -> None:
    done = _cohort("--redis-url", job.server.url, "acl", "--job", JOB, *args)
    assert done.returncode == 2
    assert says in one_line(done)


def test_a_worker_started_with_another_worker_s_credential_refuses_to_start(job: Job) -> None:
    done = _cohort("--redis-url", job.own("a"), "example-worker", "--job", JOB, "--id", "b")
    assert done.returncode == 2
    line = one_line(done)
    assert "worker id 'b' does not match its Redis user 'cohort-ident-w-a'" in line
    assert "(--id a)" in line and "cohort acl --job J --worker b --apply" in line


def test_a_coordinator_whose_rules_predate_identity_stops_naming_the_fix(job: Job) -> None:
    from cohort.coordinator.errors import CoordinatorError

    old = [r for r in acl.rules(JOB, "coordinator") if r != "+smembers"]
    job.admin.execute_command(
        "ACL", "SETUSER", acl.user(JOB, "coordinator"), "reset", "on",
        acl.password_hash(PASSWORDS["coordinator"]), *old,
    )  # fmt: skip
    conn = job.connect(job.role("coordinator"))
    try:
        coordinator = Coordinator.on_redis(conn, ServiceSettings(job=JOB, coordinator="c1"))
        coordinator.start()
        with pytest.raises(CoordinatorError, match="--role coordinator --apply"):
            coordinator.step()
    finally:
        conn.close()
