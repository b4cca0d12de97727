"""A throwaway redis-server on a free port in a fresh temp dir, for `cohort demo` and tests.

Real processes, real signals: stop() sends SIGTERM (then SIGKILL), kill() simulates a
crash, restart() reuses the port and dir so the AOF is reloaded. Without a redis-server
binary, `embedded_ok=True` falls back to fakeredis's TCP server in a thread and says so
through `.embedded`.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import redis

from cohort import processes
from cohort.errors import CohortError
from cohort.events.connection import Client, RedisSettings, connect, text

BINARY_ENV = "COHORT_REDIS_SERVER"
HOST = "127.0.0.1"
_POLL = 0.02


class LocalRedisError(CohortError):
    """The local server could not be started or stopped; the message carries its log tail."""


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for a TLS-only server: its certificate and key, the CA it trusts for client
    certificates, and the client certificate `client()` and the readiness probe present."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path | None = None
    client_key: Path | None = None
    auth_clients: bool = True

    def settings(self, url: str, **kw: Any) -> RedisSettings:
        """Settings for a client of this server that trusts `ca` and shows the client cert."""
        return RedisSettings(
            url=url,
            tls_ca=str(self.ca),
            tls_cert=str(self.client_cert) if self.client_cert else None,
            tls_key=str(self.client_key) if self.client_key else None,
            **kw,
        )


def find_redis_server() -> str | None:
    """The redis-server binary: $COHORT_REDIS_SERVER if set, else the first on PATH."""
    chosen = os.environ.get(BINARY_ENV)
    if chosen:
        return chosen if os.access(chosen, os.X_OK) else None
    return shutil.which("redis-server")


def free_port() -> int:
    """A port the OS just called free. Another process may still take it first: callers retry."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


class LocalRedis:
    """A private Redis server: use as a context manager, or call start() and stop()."""

    def __init__(
        self,
        *,
        appendonly: bool = True,
        appendfsync: str = "everysec",
        extra_args: Sequence[str] = (),
        keep: bool = False,
        embedded_ok: bool = False,
        binary: str | None = None,
        start_timeout: float = 10.0,
        stop_timeout: float = 10.0,
        port_attempts: int = 5,
        tls: TlsFiles | None = None,
        data_dir: Path | None = None,
        own_session: bool = False,
        host: str = HOST,
        launcher: Sequence[str] = (),
        password: str | None = None,
    ) -> None:
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.extra_args = tuple(extra_args)
        self.keep = keep
        self.embedded_ok = embedded_ok
        self.binary = binary or find_redis_server()
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.port_attempts = port_attempts
        self.tls = tls
        """If set, the server listens with TLS only (on `port`), and `url` is rediss://."""
        self.data_dir = data_dir
        """Where the server keeps its files (None: a fresh temp dir, removed at stop)."""
        self.own_session = own_session
        """Start the server in a session of its own: a Ctrl-C meant for its parent does not
        reach it (the parent then stops it when its own clients are done)."""
        self.host = host
        """The address the server binds and clients reach it at."""
        self.launcher = tuple(launcher)
        """A command the server is started through, e.g. `ip netns exec NS` (bench/netsim.py:
        a server on a simulated host); it must exec the server, so that signals reach it."""
        self.password = password
        """If set, clients must give it (`requirepass`; the `url` carries it): a server bound
        to an address other hosts reach (cohort run's under SLURM)."""
        self.embedded = False
        self.port = 0
        self.dir: Path | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self._out: IO[bytes] | None = None
        self._fake: Any = None  # fakeredis.TcpFakeServer when embedded
        self._fake_thread: threading.Thread | None = None

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> LocalRedis:
        """Start on a fresh free port in a fresh temp dir; returns self once PING answers."""
        if self.alive():
            raise LocalRedisError(f"already running at {self.url}")
        if self.data_dir is not None:
            self.data_dir.mkdir(parents=True, exist_ok=True)
        self.dir = self.data_dir or Path(tempfile.mkdtemp(prefix="cohort-redis-"))
        try:
            if self.binary is None:
                if not self.embedded_ok:
                    raise LocalRedisError(
                        "no redis-server binary found (looked at $COHORT_REDIS_SERVER and PATH); "
                        "install redis-server >= 7.0 or pass embedded_ok=True"
                    )
                self._start_embedded(free_port())
                return self
            last: LocalRedisError | None = None
            for _ in range(self.port_attempts):
                try:
                    self._spawn(free_port())
                    return self
                except _PortTaken as exc:
                    last = exc
            raise LocalRedisError(
                f"redis-server could not bind a free port in {self.port_attempts} attempts: {last}"
            )
        except BaseException:
            self._remove_dir()
            raise

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after stop_timeout; removes the temp dir unless keep=True."""
        self._terminate()
        if not self.keep:
            self._remove_dir()

    def kill(self) -> None:
        """SIGKILL, as a crash would: the dir (and whatever AOF reached disk) stays."""
        if self.embedded:
            self._stop_embedded()
            return
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(self.stop_timeout)
        self._close_out()

    def restart(self) -> LocalRedis:
        """Stop if running, then start again on the same port and dir (the AOF is reloaded)."""
        if self.dir is None:
            raise LocalRedisError("restart() before start(): there is no port or dir to reuse")
        self._terminate()
        if self.embedded:
            self._start_embedded(self.port)
        else:
            try:
                self._spawn(self.port)
            except _PortTaken as exc:
                raise LocalRedisError(f"port {self.port} was taken while stopped: {exc}") from exc
        return self

    def alive(self) -> bool:
        if self.embedded:
            return self._fake_thread is not None and self._fake_thread.is_alive()
        return self.process is not None and self.process.poll() is None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"{'rediss' if self.tls else 'redis'}://{auth}{self.host}:{self.port}/0"

    def settings(self, **kw: Any) -> RedisSettings:
        """Connection settings for this server (with the TLS files in TLS mode)."""
        if self.tls is not None:
            return self.tls.settings(self.url, **kw)
        return RedisSettings(url=self.url, **kw)

    def client(self) -> Client:
        """A client through the one connection factory (the caller closes it)."""
        return connect(self.settings())

    def log_tail(self, lines: int = 20) -> str:
        if self.dir is None:
            return ""
        return "\n".join(
            t
            for t in (
                processes.tail(self.dir / "redis.out", lines),
                processes.tail(self.dir / "redis.log", lines),
            )
            if t
        )

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        kind = "embedded" if self.embedded else "redis-server"
        return f"LocalRedis({kind}, url={self.url!r}, dir={str(self.dir)!r}, alive={self.alive()})"

    # -- redis-server --------------------------------------------------------------

    def _argv(self, port: int) -> list[str]:
        assert self.binary is not None and self.dir is not None
        return [
            *self.launcher,
            self.binary,
            *self._auth_conf(),
            "--port", str(port),
            "--bind", self.host,
            "--dir", str(self.dir),
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", self.appendfsync,
            "--logfile", str(self.dir / "redis.log"),
            "--daemonize", "no",
            *self._tls_argv(port),
            *self.extra_args,
        ]  # fmt: skip

    def _auth_conf(self) -> list[str]:
        """The password, in a config file only its user may read (a command line is seen
        by every user of the host); the file must be the server's first argument."""
        if not self.password:
            return []
        assert self.dir is not None
        path = self.dir / "auth.conf"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(f"requirepass {self.password}\n")
        return [str(path)]

    def _tls_argv(self, port: int) -> list[str]:
        if self.tls is None:
            return []
        return [
            "--port", "0",  # the later --port wins: no plain-text listener at all
            "--tls-port", str(port),
            "--tls-cert-file", str(self.tls.server_cert),
            "--tls-key-file", str(self.tls.server_key),
            "--tls-ca-cert-file", str(self.tls.ca),
            "--tls-auth-clients", "yes" if self.tls.auth_clients else "no",
        ]  # fmt: skip

    def _spawn(self, port: int) -> None:
        assert self.dir is not None
        self.port = port
        self._close_out()
        self._out = open(self.dir / "redis.out", "ab")  # noqa: SIM115 - lives as long as the server
        self.process = subprocess.Popen(
            self._argv(port),
            stdin=subprocess.DEVNULL,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            cwd=self.dir,
            start_new_session=self.own_session,
        )
        self._wait_ready()

    def _wait_ready(self) -> None:
        """Poll PING until it answers, the process exits, or start_timeout passes."""
        assert self.process is not None
        probe = connect(self.settings(socket_timeout=0.5, connect_timeout=0.5, retries=0))
        deadline = time.monotonic() + self.start_timeout
        pause = threading.Event()
        try:
            while time.monotonic() < deadline:
                code = self.process.poll()
                if code is not None:
                    self._close_out()
                    tail = self.log_tail()
                    if "address already in use" in tail.lower():
                        raise _PortTaken(f"port {self.port}: {tail.splitlines()[-1]}")
                    raise LocalRedisError(
                        f"redis-server exited with code {code} before answering PING on port "
                        f"{self.port}; log tail:\n{tail}"
                    )
                try:
                    if probe.ping():
                        return
                except (redis.ConnectionError, redis.TimeoutError):
                    pass  # not listening yet, or someone else's socket on our port
                except redis.ResponseError as exc:  # e.g. LOADING while the AOF is replayed
                    if "loading" not in str(exc).lower():
                        raise
                pause.wait(_POLL)
        finally:
            probe.close()
        self._terminate()
        raise LocalRedisError(
            f"redis-server on port {self.port} did not answer PING within {self.start_timeout}s; "
            f"log tail:\n{self.log_tail()}"
        )

    def _terminate(self) -> None:
        if self.embedded:
            self._stop_embedded()
            return
        process = self.process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                process.send_signal(signal.SIGKILL)
                process.wait(self.stop_timeout)
        self._close_out()

    def _close_out(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None

    def _remove_dir(self) -> None:
        if self.dir is not None and self.dir != self.data_dir and self.dir.exists():
            shutil.rmtree(self.dir, ignore_errors=True)

    # -- embedded fakeredis ----------------------------------------------------------

    def _start_embedded(self, port: int) -> None:
        from fakeredis import TcpFakeServer  # only needed without a binary

        previous = self._fake
        try:
            server = TcpFakeServer((HOST, port), server_type="redis")
        except OSError as exc:
            raise LocalRedisError(f"embedded fakeredis could not bind port {port}: {exc}") from exc
        if previous is not None:
            # the same in-memory data across restart(), standing in for the AOF
            server.fake_server = previous.fake_server
        self.embedded = True
        self.port = port
        self._fake = server
        self._fake_thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True,
            name=f"fakeredis-{port}",
        )  # fmt: skip
        self._fake_thread.start()

    def _stop_embedded(self) -> None:
        if self._fake_thread is not None and self._fake_thread.is_alive():
            self._fake.shutdown()
            self._fake.server_close()
            self._fake_thread.join(self.stop_timeout)


class _PortTaken(LocalRedisError):
    """redis-server lost the race for the port we picked; pick another. Control flow inside
    the launcher: it retries on a new port, no caller sees it."""


class _ClusterNode(LocalRedis):
    """A cluster-enabled redis-server whose bus port is picked free too (port + 10000, the
    default, can exceed 65535 for the high ports the OS hands out), and kept by restart(),
    as a restarted node keeps both its ports."""

    def __init__(self, node_timeout_ms: int, **kw: Any) -> None:
        super().__init__(**kw)
        self.node_timeout_ms = node_timeout_ms
        self.bus_port = 0
        self._restarting = False

    def restart(self) -> LocalRedis:
        self._restarting = True
        try:
            return super().restart()
        finally:
            self._restarting = False

    def _argv(self, port: int) -> list[str]:
        if not (self._restarting and self.bus_port):  # a start, or a retry on another port
            self.bus_port = free_port()
        return [
            *super()._argv(port),
            "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf",
            "--cluster-port", str(self.bus_port),
            "--cluster-node-timeout", str(self.node_timeout_ms),
        ]  # fmt: skip


class LocalCluster:
    """A private Redis Cluster: `primaries` primaries with `replicas` replicas each, every
    node a redis-server on a free port in its own temp dir (AOF on), joined with
    `redis-cli --cluster create`. Use as a context manager, or call start() and stop()."""

    def __init__(
        self,
        primaries: int = 3,
        replicas: int = 1,
        *,
        binary: str | None = None,
        cli: str | None = None,
        node_timeout_ms: int = 2000,
        start_timeout: float = 60.0,
        appendfsync: str = "everysec",
        appendonly: bool = True,
        places: Sequence[tuple[str, Sequence[str]]] = (),
        extra_args: Sequence[str] = (),
    ) -> None:
        if primaries < 1 or (primaries < 3 and replicas):
            raise LocalRedisError(
                f"a Redis Cluster of {primaries} primaries with {replicas} replicas each: "
                "give at least 1 primary, and at least 3 where they have replicas"
            )
        count = primaries * (1 + replicas)
        if places and len(places) != count:
            raise LocalRedisError(f"{len(places)} places for {count} nodes")
        self.binary = binary or find_redis_server()
        self.cli = cli or find_redis_cli(self.binary)
        self.nodes = [
            _ClusterNode(
                node_timeout_ms,
                binary=self.binary,
                appendonly=appendonly,
                appendfsync=appendfsync,
                start_timeout=start_timeout,
                host=host,
                launcher=launcher,
                extra_args=extra_args,
            )
            for host, launcher in (places or [(HOST, ())] * count)
        ]
        self.primaries = primaries
        self.replicas = replicas
        self.start_timeout = start_timeout

    def start(self) -> LocalCluster:
        """Start every node, create the cluster, and return once all agree it is ok."""
        if self.binary is None:
            raise LocalRedisError(
                "no redis-server binary found (looked at $COHORT_REDIS_SERVER and PATH)"
            )
        if self.cli is None:
            raise LocalRedisError("no redis-cli binary found next to redis-server or on PATH")
        try:
            for node in self.nodes:
                node.start()
            if self.primaries < 3:
                self._assign_slots()
                self.wait_ok()
                return self
            create = subprocess.run(
                [
                    self.cli, "--cluster", "create",
                    *(f"{node.host}:{node.port}" for node in self.nodes),
                    "--cluster-replicas", str(self.replicas),
                    "--cluster-yes",
                ],
                capture_output=True,
                text=True,
                timeout=self.start_timeout,
                check=False,
            )  # fmt: skip
            if create.returncode != 0:
                raise LocalRedisError(
                    f"redis-cli --cluster create failed ({create.returncode}):\n"
                    f"{create.stdout[-2000:]}{create.stderr[-2000:]}"
                )
            self.wait_ok()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ok(self, timeout: float | None = None) -> None:
        """Return once every live node says cluster_state:ok, knows every node, has every
        slot covered and (replicas) is in sync with its primary; LocalRedisError after
        `timeout` (default start_timeout)."""
        deadline = time.monotonic() + (timeout or self.start_timeout)
        pause = threading.Event()
        last = ""
        while time.monotonic() < deadline:
            states = []
            for node in self.nodes:
                if not node.alive():
                    continue
                probe = redis.Redis(host=node.host, port=node.port, socket_timeout=1.0)
                try:
                    info = probe.cluster("INFO")
                    replication = probe.info("replication")
                    synced = (
                        replication.get("role") == "master"
                        or replication.get("master_link_status") == "up"
                    )
                    states.append(
                        info.get("cluster_state") == "ok"
                        and int(info.get("cluster_slots_ok", 0)) == 16384
                        and int(info.get("cluster_known_nodes", 0)) == len(self.nodes)
                        and synced
                    )
                    last = f"{node.port}: {info.get('cluster_state')}, synced={synced}"
                except redis.RedisError as exc:
                    states.append(False)
                    last = f"{node.port}: {exc}"
                finally:
                    probe.close()
            if states and all(states):
                return
            pause.wait(0.1)
        raise LocalRedisError(f"cluster not ok within its timeout (last: {last})")

    def _assign_slots(self) -> None:
        """A cluster too small for `redis-cli --cluster create` (1 or 2 primaries, no
        replicas): each node takes an even share of the slots, and the first meets the rest."""
        share = -(-16384 // self.primaries)
        for i, node in enumerate(self.nodes):
            probe = redis.Redis(host=node.host, port=node.port, socket_timeout=5.0)
            try:
                probe.execute_command(
                    "CLUSTER", "ADDSLOTSRANGE", i * share, min(16384, (i + 1) * share) - 1
                )
                if i:
                    probe.execute_command("CLUSTER", "MEET", self.nodes[0].host, self.nodes[0].port)
            finally:
                probe.close()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    @property
    def url(self) -> str:
        """redis+cluster:// naming every node as a startup node."""
        return "redis+cluster://" + ",".join(f"{node.host}:{node.port}" for node in self.nodes)

    def settings(self, **kw: Any) -> RedisSettings:
        return RedisSettings(url=self.url, **kw)

    def client(self) -> Client:
        return connect(self.settings())

    def roles(self) -> dict[int, str]:
        """port -> 'master' or 'slave' for every live node, as each node says itself."""
        out = {}
        for node in self.nodes:
            if node.alive():
                probe = redis.Redis(host=node.host, port=node.port, socket_timeout=1.0)
                try:
                    out[node.port] = str(probe.info("replication")["role"])
                finally:
                    probe.close()
        return out

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class LocalSentinel(LocalRedis):
    """A redis-server in Sentinel mode watching one primary as `service`, for tests.

    The config is written fresh on every start (Sentinel rewrites it as it learns)."""

    def __init__(
        self,
        primary_port: int,
        service: str = "cohort",
        *,
        quorum: int = 1,
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 5000,
        **kw: Any,
    ) -> None:
        super().__init__(appendonly=False, **kw)
        self.primary_port = primary_port
        self.service = service
        self.quorum = quorum
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms

    def _argv(self, port: int) -> list[str]:
        assert self.binary is not None and self.dir is not None
        conf = self.dir / "sentinel.conf"
        name = self.service
        conf.write_text(
            f"port {port}\nbind {HOST}\ndir {self.dir}\nlogfile {self.dir / 'redis.log'}\n"
            f"sentinel monitor {name} {HOST} {self.primary_port} {self.quorum}\n"
            f"sentinel down-after-milliseconds {name} {self.down_after_ms}\n"
            f"sentinel failover-timeout {name} {self.failover_timeout_ms}\n"
            f"sentinel parallel-syncs {name} 1\n"
        )
        return [self.binary, str(conf), "--sentinel"]

    def primary(self) -> tuple[str, int] | None:
        """The (host, port) this Sentinel names as the service's primary now."""
        probe = redis.Redis(host=HOST, port=self.port, socket_timeout=1.0)
        try:
            found: Any = probe.sentinel_get_master_addr_by_name(self.service)
        finally:
            probe.close()
        if not found:
            return None
        host = text(found[0])
        return host, int(found[1])


def find_redis_cli(server: str | None) -> str | None:
    """redis-cli next to `server`, else the first on PATH."""
    if server is not None:
        sibling = Path(server).with_name("redis-cli")
        if os.access(sibling, os.X_OK):
            return str(sibling)
    return shutil.which("redis-cli")
