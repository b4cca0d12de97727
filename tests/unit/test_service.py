"""The coordinator's loop over an in-memory lease and job log: every way a turn can end.

A leader turn loads inbox commands, decides them, saves facts + cursor + dead letters in
one fenced append, and accounts. These tests break the save the ways Redis and the network
do (another leader, a moved journal, a refused write, a write whose reply is lost) and
check the one promise behind all of them: the leader's state is the fold of the journal,
and no command is decided twice or skipped.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import pytest
import redis

from cohort.coordinator import decide as decide_module
from cohort.coordinator import fold as fold_module
from cohort.coordinator import service
from cohort.coordinator.errors import ConfigConflictError
from cohort.coordinator.fold import fold
from cohort.coordinator.service import Coordinator, ServiceSettings
from cohort.events.clock import ManualClock
from cohort.events.models import (
    Heartbeat,
    JobConfig,
    JobConfigured,
    Join,
    LeaderElected,
    Leave,
    StepDone,
    TrainingPaused,
    WeightsLoaded,
    WorkerFailed,
    WorkerJoined,
)
from tests.unit.memory import MemoryLease, MemoryLog

JOB = "mem"


class Setup:
    def __init__(self, lease_ms: int = 3000, **config: Any) -> None:
        self.clock = ManualClock()
        self.lease_ms = lease_ms
        self.lease = MemoryLease(self.clock, lease_ms=lease_ms)
        self.log = MemoryLog(self.clock, self.lease)
        self.config = JobConfig(
            **{"min_workers": 1, "heartbeat_timeout": 5.0, "dataset_size": 60_000, **config}
        )

    def coordinator(
        self,
        name: str = "c1",
        batch: int = 1024,
        given: set[str] | None = None,
        stay: bool = False,
        **config: Any,
    ) -> Coordinator:
        settings = ServiceSettings(
            job=JOB,
            coordinator=name,
            config=self.config.model_copy(update=config),
            lease_ms=self.lease_ms,
            batch=batch,
            given=frozenset(given or ()),
            stay=stay,
        )
        coordinator = Coordinator(self.log, self.lease, settings, self.clock)
        coordinator.start()
        return coordinator

    def join(self, *workers: str) -> None:
        for worker in workers:
            self.log.send(Join(at=0, job=JOB, worker=worker))
            self.log.send(WeightsLoaded(at=0, job=JOB, worker=worker))

    def done(self, worker: str, step: int, world: int = 1) -> None:
        self.log.send(StepDone(at=0, job=JOB, worker=worker, step=step, world=world))

    def types(self) -> list[str]:
        return [type(f).__name__ for f in self.log.facts()]


def leader_of(setup: Setup, **kw: Any) -> Coordinator:
    leader = setup.coordinator(**kw)
    leader.step()  # follow: nobody leads, so it takes over
    assert leader.leading
    return leader


def test_a_turn_loads_decides_saves_and_the_state_is_the_fold_of_the_journal() -> None:
    setup = Setup()
    leader = leader_of(setup)
    setup.join("a")
    setup.done("a", 0)
    leader.step()
    assert setup.types()[:2] == ["JobConfigured", "LeaderElected"]
    assert "StepCommitted" in setup.types()
    assert leader.state == fold(setup.log.facts())
    assert leader.cursor == setup.log.inbox_end() == setup.log.cursor()
    assert leader.counters.commands == 3 and leader.counters.facts == len(setup.log.facts())
    assert not leader.core.pending


def test_every_decided_fact_is_folded_exactly_once(monkeypatch: pytest.MonkeyPatch) -> None:
    evolved: Counter[str] = Counter()
    original, commits = fold_module.evolve, fold_module._commits

    def counting(state: Any, fact: Any) -> Any:
        evolved[type(fact).__name__] += 1
        return original(state, fact)

    def counting_commits(state: Any, run: Any) -> Any:
        evolved["StepCommitted"] += len(run)
        return commits(state, run)

    monkeypatch.setattr(fold_module, "evolve", counting)
    monkeypatch.setattr(fold_module, "_commits", counting_commits)
    monkeypatch.setattr(decide_module, "evolve", counting)
    setup = Setup()
    leader = leader_of(setup)
    setup.join("a", "b")
    for step in range(5):
        setup.done("a", step)
        setup.done("b", step)
    leader.step()
    assert evolved == Counter(type(f).__name__ for f in setup.log.facts())


def test_taking_over_journals_the_config_once_and_keeps_it() -> None:
    setup = Setup()
    first = leader_of(setup)
    first.close()  # gives the lease back
    second = setup.coordinator("c2", max_workers=3)  # not given by the operator: a default
    second.step()
    assert second.leading
    assert setup.types() == ["JobConfigured", "LeaderElected", "LeaderElected"]
    assert second.state.config == setup.config  # the journaled one
    assert second.state.leader == "c2" and second.state.leader_epoch == 2


def test_settings_given_that_differ_from_the_journaled_config_are_refused_naming_both() -> None:
    setup = Setup()
    leader_of(setup).close()
    with pytest.raises(ConfigConflictError) as refused:
        setup.coordinator("c2", given={"max_workers", "min_workers"}, max_workers=3)
    message = str(refused.value)
    assert "--max-workers 3 (journaled: 64)" in message
    assert "min-workers" not in message  # given, but equal to the journaled value
    assert "cohort reset --job mem" in message
    assert setup.types() == ["JobConfigured", "LeaderElected"]  # nothing was written
    again = setup.coordinator("c3", given={"max_workers"})  # the journaled value: accepted
    again.step()
    assert again.leading


def test_shuffle_flags_are_settings_the_journal_holds_and_refuses_to_change() -> None:
    from cohort.commands.coordinator import coordinator
    from cohort.commands.settings import job_config

    parsed = coordinator.make_context("coordinator", ["--job", "j", "--no-shuffle", "--seed", "7"])
    config, given = job_config(None, None, {k: parsed.params[k] for k in ("shuffle", "seed")})
    assert (config.shuffle, config.seed) == (False, 7) and given == {"shuffle", "seed"}
    unset = coordinator.make_context("coordinator", ["--job", "j"])
    assert unset.params["shuffle"] is None  # not given: a standby compares nothing
    setup = Setup()  # journals the default: shuffled
    leader_of(setup).close()
    with pytest.raises(ConfigConflictError, match="--no-shuffle \\(journaled: --shuffle\\)"):
        setup.coordinator("c2", given={"shuffle"}, shuffle=False)


def test_a_conflict_journaled_while_following_is_refused_before_leading() -> None:
    setup = Setup()
    follower = setup.coordinator("c2", given={"batch_size"}, batch_size=64)  # journal empty
    leader = leader_of(setup)  # journals its own config (batch_size 32) first
    assert leader.leading
    with pytest.raises(ConfigConflictError, match="--batch-size 64 \\(journaled: 32\\)"):
        follower.step()
    assert not follower.leading


def test_an_append_refused_by_the_fence_rolls_back_and_follows() -> None:
    setup = Setup()
    leader = leader_of(setup)
    setup.join("a")
    setup.clock.advance(4)  # the lease (3 s) ran out without a renewal ...
    assert setup.lease.acquire("usurper") is not None  # ... and someone else took it
    leader._renewed_at = setup.clock.monotonic()  # it believes its lease fresh: the fence decides
    before = list(setup.log.facts())
    leader.step()
    assert not leader.leading
    assert setup.log.facts() == before  # nothing of the refused decision was written
    assert leader.state == fold(before) and not leader.core.pending
    assert setup.log.cursor() == leader.cursor  # the commands stay for the next leader


def test_a_moved_journal_is_folded_again_and_the_commands_decided_once() -> None:
    setup = Setup()
    leader = leader_of(setup)
    setup.join("a")
    setup.log.write(TrainingPaused(at=0, job=JOB, reason="another writer", active=0, min_workers=1))
    leader.step()  # Conflict: it folds what moved, keeps the cursor
    assert leader.state == fold(setup.log.facts())
    assert leader.counters.resyncs == 1 and setup.types().count("WorkerJoined") == 0
    leader.step()
    assert setup.types().count("WorkerJoined") == 1
    assert leader.state == fold(setup.log.facts())


def test_a_refused_write_decides_nothing_and_the_turn_is_tried_again() -> None:
    setup = Setup()
    leader = leader_of(setup)
    setup.join("a")
    setup.log.fail_next = "refuse"
    with pytest.raises(redis.ConnectionError):
        leader.step()
    assert not leader.core.pending  # back to what the journal holds
    assert leader.state == fold(setup.log.facts()) and "a" not in leader.state.members
    leader.step()
    assert setup.types().count("WorkerJoined") == 1 and "a" in leader.state.members


def test_a_write_whose_reply_was_lost_is_not_decided_twice() -> None:
    setup = Setup()
    leader = leader_of(setup)
    setup.join("a")
    setup.log.fail_next = "lose reply"
    with pytest.raises(redis.ConnectionError):
        leader.step()
    assert "a" not in leader.state.members  # it cannot know the write landed
    leader.step()  # the journal moved past what it knows: Conflict, fold, cursor re-read
    leader.step()
    assert setup.types().count("WorkerJoined") == 1
    assert leader.state == fold(setup.log.facts()) and "a" in leader.state.members
    assert leader.cursor == setup.log.inbox_end()


def test_a_leader_whose_lease_renewal_fails_follows_again() -> None:
    setup = Setup()
    leader = leader_of(setup)
    setup.clock.advance(4)
    assert setup.lease.acquire("usurper") is not None
    leader.step()
    assert not leader.leading and leader.counters.resyncs == 1


def test_silence_is_judged_only_once_the_backlog_is_read() -> None:
    setup = Setup(heartbeat_timeout=5.0, lease_ms=60_000)
    leader = leader_of(setup, batch=2)
    setup.join("a")
    setup.done("a", 0)
    for _ in range(8):  # heartbeats queued while the leader was busy elsewhere
        setup.clock.advance(1)
        setup.log.send(Heartbeat(at=0, job=JOB, worker="a"))
    while leader.cursor != setup.log.inbox_end():
        leader.step()
    leader.step()  # drained: time is judged now
    assert "WorkerFailed" not in setup.types()
    setup.clock.advance(6)
    leader.step()
    assert setup.types().count("WorkerFailed") == 1
    failed = [f for f in setup.log.facts() if isinstance(f, WorkerFailed)][0]
    assert failed.worker == "a" and failed.timeout == 5.0


def test_a_journal_that_lost_what_the_leader_folded_is_folded_again_and_it_steps_down() -> None:
    setup = Setup()
    leader = leader_of(setup)
    setup.join("a")
    leader.step()
    kept = setup.log.journal[:2]  # JobConfigured, LeaderElected: the rest was lost
    setup.log.journal[:] = kept
    setup.join("b")
    leader.step()  # its append conflicts, and the journal no longer holds what it folded
    assert not leader.leading and leader.counters.rollbacks == 1
    assert setup.lease.holder() is None  # released, so the next election shows a new token
    assert leader.state == fold(setup.log.facts())
    assert [type(f) for f in setup.log.facts()] == [JobConfigured, LeaderElected]


def test_bad_entries_are_dead_lettered_beside_the_facts_of_good_ones() -> None:
    setup = Setup()
    leader = leader_of(setup)
    setup.log.send_raw(b"\xc1 not msgpack")
    setup.log.send(Join(at=0, job="other-job", worker="x"))
    setup.log.send(Join(at=0, job=JOB, worker="a"))
    leader.step()
    reasons = [letter.reason for letter in setup.log.dead]
    assert len(reasons) == 2 and "other-job" in reasons[1]
    assert [type(f) for f in setup.log.facts()][-1] is WorkerJoined
    assert leader.counters.dead == 2 and setup.log.appends == 2  # take over, then one turn


# ---------------------------------------------------------------- start-up order and gaps
# Invariant 10 of docs/design.md: a worker that is sending heartbeats is never declared failed,
# whatever the order in which workers and coordinators started.


def beat(setup: Setup, seconds: int, *workers: str) -> None:
    """`seconds` of heartbeats, one a second from each of `workers`, while the clock moves."""
    for _ in range(seconds):
        setup.clock.advance(1)
        for worker in workers:
            setup.log.send(Heartbeat(at=0, job=JOB, worker=worker))


def drain(leader: Coordinator, setup: Setup) -> None:
    """Lead until the inbox is read, then one more turn: time is judged on a drained inbox."""
    while leader.cursor != setup.log.inbox_end():
        leader.step()
    leader.step()


def failed(setup: Setup) -> list[WorkerFailed]:
    return [f for f in setup.log.facts() if isinstance(f, WorkerFailed)]


@pytest.mark.parametrize("batch", [1024, 7])
def test_workers_started_long_before_the_first_coordinator_are_judged_by_their_heartbeats(
    batch: int,
) -> None:
    setup = Setup(heartbeat_timeout=5.0, lease_ms=60_000)
    for worker in ("a", "b"):
        setup.log.send(Join(at=0, job=JOB, worker=worker))
    beat(setup, 40, "a", "b")  # 8 timeouts of waiting, heartbeating behind the Join
    leader = leader_of(setup, batch=batch)
    drain(leader, setup)
    assert set(leader.state.members) == {"a", "b"} and failed(setup) == []
    beat(setup, 4, "a")  # b goes quiet: silence is still judged, from b's last heartbeat
    setup.clock.advance(2)
    leader.step()
    (b,) = failed(setup)
    assert b.worker == "b" and b.last_seen == setup.clock.now() - 6


def test_a_coordinator_back_after_a_long_gap_fails_only_the_workers_that_went_quiet() -> None:
    setup = Setup(heartbeat_timeout=5.0, min_workers=2, lease_ms=3000)
    first = leader_of(setup)
    setup.join("a", "b", "c")
    first.step()
    assert set(first.state.members) == {"a", "b", "c"}
    # The only coordinator dies without a word (its lease runs out); the workers carry on
    # heartbeating for 60 s, but c dies 2 s in.
    beat(setup, 2, "a", "b", "c")
    quiet_since = setup.clock.now()
    beat(setup, 58, "a", "b")
    second = setup.coordinator("c2")
    second.step()  # nobody holds the lease: it takes over
    assert second.leading
    drain(second, setup)
    (c,) = failed(setup)
    assert c.worker == "c" and c.last_seen == quiet_since
    assert set(second.state.members) == {"a", "b"}


def test_a_restarted_coordinator_knows_who_was_alive_from_the_whole_window_before_its_cursor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A new leader with nothing after the cursor judges silence at once, from what it
    observed of the inbox window before the cursor: all of it, however many pages."""
    monkeypatch.setattr(service, "WINDOW_PAGE", 4)
    setup = Setup(heartbeat_timeout=5.0, lease_ms=60_000)
    first = leader_of(setup)
    setup.join("a")
    beat(setup, 1, "a")
    beat(setup, 4, *(f"x{i}" for i in range(5)))  # 20 entries of other senders
    beat(setup, 1, "a")  # a's latest sign of life, pages after its first one in the window
    drain(first, setup)
    first.close()  # a clean restart: the lease is given back
    setup.clock.advance(3.5)
    second = setup.coordinator("c2")
    second.step()
    assert second.leading
    drain(second, setup)
    assert failed(setup) == [] and "a" in second.state.members
    setup.clock.advance(2)
    drain(second, setup)  # a went quiet 5.5 s ago: now it has failed
    assert [f.worker for f in failed(setup)] == ["a"]


def test_a_leader_stalled_between_reading_the_inbox_and_judging_silence_fails_nobody_alive() -> (
    None
):
    """Silence is judged as of the moment the drained inbox was read, not later: heartbeats
    that arrive while the leader decides (a GC pause, a slow turn) are the next turn's."""
    setup = Setup(heartbeat_timeout=5.0, lease_ms=60_000)
    leader = leader_of(setup)
    setup.join("a")
    beat(setup, 1, "a")
    drain(leader, setup)
    setup.log.after_read = lambda: beat(setup, 6, "a")  # the leader stalls 6 s right there
    beat(setup, 1, "a")
    leader.step()
    assert failed(setup) == []
    drain(leader, setup)
    assert failed(setup) == [] and "a" in leader.state.members


def test_coordinators_exit_once_the_job_finished_and_its_last_worker_left() -> None:
    setup = Setup(max_steps=1)
    leader = leader_of(setup)
    stayer = setup.coordinator("c2", stay=True)
    setup.join("a")
    setup.done("a", 0)
    leader.step()
    assert leader.state.finished == "max_steps=1 reached"
    assert not leader.done  # a still has to leave (and write the last checkpoint, if asked)
    setup.log.send(Leave(at=0, job=JOB, worker="a", reason="finished"))
    leader.step()
    stayer.step()
    assert leader.done and not stayer.done
    leader.run(threading.Event())  # returns although nobody stopped it
    assert not leader.leading  # it gave the lease back on its way out
    latecomer = setup.coordinator("c3")
    latecomer.run(threading.Event())  # a finished job: nothing to do, exit at once
    assert latecomer.state.finished and not latecomer.leading


def test_the_leader_logs_each_fact_it_journals_at_info_and_commits_at_debug(
    caplog: pytest.LogCaptureFixture,
) -> None:
    setup = Setup(heartbeat_timeout=5.0, lease_ms=60_000, min_workers=2)
    with caplog.at_level("DEBUG", logger="cohort.coordinator"):
        leader = leader_of(setup)
        setup.join("a", "b")
        leader.step()
        setup.done("a", 0)
        setup.done("b", 0)
        leader.step()
        setup.clock.advance(6)
        leader.step()  # both silent: failed, and training pauses
    lines = {r.getMessage().split()[0]: r for r in caplog.records if hasattr(r, "fact")}
    for name in ("LeaderElected", "WorkerJoined", "WorldChanged", "WorkerFailed"):
        assert lines[name].levelname == "INFO", name
    assert lines["StepCommitted"].levelname == "DEBUG"
    failed = lines["WorkerFailed"]
    assert failed.getMessage().startswith("WorkerFailed worker=") and "(journal " in failed.msg
    assert failed.fact == "WorkerFailed" and failed.job == JOB  # type: ignore[attr-defined]
    journaled = [type(f).__name__ for f in setup.log.facts()]
    logged = [r.fact for r in caplog.records if hasattr(r, "fact")]  # type: ignore[attr-defined]
    assert logged == journaled  # one line per fact, in journal order


def test_silence_during_the_leaders_own_redis_outage_fails_nobody() -> None:
    """Nobody can heartbeat while Redis is away: once back, the leader gives every member a
    full heartbeat timeout before judging silence, even if it reconnects before they do."""
    setup = Setup(heartbeat_timeout=5.0)
    leader = leader_of(setup)
    setup.join("a")
    leader.step()
    assert "a" in leader.state.members
    stop = threading.Event()
    reads = setup.log.commands
    outage = iter([True])

    def commands(after: str, block_ms: int, count: int) -> list[Any]:
        if next(outage, False):  # Redis goes away for a minute, then comes back
            setup.clock.advance(60.0)
            raise redis.ConnectionError("Redis is away")
        stop.set()  # the first turn after the outage is the loop's last
        return reads(after, block_ms, count)

    setup.log.commands = commands  # type: ignore[method-assign]
    leader.run(stop)
    assert "WorkerFailed" not in setup.types(), "silence while Redis was away failed a worker"
    setup.log.commands = reads  # type: ignore[method-assign]
    setup.clock.advance(4.0)
    leader.step()
    assert "WorkerFailed" not in setup.types()
    setup.clock.advance(2.0)  # more than the timeout since Redis came back, and still silent
    leader.step()
    assert "WorkerFailed" in setup.types()


def test_the_leader_reads_connections_each_turn_and_fails_a_closed_member_after_the_grace() -> None:
    """Each turn (at most every WATCH_EVERY s) the leader asks which members hold a presence
    subscription, before it reads the inbox; a member found without one and silent since is
    failed once the grace passed, the journal saying why."""
    setup = Setup(heartbeat_timeout=30.0, disconnect_grace=0.3)
    leader = leader_of(setup)
    setup.join("a", "b")
    setup.log.subscribed = {"a", "b"}
    leader.step()
    assert set(leader.state.members) == {"a", "b"}
    setup.clock.advance(service.WATCH_EVERY)
    leader.step()  # the first reading with them members: both connected
    setup.log.subscribed = {"a"}  # b's process died: its sockets closed
    setup.clock.advance(service.WATCH_EVERY)
    leader.step()
    closed_at = setup.clock.now()
    setup.clock.advance(0.2)
    leader.step()
    assert failed(setup) == []
    setup.clock.advance(0.15)
    leader.step()
    (b,) = failed(setup)
    assert (b.worker, b.cause, b.closed_at, b.grace) == ("b", "disconnected", closed_at, 0.3)


def test_a_redis_that_refuses_the_reading_leaves_failures_to_silence(
    caplog: pytest.LogCaptureFixture,
) -> None:
    setup = Setup(heartbeat_timeout=5.0)
    leader = leader_of(setup)
    setup.join("a")
    calls = []

    def refused(workers: Any) -> Any:
        calls.append(workers)
        raise redis.ResponseError("NOPERM this user has no permissions to run 'pubsub'")

    setup.log.connected = refused  # type: ignore[method-assign]
    for _ in range(3):
        setup.clock.advance(1.0)
        leader.step()
    assert len(calls) == 1, "a refused reading is not tried every turn"
    assert "failed by their silence alone" in caplog.text and "cohort acl --apply" in caplog.text
    for _ in range(3):
        setup.clock.advance(1.0)
        leader.step()
    assert [f.cause for f in failed(setup)] == ["silent"]
    setup.log.connected = MemoryLog.connected.__get__(setup.log)  # type: ignore[method-assign]
    setup.join("b")  # the ACL applied again; a new member to watch
    for _ in range(int(service.WATCH_REFUSED_RETRY) + 1):
        setup.log.send(Heartbeat(at=0, job=JOB, worker="b"))
        setup.clock.advance(1.0)
        leader.step()
    assert leader._watch_refused is None, "asked again once a minute, and answered"
    assert caplog.text.count("Redis refused PUBSUB SHARDNUMSUB") == 1


def test_while_a_member_is_closed_the_turn_waits_only_until_its_grace_ends() -> None:
    """...and no shorter once the grace is over: a member heard from since it closed (its
    silence judges it now) does not make the leader spin on the inbox."""
    setup = Setup(heartbeat_timeout=30.0, disconnect_grace=0.3)
    leader = leader_of(setup)
    setup.join("a", "b")
    setup.log.subscribed = {"a", "b"}
    leader.step()
    setup.clock.advance(service.WATCH_EVERY)
    leader.step()
    setup.log.subscribed = {"a"}
    setup.clock.advance(service.WATCH_EVERY)
    assert leader._watch_connections() == int(service.WATCH_EVERY * 1000)  # grace: 0.3 s
    setup.clock.advance(0.28)
    assert leader._watch_connections() in range(15, 25)  # about 0.02 s of the grace left
    setup.log.send(Heartbeat(at=0, job=JOB, worker="b"))  # b speaks: alive after all
    leader.step()
    setup.clock.advance(0.5)
    assert leader._watch_connections() == int(service.WATCH_EVERY * 1000)
    assert failed(setup) == []
