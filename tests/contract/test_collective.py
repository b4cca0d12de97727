"""Collectives on fakeredis and a real redis-server: N ranks are N threads, each with its own
client, and a stand-in for the worker that fixes the world the test wants."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import fakeredis
import numpy as np
import pytest
import redis

from cohort.events.codec import FIELD, encode
from cohort.events.keys import Keys
from cohort.events.models import WorldChanged
from cohort.events.shards import Shard
from cohort.worker.collective import wire as wire_module
from cohort.worker.collective.redis_collective import Collective, Participant, calls
from cohort.worker.collective.tensors import pieces
from cohort.worker.collective.tensors import unpack as unpack_blob
from cohort.worker.collective.wire import Wire
from cohort.worker.errors import CollectiveError, CollectiveTimeoutError, WorldChangedError
from cohort.worker.membership.view import Assignment
from tests.helpers import wait_until

JOB = "coll"
KEYS = Keys(JOB)


@dataclass
class StandIn:
    """The part of `worker.client.Worker` a Collective reads; the test moves it at will."""

    id: str
    rank: int
    world_size: int
    world_version: int = 1
    assignment: Assignment | None = None

    @property
    def ranks(self) -> tuple[str, ...]:
        return tuple(f"w{r}" for r in range(self.world_size))


def _notices(conn: Any, step: int, op: str = "allreduce", n: int = 4) -> list[Any]:
    """Every notice of one call in world 1: each rank writes its own stream."""
    return [
        fields
        for r in range(n)
        for _, fields in conn.xrange(KEYS.step_events(1, step, op, f"w{r}"))  # type: ignore[union-attr]
    ]


def _members(n: int) -> list[StandIn]:
    return [StandIn(id=f"w{r}", rank=r, world_size=n) for r in range(n)]


def run_ranks(
    clients: Callable[[], redis.Redis],
    members: list[StandIn],
    body: Callable[[Collective, StandIn], Any],
    timeout: float = 30.0,
    **options: Any,
) -> list[Any]:
    """Run `body` once per member, each in its own thread with its own client; results or
    the exceptions raised, in rank order."""
    results: list[Any] = [None] * len(members)

    def run(i: int, collective: Collective) -> None:
        try:
            results[i] = body(collective, members[i])
        except BaseException as exc:
            results[i] = exc

    threads = [
        threading.Thread(target=run, args=(i, Collective(clients(), JOB, m, **options)))
        for i, m in enumerate(members)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a rank did not finish"
    return results


def _ok(results: list[Any]) -> list[Any]:
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def _tensors(rank: int, dtype: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(rank)
    return {
        "w": rng.standard_normal((5, 7)).astype(dtype),
        "b": rng.standard_normal(3).astype(dtype),
        "s": np.asarray(rng.standard_normal(), dtype=dtype),
        "empty": np.zeros((0, 4), dtype=dtype),
    }


def test_the_real_worker_satisfies_the_participant_protocol() -> None:
    from cohort.worker.membership.client import Worker

    worker: Participant = Worker(fakeredis.FakeRedis(), JOB, worker_id="w0")
    assert worker.id == "w0"


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("dtype,rtol", [("<f4", 1e-6), ("<f2", 1e-3), ("<f8", 1e-12)])
def test_allreduce_is_the_mean_over_ranks(
    connect_more: Callable[[], redis.Redis], n: int, dtype: str, rtol: float
) -> None:
    members = _members(n)
    results = _ok(
        run_ranks(connect_more, members, lambda c, m: c.allreduce(_tensors(m.rank, dtype), 0))
    )
    inputs = [_tensors(r, dtype) for r in range(n)]
    for got in results:
        assert set(got) == set(inputs[0])
        for name, array in got.items():
            want = np.mean([i[name].astype(np.float64) for i in inputs], axis=0)
            assert array.dtype == np.dtype(dtype) and array.shape == want.shape
            np.testing.assert_allclose(array, want, rtol=rtol, atol=rtol)


PIECE_BYTES = 64 * 1024 + 1024
"""A value cap of ~1 KiB of data beyond the blob's own: each rank's chunk travels in pieces."""


def _in_pieces(
    clients: Callable[[], redis.Redis],
    n: int,
    tensors: Callable[[int], dict[str, np.ndarray]],
    step: int,
) -> list[Any]:
    """Each of `n` ranks' allreduce of `tensors(rank)` at `step`, values capped at PIECE_BYTES."""
    return _ok(
        run_ranks(
            clients,
            _members(n),
            lambda c, m: c.allreduce(tensors(m.rank), step),
            max_value_bytes=PIECE_BYTES,
        )
    )


@pytest.mark.parametrize("n", [1, 3])
def test_allreduce_sums_int64_exactly_beside_floats_it_averages(
    connect_more: Callable[[], redis.Redis], n: int
) -> None:
    """Exact gradient sums travel as int64 (worker/pytorch/exact.py): summed, not averaged,
    to the last bit (beyond float64's 53), split over pieces like any vector."""

    def tensors(rank: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(20 + rank)
        big = rng.integers(-(2**60), 2**60, size=3001, dtype=np.int64)
        return {"q": big, "f": rng.standard_normal(50).astype("<f4")}

    results = _in_pieces(connect_more, n, tensors, 3)
    want = sum((tensors(r)["q"] for r in range(n)), np.zeros(3001, dtype=np.int64))
    for got in results:
        assert got["q"].dtype == np.int64 and np.array_equal(got["q"], want)
        means = np.mean([tensors(r)["f"].astype(np.float64) for r in range(n)], axis=0)
        np.testing.assert_allclose(got["f"], means, rtol=1e-6)


def test_allreduce_mixes_dtypes_and_splits_values_over_the_limit(
    connect_more: Callable[[], redis.Redis],
) -> None:
    """With values capped at ~1 KiB of data, each rank's chunk travels in several pieces."""
    n = 3

    def tensors(rank: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(10 + rank)
        return {
            "a": rng.standard_normal(4001).astype("<f4"),
            "h": rng.standard_normal((30, 11)).astype("<f2"),
            "d": rng.standard_normal(777),
        }

    results = _in_pieces(connect_more, n, tensors, 7)
    for got in results:
        for name in ("a", "h", "d"):
            want = np.mean([tensors(r)[name].astype(np.float64) for r in range(n)], axis=0)
            np.testing.assert_allclose(got[name], want, rtol=1e-3 if name == "h" else 1e-6)
    per_rank = pieces(-(-(4001 * 4 + 330 * 2 + 777 * 8) // n), PIECE_BYTES)
    assert per_rank > 1
    scattered = list(connect_more().scan_iter(match=f"{KEYS.prefix}:grad:1:7:0:*/w0"))
    assert len(scattered) == (n - 1) * per_rank  # rank 0's pieces of the chunks it does not own


def test_float16_transport_halves_the_bytes_and_every_rank_gets_the_same_result(
    connect_more: Callable[[], redis.Redis],
) -> None:
    n = 3

    def tensors(rank: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(20 + rank)
        return {"a": rng.standard_normal(3001).astype("<f4"), "d": rng.standard_normal(50)}

    def body(c: Collective, m: StandIn) -> Any:
        return c.allreduce(tensors(m.rank), 0, transport="float16")

    results = _ok(run_ranks(connect_more, _members(n), body))
    want = np.mean([tensors(r)["a"].astype(np.float64) for r in range(n)], axis=0)
    for got in results:
        assert got["a"].dtype == np.float32
        np.testing.assert_array_equal(got["a"], results[0]["a"])  # one answer on every rank
        np.testing.assert_allclose(got["a"], want, rtol=2e-3, atol=2e-3)
        assert not np.array_equal(got["a"], want.astype(np.float32))  # it did travel as f16
        want_d = np.mean([tensors(r)["d"] for r in range(n)], axis=0)
        np.testing.assert_allclose(got["d"], want_d, rtol=1e-12)  # float64 is untouched
    scattered = connect_more().get(KEYS.grad(1, 0, 0, 1, "w0"))
    assert scattered is not None
    assert unpack_blob(scattered)["<f4"].dtype == np.float16


def test_float16_transport_refuses_values_beyond_its_range_and_mixed_transports(
    connect_more: Callable[[], redis.Redis],
) -> None:
    big = {"x": np.full(8, 1e6, "<f4")}
    for error in run_ranks(
        connect_more, _members(2), lambda c, m: c.allreduce(big, 0, transport="float16")
    ):
        assert isinstance(error, CollectiveError) and "1e+06" in str(error)

    def mixed(c: Collective, m: StandIn) -> Any:
        transport = "float16" if m.rank else "float32"
        return c.allreduce({"x": np.ones(4, "<f4")}, 1, timeout=10, transport=transport)

    for error in run_ranks(connect_more, _members(2), mixed):
        assert isinstance(error, CollectiveError) and "transport" in str(error)
    with pytest.raises(CollectiveError, match="'bfloat16'"):
        Collective(connect_more(), JOB, _members(1)[0]).allreduce(big, 2, transport="bfloat16")  # type: ignore[arg-type]


def test_a_rank_that_never_contributes_and_a_world_change_wake_the_others_within_a_second(
    conn: redis.Redis, connect_more: Callable[[], redis.Redis]
) -> None:
    members = _members(3)
    raised_at: dict[int, float] = {}

    def body(c: Collective, m: StandIn) -> Any:
        if m.rank == 2:
            return None  # never contributes
        try:
            return c.allreduce(_tensors(m.rank, "<f4"), 4, timeout=20)
        finally:
            raised_at[m.rank] = time.monotonic()

    box: list[list[Any]] = []
    thread = threading.Thread(target=lambda: box.append(run_ranks(connect_more, members, body)))
    thread.start()
    # Both ranks have scattered (so they read the journal from before the fact) before it lands.
    wait_until(lambda: len(_notices(conn, 4, n=2)) == 2, message="ranks 0 and 1 scatter")
    fact = WorldChanged(
        at=1.0,
        job=JOB,
        version=2,
        start_step=4,
        epoch=0,
        ranks=("w0", "w1"),
        shards=(Shard(ranges=((0, 5),)), Shard(ranges=((5, 10),))),
        reason="w2 failed",
    )
    conn.xadd(KEYS.journal, {FIELD: encode(fact)})
    appended = time.monotonic()
    thread.join(30)
    results = box[0]
    for rank in (0, 1):
        error = results[rank]
        assert isinstance(error, WorldChangedError), error
        assert error.step == 4
        assert error.assignment is not None
        assert (error.assignment.world_version, error.assignment.rank) == (2, rank)
        assert raised_at[rank] - appended < 1.0


def test_a_worker_view_moving_past_the_call_s_world_aborts_it(
    connect_more: Callable[[], redis.Redis],
) -> None:
    members = _members(2)

    def body(c: Collective, m: StandIn) -> Any:
        if m.rank == 1:
            wait_until(lambda: len(_notices(c.conn, 0, n=2)) == 1, message="rank 0 scatters")
            members[0].world_version = 3  # what the worker's journal tail would do
            return time.monotonic()
        return c.allreduce({"x": np.ones(10, "<f4")}, 0, timeout=20)

    error, moved = run_ranks(connect_more, members, body)
    assert isinstance(error, WorldChangedError), error
    assert time.monotonic() - moved < 1.0 + 0.5  # WAKE_S bounds it; slack for the thread join


def test_a_timeout_names_the_ranks_that_did_not_contribute(
    connect_more: Callable[[], redis.Redis],
) -> None:
    members = _members(3)

    def body(c: Collective, m: StandIn) -> Any:
        if m.rank == 0:
            return c.allreduce({"x": np.ones(10, "<f4")}, 0, timeout=0.3)
        if m.rank == 1:
            return c.allreduce({"x": np.ones(10, "<f4")}, 0, timeout=0.6)
        return None

    error = run_ranks(connect_more, members, body)[0]
    assert isinstance(error, CollectiveTimeoutError)
    assert "[2]" in str(error) and "step 0" in str(error)


def test_a_call_id_s_errors_name_the_training_step_it_serves(
    connect_more: Callable[[], redis.Redis],
) -> None:
    """sync_gradients calls allreduce with a call id per bucket (negative); a person reading
    its timeout or world change wants step 90, not -471859201."""
    members = _members(2)
    call = calls.call_id(90, calls.GRADIENTS, 0)
    assert call == -471859201

    def body(c: Collective, m: StandIn) -> Any:
        if m.rank == 0:
            return c.allreduce({"x": np.ones(10, "<f4")}, call, timeout=0.3)
        wait_until(
            lambda: c.conn.exists(KEYS.step_events(1, call, "allreduce", "w0")),
            message="rank 0 began",
        )
        members[1].world_version = 2
        return c.allreduce({"x": np.ones(10, "<f4")}, call, timeout=5, world=1)

    timeout, moved = run_ranks(connect_more, members, body)
    assert isinstance(timeout, CollectiveTimeoutError)
    assert str(timeout).startswith("allreduce of step 90 (gradients, bucket 0) in world 1")
    assert str(call) not in str(timeout)
    assert isinstance(moved, WorldChangedError) and moved.step == 90


def test_ranks_passing_different_shapes_are_told_so(
    connect_more: Callable[[], redis.Redis],
) -> None:
    def body(c: Collective, m: StandIn) -> Any:
        return c.allreduce({"x": np.ones((2, 6) if m.rank else (3, 4), "<f4")}, 0, timeout=10)

    for error in run_ranks(connect_more, _members(2), body):
        assert isinstance(error, CollectiveError) and "layout" in str(error)


def test_keys_expire_and_only_the_last_two_steps_remain(
    conn: redis.Redis, connect_more: Callable[[], redis.Redis]
) -> None:
    def body(c: Collective, m: StandIn) -> Any:
        return [c.allreduce(_tensors(m.rank, "<f4"), step) for step in range(5)]

    _ok(run_ranks(connect_more, _members(3), body))
    keys = [k.decode() for k in conn.scan_iter(match=f"{KEYS.prefix}:grad:*", count=1000)]
    steps = {int(k.split(":")[4]) for k in keys}
    assert steps == {3, 4}
    assert all(0 < int(conn.pttl(k)) <= 10 * 60 * 1000 for k in keys)


def test_broadcast_gives_every_rank_the_root_s_tensors(
    conn: redis.Redis, connect_more: Callable[[], redis.Redis]
) -> None:
    rng = np.random.default_rng(3)
    sent = {f"t{i}": rng.standard_normal(3000).astype("<f4") for i in range(5)}
    sent["ids"] = np.arange(7, dtype="<i8")

    def body(c: Collective, m: StandIn) -> Any:
        return c.broadcast(sent if m.rank == 1 else None, root=1, step=2)

    results = _ok(run_ranks(connect_more, _members(3), body, max_value_bytes=64 * 1024 + 13_000))
    for got in results:
        assert set(got) == set(sent)
        for name, array in sent.items():
            np.testing.assert_array_equal(got[name], array)
    notices = _notices(conn, 2, "broadcast", n=3)
    assert [int(f[b"n"]) for f in notices if f[b"p"] == b"sent"] == [5]  # 5 values, each < limit
    assert not conn.exists(KEYS.grad_broadcast(1, 2, 0, "w1"))  # the root unlinks once all received


def test_barrier_waits_for_every_rank(connect_more: Callable[[], redis.Redis]) -> None:
    passed: list[int] = []
    gate = threading.Event()

    def body(c: Collective, m: StandIn) -> Any:
        if m.rank == 2:
            gate.wait(10)  # the last rank arrives only after the test checked nobody passed
        c.barrier(0, timeout=10)
        passed.append(m.rank)

    thread = threading.Thread(target=lambda: run_ranks(connect_more, _members(3), body))
    thread.start()
    probe = connect_more()
    wait_until(lambda: len(_notices(probe, 0, "barrier", n=3)) == 2)
    assert passed == []
    gate.set()
    thread.join(30)
    assert sorted(passed) == [0, 1, 2]


def test_sets_bypass_the_joining_packer_only_on_a_real_server(conn: redis.Redis) -> None:
    c = Collective(conn, JOB, StandIn(id="w0", rank=0, world_size=1))
    assert c.wire.fast_set is not isinstance(conn, fakeredis.FakeRedis)


def test_a_call_prepared_for_an_older_world_is_refused_before_it_writes(conn: redis.Redis) -> None:
    member = StandIn(id="w0", rank=0, world_size=2, world_version=4)
    collective = Collective(conn, JOB, member)
    with pytest.raises(WorldChangedError):
        collective.allreduce({"x": np.ones(4, "<f4")}, 7, world=3)
    with pytest.raises(WorldChangedError):
        collective.broadcast({"x": np.ones(4, "<f4")}, root=0, step=7, world=3)
    assert conn.keys(f"{KEYS.prefix}:*") == []


def _world_changed(version: int, ranks: tuple[str, ...], start_step: int) -> WorldChanged:
    shards = tuple(Shard(ranges=((r * 5, r * 5 + 5),)) for r in range(len(ranks)))
    return WorldChanged(
        at=1.0,
        job=JOB,
        version=version,
        start_step=start_step,
        epoch=0,
        ranks=ranks,
        shards=shards,
        reason="w2 failed",
    )


@pytest.mark.parametrize("moved_on", [True, False])
def test_a_blob_found_gone_is_a_world_change_when_the_journal_moved_on_unseen(
    conn: redis.Redis, moved_on: bool
) -> None:
    """A rank cut off from Redis mid-call comes back to find its peers' blobs gone: the job
    failed it meanwhile and the survivors went on. What it has to learn is that (it is out
    of the world), read from the journal it missed, not that Redis lost a blob."""
    member = StandIn(id="w2", rank=2, world_size=3)
    collective = Collective(conn, JOB, member)
    call = collective.begin_in(collective.world(), "allreduce", 11, timeout=5)
    if moved_on:
        conn.xadd(KEYS.journal, {FIELD: encode(_world_changed(2, ("w0", "w1"), 11))})
    gone = [call.part_key(0, 0, ())]
    expected = WorldChangedError if moved_on else CollectiveError
    with pytest.raises(expected) as raised:
        list(collective._fetch(call, gone, 1024))
    if moved_on:
        assert isinstance(raised.value, WorldChangedError) and raised.value.assignment is None
    else:
        assert "is gone (expired or deleted)" in str(raised.value)


@pytest.mark.parametrize("fetch_bytes, trips", [(32 * 1024 * 1024, [3]), (1, [1, 1, 1])])
def test_chunks_of_ranks_already_there_come_in_one_round_trip_up_to_fetch_bytes(
    connect_more: Callable[[], redis.Redis],
    monkeypatch: pytest.MonkeyPatch,
    fetch_bytes: int,
    trips: list[int],
) -> None:
    """Rank 0 arrives last: the other three ranks' chunks of the part it owns are all stored,
    so it reads them in as few GETs round trips as FETCH_BYTES allows, and still sums right."""
    monkeypatch.setattr(wire_module, "FETCH_BYTES", fetch_bytes)
    fetched: list[int] = []
    rank_0: list[Wire] = []  # the wire of rank 0, whose trips are counted
    get_all = Wire._get_all

    def counted(self: Wire, keys: list[str]) -> list[Any]:
        if self in rank_0:
            fetched.append(len(keys))
        return get_all(self, keys)

    monkeypatch.setattr(Wire, "_get_all", counted)
    probe = connect_more()

    def body(c: Collective, m: StandIn) -> Any:
        if m.rank == 0:
            rank_0.append(c.wire)
            wait_until(
                lambda: sum(f[b"p"] == b"scatter" for f in _notices(probe, 3)) == 3,
                10,
                0.01,
                "the other ranks scattered",
            )
        return c.allreduce(_tensors(m.rank, "<f4"), 3)

    results = _ok(run_ranks(connect_more, _members(4), body))
    assert fetched[: len(trips)] == trips
    want = np.mean([_tensors(r, "<f4")["w"].astype(np.float64) for r in range(4)], axis=0)
    for got in results:
        np.testing.assert_allclose(got["w"], want, rtol=1e-6)


def test_large_shares_are_scattered_owner_by_owner_each_notified_as_its_chunks_land(
    connect_more: Callable[[], redis.Redis],
) -> None:
    """4 ranks, 4 MiB each (1 MiB per owner): every rank notifies each owner on its own,
    from the next rank on (so owners read while the others still write), and the mean is
    exact. Below STAGGER_BYTES one notice covers every owner, as before."""
    probe = connect_more()
    big = [{"g": np.random.default_rng(r).standard_normal(2**20).astype("<f4")} for r in range(4)]
    results = _ok(run_ranks(connect_more, _members(4), lambda c, m: c.allreduce(big[m.rank], 5)))
    want = np.mean([b["g"].astype(np.float64) for b in big], axis=0)
    for got in results:
        np.testing.assert_allclose(got["g"], want, rtol=1e-6, atol=1e-7)
    for r in range(4):
        stream = KEYS.step_events(1, 5, "allreduce", f"w{r}")
        phases = [f[b"p"].decode() for _, f in probe.xrange(stream)]  # type: ignore[union-attr]
        scatters = [p for p in phases if p.startswith("scatter")]
        assert scatters == [f"scatter/{(r + k) % 4}" for k in (1, 2, 3)], phases

    _ok(run_ranks(connect_more, _members(4), lambda c, m: c.allreduce(_tensors(m.rank, "<f4"), 6)))
    small = [f[b"p"] for f in _notices(probe, 6)]
    assert small.count(b"scatter") == 4 and not any(p.startswith(b"scatter/") for p in small)


def test_broadcast_receivers_get_every_piece_in_one_round_trip(
    connect_more: Callable[[], redis.Redis], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The root's notice names all its pieces, so a receiver pipelines their GETs."""
    trips: dict[Wire, list[int]] = {}
    get_all = Wire._get_all

    def counted(self: Wire, keys: list[str]) -> list[Any]:
        trips.setdefault(self, []).append(len(keys))
        return get_all(self, keys)

    monkeypatch.setattr(Wire, "_get_all", counted)
    rng = np.random.default_rng(4)
    sent = {f"t{i}": rng.standard_normal(3000).astype("<f4") for i in range(5)}

    def body(c: Collective, m: StandIn) -> Any:
        return c.broadcast(sent if m.rank == 0 else None, root=0, step=5)

    results = _ok(run_ranks(connect_more, _members(3), body, max_value_bytes=64 * 1024 + 13_000))
    assert sorted(trips.values()) == [[5], [5]]  # two receivers, one trip of 5 pieces each
    for got in results:
        for name, array in sent.items():
            np.testing.assert_array_equal(got[name], array)
