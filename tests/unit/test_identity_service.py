"""The leader checks who speaks (issue 24): in identity mode a command is decided only if
its signature proves the worker it names; anything else is dead-lettered with the reason
and changes nothing. Without a job key the inbox works as it always did."""

from __future__ import annotations

from typing import Any

import pytest

from cohort.coordinator.service import TRUST_REFRESH, Coordinator
from cohort.events import identity
from cohort.events.codec import FIELD, encode
from cohort.events.identity import Signer, Trust
from cohort.events.models import (
    Command,
    GpuDevice,
    GpuReading,
    Heartbeat,
    Join,
    Leave,
    StepDone,
    WeightsDiverged,
    WeightsLoaded,
    WorkerFailed,
    WorkerJoined,
)
from tests.unit.test_service import JOB, Setup, drain, leader_of

JOB_KEY = b"k" * 32


def signer(worker: str) -> Signer:
    return Signer(worker, identity.secret_of(JOB_KEY, worker))


class Signed(Setup):
    """A job in identity mode: every worker sends with its own credential."""

    def __init__(self, **config: Any) -> None:
        super().__init__(**config)
        self.log.trusted = Trust(JOB_KEY)

    def send_as(self, worker: str, command: Command) -> str:
        return self.log.send_fields(signer(worker).fields(encode(command)))

    def join(self, *workers: str) -> None:
        for worker in workers:
            self.send_as(worker, Join(at=0, job=JOB, worker=worker))
            self.send_as(worker, WeightsLoaded(at=0, job=JOB, worker=worker))

    def done(self, worker: str, step: int, world: int = 1, digest: str | None = None) -> None:
        self.send_as(
            worker, StepDone(at=0, job=JOB, worker=worker, step=step, world=world, digest=digest)
        )


def training(setup: Signed) -> Coordinator:
    """a and b are ranks of world 1."""
    leader = leader_of(setup, min_workers=2)
    setup.join("a", "b")
    leader.step()
    assert set(leader.state.ranks) == {"a", "b"}
    return leader


def reasons(setup: Setup) -> list[str]:
    return [letter.reason for letter in setup.log.dead]


FORGED_BY_A_NAMING_B = {
    "Leave": Leave(at=0, job=JOB, worker="b", reason="forged"),
    "StepDone": StepDone(at=0, job=JOB, worker="b", step=0, world=1, digest="deadbeef"),
    "Heartbeat": Heartbeat(at=0, job=JOB, worker="b", step=0, world=1),
    "GpuReading": GpuReading(
        at=0, job=JOB, worker="b", devices=(GpuDevice(index=0, temperature=99.0),)
    ),
    "Join": Join(at=0, job=JOB, worker="c"),
}


@pytest.mark.parametrize("name", FORGED_BY_A_NAMING_B)
def test_a_command_signed_by_a_naming_another_worker_is_dead_lettered_and_changes_nothing(
    name: str,
) -> None:
    setup = Signed()
    leader = training(setup)
    state, facts = leader.state, setup.log.facts()
    command = FORGED_BY_A_NAMING_B[name]
    setup.send_as("a", command)
    leader.step()
    claimed = command.worker
    assert reasons(setup) == [
        f"command claims worker {claimed!r} but was signed by worker 'a''s credential"
    ]
    assert setup.log.dead[0].raw == encode(command)
    assert leader.state == state and setup.log.facts() == facts
    assert leader.counters.forged == leader.counters.dead == 1
    assert "b" not in leader.core.seen.gpus  # not even the leader's volatile view moved


def test_a_wrong_digest_sent_in_b_s_name_raises_no_divergence_and_b_s_own_commits() -> None:
    setup = Signed()
    leader = training(setup)
    setup.done("a", 0, digest="aaaaaaaa")
    setup.send_as("a", StepDone(at=0, job=JOB, worker="b", step=0, world=1, digest="bbbbbbbb"))
    leader.step()
    assert leader.state.last_committed == -1  # b has not spoken: the step waits for it
    setup.done("b", 0, digest="aaaaaaaa")
    leader.step()
    assert leader.state.last_committed == 0
    assert not [f for f in setup.log.facts() if isinstance(f, WeightsDiverged)]


def test_heartbeats_sent_in_a_silent_worker_s_name_do_not_keep_it_alive() -> None:
    setup = Signed(heartbeat_timeout=5.0)
    leader = training(setup)
    for _ in range(8):
        setup.clock.advance(1)
        setup.send_as("a", Heartbeat(at=0, job=JOB, worker="a"))
        setup.send_as("a", Heartbeat(at=0, job=JOB, worker="b"))  # b itself is silent
        drain(leader, setup)
    assert [f.worker for f in setup.log.facts() if isinstance(f, WorkerFailed)] == ["b"]
    assert leader.counters.forged == 8


def test_each_worker_s_own_signed_commands_are_decided() -> None:
    setup = Signed()
    leader = training(setup)
    setup.done("a", 0)
    setup.done("b", 0)
    setup.send_as("b", Leave(at=0, job=JOB, worker="b", after_step=0))
    leader.step()
    assert leader.state.last_committed == 0 and leader.counters.dead == 0
    assert "b" not in leader.state.members


def test_unsigned_and_badly_signed_entries_are_dead_lettered_with_their_reason() -> None:
    setup = Signed()
    leader = leader_of(setup)
    setup.log.send(Join(at=0, job=JOB, worker="a"))  # the shared worker user: no signature
    tampered = signer("a").fields(encode(Join(at=0, job=JOB, worker="a")))
    tampered[FIELD] = encode(Join(at=0, job=JOB, worker="a", host="elsewhere"))
    setup.log.send_fields(tampered)
    leader.step()
    got = reasons(setup)
    assert got[0].startswith("unsigned command: this job requires per-worker credentials")
    assert got[1] == "signature does not verify for worker 'a'"
    assert not leader.state.members and leader.counters.forged == 2


def test_a_revoked_worker_s_commands_are_dead_lettered_and_it_fails_by_silence() -> None:
    setup = Signed(heartbeat_timeout=5.0)
    leader = training(setup)
    setup.log.trusted = Trust(JOB_KEY, frozenset({"b"}))  # cohort acl --revoke b
    setup.clock.advance(TRUST_REFRESH)  # the leader reads the revoked set every second
    for _ in range(8):
        setup.clock.advance(1)
        setup.send_as("a", Heartbeat(at=0, job=JOB, worker="a"))
        setup.send_as("b", Heartbeat(at=0, job=JOB, worker="b"))  # still sending, refused
        drain(leader, setup)
    assert set(reasons(setup)) == {"worker 'b''s credential is revoked"}
    assert [f.worker for f in setup.log.facts() if isinstance(f, WorkerFailed)] == ["b"]
    assert leader.state.ranks == ("a",)


def test_without_a_job_key_unsigned_and_signed_commands_are_decided_as_before() -> None:
    setup = Setup()
    leader = leader_of(setup)
    setup.join("a")  # unsigned
    setup.log.send_fields(signer("b").fields(encode(Join(at=0, job=JOB, worker="b"))))
    leader.step()
    assert [f.worker for f in setup.log.facts() if isinstance(f, WorkerJoined)] == ["a", "b"]
    assert leader.counters.dead == leader.counters.forged == 0


def test_the_leader_s_status_says_whether_commands_must_be_signed_and_counts_forgeries() -> None:
    import msgpack

    setup = Signed()
    leader = training(setup)
    setup.send_as("a", Leave(at=0, job=JOB, worker="b"))
    leader.step()
    leader._publish_status()
    assert setup.log.status is not None
    body = msgpack.unpackb(setup.log.status)
    assert body["identity"] is True and body["counters"]["forged"] == 1


def test_forged_commands_are_counted_in_the_metrics_beside_the_dead_letters() -> None:
    from cohort.coordinator.metrics import Metrics
    from cohort.coordinator.service import ServiceSettings

    setup = Signed()
    metrics = Metrics(JOB, "c1")
    leader = Coordinator(
        setup.log, setup.lease, ServiceSettings(job=JOB, coordinator="c1"), setup.clock, metrics
    )
    leader.start()
    leader.step()
    setup.send_as("a", Join(at=0, job=JOB, worker="b"))
    setup.log.send_fields(signer("a").fields(b"\xc1 not msgpack"))  # dead, but a's own
    leader.step()
    labels = {"job": JOB, "coordinator": "c1"}
    sample = metrics.registry.get_sample_value
    assert sample("cohort_forged_commands_total", labels) == 1
    assert sample("cohort_dead_letters_total", labels) == 2
