"""Where gradient chunks live on Redis Cluster: chunk i of a step on primary i mod M.

Every key of a job shares the hash tag `{J}`, so on a cluster the job's control plane sits
in one slot, on one primary. Gradient chunks need the opposite: spread over every primary,
so that allreduce bandwidth grows with the number of nodes. `Placement` asks the client's
slot map (redis-py's `get_node_from_key`) for the smallest tag `g<s>` whose slot each
primary owns, primaries in name order, and caches the answer until the set of primaries
changes. Chunk i's keys use the tag of primary i mod M.

Correctness never depends on this choice: a writer names the tags it used in its notice,
and readers build key names from the writer's tags (and the writer's worker name, which
ends every key: a tag cannot point a reader at another writer's key), so ranks with
different slot maps (a topology change mid-step) still find each other's chunks; redis-py
follows MOVED/ASK to
wherever a slot moved. Only speed depends on placement. On one server (or Sentinel) there
are no tags and the key names are those of the job's prefix, as before.
"""

from __future__ import annotations

import re

from redis.cluster import RedisCluster

from cohort.events.connection import Client
from cohort.events.errors import InvalidValueError
from cohort.events.keys import Keys

_TAG = re.compile(r"g[0-9]{1,7}")
SPREAD = 6
"""Pieces per rank on a cluster: an even share on 1, 2, 3 or 6 primaries, whatever N is."""
MIN_PIECE_BYTES = 256 * 1024
"""Below this, one more round trip costs more than an even spread saves."""
SEARCH_LIMIT = 1_000_000
"""Tags tried per primary before giving up (a primary owning no slot has none)."""


class Placement:
    """The hash tags of one job's gradient chunks on the client's current cluster."""

    def __init__(self, conn: Client, keys: Keys) -> None:
        self.conn = conn
        self.keys = keys
        self._primaries: tuple[str, ...] = ()
        self._tags: tuple[str, ...] = ()

    def pieces(self, part_bytes: int, needed: int) -> int:
        """Chunks each rank's part of an allreduce is cut into. On one server: `needed`
        (what the value size limit asks). On a cluster: at least SPREAD, or 3 or 2 where
        fewer pieces of MIN_PIECE_BYTES fit, so that a step's chunks fall evenly on the
        primaries (one chunk per rank on M primaries leaves one primary ceil(N/M) of them:
        with 4 ranks on 3 primaries, half the bytes on one). Only the kind of server and
        the sizes decide it, and every rank of a job shares those."""
        if not isinstance(self.conn, RedisCluster):
            return needed
        fits = part_bytes // MIN_PIECE_BYTES
        return max(needed, next(d for d in (SPREAD, 3, 2, 1) if d <= max(1, fits)))

    def tags(self) -> tuple[str, ...]:
        """One tag per primary (name order); () on a single server."""
        conn = self.conn
        if not isinstance(conn, RedisCluster):
            return ()
        names = tuple(sorted(node.name for node in conn.get_primaries()))
        if names != self._primaries:
            self._tags = self._search(conn, names)
            self._primaries = names
        return self._tags

    def _search(self, conn: RedisCluster, names: tuple[str, ...]) -> tuple[str, ...]:
        found: dict[str, str] = {}
        for s in range(SEARCH_LIMIT):
            tag = f"g{s}"
            owner = conn.get_node_from_key(self.keys.spread(tag)).name
            if owner in names and owner not in found:
                found[owner] = tag
                if len(found) == len(names):
                    break
        # a primary without slots gets no tag of its own: its share goes round-robin
        return tuple(found[name] for name in names if name in found)


def tag_of(tags: tuple[str, ...], chunk: int) -> str | None:
    """The tag of chunk `chunk` (None: the job's own prefix)."""
    return tags[chunk % len(tags)] if tags else None


def encode(tags: tuple[str, ...]) -> str:
    """Tags as a notice field value."""
    return ",".join(tags)


def decode(value: bytes | str | None) -> tuple[str, ...]:
    """A notice's tags; () when absent (a writer on one server). ValueError if malformed."""
    if not value:
        return ()
    text = value.decode(errors="replace") if isinstance(value, bytes) else value
    tags = tuple(text.split(","))
    bad = [t for t in tags if not _TAG.fullmatch(t)]
    if bad:
        raise InvalidValueError(f"chunk tags {bad[:3]!r} are not of the form g<number>")
    return tags
