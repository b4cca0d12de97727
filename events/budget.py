"""Gradients never starve the control plane: the memory budget a collective checks first.

With `maxmemory-policy noeviction` (which the coordinator requires) a full Redis refuses
every write: journal appends, the inbox's heartbeats and gradients alike, and training
stops with nothing saying why. So the leader publishes the server's `maxmemory` and
`used_memory` (`Keys.memory`, every status interval), and a collective checks, before it
writes a step's blobs, that the whole step fits with `HEADROOM` of maxmemory left for the
journal, the inbox and everything else. A step that does not fit is refused on every rank
within a round trip, with a message naming maxmemory and what to do; nothing is written.

The fenced Functions the leader appends through are also flagged `allow-oom`
(coordinator/fencing.lua), so a server filled by something else still takes the journal.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

HEADROOM = 0.25
"""The share of maxmemory gradients never use: the journal, the inbox, notices, snapshots."""
LIVE_STEPS = 2
"""A step's blobs live until each rank starts the operation after the next one: two steps'
worth may be on the server at once."""


@dataclass(frozen=True, slots=True)
class Memory:
    """A server's memory as INFO reports it, in bytes (maxmemory 0: no limit)."""

    maxmemory: int
    used: int

    @property
    def limited(self) -> bool:
        return self.maxmemory > 0

    @property
    def free(self) -> int:
        """Bytes gradients may still take, headroom kept (negative: already over)."""
        return int(self.maxmemory * (1 - HEADROOM)) - self.used

    @classmethod
    def of_info(cls, info: dict[str, object]) -> Memory:
        """The figures of INFO memory. Clients' buffers are left out of `used`: a worker's
        55 MB write that Redis refuses sits in a query buffer for an instant, and counted,
        it would refuse every step until the next figure (issue 33)."""
        used = int(info.get("used_memory", 0)) - int(info.get("mem_clients_normal", 0))  # type: ignore[call-overload]
        return cls(int(info.get("maxmemory", 0)), max(0, used))  # type: ignore[call-overload]

    def encode(self) -> bytes:
        return msgpack.packb({"max": self.maxmemory, "used": self.used})  # type: ignore[no-any-return]

    @classmethod
    def decode(cls, raw: bytes | None) -> Memory | None:
        """The published figures, or None if there are none or they cannot be read."""
        if not raw:
            return None
        try:
            body = msgpack.unpackb(raw)
            return cls(int(body["max"]), int(body["used"]))
        except (ValueError, TypeError, KeyError, msgpack.UnpackException):
            return None


def refusal(memory: Memory | None, step_bytes: int) -> str | None:
    """Why a step putting `step_bytes` on the server (all ranks together) does not fit, or
    None if it does (or no budget is known)."""
    if memory is None or not memory.limited:
        return None
    need = step_bytes * LIVE_STEPS
    if need <= memory.free:
        return None
    return (
        f"the step needs {mib(need)} on Redis ({mib(step_bytes)} of gradients from all ranks, "
        f"{LIVE_STEPS} steps live), but maxmemory is {mib(memory.maxmemory)} with "
        f"{mib(memory.used)} used and {HEADROOM:.0%} kept for the journal and inbox: raise "
        "maxmemory (CONFIG SET maxmemory, and in redis.conf), or send fewer bytes "
        "(transport='float16', smaller tensors or buckets)"
    )


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
