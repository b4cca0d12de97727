"""The Redis a chaos run trains on, and the fault that takes its primary away.

- `SingleTopology`: one redis-server (AOF). Losing it: SIGKILL, started again on its AOF.
- `SentinelTopology`: a primary and two replicas (redis-server, AOF) watched by three
  Sentinels, quorum 2 (two must agree the primary is down, and a majority of the three
  elects the Sentinel that fails it over: the smallest group in which no one Sentinel's view
  alone moves the primary); clients find the primary through `redis+sentinel://`. Losing the
  primary: SIGKILL, Sentinel promotes a replica, the killed server starts again on its own
  AOF, as the primary it was, and Sentinel makes it a replica of the new one.
- `ClusterTopology`: a Redis Cluster of three primaries with a replica each, on
  `redis+cluster://`. Losing the primary that owns a key's slot: SIGKILL, the cluster
  promotes its replica once the node timeout passes, the killed node starts again and
  comes back as the new primary's replica.

Every wait is for a condition, with a deadline.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import redis
from redis.crc import key_slot

from cohort.events.connection import Client, RedisSettings, connect
from cohort.localredis import HOST, LocalCluster, LocalRedis, LocalSentinel
from tests.helpers import wait_until

T = TypeVar("T")
POLL = 0.1
SERVICE = "cohort"
SENTINELS, QUORUM = 3, 2
DOWN_AFTER_MS = 3000
"""Sentinel's down-after-milliseconds: how long the primary must be silent to be down. At
1 s, on these 2 busy cores a primary just promoted sometimes missed a second of pings and
the Sentinels failed it over again at once, to a replica still syncing from it (writes
lost, and for 10 s two primaries: see docs/redis-ha.md)."""
FAILOVER_TIMEOUT_MS = 5000
NODE_TIMEOUT_MS = 2000
"""The cluster's node timeout: how long a primary must be silent before its replica runs."""
PROMOTED_WITHIN_S = 60.0
REJOINED_WITHIN_S = 90.0
"""Sentinel demotes a restarted old primary some 8 s after it reports itself (its
`4 * publish period`), once its periodic INFO shows the role: about 15 s here."""


class TopologyError(RuntimeError):
    """A failover (or a start) did not reach the state it waits for within its deadline."""


@dataclass(frozen=True)
class Failover:
    """One loss of the primary: which server was killed, which one is primary after it,
    and how long each half took."""

    killed: int
    """Port of the server SIGKILLed."""
    primary: int
    """Port of the primary afterwards (the same server, for a restart)."""
    promote_s: float
    """From the kill to a primary serving again (for a restart: the restart)."""
    rejoin_s: float
    """From then to every server in sync with one primary again, the killed one a replica
    (0 for a restart)."""
    at: float
    """Wall-clock time of the kill."""
    settled: int = 0
    """Port of the primary once all is in sync again: `primary`, unless the topology moved
    the primary once more meanwhile."""


class Topology(Protocol):
    name: str
    lose: str
    """The fault kind that takes the primary away on this topology."""

    @property
    def url(self) -> str:
        """What every process is given as --redis-url."""
        ...

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def keep_logs(self, into: Path) -> None:
        """Copy every server's log into the folder `into` (before `stop` removes them)."""
        ...

    def client(self) -> Client: ...
    def proxy_target(self) -> int | None:
        """The port per-process proxies forward to (None: processes connect to `url`)."""
        ...

    def lose_primary(self, key: str) -> Failover:
        """SIGKILL the primary holding `key`, and return once it is replaced and back."""
        ...

    def describe(self) -> str: ...


def until(
    done: Callable[[], T | None],
    timeout: float,
    what: str,
    state: Callable[[], str] = lambda: "",
) -> T:
    """`done()`'s first truthy value, polled every POLL s; TopologyError after `timeout`,
    naming what did not happen and the `state` the servers were left in."""
    try:
        return wait_until(done, timeout, POLL, what)  # type: ignore[return-value]
    except AssertionError:
        raise TopologyError(f"{what} did not happen within {timeout:g} s; {state()}") from None


def roles(ports: Iterable[int]) -> str:
    """Each server's role as it says itself (a replica: of which port, link up or down)."""
    said = []
    for port in ports:
        info = replication(port)
        role = info.get("role", "no answer")
        if role == "slave":
            role = f"replica of {info.get('master_port')} ({info.get('master_link_status')})"
        said.append(f"{port}: {role}")
    return "servers " + ", ".join(said)


def ask(port: int, *command: Any) -> Any:
    """`command`'s reply from the server (or Sentinel) at `port`; None if it does not answer."""
    probe = redis.Redis(host=HOST, port=port, socket_timeout=1.0, socket_connect_timeout=1.0)
    try:
        return probe.execute_command(*command)
    except redis.RedisError:
        return None
    finally:
        probe.close()


def replication(port: int) -> dict[str, Any]:
    """The server's INFO replication ({} if it does not answer)."""
    reply = ask(port, "INFO", "replication")
    return dict(reply) if isinstance(reply, dict) else {}


def replicates(port: int, primary: int | None) -> bool:
    """Whether the server at `port` is a replica of `primary` (None: of any server) with its
    link up."""
    info = replication(port)
    return (
        info.get("role") == "slave"
        and primary in (None, info.get("master_port"))
        and info.get("master_link_status") == "up"
    )


def is_primary(port: int) -> bool:
    return replication(port).get("role") == "master"


class SingleTopology:
    """One redis-server; every process reaches it through a proxy of its own."""

    name = "single"
    lose = "restart-redis"

    def __init__(self, appendfsync: str = "always") -> None:
        self.server = LocalRedis(appendonly=True, appendfsync=appendfsync)

    @property
    def url(self) -> str:
        return self.server.url

    def start(self) -> None:
        self.server.start()

    def stop(self) -> None:
        self.server.stop()

    def client(self) -> Client:
        return self.server.client()

    def proxy_target(self) -> int | None:
        return self.server.port

    def lose_primary(self, key: str) -> Failover:
        at, started = time.time(), time.monotonic()
        self.server.kill()
        self.server.restart()
        took = time.monotonic() - started
        return Failover(self.server.port, self.server.port, took, 0.0, at, self.server.port)

    def keep_logs(self, into: Path) -> None:
        copy_logs({"redis": self.server}, into)

    def describe(self) -> str:
        return f"redis-server with appendfsync {self.server.appendfsync}"


class SentinelTopology:
    """A primary and two replicas watched by three Sentinels (quorum 2)."""

    name = "sentinel"
    lose = "failover-primary"

    def __init__(self, appendfsync: str = "always") -> None:
        self.servers = [LocalRedis(appendonly=True, appendfsync=appendfsync) for _ in range(3)]
        self.sentinels: list[LocalSentinel] = []

    @property
    def url(self) -> str:
        where = ",".join(f"{HOST}:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{where}/{SERVICE}"

    def start(self) -> None:
        """The servers, the replicas in sync (made replicas at run time, not in their
        arguments: a restarted server comes back as the primary it was, for Sentinel to
        demote), then the Sentinels, once each sees the other two and both replicas."""
        try:
            for server in self.servers:
                server.start()
            primary = self.servers[0].port
            for replica in self.servers[1:]:
                ask(replica.port, "REPLICAOF", HOST, primary)
            until(
                lambda: all(replicates(r.port, primary) for r in self.servers[1:]),
                30,
                "the replicas in sync",
            )
            self.sentinels = [
                LocalSentinel(
                    primary,
                    SERVICE,
                    quorum=QUORUM,
                    down_after_ms=DOWN_AFTER_MS,
                    failover_timeout_ms=FAILOVER_TIMEOUT_MS,
                )
                for _ in range(SENTINELS)
            ]
            for sentinel in self.sentinels:
                sentinel.start()
            until(lambda: self._watching(primary), 60, "every Sentinel watching the servers")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for process in [*self.sentinels, *self.servers]:
            process.stop()

    def client(self) -> Client:
        return connect(RedisSettings(url=self.url))

    def proxy_target(self) -> int | None:
        return None

    def lose_primary(self, key: str) -> Failover:
        old = until(self.primary, 30, "the Sentinels agreeing on the primary")
        server = next(s for s in self.servers if s.port == old)
        at, killed = time.time(), time.monotonic()
        server.kill()
        new = until(
            lambda: self._promoted(old),
            PROMOTED_WITHIN_S,
            "Sentinel promoting a replica",
            self.state,
        )
        promoted = time.monotonic()
        server.restart()
        settled = until(
            self._settled,
            REJOINED_WITHIN_S,
            f"the killed server (port {old}) back as a replica (of port {new}, the new primary)",
            self.state,
        )
        return Failover(old, new, promoted - killed, time.monotonic() - promoted, at, settled)

    def keep_logs(self, into: Path) -> None:
        copy_logs({f"redis-{s.port}": s for s in self.servers}, into)
        copy_logs({f"sentinel-{s.port}": s for s in self.sentinels}, into)

    def primary(self) -> int | None:
        """The primary's port, if every Sentinel names the same one."""
        named = {self._named_by(s.port) for s in self.sentinels}
        port = named.pop() if len(named) == 1 else None
        return port

    def state(self) -> str:
        """What the servers and each Sentinel say, for an error."""
        said = [roles(s.port for s in self.servers)]
        for sentinel in self.sentinels:
            replicas = ask(sentinel.port, "SENTINEL", "REPLICAS", SERVICE) or []
            others = ask(sentinel.port, "SENTINEL", "SENTINELS", SERVICE) or []
            seen = [f"{r.get('port')} {r.get('flags')}" for r in map(_pairs, replicas)]
            said.append(
                f"Sentinel {sentinel.port}: primary {self._named_by(sentinel.port)}, "
                f"replicas [{'; '.join(seen)}], {len(others)} other Sentinels; its log ends:\n"
                + sentinel.log_tail(15)
            )
        return "; ".join(said)

    def describe(self) -> str:
        return (
            f"a primary and two replicas (redis-server, appendfsync "
            f"{self.servers[0].appendfsync}) watched by {SENTINELS} Sentinels (quorum "
            f"{QUORUM}, down-after {DOWN_AFTER_MS} ms); processes on redis+sentinel://"
        )

    def _promoted(self, old: int) -> int | None:
        """The new primary, once the failover is over: every Sentinel names it and none
        is still failing over, and the other replica follows it. Only then is the killed
        server started again, as an operator would: a server back in the middle of the
        failover changes its course."""
        port = self.primary()
        if port in (None, old) or not is_primary(port):
            return None
        for sentinel in self.sentinels:
            found = ask(sentinel.port, "SENTINEL", "MASTER", SERVICE)
            if not found or "failover_in_progress" in _pairs(found).get("flags", ""):
                return None
        others = [s.port for s in self.servers if s.port not in (old, port)]
        return port if all(replicates(p, port) for p in others) else None

    def _settled(self) -> int | None:
        """The primary, once the Sentinels agree on it and watch both replicas in sync."""
        primary = self.primary()
        return primary if primary is not None and self._watching(primary) else None

    def _watching(self, primary: int) -> bool:
        """Every Sentinel names `primary` and sees two live replicas and the two other
        Sentinels; both other servers replicate `primary` with their link up."""
        if self.primary() != primary or not is_primary(primary):
            return False
        for sentinel in self.sentinels:
            replicas = ask(sentinel.port, "SENTINEL", "REPLICAS", SERVICE) or []
            others = ask(sentinel.port, "SENTINEL", "SENTINELS", SERVICE) or []
            up = [r for r in map(_pairs, replicas) if "s_down" not in r.get("flags", "")]
            if len(up) != len(self.servers) - 1 or len(others) != len(self.sentinels) - 1:
                return False
        return all(replicates(s.port, primary) for s in self.servers if s.port != primary)

    @staticmethod
    def _named_by(port: int) -> int | None:
        found = ask(port, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
        return int(found[1]) if found else None


def _pairs(reply: Any) -> dict[str, str]:
    """A Sentinel's flat [name, value, ...] reply (or redis-py's parsed dict) as text."""
    if isinstance(reply, dict):
        return {_text(k): _text(v) for k, v in reply.items()}
    items = [_text(x) for x in reply]
    return dict(zip(items[::2], items[1::2], strict=True))


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class ClusterTopology:
    """A Redis Cluster of three primaries with a replica each."""

    name = "cluster"
    lose = "failover-primary"

    def __init__(self, appendfsync: str = "always") -> None:
        self.cluster = LocalCluster(
            3, 1, node_timeout_ms=NODE_TIMEOUT_MS, appendfsync=appendfsync, appendonly=True
        )

    @property
    def url(self) -> str:
        return self.cluster.url

    def start(self) -> None:
        self.cluster.start()

    def stop(self) -> None:
        self.cluster.stop()

    def client(self) -> Client:
        return self.cluster.client()

    def proxy_target(self) -> int | None:
        return None

    def lose_primary(self, key: str) -> Failover:
        slot = key_slot(key.encode())
        old = until(lambda: self.owner(slot), 30, f"the nodes agreeing who owns slot {slot}")
        node = next(n for n in self.cluster.nodes if n.port == old)
        at, killed = time.time(), time.monotonic()
        node.kill()
        new = until(
            lambda: self._promoted(slot, old),
            PROMOTED_WITHIN_S,
            "the cluster promoting a replica",
            lambda: roles(n.port for n in self.cluster.nodes),
        )
        promoted = time.monotonic()
        node.restart()
        until(
            lambda: replicates(old, None),
            REJOINED_WITHIN_S,
            f"the killed node (port {old}) back as a replica (of port {new}, the new primary)",
            lambda: roles(n.port for n in self.cluster.nodes),
        )
        self.cluster.wait_ok(REJOINED_WITHIN_S)
        settled = until(lambda: self.owner(slot), 30, f"the nodes agreeing who owns slot {slot}")
        return Failover(old, new, promoted - killed, time.monotonic() - promoted, at, settled)

    def keep_logs(self, into: Path) -> None:
        copy_logs({f"redis-{n.port}": n for n in self.cluster.nodes}, into)

    def owner(self, slot: int) -> int | None:
        """The port of the primary serving `slot`, if every live node names the same one."""
        named = set()
        for node in self.cluster.nodes:
            if node.alive():
                named.add(_slot_owner(ask(node.port, "CLUSTER", "SLOTS"), slot))
        port = named.pop() if len(named) == 1 else None
        return port

    def describe(self) -> str:
        node = self.cluster.nodes[0]
        return (
            f"a Redis Cluster of 3 primaries with a replica each (redis-server, appendfsync "
            f"{node.appendfsync}, node timeout {NODE_TIMEOUT_MS} ms); processes on "
            "redis+cluster://"
        )

    def _promoted(self, slot: int, old: int) -> int | None:
        port = self.owner(slot)
        return port if port not in (None, old) and is_primary(port) else None


def copy_logs(servers: dict[str, LocalRedis], into: Path) -> None:
    """Each server's log file as `into`/NAME.log."""
    into.mkdir(parents=True, exist_ok=True)
    for name, server in servers.items():
        if server.dir is not None and (server.dir / "redis.log").exists():
            shutil.copyfile(server.dir / "redis.log", into / f"{name}.log")


def _slot_owner(slots: Any, slot: int) -> int | None:
    """The primary's port for `slot` in a CLUSTER SLOTS reply (None: no reply, or no owner)."""
    if not slots:
        return None
    if isinstance(slots, dict):  # redis-py parses it into {(start, end): {"primary": ...}}
        for (start, end), nodes in slots.items():
            if int(start) <= slot <= int(end):
                return int(nodes["primary"][1])
        return None
    for start, end, primary, *_ in slots:
        if int(start) <= slot <= int(end):
            return int(primary[1])
    return None


TOPOLOGIES: dict[str, Callable[[], Topology]] = {
    "single": SingleTopology,
    "sentinel": SentinelTopology,
    "cluster": ClusterTopology,
}
