"""The Worker client against fakeredis, with the test playing the coordinator.

The test appends facts to the journal itself and reads the worker's commands
from the inbox; every wait is bounded (XREAD BLOCK, futures, events), never a sleep.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import fakeredis
import pytest

from cohort.events import decode_command, encode
from cohort.events import models as m
from cohort.events.connection import where
from cohort.events.keys import JobNameError, Keys
from cohort.events.shards import Shard
from cohort.events.streams import ZERO, Inbox, Journal
from cohort.worker.errors import (
    Finished,
    JoinRefusedError,
    JoinTimeoutError,
    RemovedError,
    Stopped,
    WorldChangedError,
)
from cohort.worker.loop import simulated
from cohort.worker.membership import joining
from cohort.worker.membership.client import Worker
from tests.helpers import wait_until

JOB = "unit"
ME = "w-me"


def fact(cls: type[Any], **body: Any) -> Any:
    return cls(at=1.0, job=JOB, **body)


class Leader:
    """The test's stand-in for the coordinator: writes facts, reads commands."""

    def __init__(self, server: fakeredis.FakeServer) -> None:
        self.conn = fakeredis.FakeRedis(server=server)
        keys = Keys(JOB)
        self.journal = Journal(self.conn, keys.journal)
        self.inbox = Inbox(self.conn, keys.inbox)
        self.read = ZERO

    def say(self, *facts: Any) -> None:
        """Append `facts` in one transaction, as the fenced leader function does."""
        pipe = self.conn.pipeline(transaction=True)
        for f in facts:
            pipe.xadd(self.journal.key, {b"e": encode(f)})
        pipe.execute()

    def expect(self, kind: str, timeout: float = 3.0) -> Any:
        """The next command of type `kind` in the inbox (others are skipped)."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            for entry in self.inbox.tail(self.read, int(left * 1000) + 1, count=1):
                self.read = entry.id
                command = decode_command(entry.raw or b"")
                if command.type == kind:
                    return command
        raise AssertionError(f"no {kind} command in the inbox within {timeout} s")

    def commands(self, kind: str) -> list[Any]:
        cmds = (decode_command(e.raw or b"") for e in self.inbox.range())
        return [c for c in cmds if c.type == kind]


@pytest.fixture
def server() -> fakeredis.FakeServer:
    return fakeredis.FakeServer()


@pytest.fixture
def leader(server: fakeredis.FakeServer) -> Leader:
    lead = Leader(server)
    lead.say(
        fact(
            m.JobConfigured,
            config=m.JobConfig(
                heartbeat_interval=0.05, heartbeat_timeout=1.0, batch_size=4, dataset_size=60_000
            ),
        )
    )
    return lead


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=2) as ex:
        yield ex


@pytest.fixture
def make_worker(server: fakeredis.FakeServer) -> Iterator[Callable[..., Worker]]:
    made: list[Worker] = []

    def make(worker_id: str = ME, **kw: Any) -> Worker:
        w = Worker(fakeredis.FakeRedis(server=server), JOB, worker_id=worker_id, **kw)
        made.append(w)
        return w

    yield make
    for w in made:
        w.stop()


def joined(leader: Leader, worker: Worker, pool: ThreadPoolExecutor) -> None:
    done = pool.submit(worker.join, 5)
    join = leader.expect("Join")
    leader.say(fact(m.WorkerJoined, worker=join.worker))
    done.result(timeout=5)


def active(leader: Leader, worker: Worker, pool: ThreadPoolExecutor, ranks=(ME,)) -> None:
    """Joined, synced, activated and rank of world 1 from step 0 over samples [0, 40)."""
    joined(leader, worker, pool)
    shards = tuple(Shard(ranges=((i * 10, i * 10 + 10),)) for i in range(len(ranks)))
    leader.say(
        fact(m.WorkerSynced, worker=worker.id, step=0),
        fact(m.WorkerActivated, worker=worker.id),
        fact(m.WorldChanged, version=1, start_step=0, epoch=0, ranks=ranks, shards=shards),
    )
    worker.wait_active(3)


# ---------------------------------------------------------------- joining


def test_join_returns_once_worker_joined_is_journaled(leader, make_worker, pool) -> None:
    worker = make_worker()
    joined(leader, worker, pool)
    assert worker.view.member and worker.view.status == "syncing"
    assert worker.view.config is not None and worker.view.config.batch_size == 4
    join = leader.commands("Join")[0]
    assert join.worker == ME and join.pid > 0


def test_join_refused_raises_with_the_coordinators_reason(leader, make_worker, pool) -> None:
    worker = make_worker()
    done = pool.submit(worker.join, 5)
    leader.expect("Join")
    leader.say(fact(m.JoinRefused, worker=ME, reason="job 'unit' already has max_workers=1"))
    with pytest.raises(JoinRefusedError, match="max_workers=1") as info:
        done.result(timeout=5)
    assert info.value.reason == "job 'unit' already has max_workers=1"


def test_join_without_a_coordinator_times_out_naming_the_job_and_withdraws(
    leader, make_worker
) -> None:
    with pytest.raises(JoinTimeoutError, match="cohort coordinator --job unit") as info:
        make_worker().join(timeout=0.3)
    assert "within 0.3 s" in str(info.value) and "redis://" in str(info.value)
    # A coordinator that decides the Join later lets the worker go instead of failing it.
    (leave,) = leader.commands("Leave")
    assert leave.worker == ME and "gave up joining" in leave.reason


def test_a_worker_started_before_any_coordinator_heartbeats_until_its_join_is_answered(
    server, make_worker, pool, caplog, monkeypatch
) -> None:
    """Nothing in the journal yet, not even the job's config: the worker waits without a
    deadline, says so in the log, and heartbeats behind its Join so the leader that finally
    decides it from the inbox backlog sees it alive."""
    monkeypatch.setattr(joining, "JOIN_NOTICE_EVERY", 0.1)
    caplog.set_level(logging.INFO, "cohort.worker")
    leader = Leader(server)
    worker = make_worker(heartbeat_interval=0.02)
    done = pool.submit(worker.join)
    leader.expect("Join")
    for _ in range(3):
        assert leader.expect("Heartbeat").worker == ME
    wait_until(lambda: sum("waiting for a coordinator" in r.message for r in caplog.records) >= 2)
    assert not done.done()
    leader.say(
        fact(m.JobConfigured, config=m.JobConfig(dataset_size=60_000)),
        fact(m.WorkerJoined, worker=ME),
    )
    done.result(timeout=5)
    assert worker.view.member
    kinds = [decode_command(e.raw or b"").type for e in leader.inbox.range()]
    assert kinds[0] == "Join" and set(kinds[1:]) == {"Heartbeat"}
    line = next(r.message for r in caplog.records if "waiting for a coordinator" in r.message)
    assert "job 'unit' at redis://" in line and "s so far" in line
    assert all(r.exc_info is None for r in caplog.records)


@pytest.mark.parametrize("how", ["signal", "stop event"])
def test_a_stop_ends_the_wait_for_a_coordinator_and_withdraws_the_join(
    server, make_worker, pool, monkeypatch, how
) -> None:
    monkeypatch.setattr("cohort.worker.membership.signals.os._exit", lambda code: None)
    leader = Leader(server)
    worker = make_worker(heartbeat_interval=0.02)
    stop = threading.Event()
    done = pool.submit(worker.join, None, stop if how == "stop event" else None)
    leader.expect("Join")
    leader.expect("Heartbeat")
    if how == "signal":
        worker.on_signal(signal.SIGTERM, None)  # the first SIGTERM sets worker.stopping
    else:
        stop.set()
    with pytest.raises(Stopped, match="before a coordinator of job 'unit' answered its join"):
        done.result(timeout=3)
    assert leader.expect("Leave").worker == ME
    assert not worker._threads
    assert worker.view.member is False


def test_worker_sees_the_world_journaled_before_it_joined(leader, make_worker, pool) -> None:
    leader.say(
        fact(m.WorkerJoined, worker="early"),
        fact(
            m.WorldChanged,
            version=3,
            start_step=7,
            epoch=0,
            ranks=("early",),
            shards=(Shard(ranges=((0, 10),)),),
        ),
        fact(m.StepCommitted, step=9, world=3),
    )
    worker = make_worker()
    joined(leader, worker, pool)
    assert worker.world_version == 3 and worker.next_step == 10
    assert worker.view.members == {"early", ME} and worker.assignment is None


def test_a_signal_ends_a_join_that_waits_for_redis_itself(server, make_worker, pool) -> None:
    server.connected = False
    worker = make_worker()
    done = pool.submit(worker.join)
    with pytest.raises(TimeoutError):
        done.result(timeout=0.3)  # retrying, without a deadline
    worker.on_signal(signal.SIGTERM, None)
    with pytest.raises(Stopped, match="unreachable"):
        done.result(timeout=3)


# ---------------------------------------------------------------- heartbeats


def test_heartbeats_arrive_at_the_configured_interval(leader, make_worker, pool) -> None:
    worker = make_worker()
    joined(leader, worker, pool)
    beats = [leader.expect("Heartbeat") for _ in range(4)]
    assert all(b.worker == ME and b.step is None for b in beats)
    stamps = [
        e.ms for e in leader.inbox.range() if decode_command(e.raw or b"").type == "Heartbeat"
    ]
    assert stamps[3] - stamps[0] >= 3 * 50 * 0.8  # paced by the interval, not a busy loop


def test_heartbeats_follow_a_config_journaled_after_the_join(server, make_worker, pool) -> None:
    """A worker may start before the coordinator: it must not keep the 1 s default pace."""
    leader = Leader(server)
    worker = make_worker()
    done = pool.submit(worker.join, 5)
    leader.expect("Join")
    config = m.JobConfig(heartbeat_interval=0.05, heartbeat_timeout=0.3, dataset_size=60_000)
    leader.say(fact(m.JobConfigured, config=config), fact(m.WorkerJoined, worker=ME))
    done.result(timeout=5)
    for _ in range(3):
        leader.expect("Heartbeat", timeout=0.5)  # well inside the 0.3 s timeout each


def test_heartbeat_carries_the_last_finished_step_and_its_world(leader, make_worker, pool) -> None:
    worker = make_worker()
    active(leader, worker, pool)
    worker.batch(0)
    worker.step_done(0)
    leader.expect("StepDone")
    beat = leader.expect("Heartbeat")
    assert (beat.step, beat.world) == (0, 1)


# ---------------------------------------------------------------- steps and worlds


def test_wait_active_returns_the_assignment_and_batches_follow_it(
    leader, make_worker, pool
) -> None:
    worker = make_worker()
    active(leader, worker, pool, ranks=("x", ME))
    assert (worker.rank, worker.world_size) == (1, 2)
    assert worker.batch(0) == ((10, 14),) and worker.batch(2) == ((18, 20),)


def test_samples_are_the_batch_s_positions_in_the_epoch_s_order(leader, make_worker, pool) -> None:
    worker = make_worker()
    active(leader, worker, pool, ranks=("x", ME))
    order = m.JobConfig(dataset_size=60_000).order(
        0
    )  # the job's config: shuffled, seed 0, 60000 samples
    assert worker.samples(0).tolist() == [order[p] for p in range(10, 14)]
    assert worker.samples(0).tolist() != [10, 11, 12, 13]


def test_wait_active_waits_while_training_is_paused(leader, make_worker, pool) -> None:
    worker = make_worker()
    active(leader, worker, pool)
    leader.say(fact(m.TrainingPaused, reason="few", active=1, min_workers=2))
    worker.wait_for(lambda v: v.paused, 3)
    with pytest.raises(TimeoutError):
        worker.wait_active(0.2)
    waiting = pool.submit(worker.wait_active, 3)
    leader.say(fact(m.TrainingResumed, active=2))
    assert waiting.result(timeout=3).rank == 0


def test_wait_committed_returns_when_the_step_commits_with_a_new_world(
    leader, make_worker, pool
) -> None:
    worker = make_worker()
    active(leader, worker, pool)
    worker.batch(0)
    worker.step_done(0, step_time=0.1, samples=4, digest="ab" * 8, loss=0.5)
    done = leader.expect("StepDone")
    assert (done.step, done.world, done.samples, done.loss) == (0, 1, 4, 0.5)
    waiting = pool.submit(worker.wait_committed, 0, 3)
    # one decision: the step commits AND a joiner is activated in a new world
    leader.say(
        fact(m.StepCommitted, step=0, world=1),
        fact(m.WorkerActivated, worker="new"),
        fact(
            m.WorldChanged,
            version=2,
            start_step=1,
            epoch=0,
            ranks=(ME, "new"),
            shards=(Shard(ranges=((4, 7),)), Shard(ranges=((7, 10),))),
        ),
    )
    assert waiting.result(timeout=3) is None
    assert worker.world_changed.is_set() and worker.world_size == 2


def test_wait_committed_raises_world_changed_when_the_step_is_aborted(
    leader, make_worker, pool
) -> None:
    worker = make_worker()
    active(leader, worker, pool, ranks=(ME, "peer"))
    worker.batch(0)
    worker.step_done(0)
    waiting: Future[None] = pool.submit(worker.wait_committed, 0, 3)
    leader.say(
        fact(m.WorkerFailed, worker="peer", last_seen=1.0, timeout=1.0),
        fact(
            m.WorldChanged,
            version=2,
            start_step=0,
            epoch=0,
            ranks=(ME,),
            shards=(Shard(ranges=((0, 20),)),),
        ),
    )
    with pytest.raises(WorldChangedError) as info:
        waiting.result(timeout=3)
    new = info.value.assignment
    assert new is not None
    assert (new.world_version, new.start_step, new.world_size) == (2, 0, 1)
    assert worker.batch(0) == ((0, 4),)  # the step is redone with the new shard


def test_a_step_begun_before_a_world_change_reports_its_old_world(
    leader, make_worker, pool
) -> None:
    worker = make_worker()
    active(leader, worker, pool)
    worker.batch(0)  # begun in world 1
    leader.say(
        fact(
            m.WorldChanged,
            version=2,
            start_step=0,
            epoch=0,
            ranks=(ME,),
            shards=(Shard(ranges=((0, 10),)),),
        )
    )
    assert worker.wait_for_change(1, 3)
    worker.step_done(0)
    assert leader.expect("StepDone").world == 1  # never claims old-world work for world 2
    with pytest.raises(WorldChangedError):
        worker.wait_committed(0, 3)


def test_the_end_of_the_job_ends_the_waits_for_a_rank_and_for_later_steps(
    leader, make_worker, pool
) -> None:
    worker = make_worker()
    active(leader, worker, pool)
    worker.step_done(0, samples=4)
    worker.step_done(1, samples=4)  # begun, but the job ends with step 0
    waiting = pool.submit(worker.wait_committed, 1, 3)
    leader.say(
        fact(m.StepCommitted, step=0, world=1),
        fact(m.JobFinished, step=0, epoch=0, reason="max_steps=1 reached"),
    )
    with pytest.raises(Finished, match="finished at step 0 \\(max_steps=1 reached\\)"):
        waiting.result(timeout=3)
    assert worker.finished and worker.committed(0) and not worker.committed(1)
    with pytest.raises(Finished) as end:
        worker.wait_active(3)
    assert (end.value.step, end.value.reason) == (0, "max_steps=1 reached")


def test_a_worker_does_not_join_a_finished_job_and_says_how_to_run_it_again(
    leader, make_worker
) -> None:
    leader.say(fact(m.JobFinished, step=9, epoch=0, reason="max_steps=10 reached"))
    with pytest.raises(JoinRefusedError, match="cohort reset --job unit"):
        make_worker().join(timeout=3)  # no coordinator needed to say no
    assert leader.commands("Join") == []


def test_a_join_still_unanswered_when_the_job_finishes_is_refused_by_the_end(
    leader, make_worker, pool
) -> None:
    """The coordinators end with the job and may never read a Join sent just before: the
    JobFinished in the journal is the answer (else the worker waited for ever)."""
    joining = pool.submit(make_worker().join, 5)
    leader.expect("Join")
    leader.say(fact(m.JobFinished, step=9, epoch=0, reason="max_steps=10 reached"))
    with pytest.raises(JoinRefusedError, match=r"finished at step .*\(max_steps=10 reached\)"):
        joining.result(timeout=5)


def test_a_step_reported_without_waiting_goes_out_before_the_leave_after_it(
    server, leader, make_worker, pool
) -> None:
    """The training loop's report does not wait for Redis, even through an outage, and
    still reaches the inbox before anything the worker sends after it."""
    worker = make_worker()
    active(leader, worker, pool)
    worker.batch(0)
    server.connected = False
    worker.step_done(0, wait=False)  # returns at once: the outbox retries meanwhile
    leaving = pool.submit(worker.leave, "done", 5)
    server.connected = True
    assert leader.expect("Leave").after_step == 0
    leader.say(fact(m.WorkerLeft, worker=ME, reason="done"))
    assert leaving.result(timeout=5) is True
    sent = [decode_command(e.raw or b"").type for e in leader.inbox.range()]
    assert [kind for kind in sent if kind in ("StepDone", "Leave")] == ["StepDone", "Leave"]


def test_wait_for_change_times_out_false_without_a_new_world(leader, make_worker, pool) -> None:
    worker = make_worker()
    active(leader, worker, pool)
    assert worker.wait_for_change(1, 0.1) is False


def test_removed_is_raised_when_this_worker_is_declared_failed(leader, make_worker, pool) -> None:
    worker = make_worker()
    active(leader, worker, pool)
    worker.batch(0)
    worker.step_done(0)
    waiting = pool.submit(worker.wait_committed, 0, 3)
    leader.say(fact(m.WorkerFailed, worker=ME, last_seen=1.0, timeout=1.0))
    with pytest.raises(RemovedError, match="no heartbeat"):
        waiting.result(timeout=3)
    with pytest.raises(RemovedError):
        worker.wait_active(1)


def test_a_removed_worker_can_join_again(leader, make_worker, pool) -> None:
    worker = make_worker()
    joined(leader, worker, pool)
    leader.say(fact(m.WorkerFailed, worker=ME, last_seen=1.0, timeout=1.0))
    with pytest.raises(RemovedError):
        worker.wait_active(3)
    joined(leader, worker, pool)
    assert worker.view.member and worker.view.joins == 2


def test_undecodable_facts_are_skipped_and_logged_once(leader, make_worker, pool, caplog) -> None:
    worker = make_worker()
    joined(leader, worker, pool)
    caplog.set_level(logging.DEBUG, "cohort.worker")
    for _ in range(3):
        leader.journal.append_raw(b"\x93not an event")
    leader.say(
        fact(
            m.WorldChanged,
            version=1,
            start_step=0,
            epoch=0,
            ranks=(ME,),
            shards=(Shard(ranges=((0, 10),)),),
        )
    )
    assert worker.wait_for_change(0, 3)  # the fact after the bad entries got through
    warned = [r for r in caplog.records if "cannot read" in r.message]
    assert len(warned) == 3
    assert [r.levelno for r in warned].count(logging.WARNING) == 1


# ---------------------------------------------------------------- leaving and signals


def test_leave_sends_the_last_finished_step_and_waits_for_worker_left(
    leader, make_worker, pool
) -> None:
    worker = make_worker()
    active(leader, worker, pool)
    worker.batch(0)
    worker.step_done(0)
    leaving = pool.submit(worker.leave, "done", 3)
    leave = leader.expect("Leave")
    assert (leave.worker, leave.after_step, leave.reason) == (ME, 0, "done")
    leader.say(fact(m.WorkerLeft, worker=ME, reason="done"))
    assert leaving.result(timeout=3) is True
    assert not worker._threads  # stopped


def test_leave_without_draining_asks_to_go_now_not_after_its_uncommitted_step(
    leader, make_worker, pool
) -> None:
    """A rank whose applied step the job will not commit (it rejoins for the committed
    weights) must not ask to leave after it: the leader would wait for that commit."""
    worker = make_worker()
    active(leader, worker, pool)
    worker.batch(0)
    worker.step_done(0)
    leaving = pool.submit(worker.leave, "ahead", 3, drain=False)
    assert leader.expect("Leave").after_step is None
    leader.say(fact(m.WorkerLeft, worker=ME, reason="ahead"))
    assert leaving.result(timeout=3) is True


def test_leave_gives_up_after_its_timeout_and_still_stops(leader, make_worker, pool) -> None:
    worker = make_worker()
    joined(leader, worker, pool)
    assert worker.leave(timeout=0.1) is False
    assert leader.expect("Leave").after_step is None
    assert not worker._threads


def test_first_signal_asks_to_stop_and_the_second_exits_now(
    leader, make_worker, monkeypatch
) -> None:
    exits: list[int] = []
    monkeypatch.setattr("cohort.worker.membership.signals.os._exit", exits.append)
    worker = make_worker()
    worker.on_signal(signal.SIGTERM, None)
    assert worker.stopping.is_set() and exits == []
    worker.on_signal(signal.SIGINT, None)
    assert exits == [130]


def test_stop_wakes_a_waiter(leader, make_worker, pool) -> None:
    worker = make_worker()
    active(leader, worker, pool)
    waiting = pool.submit(worker.wait_committed, 0, 30)
    worker.stop()
    with pytest.raises(Stopped):
        waiting.result(timeout=3)


# ---------------------------------------------------------------- Redis outages


def test_commands_sent_during_an_outage_arrive_once_it_ends(
    server, leader, make_worker, pool, caplog
) -> None:
    worker = make_worker()
    active(leader, worker, pool)
    caplog.set_level(logging.INFO, "cohort.worker")
    worker.batch(0)
    server.connected = False
    sending = pool.submit(worker.step_done, 0)
    lost = threading.Event()

    class Spy(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "lost the connection" in record.getMessage():
                lost.set()

    spy = Spy()
    logging.getLogger("cohort.worker").addHandler(spy)
    try:
        assert lost.wait(3)
        assert not sending.done()  # retrying, not crashed
        server.connected = True
        sending.result(timeout=5)
    finally:
        logging.getLogger("cohort.worker").removeHandler(spy)
    leader.say(fact(m.StepCommitted, step=0, world=1))
    worker.wait_committed(0, 5)  # the tail survived the outage too
    assert len(leader.commands("StepDone")) == 1
    leader.expect("Heartbeat")  # and so did the heartbeat thread
    messages = [r.getMessage() for r in caplog.records]
    assert sum("lost the connection" in msg for msg in messages) == 1
    assert sum("is back" in msg for msg in messages) == 1
    assert all(r.exc_info is None for r in caplog.records)
    assert "redis://" in next(msg for msg in messages if "lost the connection" in msg)


# ---------------------------------------------------------------- the simulated loop


def test_simulated_loop_trains_each_committed_batch_once(server, leader, make_worker) -> None:
    """A minimal leader answers every command; the loop sees one world change mid-run."""
    stop = threading.Event()
    replies = threading.Thread(target=_auto_leader, args=(leader, stop), daemon=True)
    replies.start()
    try:
        summary = simulated.run(make_worker(), steps=6, step_time=0.0, stop=threading.Event())
    finally:
        stop.set()
        replies.join()
    assert summary["steps_committed"] == 6 and summary["world_changes"] == 1
    used = [i for ranges in summary["ranges"].values() for a, b in ranges for i in range(a, b)]
    assert sorted(used) == list(range(len(used))) and len(used) == summary["samples"]
    assert leader.commands("Leave")[0].reason == "done"
    assert [(w, st) for w, st, _ in summary["reported"]][2:4] == [(1, 2), (2, 2)]  # step 2 redone


def _auto_leader(leader: Leader, stop: threading.Event) -> None:
    """Join → joined; WeightsLoaded → active in world 1; StepDone 2 aborted once by world 2."""
    aborted = False
    while not stop.is_set():
        for entry in leader.inbox.tail(leader.read, 100):
            leader.read = entry.id
            cmd = decode_command(entry.raw or b"")
            match cmd:
                case m.Join():
                    leader.say(fact(m.WorkerJoined, worker=cmd.worker))
                case m.WeightsLoaded():
                    leader.say(
                        fact(m.WorkerSynced, worker=cmd.worker, step=0),
                        fact(m.WorkerActivated, worker=cmd.worker),
                        _world(1, 0, cmd.worker, 0),
                    )
                case m.StepDone() if cmd.step == 2 and not aborted:
                    aborted = True  # a peer "failed": step 2 is redone in world 2
                    leader.say(_world(2, 2, cmd.worker, 8))
                case m.StepDone():
                    leader.say(fact(m.StepCommitted, step=cmd.step, world=cmd.world))
                case m.Leave():
                    leader.say(fact(m.WorkerLeft, worker=cmd.worker, reason=cmd.reason))


def _world(version: int, start: int, worker: str, first: int) -> Any:
    shard = Shard(ranges=((first, 1000),))
    return fact(
        m.WorldChanged, version=version, start_step=start, epoch=0, ranks=(worker,), shards=(shard,)
    )


# ---------------------------------------------------------------- bad arguments


@pytest.mark.parametrize("job", [None, ""])
def test_a_worker_without_a_job_name_says_so(server, job) -> None:
    with pytest.raises(
        JobNameError, match=r"no job name given \(" + repr(job) + r"\): pass the name"
    ):
        Worker(fakeredis.FakeRedis(server=server), job)


def test_the_join_line_names_the_redis_it_joined_on(leader, make_worker, pool, caplog) -> None:
    worker = make_worker()
    with caplog.at_level(logging.INFO, logger="cohort"):
        joined(leader, worker, pool)
    said = [r.getMessage() for r in caplog.records if "joined job" in r.getMessage()]
    assert said == [f"worker {ME} joined job {JOB!r} on Redis {where(worker.conn)}"]
    assert "redis://" in said[0]  # which server: forgetting $COHORT_REDIS_URL shows here
