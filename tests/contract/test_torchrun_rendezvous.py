"""torchrun's rendezvous pieces on Redis (fakeredis and a real server): the backend's
fenced get_state/set_state contract case by case, the c10d store as torch calls it, and
the state holder that drops the agents the journal says are gone."""

from __future__ import annotations

import pickle
import threading
from datetime import UTC, datetime, timedelta

import pytest
import redis

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
from torch.distributed.elastic.rendezvous.api import (  # noqa: E402
    RendezvousConnectionError,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (  # noqa: E402
    DynamicRendezvousHandler,
    RendezvousSettings,
    RendezvousTimeout,
    _NodeDesc,
    _RendezvousState,
)

from cohort.events.connection import RedisSettings, connect  # noqa: E402
from cohort.events.keys import Keys  # noqa: E402
from cohort.worker.pytorch.torchrun.c10d_store import RedisStore  # noqa: E402
from cohort.worker.pytorch.torchrun.handler import JournalStateHolder, agent_id  # noqa: E402
from cohort.worker.pytorch.torchrun.rendezvous_backend import RedisRendezvousBackend  # noqa: E402

JOB = "rdzv"


@pytest.fixture
def backend(conn: redis.Redis) -> RedisRendezvousBackend:
    return RedisRendezvousBackend(conn, JOB)


# ---------------------------------------------------------------- the backend's contract


def test_get_state_is_none_before_any_state(backend: RedisRendezvousBackend) -> None:
    assert backend.get_state() is None
    assert backend.name == "cohort"


def test_set_without_token_creates_the_state_and_returns_its_token(
    backend: RedisRendezvousBackend,
) -> None:
    state, token, has_set = backend.set_state(b"first") or pytest.fail("no reply")
    assert (state, has_set) == (b"first", True)
    assert backend.get_state() == (b"first", token)


@pytest.mark.parametrize("no_token", [None, 0, "", b""])
def test_set_without_token_never_overwrites_an_existing_state(
    backend: RedisRendezvousBackend, no_token: object
) -> None:
    _, token, _ = backend.set_state(b"first") or pytest.fail("no reply")
    assert backend.set_state(b"second", no_token) == (b"first", token, False)
    assert backend.get_state() == (b"first", token)


def test_set_with_the_current_token_writes_and_returns_a_new_token(
    backend: RedisRendezvousBackend,
) -> None:
    _, token, _ = backend.set_state(b"first") or pytest.fail("no reply")
    state, new_token, has_set = backend.set_state(b"second", token) or pytest.fail("no reply")
    assert (state, has_set) == (b"second", True) and new_token != token
    assert backend.get_state() == (b"second", new_token)


def test_tokens_round_trip_as_torch_may_keep_them(backend: RedisRendezvousBackend) -> None:
    _, token, _ = backend.set_state(b"first") or pytest.fail("no reply")
    assert backend.set_state(b"second", str(token).encode())[2] is True  # type: ignore[index]


def test_set_with_a_stale_token_writes_nothing_and_returns_the_current_state(
    backend: RedisRendezvousBackend,
) -> None:
    _, stale, _ = backend.set_state(b"first") or pytest.fail("no reply")
    _, current, _ = backend.set_state(b"second", stale) or pytest.fail("no reply")
    assert backend.set_state(b"third", stale) == (b"second", current, False)
    assert backend.get_state() == (b"second", current)


def test_two_agents_with_the_same_token_one_wins(conn: redis.Redis) -> None:
    first, second = RedisRendezvousBackend(conn, JOB), RedisRendezvousBackend(conn, JOB)
    _, token, _ = first.set_state(b"base") or pytest.fail("no reply")
    won = first.set_state(b"mine", token)
    lost = second.set_state(b"yours", token)
    assert won is not None and lost is not None
    assert won[2] is True and lost == (b"mine", won[1], False)


@pytest.mark.parametrize("foreign", ["abc", b"x1", 1.5, object(), True])
def test_a_token_never_given_out_cannot_be_current(
    backend: RedisRendezvousBackend, foreign: object
) -> None:
    assert backend.set_state(b"x", foreign) is None  # no state: nothing to return
    _, token, _ = backend.set_state(b"first") or pytest.fail("no reply")
    assert backend.set_state(b"x", foreign) == (b"first", token, False)


def test_set_with_a_token_after_the_state_vanished_returns_none(
    backend: RedisRendezvousBackend, conn: redis.Redis
) -> None:
    _, token, _ = backend.set_state(b"first") or pytest.fail("no reply")
    conn.delete(Keys(JOB).rendezvous)
    assert backend.set_state(b"second", token) is None
    assert backend.get_state() is None


@pytest.mark.parametrize(
    "corrupt",
    [
        {"state": b"s"},  # no token
        {"token": b"3"},  # no state
        {"state": b"s", "token": b"three"},  # not a counter
    ],
)
def test_a_corrupt_state_raises_rendezvous_state_error(
    backend: RedisRendezvousBackend, conn: redis.Redis, corrupt: dict[str, bytes]
) -> None:
    conn.hset(Keys(JOB).rendezvous, mapping=corrupt)
    with pytest.raises(RendezvousStateError, match="corrupt"):
        backend.get_state()
    with pytest.raises(RendezvousStateError, match="corrupt"):
        backend.set_state(b"new", 999)  # a failed set returns the state, so decodes it


def test_a_key_of_another_type_is_a_corrupt_state(
    backend: RedisRendezvousBackend, conn: redis.Redis
) -> None:
    conn.set(Keys(JOB).rendezvous, b"not a hash")
    with pytest.raises(RendezvousStateError, match="corrupt"):
        backend.get_state()
    with pytest.raises(RendezvousStateError, match="corrupt"):
        backend.set_state(b"new")


def test_the_state_expires_unless_written(
    backend: RedisRendezvousBackend, conn: redis.Redis
) -> None:
    backend.set_state(b"first")
    assert 0 < conn.pttl(Keys(JOB).rendezvous) <= backend.ttl_ms


def test_an_unreachable_redis_raises_rendezvous_connection_error() -> None:
    conn = connect(RedisSettings(url="redis://127.0.0.1:1/0", retries=0, connect_timeout=0.5))
    with pytest.raises(RendezvousConnectionError, match="127.0.0.1:1"):
        RedisRendezvousBackend(conn, JOB).get_state()
    with pytest.raises(RendezvousConnectionError):
        RedisRendezvousBackend(conn, JOB).set_state(b"x")


def test_torchs_own_dynamic_handler_runs_a_rendezvous_on_it(conn: redis.Redis) -> None:
    handler = DynamicRendezvousHandler.from_backend(
        JOB, RedisStore(conn, JOB), RedisRendezvousBackend(conn, JOB), 1, 1, "127.0.0.1"
    )
    try:
        info = handler.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1)
        info.store.set("k", "v")  # the round's keys, in the job's Redis
        assert conn.hget(Keys(JOB).c10d(f"torch.rendezvous.{JOB}.0"), "k") == b"v"
    finally:
        handler.shutdown()
    assert handler.is_closed()


# ---------------------------------------------------------------- the c10d store


@pytest.fixture
def store(conn: redis.Redis) -> RedisStore:
    return RedisStore(conn, JOB, timeout=timedelta(seconds=2))


@pytest.fixture
def round_store(store: RedisStore) -> dist.Store:
    """The store as torch's rendezvous hands it to an agent: prefixed with the round."""
    return dist.PrefixStore(f"torch.rendezvous.{JOB}.4", store)


def test_store_keys_live_under_the_jobs_prefix_one_hash_per_round(
    round_store: dist.Store, conn: redis.Redis
) -> None:
    round_store.set("MASTER_ADDR", "host-a")
    assert round_store.get("MASTER_ADDR") == b"host-a"
    keys = {k.decode() for k in conn.keys("*")}
    assert keys and all(k.startswith(Keys(JOB).prefix) for k in keys), keys
    assert conn.hgetall(Keys(JOB).c10d(f"torch.rendezvous.{JOB}.4")) == {b"MASTER_ADDR": b"host-a"}
    assert conn.pttl(Keys(JOB).c10d(f"torch.rendezvous.{JOB}.4")) > 0


def test_store_get_waits_for_a_key_written_later(round_store: dist.Store) -> None:
    writer = threading.Timer(0.2, lambda: round_store.set("late", b"here"))
    writer.start()
    assert round_store.get("late") == b"here"
    writer.join()


def test_store_get_of_a_missing_key_times_out_naming_it(store: RedisStore) -> None:
    store.set_timeout(timedelta(milliseconds=200))
    with pytest.raises(dist.DistStoreError, match="never-set"):
        store.get("g/never-set")
    with pytest.raises(dist.DistStoreError, match="also-missing"):
        store.wait(["g/also-missing"], timedelta(milliseconds=100))


def test_store_add_counts_from_zero(round_store: dist.Store) -> None:
    assert [round_store.add("n", 1), round_store.add("n", 5), round_store.add("n", -2)] == [1, 6, 4]
    assert round_store.get("n") == b"4"


def test_store_compare_set_follows_c10d(round_store: dist.Store) -> None:
    assert round_store.compare_set("k", "", "first") == b"first"  # missing, expected empty
    assert round_store.compare_set("k", "wrong", "second") == b"first"  # mismatch: current
    assert round_store.compare_set("k", "first", "second") == b"second"  # match: swapped
    assert round_store.compare_set("absent", "hoped", "x") == b"hoped"  # missing: expected
    assert not round_store.check(["absent"])


def test_store_check_multi_get_multi_set_and_append(round_store: dist.Store) -> None:
    assert round_store.check([]) and not round_store.check(["a"])
    round_store.multi_set(["a", "b"], ["1", "2"])
    assert round_store.check(["a", "b"])
    assert round_store.multi_get(["b", "a"]) == [b"2", b"1"]
    round_store.append("log", "x")
    round_store.append("log", b"y")
    assert round_store.get("log") == b"xy"
    round_store.wait(["a", "b"])


def test_store_delete_key_and_num_keys(store: RedisStore) -> None:
    store.set("r1/a", "1")
    store.set("r2/b", "2")
    store.set("plain", "3")
    assert store.num_keys() == 3
    assert store.delete_key("r1/a") is True and store.delete_key("r1/a") is False
    assert store.num_keys() == 2


def test_store_drop_deletes_whole_groups_only(store: RedisStore, conn: redis.Redis) -> None:
    old, new = f"torch.rendezvous.{JOB}.0", f"torch.rendezvous.{JOB}.1"
    store.set(f"{old}/x", "old")
    store.queue_push(f"{old}/q", "old")
    store.set(f"{new}/x", "new")
    store.queue_push(f"{new}/q", "new")
    dropped = store.drop(lambda group: group.endswith(".0"))
    assert dropped == [old]
    assert store.groups() == [new]
    assert not conn.exists(
        Keys(JOB).c10d(old),
        Keys(JOB).c10d_events(old),
        Keys(JOB).c10d_queue(old, "q"),
        Keys(JOB).c10d_queues(old),
    )
    assert store.get(f"{new}/x") == b"new" and store.queue_pop(f"{new}/q") == b"new"


# ---------------------------------------------------------------- the journal's drop


def _node(pid: int) -> _NodeDesc:
    return _NodeDesc("host-a", pid, 0)


def _holder(
    conn: redis.Redis, gone: set[str], me: _NodeDesc, min_nodes: int = 1
) -> JournalStateHolder:
    settings = RendezvousSettings(
        JOB, min_nodes, 4, RendezvousTimeout(), timedelta(seconds=5), keep_alive_max_attempt=3
    )
    return JournalStateHolder(
        RedisRendezvousBackend(conn, JOB), settings, lambda: frozenset(gone), me
    )


def _write(conn: redis.Redis, state: _RendezvousState) -> None:
    RedisRendezvousBackend(conn, JOB).set_state(pickle.dumps(state))


def _complete_round(*nodes: _NodeDesc) -> _RendezvousState:
    state = _RendezvousState()
    state.round, state.complete = 3, True
    state.participants = {node: rank for rank, node in enumerate(nodes)}
    state.last_heartbeats = {node: datetime.now(UTC) for node in nodes}
    return state


def test_a_participant_the_journal_says_is_gone_is_dropped_and_lost(conn: redis.Redis) -> None:
    me, peer, waiter = _node(1), _node(2), _node(3)
    state = _complete_round(me, peer)
    state.wait_list = {waiter}
    _write(conn, state)
    holder = _holder(conn, {agent_id(peer), agent_id(waiter)}, me)
    holder.sync()
    assert list(holder.state.participants) == [me] and holder.state.complete
    assert holder.state.wait_list == set() and peer not in holder.state.last_heartbeats
    assert holder.lost == {(3, peer)}  # the waiter was no participant: no restart for it


def test_without_gone_agents_nothing_is_dropped(conn: redis.Redis) -> None:
    me, peer = _node(1), _node(2)
    _write(conn, _complete_round(me, peer))
    holder = _holder(conn, {"torchrun-other-9-0"}, me)
    holder.sync()
    assert list(holder.state.participants) == [me, peer] and holder.lost == set()


def test_this_agent_is_never_dropped_even_if_the_journal_failed_it(conn: redis.Redis) -> None:
    me, peer = _node(1), _node(2)
    _write(conn, _complete_round(me, peer))
    holder = _holder(conn, {agent_id(me)}, me)
    holder.sync()
    assert me in holder.state.participants


def test_a_round_left_empty_moves_to_the_next_as_torch_does(conn: redis.Redis) -> None:
    me, peer = _node(1), _node(2)
    _write(conn, _complete_round(peer))  # this agent already left the round
    holder = _holder(conn, {agent_id(peer)}, me)
    holder.sync()
    assert (holder.state.round, holder.state.complete) == (4, False)


def test_an_open_round_below_min_nodes_loses_its_deadline(conn: redis.Redis) -> None:
    me, peer = _node(1), _node(2)
    state = _complete_round(me, peer)
    state.complete, state.deadline = False, datetime.now(UTC)
    _write(conn, state)
    holder = _holder(conn, {agent_id(peer)}, me, min_nodes=2)
    holder.sync()
    assert holder.state.deadline is None and not holder.state.complete


# ---------------------------------------------------------------- a run after a closed one


def _closed(*live: _NodeDesc, heartbeat: datetime | None = None) -> _RendezvousState:
    state = _complete_round(*live)
    state.closed = True
    state.last_heartbeats = {node: heartbeat or datetime.now(UTC) for node in live}
    return state


def test_a_rendezvous_closed_by_a_finished_run_reopens_one_round_on(conn: redis.Redis) -> None:
    me = _node(1)
    state = _closed()  # every agent of the last run took itself out as it shut down
    state.participants = {_node(2): 0}
    _write(conn, state)
    holder = _holder(conn, set(), me)
    assert holder.reopen() is True
    again = _holder(conn, set(), _node(3))
    again.sync()  # what every other agent of the new run reads
    assert not again.state.closed and again.state.round == 4
    assert again.state.participants == {} and not again.state.complete


def test_a_closed_rendezvous_with_live_agents_stays_closed(conn: redis.Redis) -> None:
    peer = _node(2)
    _write(conn, _closed(peer))  # an agent of the last run still keeps alive
    holder = _holder(conn, set(), _node(1))
    assert holder.reopen() is False
    _holder(conn, set(), _node(3)).sync()
    assert RedisRendezvousBackend(conn, JOB).get_state() is not None
    assert pickle.loads(RedisRendezvousBackend(conn, JOB).get_state()[0]).closed  # type: ignore[index]


def test_a_killed_agents_keep_alive_keeps_it_closed_only_until_it_expires_or_is_gone(
    conn: redis.Redis,
) -> None:
    dead = _node(2)
    _write(conn, _closed(dead, heartbeat=datetime.now(UTC) - timedelta(seconds=16)))
    assert _holder(conn, set(), _node(1)).reopen() is True  # 5 s x 3 keep-alives missed
    _write(conn, _closed(dead))
    assert _holder(conn, {agent_id(dead)}, _node(3)).reopen() is True  # the journal failed it


def test_two_new_agents_reopening_at_once_agree_on_one_new_run(conn: redis.Redis) -> None:
    _write(conn, _closed())
    a, b = _holder(conn, set(), _node(1)), _holder(conn, set(), _node(2))
    a.sync(), b.sync()  # both read the closed state
    assert a.reopen() and b.reopen()
    assert a.state.round == b.state.round == 4


def test_an_agent_shutting_down_takes_its_keep_alive_out_of_the_closed_state(
    conn: redis.Redis,
) -> None:
    me, peer = _node(1), _node(2)
    _write(conn, _closed(me, peer))
    mine = _holder(conn, set(), me)
    mine.depart()
    assert _holder(conn, set(), _node(3)).reopen() is False  # the peer is still ending
    _holder(conn, set(), peer).depart()
    assert _holder(conn, set(), _node(3)).reopen() is True
