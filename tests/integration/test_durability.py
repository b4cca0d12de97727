"""What an acknowledged fact survives, and the coordinator's refusal to lead on volatile Redis."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cohort.coordinator.election import FencedJournal, RedisLease, load_library
from cohort.events.codec import encode
from cohort.events.keys import Keys
from cohort.events.models import WorkerJoined
from cohort.localredis import LocalRedis
from tests.helpers import require_redis_server

pytestmark = [pytest.mark.redis_server, pytest.mark.slow]


@pytest.mark.parametrize("fsync", ["everysec", "always"])
def test_acknowledged_facts_survive_a_redis_sigkill_and_restart(fsync: str) -> None:
    keys = Keys("durable")
    with LocalRedis(appendonly=True, appendfsync=fsync, binary=require_redis_server()) as server:
        conn = server.client()
        load_library(conn)
        token = RedisLease(conn, keys, 60_000).acquire("n")
        assert token is not None
        store, last, acknowledged = FencedJournal(conn, keys), "0-0", []
        for n in range(500):
            fact = WorkerJoined(at=float(n), job="durable", worker=f"w{n}")
            ids = store.append(token, last, [encode(fact)], cursor=f"{n + 1}-0")
            last = ids[-1]
            acknowledged.append(last)
        server.kill()  # SIGKILL: no shutdown, no final fsync
        server.restart()
        conn = server.client()
        stored = [i.decode() for i, _ in conn.xrange(keys.journal)]
        assert stored == acknowledged
        assert conn.get(keys.cursor) == b"500-0"
        assert conn.fcall("cohort_version", 0) is not None  # functions are in the AOF too


def cohort(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cohort", *args], capture_output=True, text=True, timeout=60
    )


def test_coordinator_refuses_redis_without_aof_unless_allowed(tmp_path: Path) -> None:
    with LocalRedis(appendonly=False, binary=require_redis_server()) as server:
        refused = cohort("--redis-url", server.url, "coordinator", "--job", "j")
        assert refused.returncode == 4
        assert "appendonly no" in refused.stderr and "--allow-volatile" in refused.stderr
        assert "Traceback" not in refused.stderr
        allowed = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cohort",
                "--redis-url",
                server.url,
                "coordinator",
                "--job",
                "j",
                "--allow-volatile",
            ],
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            line = ""
            while "leads job" not in line:
                line = allowed.stderr.readline()  # type: ignore[union-attr]
                assert line, "the coordinator exited instead of leading"
        finally:
            allowed.terminate()
            allowed.wait(10)


def test_coordinator_refuses_a_redis_that_evicts_unless_allowed() -> None:
    evicting = ("--maxmemory-policy", "allkeys-lru")
    with LocalRedis(appendonly=True, extra_args=evicting, binary=require_redis_server()) as server:
        refused = cohort(
            "--redis-url", server.url, "coordinator", "--job", "j", "--dataset-size", "64"
        )
        assert refused.returncode == 4, refused.stderr
        assert "maxmemory-policy allkeys-lru" in refused.stderr
        assert "noeviction" in refused.stderr and "--allow-eviction" in refused.stderr
        assert "Traceback" not in refused.stderr
        assert not server.client().exists("cohort:{j}:journal"), "it led before refusing"
        allowed = subprocess.Popen(
            [
                sys.executable, "-m", "cohort", "--redis-url", server.url, "coordinator",
                "--job", "j", "--dataset-size", "64", "--allow-eviction",
            ],
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        try:
            seen = []
            while not seen or "leads job" not in seen[-1]:
                seen.append(allowed.stderr.readline())  # type: ignore[union-attr]
                assert seen[-1], "the coordinator exited instead of leading"
            assert any("--allow-eviction" in s and "allkeys-lru" in s for s in seen), seen
        finally:
            allowed.terminate()
            allowed.wait(10)
