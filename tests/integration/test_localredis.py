"""LocalRedis runs real redis-server processes: they start, persist, crash and go away cleanly."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest

import cohort.localredis as localredis
from cohort.localredis import LocalRedis, LocalRedisError
from tests.helpers import require_redis_server


@pytest.fixture
def binary() -> str:
    return require_redis_server()


def process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.redis_server
def test_stop_leaves_no_process_and_no_temp_dir(binary: str) -> None:
    with LocalRedis(binary=binary) as server:
        assert server.process is not None and server.dir is not None
        pid, directory = server.process.pid, server.dir
        assert server.alive()
        with server.client() as client:
            assert client.ping()

    assert not server.alive()
    assert process_gone(pid)
    assert not directory.exists()


@pytest.mark.redis_server
def test_keep_leaves_the_dir_for_inspection(binary: str) -> None:
    server = LocalRedis(binary=binary, keep=True)
    with server:
        directory = server.dir
    try:
        assert directory is not None and (directory / "redis.log").exists()
    finally:
        if directory is not None:
            localredis.shutil.rmtree(directory)


@pytest.mark.redis_server
def test_restart_reloads_the_aof_on_the_same_port(binary: str) -> None:
    with LocalRedis(binary=binary, appendfsync="always") as server:
        port = server.port
        with server.client() as client:
            client.set("k", b"v")
            client.xadd("s", {"e": b"fact"})

        server.restart()

        assert server.port == port
        with server.client() as client:
            assert client.get("k") == b"v"
            assert client.xlen("s") == 1


@pytest.mark.redis_server
def test_kill_keeps_the_dir_and_restart_recovers_the_data(binary: str) -> None:
    with LocalRedis(binary=binary, appendfsync="always") as server:
        assert server.process is not None
        with server.client() as client:
            client.set("k", b"v")
        pid = server.process.pid

        server.kill()

        assert not server.alive()
        assert process_gone(pid)
        assert server.dir is not None and server.dir.exists()
        server.restart()
        with server.client() as client:
            assert client.get("k") == b"v"


@pytest.mark.redis_server
def test_two_servers_at_once_get_different_ports_and_dirs(binary: str) -> None:
    with LocalRedis(binary=binary) as one, LocalRedis(binary=binary) as two:
        assert one.port != two.port
        assert one.dir != two.dir
        with one.client() as a, two.client() as b:
            a.set("who", b"one")
            assert b.get("who") is None


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


@pytest.mark.redis_server
def test_a_port_taken_before_redis_binds_it_is_retried(
    binary: str, busy_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    ports = iter([busy_port, localredis.free_port()])
    monkeypatch.setattr(localredis, "free_port", lambda: next(ports))

    with LocalRedis(binary=binary) as server:
        assert server.port != busy_port
        with server.client() as client:
            assert client.ping()


@pytest.mark.redis_server
def test_a_server_that_cannot_start_raises_with_its_log(binary: str) -> None:
    server = LocalRedis(binary=binary, extra_args=["--no-such-directive", "yes"])

    with pytest.raises(LocalRedisError, match="no-such-directive"):
        server.start()

    assert server.dir is not None and not server.dir.exists()


def test_without_a_binary_the_embedded_fallback_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(localredis.BINARY_ENV, "/nonexistent/redis-server")

    with pytest.raises(LocalRedisError, match="no redis-server binary"):
        LocalRedis().start()
    with LocalRedis(embedded_ok=True) as server:
        assert server.embedded
        with server.client() as client:
            client.set("k", b"v")
        server.restart()
        with server.client() as client:
            assert client.get("k") == b"v"
    assert not server.alive()
