"""What survives: the coordinator checks that Redis persists before it leads.

A fact is acknowledged when `cohort_append` returns. Redis appends it to the AOF
buffer and, before it replies, writes that buffer to the file (the kernel holds
it from then on). So:

- `appendonly yes`, `appendfsync always`: the write is fsynced before the reply;
  nothing acknowledged is lost, even by a power cut.
- `appendonly yes`, `appendfsync everysec` (Redis's default): a redis-server
  crash or SIGKILL loses nothing acknowledged (the kernel has it); a host crash
  or power cut loses at most about the last second.
- `appendonly no`: a restart loses everything since the last RDB snapshot, if
  any. The coordinator refuses this unless told `--allow-volatile`.

Where the server has WAITAOF (Redis >= 7.2) and `--wait-aof` is given, the
leader also waits after each append until the AOF is fsynced locally, which gives
`always` semantics for the journal under `everysec` for everything else.

Replicas (Sentinel, Cluster) are another matter: replication is asynchronous, so a
failover can lose what the old primary acknowledged but had not yet sent. With
`--wait-replicas N` the leader sends WAIT N after each append, on the connection that
made it, so an acknowledged fact is on N replicas too (docs/redis-ha.md).

Eviction is the same class of danger: a server whose `maxmemory-policy` is anything but
`noeviction` may drop keys under memory pressure, the journal (`allkeys-*`) or the leader's
lease and the gradient blobs (`volatile-*`) among them, silently. The coordinator refuses
such a server unless told `--allow-eviction`.

On Redis Cluster every primary is checked, not only the one owning the job's slot: a
slot can move (resharding, failover) to any of them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import redis

from cohort.coordinator.errors import CoordinatorError
from cohort.events.connection import Client, primaries

SAFE_POLICY = "noeviction"


@dataclass(frozen=True)
class Persistence:
    aof: bool | None  # None: the server would not say
    waitaof: bool
    version: str
    policy: str | None = None
    """`maxmemory-policy` (None: the server would not say)."""

    def problem(self, display_url: str) -> str | None:
        if self.aof:
            return None
        if self.aof is None:
            return (
                f"cannot tell whether Redis at {display_url} persists (INFO persistence is "
                "refused or unknown); grant the coordinator user INFO, or run with "
                "--allow-volatile if losing the journal on a Redis restart is acceptable"
            )
        return (
            f"Redis at {display_url} runs without an append-only file (appendonly no): a "
            "restart would lose acknowledged facts and the inbox cursor. Set `appendonly yes` "
            "(appendfsync everysec or always), or run with --allow-volatile for a throwaway job"
        )

    def eviction_problem(self, display_url: str) -> str | None:
        """Why this server may drop the job's keys under memory pressure, or None."""
        if self.policy == SAFE_POLICY:
            return None
        if self.policy is None:
            return (
                f"cannot tell whether Redis at {display_url} evicts keys (INFO memory is "
                "refused or has no maxmemory_policy); grant the coordinator user INFO, or run "
                "with --allow-eviction if losing the journal under memory pressure is acceptable"
            )
        return (
            f"Redis at {display_url} runs with maxmemory-policy {self.policy}: under memory "
            "pressure it may evict the journal, the leader's lease or gradients, silently. Set "
            f"`maxmemory-policy {SAFE_POLICY}` (CONFIG SET maxmemory-policy {SAFE_POLICY}, and in "
            "redis.conf), or run with --allow-eviction for a throwaway job"
        )


def inspect(conn: redis.Redis) -> Persistence:
    """Ask the server how it persists. Never raises for a server that will not say."""
    aof: bool | None
    version = "unknown"
    try:
        info = conn.info("persistence")
        aof = bool(int(info.get("aof_enabled", 0)))
    except redis.ResponseError:
        aof = None
    with contextlib.suppress(redis.ResponseError):
        version = str(conn.info("server").get("redis_version", "unknown"))
    policy: str | None = None
    with contextlib.suppress(redis.ResponseError):
        found = conn.info("memory").get("maxmemory_policy")
        policy = None if found is None else str(found)
    return Persistence(aof=aof, waitaof=_at_least(version, (7, 2)), version=version, policy=policy)


def _at_least(version: str, wanted: tuple[int, int]) -> bool:
    try:
        major, minor = (int(p) for p in version.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= wanted


def require(
    conn: Client, display_url: str, allow_volatile: bool, allow_eviction: bool = False
) -> Persistence:
    """The persistence of every primary (the least of them), or CoordinatorError naming the
    first primary that does not persist or may evict keys, unless that is explicitly
    allowed."""
    servers = primaries(conn)
    found = [(name, inspect(server)) for name, server in servers]
    for name, persistence in found:
        where = display_url if len(servers) == 1 else f"{display_url} (primary {name})"
        problem = persistence.problem(where)
        if problem and not allow_volatile:
            raise CoordinatorError(problem)
        problem = persistence.eviction_problem(where)
        if problem and not allow_eviction:
            raise CoordinatorError(problem)
    least = [p for _, p in found]
    aofs = [p.aof for p in least]
    return Persistence(
        aof=None if None in aofs else all(aofs),
        waitaof=all(p.waitaof for p in least),
        version=min((p.version for p in least), key=_version_key),
        policy=next((p.policy for p in least if p.policy != SAFE_POLICY), SAFE_POLICY),
    )


def _version_key(version: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in version.split("."))
    except ValueError:
        return (0,)
