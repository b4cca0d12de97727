"""torch's `Store` contract, kept by cohort's `RedisStore` as by torch's own `TCPStore`.

Every case runs on a TCPStore (the reference: the store torchrun's c10d backend uses) and
on a RedisStore on fakeredis and on a real redis-server, each called directly and through
the `PrefixStore` torch wraps around every store it hands out; the assertions are the same
for all, so they say what the contract is, not what one store happens to do.

torch's C++ `PrefixStore` passes `list_keys` and the queue calls on only to stores written
in C++ (torch 2.13): those cases run wherever torch reaches the store, and one test pins
the gap, so a torch that closes it tells us.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, Protocol

import pytest
import redis

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

from cohort.worker.pytorch.torchrun.c10d_store import RedisStore  # noqa: E402

JOB = "c10d"
PREFIX = f"torch.rendezvous.{JOB}.3"
TIMEOUT = timedelta(seconds=10)
"""The stores' timeout where a case does not test one: a failing case ends, a passing
case never waits for it."""
SHORT = timedelta(milliseconds=200)
"""The timeout a case waits out on purpose."""
REAL = pytest.mark.redis_server

Combo = tuple[str, str]
"""(backend, via): "tcp", "fakeredis" or "redis-server"; "direct" or "prefixed"."""


class TorchStore(Protocol):
    """torch's `Store` as it is at run time (torch 2.13's type stubs leave out append,
    multi_set, clone, barrier, has_extended_api and timeout, and take values as str only)."""

    @property
    def timeout(self) -> timedelta: ...
    def set_timeout(self, timeout: timedelta) -> None: ...
    def set(self, key: str, value: str | bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def add(self, key: str, amount: int) -> int: ...
    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes: ...
    def append(self, key: str, value: str | bytes) -> None: ...
    def multi_get(self, keys: list[str]) -> list[bytes]: ...
    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None: ...
    def wait(self, keys: list[str], timeout: timedelta = ...) -> None: ...
    def check(self, keys: list[str]) -> bool: ...
    def num_keys(self) -> int: ...
    def delete_key(self, key: str) -> bool: ...
    def list_keys(self) -> list[str]: ...
    def queue_push(self, key: str, value: str | bytes) -> None: ...
    def queue_pop(self, key: str, block: bool = True) -> bytes: ...
    def queue_len(self, key: str) -> int: ...
    def clone(self) -> TorchStore: ...
    def has_extended_api(self) -> bool: ...
    def barrier(self, key: str, world_size: int, timeout: timedelta | None = None) -> None: ...


def _combos(*, python_prefixed: bool) -> list[Any]:
    combos = []
    for backend in ("tcp", "fakeredis", "redis-server"):
        for via in ("direct", "prefixed"):
            if via == "prefixed" and backend != "tcp" and not python_prefixed:
                continue
            marks = [REAL] if backend == "redis-server" else []
            combos.append(pytest.param((backend, via), marks=marks, id=f"{backend}-{via}"))
    return combos


def _base(request: pytest.FixtureRequest, backend: str) -> Any:
    """A fresh, empty store of `backend`."""
    if backend == "tcp":
        return dist.TCPStore("127.0.0.1", 0, 1, True, TIMEOUT, wait_for_workers=False)
    conn: redis.Redis = request.getfixturevalue(
        "fake_conn" if backend == "fakeredis" else "real_conn"
    )
    return RedisStore(conn, JOB, timeout=TIMEOUT)


@pytest.fixture
def made() -> Iterator[list[Any]]:
    """The stores a case made, kept alive until it ends (torch keeps only a Python store's
    C++ half: the Python half must outlive every call torch makes on it)."""
    stores: list[Any] = []
    yield stores
    stores.clear()


def behind_prefix(store: Any, prefix: str = PREFIX) -> Any:
    """`store` behind torch's PrefixStore, as torch hands a store out."""
    return dist.PrefixStore(prefix, store)


def _store(request: pytest.FixtureRequest, made: list[Any], combo: Combo) -> TorchStore:
    backend, via = combo
    base = _base(request, backend)
    made.append(base)
    return base if via == "direct" else behind_prefix(base)


@pytest.fixture(params=_combos(python_prefixed=True))
def store(request: pytest.FixtureRequest, made: list[Any]) -> TorchStore:
    """Every store, as torch may hand it out."""
    return _store(request, made, request.param)


@pytest.fixture(params=_combos(python_prefixed=False))
def listing_store(request: pytest.FixtureRequest, made: list[Any]) -> TorchStore:
    """Every store where torch passes `list_keys` and the queue calls on to it."""
    return _store(request, made, request.param)


def in_thread(call: Callable[[], Any]) -> tuple[threading.Event, list[Any]]:
    """Run `call` in a thread; the event is set once it returned or raised (in the list)."""
    done, result = threading.Event(), []

    def run() -> None:
        try:
            result.append(call())
        except Exception as exc:  # handed to the test, which asserts on it
            result.append(exc)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return done, result


def still_blocked(done: threading.Event) -> bool:
    """True if the call has not returned a moment after it started (nothing was written)."""
    return not done.wait(0.1)


def timed_out(call: Callable[[], Any], timeout: timedelta) -> pytest.ExceptionInfo[Any]:
    """Assert `call` raises DistStoreError as a timeout of `timeout` does, and when."""
    started = time.monotonic()
    ms = int(timeout.total_seconds() * 1000)
    with pytest.raises(dist.DistStoreError, match=f"wait timeout after {ms}ms") as info:
        call()
    elapsed = time.monotonic() - started
    assert timeout.total_seconds() * 0.9 <= elapsed < timeout.total_seconds() + 2
    return info


# ---------------------------------------------------------------- set, get, wait, check


def test_set_then_get_returns_the_bytes_last_set(store: TorchStore) -> None:
    store.set("text", "value")
    store.set("raw", bytes(range(256)))
    store.set("empty", "")
    assert store.get("text") == b"value"
    assert store.get("raw") == bytes(range(256))
    assert store.get("empty") == b""
    store.set("text", b"again")
    assert store.get("text") == b"again"


def test_get_waits_for_a_key_written_later(store: TorchStore) -> None:
    reader = store.clone()  # one store per thread, as torch's clone is meant
    done, got = in_thread(lambda: reader.get("late"))
    assert still_blocked(done)
    store.set("late", "here")
    assert done.wait(5) and got == [b"here"]


def test_get_of_a_missing_key_times_out_after_the_stores_timeout(store: TorchStore) -> None:
    store.set_timeout(SHORT)
    timed_out(lambda: store.get("never-set"), SHORT)


def test_wait_without_timeout_waits_out_the_stores_timeout(store: TorchStore) -> None:
    store.set_timeout(SHORT)
    timed_out(lambda: store.wait(["never-set"]), SHORT)


def test_wait_with_a_timeout_waits_out_that_one(store: TorchStore) -> None:
    wait = timedelta(milliseconds=300)
    timed_out(lambda: store.wait(["never-set"], wait), wait)


def test_wait_returns_once_every_key_exists(store: TorchStore) -> None:
    store.wait([])  # nothing to wait for
    store.set("first", "1")
    waiter = store.clone()
    done, got = in_thread(lambda: waiter.wait(["first", "second"], TIMEOUT))
    assert still_blocked(done)
    store.add("second", 1)
    assert done.wait(5) and got == [None]


def test_check_says_whether_every_key_exists_without_waiting(store: TorchStore) -> None:
    assert store.check([])
    assert not store.check(["a"])
    store.set("a", "")
    assert store.check(["a"])
    assert not store.check(["a", "b"])


# ---------------------------------------------------------------- add, compare_set, append


def test_add_counts_from_zero_and_get_reads_the_count(store: TorchStore) -> None:
    assert [store.add("n", 1), store.add("n", 5), store.add("n", -2)] == [1, 6, 4]
    assert store.get("n") == b"4"
    assert store.add("zero", 0) == 0 and store.check(["zero"])
    store.set("set", "41")
    assert store.add("set", 1) == 42  # a number set as text counts on


def test_compare_set_swaps_only_on_the_expected_value(store: TorchStore) -> None:
    assert store.compare_set("k", "", "first") == b"first"  # missing, expected empty: set
    assert store.compare_set("k", "wrong", "second") == b"first"  # mismatch: the current
    assert store.compare_set("k", "", "second") == b"first"  # present: '' matches nothing
    assert store.compare_set("k", "first", "second") == b"second"  # match: swapped
    assert store.get("k") == b"second"
    assert store.compare_set("absent", "hoped", "x") == b"hoped"  # missing: the expected
    assert not store.check(["absent"])


def test_append_creates_then_extends(store: TorchStore) -> None:
    store.append("log", "po")
    store.append("log", b"tato")
    assert store.get("log") == b"potato"


# ---------------------------------------------------------------- multi_get, multi_set


def test_multi_set_then_multi_get_in_the_order_asked(store: TorchStore) -> None:
    store.multi_set(["a", "b"], ["1", b"2"])
    store.multi_set([], [])
    assert store.multi_get(["b", "a"]) == [b"2", b"1"]
    assert store.multi_get([]) == []


def test_multi_get_waits_for_every_key_then_times_out(store: TorchStore) -> None:
    store.set("a", "1")
    reader = store.clone()
    done, got = in_thread(lambda: reader.multi_get(["a", "late"]))
    assert still_blocked(done)
    store.set("late", "2")
    assert done.wait(5) and got == [[b"1", b"2"]]
    store.set_timeout(SHORT)
    timed_out(lambda: store.multi_get(["a", "never-set"]), SHORT)


# ---------------------------------------------------------------- num_keys, delete_key


def test_num_keys_counts_the_keys_written(store: TorchStore) -> None:
    assert store.num_keys() == 0
    store.set("a", "1")
    store.add("n", 1)
    store.append("log", "x")
    store.set("a", "2")  # the same key again
    assert store.num_keys() == 3


def test_through_a_prefix_num_keys_counts_the_whole_store(
    request: pytest.FixtureRequest, made: list[Any]
) -> None:
    for backend in ("tcp", "fakeredis"):
        base = _base(request, backend)
        made.append(base)
        base.set("outside", "x")
        prefixed = behind_prefix(base)
        prefixed.set("inside", "y")
        assert (base.num_keys(), prefixed.num_keys()) == (2, 2), backend


def test_delete_key_says_whether_it_deleted(store: TorchStore) -> None:
    store.set("a", "1")
    store.set("b", "2")
    assert store.delete_key("a") is True
    assert store.delete_key("a") is False
    assert store.delete_key("never-set") is False
    assert not store.check(["a"]) and store.check(["b"])
    assert store.num_keys() == 1


# ---------------------------------------------------------------- list_keys


def test_list_keys_lists_every_key_written_but_no_queue(listing_store: TorchStore) -> None:
    store = listing_store
    assert store.list_keys() == []
    store.set("b", "1")
    store.add("a", 1)
    store.append("c", "x")
    store.queue_push("q", "v")
    assert sorted(store.list_keys()) == ["a", "b", "c"]
    store.delete_key("b")
    assert sorted(store.list_keys()) == ["a", "c"]


def test_list_keys_names_keys_in_full_across_groups(
    request: pytest.FixtureRequest, made: list[Any]
) -> None:
    for backend in ("tcp", "fakeredis"):
        base = _base(request, backend)
        made.append(base)
        base.set("plain", "1")
        base.set("g/k", "2")
        behind_prefix(base).set("k", "3")
        assert sorted(base.list_keys()) == sorted(["plain", "g/k", f"{PREFIX}/k"]), backend


# ---------------------------------------------------------------- queues


def test_a_queue_pops_in_the_order_pushed(listing_store: TorchStore) -> None:
    store = listing_store
    assert store.queue_len("q") == 0
    store.queue_push("q", "a")
    store.queue_push("q", b"b")
    assert store.queue_len("q") == 2
    assert [store.queue_pop("q"), store.queue_pop("q", False)] == [b"a", b"b"]
    assert store.queue_len("q") == 0


def test_a_non_blocking_pop_of_an_empty_queue_raises_queue_empty(
    listing_store: TorchStore,
) -> None:
    with pytest.raises(dist.QueueEmptyError):
        listing_store.queue_pop("q", block=False)


def test_a_blocking_pop_waits_for_a_push(listing_store: TorchStore) -> None:
    popper = listing_store.clone()
    done, got = in_thread(lambda: popper.queue_pop("q"))
    assert still_blocked(done)
    listing_store.queue_push("q", "late")
    assert done.wait(5) and got == [b"late"]
    assert listing_store.queue_len("q") == 0


def test_a_blocking_pop_of_an_empty_queue_times_out(listing_store: TorchStore) -> None:
    listing_store.set_timeout(SHORT)
    info = timed_out(lambda: listing_store.queue_pop("q"), SHORT)
    assert not isinstance(info.value, dist.QueueEmptyError)


def test_check_and_wait_see_a_queue_with_values_without_popping(
    listing_store: TorchStore,
) -> None:
    store = listing_store
    assert not store.check(["q"])
    waiter = store.clone()
    done, got = in_thread(lambda: waiter.wait(["q"], TIMEOUT))
    assert still_blocked(done)
    store.queue_push("q", "v")
    assert done.wait(5) and got == [None]
    assert store.check(["q"]) and store.queue_len("q") == 1
    store.queue_pop("q")
    assert not store.check(["q"])


def test_queues_are_apart_from_keys(listing_store: TorchStore) -> None:
    store = listing_store
    store.set("k", "value")
    store.queue_push("k", "queued")
    assert store.get("k") == b"value" and store.queue_len("k") == 1
    assert store.num_keys() == 1
    assert store.delete_key("k") is True and store.queue_len("k") == 1
    assert store.queue_pop("k") == b"queued"


def test_torchs_prefix_store_passes_no_list_keys_or_queue_call_to_a_python_store(
    conn: redis.Redis,
) -> None:
    base = RedisStore(conn, JOB, timeout=TIMEOUT)
    prefixed = behind_prefix(base)
    for call in (
        prefixed.list_keys,
        lambda: prefixed.queue_push("q", "v"),
        lambda: prefixed.queue_pop("q", False),
        lambda: prefixed.queue_len("q"),
    ):
        with pytest.raises(NotImplementedError):
            call()
    base.queue_push(f"{PREFIX}/q", "v")  # the store itself has them
    assert base.queue_len(f"{PREFIX}/q") == 1 and base.list_keys() == []


# ---------------------------------------------------------------- clone, timeout, api


def test_a_clone_shares_the_keys_and_the_timeout(store: TorchStore) -> None:
    store.set_timeout(timedelta(seconds=7))
    clone = store.clone()
    assert clone.timeout == timedelta(seconds=7)
    clone.set("from-clone", "1")
    store.set("from-original", "2")
    assert store.get("from-clone") == b"1" and clone.get("from-original") == b"2"
    clone.set_timeout(timedelta(seconds=3))
    assert (clone.timeout, store.timeout) == (timedelta(seconds=3), timedelta(seconds=7))


def test_a_clone_works_after_its_python_reference_is_gone(store: TorchStore) -> None:
    clone = store.clone()
    survivor = behind_prefix(clone, "p")  # torch keeps only this
    del clone
    gc.collect()
    survivor.set("k", "v")
    assert survivor.get("k") == b"v" and store.get("p/k") == b"v"


def test_set_timeout_sets_the_timeout_also_through_a_prefix(
    request: pytest.FixtureRequest, made: list[Any]
) -> None:
    for backend in ("tcp", "fakeredis"):
        base = _base(request, backend)
        made.append(base)
        assert base.timeout == TIMEOUT
        prefixed = behind_prefix(base)
        prefixed.set_timeout(timedelta(seconds=7))
        assert (prefixed.timeout, base.timeout) == (timedelta(seconds=7),) * 2, backend


def test_the_extended_api_is_the_stores_own(store: TorchStore) -> None:
    assert store.has_extended_api() is True


def test_a_barrier_returns_once_every_member_arrived(store: TorchStore) -> None:
    store.barrier("alone", 1)
    peer = store.clone()
    done, got = in_thread(lambda: peer.barrier("pair", 2))
    assert still_blocked(done)
    store.barrier("pair", 2)
    assert done.wait(5) and got == [None]


# ---------------------------------------------------------------- torch's own harness


def test_torchs_python_store_harness_passes(conn: redis.Redis) -> None:
    base = RedisStore(conn, JOB, timeout=TIMEOUT)
    dist._test_python_store(base)  # from C++: clone, then set/get/add on the clone
    assert base.get("key") == b"6"
