"""Presence on Redis: a worker's subscription to its channel lives as long as its process,
comes back on its own after a dropped connection, and the leader counts it on the server
that owns the job's slot (docs/design.md "Membership")."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

import pytest
import redis

from cohort.coordinator.joblog import Durability, RedisJobLog
from cohort.events.keys import Keys
from cohort.localredis import LocalRedis
from cohort.worker.membership.presence import PresenceThread
from tests.helpers import wait_until

JOB = "presence"
log = logging.getLogger("test")


def held(conn: redis.Redis, worker: str) -> Iterator[PresenceThread]:
    stop = threading.Event()
    presence = PresenceThread(conn, Keys(JOB).presence(worker), stop, log)
    thread = threading.Thread(target=presence.run, daemon=True)
    thread.start()
    try:
        yield presence
    finally:
        stop.set()
        thread.join(5)
        assert not thread.is_alive(), "the presence thread did not stop"


def counts(conn: redis.Redis, *workers: str) -> dict[str, int]:
    return RedisJobLog(conn, JOB, Durability()).connected(list(workers))[1]


def test_a_held_subscription_is_counted(
    conn: redis.Redis, connect_more: Callable[[], redis.Redis]
) -> None:
    holder = held(connect_more(), "w1")
    presence = next(holder)
    assert presence.subscribed.wait(5)
    assert counts(conn, "w1", "w2") == {"w1": 1, "w2": 0}
    next(holder, None)


@pytest.mark.redis_server
def test_a_subscription_is_gone_once_its_holder_stops(
    real_conn: redis.Redis, redis_server: LocalRedis
) -> None:
    """(fakeredis keeps a closed connection's sharded subscriptions: on the embedded server a
    dead worker is found by its silence alone, never failed early by mistake.)"""
    holder = held(redis.Redis.from_url(redis_server.url), "w1")
    assert next(holder).subscribed.wait(5)
    next(holder, None)  # stops it
    wait_until(lambda: counts(real_conn, "w1") == {"w1": 0}, 5, 0.01, "the subscription to go")


@pytest.mark.redis_server
def test_the_server_s_id_comes_with_the_counts(real_conn: redis.Redis) -> None:
    server, found = RedisJobLog(real_conn, JOB, Durability()).connected([])
    assert server == str(real_conn.info("server")["run_id"]) and found == {}


@pytest.mark.redis_server
def test_a_dropped_connection_is_taken_up_again_at_once(
    real_conn: redis.Redis, redis_server: LocalRedis
) -> None:
    """CLIENT KILL is what Redis sees of a blip: the thread subscribes again by itself."""
    conn = real_conn
    holder = held(redis.Redis.from_url(redis_server.url), "w1")
    presence = next(holder)
    assert presence.subscribed.wait(5)
    killed = conn.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
    assert killed >= 1
    wait_until(lambda: counts(conn, "w1") == {"w1": 1}, 5, 0.01, "the subscription to come back")
    assert presence.refused is None
    next(holder, None)


@pytest.mark.redis_server
def test_a_restarted_server_answers_with_another_id_and_the_worker_subscribes_again() -> None:
    with LocalRedis(appendonly=True) as server:
        conn = redis.Redis.from_url(server.url)
        worker_conn = redis.Redis.from_url(server.url)
        holder = held(worker_conn, "w1")
        presence = next(holder)
        assert presence.subscribed.wait(5)
        before, _ = RedisJobLog(conn, JOB, Durability()).connected(["w1"])
        server.restart()
        wait_until(lambda: counts(conn, "w1") == {"w1": 1}, 30, 0.05, "the worker to come back")
        after, _ = RedisJobLog(conn, JOB, Durability()).connected(["w1"])
        assert before and after and before != after
        next(holder, None)


@pytest.mark.redis_server
def test_a_user_without_channel_access_is_told_and_the_thread_waits_to_ask_again(
    real_conn: redis.Redis, redis_server: LocalRedis
) -> None:
    conn = real_conn
    conn.execute_command(
        "ACL", "SETUSER", "nochannels", "on", ">pw", "resetchannels", "+@all", "~*"
    )
    try:
        limited = redis.Redis.from_url(
            redis_server.url.replace("redis://", "redis://nochannels:pw@")
        )
        holder = held(limited, "w1")
        presence = next(holder)
        wait_until(lambda: presence.refused is not None, 5, 0.01, "the refusal")
        assert "no permissions" in str(presence.refused) and not presence.subscribed.is_set()
        next(holder, None)  # it waits to ask again, and stops when told
    finally:
        conn.execute_command("ACL", "DELUSER", "nochannels")
