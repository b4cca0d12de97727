"""Identity mode through Redis (fakeredis and a real server): the job key and revoked set as
the leader reads them, signed entries as `Inbox` writes them, and the operator's signature."""

from __future__ import annotations

import fakeredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cohort.commands.lineage import _operator_signer
from cohort.coordinator.joblog import Durability, RedisJobLog
from cohort.coordinator.service import Coordinator, ServiceSettings
from cohort.events import identity
from cohort.events.codec import FIELD, encode
from cohort.events.keys import Keys
from cohort.events.models import Heartbeat, JobConfig, Join, Leave
from cohort.events.streams import Inbox

JOB = "idc"
KEYS = Keys(JOB)
JOB_KEY = b"j" * 32


def leader(conn) -> Coordinator:  # type: ignore[no-untyped-def]
    coordinator = Coordinator.on_redis(
        conn,
        ServiceSettings(
            job=JOB,
            coordinator="c1",
            config=JobConfig(dataset_size=1000),
            block_ms=1,
            allow_volatile=True,
            allow_eviction=True,
        ),
    )
    coordinator.start()
    coordinator.step()
    assert coordinator.leading
    return coordinator


def as_worker(conn, worker: str) -> Inbox:  # type: ignore[no-untyped-def]
    return Inbox(conn, KEYS.inbox, identity.Signer(worker, identity.secret_of(JOB_KEY, worker)))


def test_the_leader_reads_the_job_key_and_the_revoked_workers(conn) -> None:  # type: ignore[no-untyped-def]
    log = RedisJobLog(conn, JOB, Durability())
    assert log.trust() is None  # no key: identity mode is off
    conn.set(KEYS.identity, JOB_KEY)
    conn.sadd(KEYS.revoked, "x", "y")
    assert log.trust() == identity.Trust(JOB_KEY, frozenset({"x", "y"}))


def test_signed_entries_through_redis_are_decided_and_forged_ones_dead_lettered(conn) -> None:  # type: ignore[no-untyped-def]
    conn.set(KEYS.identity, JOB_KEY)
    coordinator = leader(conn)
    as_worker(conn, "a").send(Join(at=0, job=JOB, worker="a"))
    as_worker(conn, "a").send(Leave(at=0, job=JOB, worker="b"))
    Inbox(conn, KEYS.inbox).send(Heartbeat(at=0, job=JOB, worker="a"))
    coordinator.step()
    assert set(coordinator.state.members) == {"a"}
    dead = [f[b"reason"].decode() for _, f in conn.xrange(KEYS.dead)]
    assert dead[0] == "command claims worker 'b' but was signed by worker 'a''s credential"
    assert dead[1].startswith("unsigned command")
    assert coordinator.counters.forged == 2


def test_cohort_resume_signs_as_the_operator_only_in_identity_mode(conn) -> None:  # type: ignore[no-untyped-def]
    assert _operator_signer(conn, JOB) is None
    conn.set(KEYS.identity, JOB_KEY)
    signer = _operator_signer(conn, JOB)
    assert signer == identity.Signer("operator", identity.secret_of(JOB_KEY, "operator"))


signed_or_not = st.fixed_dictionaries(
    {},
    optional={
        identity.SIGNER: st.sampled_from([b"a", b"b", b"operator", b"\xff", b""]),
        identity.SIGNATURE: st.binary(max_size=40),
    },
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(["a", "b"]), signed_or_not), min_size=1, max_size=10))
def test_no_forged_signature_is_decided_and_the_leader_keeps_going(
    batch: list[tuple[str, dict[bytes, bytes]]],
) -> None:
    conn = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    conn.set(KEYS.identity, JOB_KEY)
    coordinator = leader(conn)
    sent = []
    for worker, fields in batch:
        raw = encode(Join(at=0, job=JOB, worker=worker))
        sent.append(conn.xadd(KEYS.inbox, {FIELD: raw, **fields}).decode())
    for _ in range(3):
        coordinator.step()
    assert coordinator.cursor == sent[-1]
    assert not coordinator.state.members  # random signatures never prove anyone
    assert conn.xlen(KEYS.dead) == len(batch) == coordinator.counters.forged
