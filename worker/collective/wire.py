"""How chunk blobs go to Redis and come back: SETs that copy nothing, GETs pipelined.

redis-py's default packer joins a command into one bytes object: a copy of the whole
value, on top of the copy that made the blob. Against a real redis-server `Wire` sends each
SET through a pooled connection as a list of parts (`send_packed_command`), so the array
memory itself is handed to `sendall` and nothing is joined. fakeredis has no socket, so
there the blob is joined and stored with a plain SET. GET returns bytes (hiredis's one
copy out of the socket), which `tensors.unpack` views without copying. What each path
costs is measured by `python -m bench.allreduce` (figures in BENCHMARKS.md).

On Redis Cluster SETs go straight to the pool of the node owning each key; a MOVED/ASK
reply or a node that is gone sends those SETs through redis-py's routed pipeline instead,
which follows the slot and refreshes its map. GETs of chunks already there go in one
pipelined round trip, at most `FETCH_BYTES` of replies at a time.

Every operation here is idempotent (SET of the same bytes, GET), so the caller retries it
whole: `Attempt` is how it does so within its deadline.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

import redis
from redis.cluster import RedisCluster

from cohort.events.connection import UNAVAILABLE, Client, is_cluster
from cohort.worker.collective import tensors as blobs

T = TypeVar("T")

TTL_MS = 10 * 60 * 1000
"""Every collective key expires after this, whatever happens to the ranks that wrote it."""
FETCH_BYTES = 32 * 1024 * 1024
"""Chunks fetched in one round trip, at most (their replies are held until unpacked)."""
SMALL_PART = 64 * 1024
"""Parts smaller than this are copied into the command's framing; larger ones are sent as
they are."""

Item = tuple[str, list[blobs.Part]]
"""A key and the blob to SET there, as `tensors.pack` parts."""


class Attempt(Protocol):
    """Runs an idempotent Redis operation again while Redis is unreachable, until the
    caller's deadline; `what` names it in logs and errors."""

    def __call__(self, op: Callable[[], T], what: str) -> T: ...


def set_command(key: str, parts: list[blobs.Part], ttl_ms: int) -> list[blobs.Part]:
    """SET key <parts joined> PX ttl as RESP pieces; big parts are passed through, not copied."""
    raw_key, ttl = key.encode(), str(ttl_ms).encode()
    size = blobs.nbytes(parts)
    out: list[blobs.Part] = []
    small = bytearray(b"*5\r\n$3\r\nSET\r\n$%d\r\n%b\r\n$%d\r\n" % (len(raw_key), raw_key, size))
    for part in parts:
        view = memoryview(part)
        if view.nbytes < SMALL_PART:
            small += view
            continue
        if small:
            out.append(bytes(small))
            small = bytearray()
        out.append(view)
    small += b"\r\n$2\r\nPX\r\n$%d\r\n%b\r\n" % (len(ttl), ttl)
    out.append(bytes(small))
    return out


def send_sets(pool: Any, items: list[Item]) -> list[Item]:
    """Pipeline SETs of `items` on one connection of `pool`, array memory handed to the
    socket; returns the items the server redirected (MOVED/ASK) instead of storing."""
    redirected = []
    connection = pool.get_connection()
    try:
        for key, parts in items:  # pipelined: the replies are a few bytes each
            connection.send_packed_command(set_command(key, parts, TTL_MS))
        for item in items:
            try:
                connection.read_response()
            except redis.exceptions.AskError:  # MovedError is an AskError
                redirected.append(item)
    except BaseException:
        connection.disconnect()
        raise
    finally:
        pool.release(connection)
    return redirected


class Wire:
    """SETs and GETs of chunk blobs on one client (a server, Sentinel's primary or a cluster)."""

    def __init__(self, conn: Client) -> None:
        self.conn = conn
        pool = getattr(conn, "connection_pool", None)
        pool_class = getattr(pool, "connection_class", type(None))
        self.fast_set = is_cluster(conn) or pool_class.__module__.split(".")[0] == "redis"
        """True: SETs hand array memory to the socket; False (fakeredis): join, then SET."""

    def store(self, items: list[Item], attempt: Attempt) -> None:
        """SET every item with a PX TTL of `TTL_MS`."""
        attempt(lambda: self._store_once(items), "storing chunks")

    def fetch(
        self, keys: list[str], chunk_bytes: int, attempt: Attempt
    ) -> Iterator[tuple[str, bytes | None]]:
        """Each of `keys` with its value (None: no such key), in order: GETs pipelined, at
        most FETCH_BYTES per round trip (`chunk_bytes`: the size of one value, at most)."""
        per_trip = max(1, FETCH_BYTES // max(chunk_bytes, 1))
        for start in range(0, len(keys), per_trip):
            group = keys[start : start + per_trip]
            raws = attempt(functools.partial(self._get_all, group), f"reading {group[0]}")
            yield from zip(group, raws, strict=True)

    def _store_once(self, items: list[Item]) -> None:
        if not self.fast_set:
            self._store_routed(items)
            return
        conn = self.conn
        if not isinstance(conn, RedisCluster):
            failed = send_sets(conn.connection_pool, items)
        else:
            by_node: dict[str, tuple[Any, list[Item]]] = {}
            for key, parts in items:
                node = conn.get_node_from_key(key)
                pool = conn.get_redis_connection(node).connection_pool
                by_node.setdefault(node.name, (pool, []))[1].append((key, parts))
            try:
                failed = [
                    item for pool, group in by_node.values() for item in send_sets(pool, group)
                ]
            except UNAVAILABLE:
                failed = items  # a primary is gone: let redis-py find the new slot owners
        if failed:  # MOVED/ASK (or a node down): redis-py routes and refreshes its slot map
            self._store_routed(failed)

    def _store_routed(self, items: list[Item]) -> None:
        """SETs through the client's own pipeline: one copy of each value (joined parts)."""
        pipe = self.conn.pipeline(transaction=False)
        for key, parts in items:
            pipe.set(key, blobs.join(parts), px=TTL_MS)
        pipe.execute()

    def _get_all(self, keys: list[str]) -> list[Any]:
        """The values at `keys` in one round trip."""
        if len(keys) == 1:
            return [self.conn.get(keys[0])]
        pipe = self.conn.pipeline(transaction=False)
        for key in keys:
            pipe.get(key)
        return pipe.execute()
