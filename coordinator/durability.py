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
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import redis

from .errors import CoordinatorError


@dataclass(frozen=True)
class Persistence:
    aof: bool | None  # None: the server would not say
    waitaof: bool
    version: str

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
    return Persistence(aof=aof, waitaof=_at_least(version, (7, 2)), version=version)


def _at_least(version: str, wanted: tuple[int, int]) -> bool:
    try:
        major, minor = (int(p) for p in version.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= wanted


def require(conn: redis.Redis, display_url: str, allow_volatile: bool) -> Persistence:
    """The server's persistence, or CoordinatorError if it does not persist and that is not
    explicitly allowed."""
    found = inspect(conn)
    problem = found.problem(display_url)
    if problem and not allow_volatile:
        raise CoordinatorError(problem)
    return found
