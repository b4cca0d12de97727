"""Collectives over Redis for the ranks of one world: allreduce, broadcast and barrier.

allreduce is a reduce-scatter then an all-gather through the server. The tensors are
flattened into one vector per dtype and cut into K = N * P chunks (N ranks, P pieces per rank
so that no Redis value exceeds `max_value_bytes`); rank r owns chunks r*P .. r*P+P-1.

1. scatter: every rank SETs each chunk it does not own at `grad(world, step, rank, chunk)`,
   then adds a "scatter" notice (with a digest of its tensor layout) to the step's stream;
2. reduce: rank r GETs its chunks from every other rank as their notices arrive, sums them in
   float64 (also for float16/float32: one rounding at the end, not N), divides by N, casts back
   to the tensor's dtype, SETs the result at `grad_reduced(world, step, chunk)` and notifies;
3. gather: every rank GETs the other ranks' reduced chunks and assembles the result.

Bytes through the server for S payload bytes: in = (N-1)S scattered + S reduced = N*S;
out = (N-1)S to the owners + (N-1)S gathered = 2(N-1)S; in + out = (3N-2)S, i.e. each
rank's byte crosses the server (3N-2)/N times (a naive hub: every rank reads every other's
whole vector, N*S in + N(N-1)S out).

Waiting is one XREAD BLOCK over the step's notice stream and the job's journal at once, so
a WorldChanged wakes the waiter, which raises `WorldChangedError`; the worker's view is also
rechecked every `WAKE_S`. Every key has a PX TTL, and the keys of an operation are unlinked
when this rank starts the operation after the next one: every operation here synchronises
all ranks, so having finished operation i+1 proves that every rank has finished i.

Large values: redis-py 8's default packer joins the command into one bytes object (a copy
of the whole value, on top of the copy that made the blob). Against a real redis-server
SETs go out through a pooled connection as a list of parts (`send_packed_command`): the
array memory itself is handed to `sendall`, nothing is joined. fakeredis has no socket, so
there the blob is joined and stored with a plain SET. GET returns bytes (hiredis's one copy
out of the socket); `tensors.unpack` views them without copying. Measured by
bench/allreduce.py (2 CPUs, redis-server 7.0, 64 MiB): SET through the default packer
0.85 GB/s, through parts 3.1-3.5 GB/s; GET 1.3-1.4 GB/s.

On Redis Cluster the chunk, reduced and broadcast keys carry a per-primary hash tag
(`worker/placement.py`: chunk i on primary i mod M), so a step's bytes are spread over every
primary; each notice names the writer's tags (field `t`) and readers use them, so ranks
need not agree on the slot map. SETs go straight to the owning node's connection pool (the
parts path); a MOVED/ASK reply or a node that is gone sends those SETs through redis-py's
routed pipeline instead, which follows the slot and refreshes its map. The notice stream
stays in the job's slot: it is XREAD together with the journal.

A call is named by (world version, step, op): calling the same op twice for one step of one
world mixes their notices. The coordinator starts a new world on every membership change, so
an aborted step is retried in a new world and never collides with itself.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar

import numpy as np
import redis
from redis.cluster import RedisCluster

from cohort.events.codec import decode_fact
from cohort.events.connection import UNAVAILABLE, Client, is_cluster, text
from cohort.events.errors import DecodeError
from cohort.events.keys import Keys
from cohort.events.models import WorldChanged
from cohort.events.streams import ZERO, Entry, entries, read_reply

from . import placement
from . import tensors as blobs
from .errors import WaitTimeout, WorkerError, WorldChangedError
from .retry import Link, describe, with_retry
from .view import Assignment

T = TypeVar("T")
LOG = logging.getLogger("cohort.collective")

TTL_MS = 10 * 60 * 1000
"""Every collective key expires after this, whatever happens to the ranks that wrote it."""
WAKE_S = 0.25
"""How often a blocked waiter rechecks the worker's view (the journal wakes it at once)."""
JOURNAL_LOOKBACK = 16
"""Journal entries checked at call start for a WorldChanged the worker has not folded yet."""
FETCH_BYTES = 32 * 1024 * 1024
"""Chunks fetched in one round trip, at most (their replies are held until unpacked)."""
SMALL_PART = 64 * 1024
FLOATS = ("<f2", "<f4", "<f8")


class CollectiveError(WorkerError):
    """A collective could not complete (ranks disagree, a key vanished, Redis failed)."""


class CollectiveTimeout(CollectiveError, WaitTimeout):
    """Some ranks did not do their part in time; the message names them."""


class Member(Protocol):
    """What a collective needs of the worker: `worker.client.Worker` satisfies it."""

    @property
    def id(self) -> str: ...

    @property
    def world_version(self) -> int: ...

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def assignment(self) -> Assignment | None: ...


@dataclass(frozen=True, slots=True)
class World:
    """The world a call runs in, fixed when the call starts."""

    version: int
    rank: int
    size: int


@dataclass(frozen=True, slots=True)
class Layout:
    """Which tensors go in which dtype vector, in a rank-independent (sorted) order."""

    groups: tuple[tuple[str, tuple[tuple[str, tuple[int, ...]], ...]], ...]

    @property
    def digest(self) -> str:
        return hashlib.blake2b(repr(self.groups).encode(), digest_size=12).hexdigest()

    def sizes(self) -> dict[str, int]:
        return {g: sum(int(np.prod(s)) for _, s in members) for g, members in self.groups}


def flatten(tensors: Mapping[str, np.ndarray]) -> tuple[Layout, dict[str, np.ndarray]]:
    """One flat vector per float dtype (a view, not a copy, when a dtype has one tensor)."""
    by_dtype: dict[str, list[tuple[str, np.ndarray]]] = {}
    for name in sorted(tensors):
        array = np.asarray(tensors[name])
        dtype = array.dtype.newbyteorder("<").str if array.dtype.byteorder == ">" else None
        dtype = dtype or array.dtype.str
        if dtype not in FLOATS:
            raise CollectiveError(
                f"tensor {name!r} has dtype {array.dtype.str!r}; allreduce averages "
                f"{list(FLOATS)} (cast other tensors first)"
            )
        by_dtype.setdefault(dtype, []).append((name, array))
    layout = Layout(
        tuple(
            (g, tuple((name, tuple(a.shape)) for name, a in members))
            for g, members in sorted(by_dtype.items())
        )
    )
    flats: dict[str, np.ndarray] = {}
    for g, members in sorted(by_dtype.items()):
        parts = [np.asarray(a, dtype=g).reshape(-1) for _, a in members]
        flats[g] = parts[0] if len(parts) == 1 else np.concatenate(parts)
    return layout, flats


def unflatten(layout: Layout, flats: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for g, members in layout.groups:
        at = 0
        for name, shape in members:
            count = int(np.prod(shape))
            out[name] = flats[g][at : at + count].reshape(shape)
            at += count
    return out


Transport = Literal["float32", "float16"]
TRANSPORTS: tuple[Transport, ...] = ("float32", "float16")
HALF_MAX = float(np.finfo(np.float16).max)


def _same(chunk: dict[str, np.ndarray], call: _Call) -> dict[str, np.ndarray]:
    return chunk


def _half(chunk: dict[str, np.ndarray], call: _Call) -> dict[str, np.ndarray]:
    """float32 (and the float64 sums of float32 values) as float16 on the wire; others as they are.

    A finite value beyond float16's range would arrive as inf, so it is refused instead."""
    out = {}
    for g, a in chunk.items():
        if g != "<f4":
            out[g] = a
            continue
        with np.errstate(over="ignore"):  # an overflow is reported below, by value
            half = a.astype("<f2")
        if np.isinf(half).any() and not np.isinf(a[np.isinf(half)]).all():
            biggest = float(np.nanmax(np.abs(a[np.isfinite(a)])))
            raise CollectiveError(
                f"{call.what()}: a float32 value of magnitude {biggest:.4g} exceeds float16's "
                f"range ({HALF_MAX:g}); scale the values down or use transport='float32'"
            )
        out[g] = half
    return out


def _bounds(sizes: Mapping[str, int], k: int) -> dict[str, list[slice]]:
    """Where chunk i of each dtype vector lies, as `tensors.chunks` cuts it."""
    out: dict[str, list[slice]] = {}
    for g, size in sizes.items():
        base, extra = divmod(size, k)
        at, cuts = 0, []
        for i in range(k):
            n = base + (1 if i < extra else 0)
            cuts.append(slice(at, at + n))
            at += n
        out[g] = cuts
    return out


def _new_assignment(fact: WorldChanged, worker: str) -> Assignment | None:
    if worker not in fact.ranks:
        return None
    rank = fact.ranks.index(worker)
    return Assignment(
        rank=rank,
        world_size=len(fact.ranks),
        world_version=fact.version,
        epoch=fact.epoch,
        start_step=fact.start_step,
        shard=fact.shards[rank],
    )


def _set_command(key: str, parts: list[blobs.Part], ttl_ms: int) -> list[blobs.Part]:
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


def _send_sets(pool: Any, items: list[tuple[str, list[blobs.Part]]]) -> list[Any]:
    """Pipeline SETs of `items` on one connection of `pool`, array memory handed to the
    socket; returns the items the server redirected (MOVED/ASK) instead of storing."""
    redirected = []
    connection = pool.get_connection()
    try:
        for key, parts in items:  # pipelined: the replies are a few bytes each
            connection.send_packed_command(_set_command(key, parts, TTL_MS))
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


@dataclass
class _Call:
    """One collective call: its world, its notice stream and where it reads the journal."""

    owner: Collective
    op: str
    step: int
    world: World
    deadline: float
    timeout: float
    events: str
    positions: dict[str, str] = field(default_factory=dict)
    notices: dict[str, dict[int, dict[bytes, bytes]]] = field(default_factory=dict)
    written: list[str] = field(default_factory=list)

    def what(self) -> str:
        return (
            f"{self.op} of step {self.step} in world {self.world.version} (rank {self.world.rank})"
        )

    def notify(self, phase: str, **extra: str | int) -> None:
        fields: dict[str, str | int] = {"p": phase, "r": self.world.rank, **extra}

        def send() -> None:
            pipe = self.owner.conn.pipeline(transaction=False)
            pipe.xadd(self.events, fields)  # type: ignore[arg-type]
            pipe.pexpire(self.events, TTL_MS)
            pipe.execute()

        # A notice sent twice after a lost reply is harmless: readers keep one per rank.
        self.owner.retry(send, self, f"notifying {phase!r}")

    def arrivals(self, phase: str, ranks: set[int]) -> Iterator[tuple[int, dict[bytes, bytes]]]:
        """Each of `ranks` with its notice of `phase`, as the notices arrive."""
        for batch in self.arrived(phase, ranks):
            yield from batch

    def arrived(
        self, phase: str, ranks: set[int]
    ) -> Iterator[list[tuple[int, dict[bytes, bytes]]]]:
        """The notices of `phase` from `ranks`, every one already there at once, in rank
        order (so their chunks can be fetched in one round trip)."""
        pending = set(ranks)
        while pending:
            seen = self.notices.get(phase, {})
            ready = sorted(pending & seen.keys())
            if ready:
                pending.difference_update(ready)
                yield [(rank, seen[rank]) for rank in ready]
            if pending:
                self._read(phase, pending)

    def tags(self, notice: dict[bytes, bytes], rank: int) -> tuple[str, ...]:
        """The chunk tags `rank` wrote with, as its notice names them."""
        try:
            return placement.decode(notice.get(b"t"))
        except ValueError as exc:
            raise CollectiveError(f"{self.what()}: rank {rank}'s notice: {exc}") from None

    def check_world(self) -> None:
        member = self.owner.worker
        if member.world_version > self.world.version:
            raise WorldChangedError(self.step, member.assignment)

    def see_journal(self, rows: list[Entry]) -> None:
        for _, fields in rows:
            raw = fields.get(b"e")
            if raw is None or b"WorldChanged" not in raw:
                continue
            try:
                fact = decode_fact(raw)
            except DecodeError:
                continue  # the worker's tail logs undecodable facts
            if isinstance(fact, WorldChanged) and fact.version > self.world.version:
                raise WorldChangedError(self.step, _new_assignment(fact, self.owner.worker.id))

    def _read(self, phase: str, pending: set[int]) -> None:
        self.check_world()
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise CollectiveTimeout(
                f"{self.what()}: no {phase!r} from ranks {sorted(pending)} within "
                f"{self.timeout:g} s; those ranks are slow, stuck or gone"
            )
        block = max(1, int(min(remaining, WAKE_S) * 1000))
        reply = self.owner.retry(
            lambda: self.owner.conn.xread(self.positions, block=block),  # type: ignore[arg-type]
            self,
            "waiting for peers",
        )
        for key, rows in read_reply(reply).items():
            if rows:
                self.positions[key] = rows[-1].id
            if key == self.owner.keys.journal:
                self.see_journal(rows)
                continue
            for _, fields in rows:
                try:
                    rank = int(fields[b"r"])
                    kind = text(fields[b"p"])
                except (KeyError, ValueError, UnicodeDecodeError):
                    continue
                self.notices.setdefault(kind, {}).setdefault(rank, fields)


class Collective:
    """allreduce / broadcast / barrier for one rank; one instance per training process."""

    def __init__(
        self,
        conn: Client,
        job: str,
        worker: Member,
        max_value_bytes: int = blobs.DEFAULT_MAX_VALUE_BYTES,
    ) -> None:
        self.conn = conn
        self.keys = Keys(job)
        self.worker = worker
        self.max_value_bytes = max_value_bytes
        self._done: deque[list[str]] = deque()
        self.placement = placement.Placement(conn, self.keys)
        pool = getattr(conn, "connection_pool", None)
        pool_class = getattr(pool, "connection_class", type(None))
        self.fast_set = is_cluster(conn) or pool_class.__module__.split(".")[0] == "redis"
        """True: SETs hand array memory to the socket; False (fakeredis): join, then SET."""
        link = getattr(worker, "link", None)
        self.link: Link = link if isinstance(link, Link) else Link(LOG, describe(conn))
        self._never = threading.Event()

    # ------------------------------------------------------------ public
    def allreduce(
        self,
        tensors: Mapping[str, np.ndarray],
        step: int,
        timeout: float = 60.0,
        world: int | None = None,
        transport: Transport = "float32",
    ) -> dict[str, np.ndarray]:
        """The mean of `tensors` over the ranks of the current world (same names and shapes).

        `world`: the world version the caller prepared this step for. If the worker has
        already moved on to another world, WorldChangedError is raised instead of running
        the step in a world whose start (e.g. a weights broadcast) the caller never saw.

        `transport="float16"` sends float32 values as float16 (half the bytes through
        Redis); sums are still taken in float64, and every rank gets the same result,
        rounded to float16 once per contribution and once after the mean. Every rank
        of a step must pass the same transport.
        """
        if transport not in TRANSPORTS:
            raise CollectiveError(
                f"transport {transport!r} is not one of {', '.join(map(repr, TRANSPORTS))}"
            )
        layout, flats = flatten(tensors)
        call = self._begin("allreduce", step, timeout, world)
        if call is None:
            return unflatten(layout, {g: f.copy() for g, f in flats.items()})
        return self._run(call, lambda: self._allreduce(call, layout, flats, transport))

    def broadcast(
        self,
        tensors: Mapping[str, np.ndarray] | None,
        root: int,
        step: int,
        timeout: float = 60.0,
        world: int | None = None,
    ) -> dict[str, np.ndarray]:
        """`root`'s tensors on every rank (read-only views on receivers; `root` passes its own)."""
        call = self._begin("broadcast", step, timeout, world)
        size = call.world.size if call else 1
        if not 0 <= root < size:
            raise CollectiveError(f"broadcast root {root} is not a rank of a world of {size}")
        mine = call is None or call.world.rank == root
        if mine and tensors is None:
            raise CollectiveError(f"rank {root} is the broadcast root but passed no tensors")
        if call is None:
            return dict(tensors or {})
        return self._run(call, lambda: self._broadcast(call, tensors, root))

    def barrier(self, step: int, timeout: float = 60.0, world: int | None = None) -> None:
        """Return once every rank of the current world reached the barrier of `step`."""
        call = self._begin("barrier", step, timeout, world)
        if call is None:
            return
        others = set(range(call.world.size)) - {call.world.rank}

        def arrive() -> None:
            call.notify("arrived")
            for _ in call.arrivals("arrived", others):
                pass

        self._run(call, arrive)

    # ------------------------------------------------------------ the machinery
    def world(self) -> World:
        """(version, rank, size) of the worker's current world, read consistently."""
        member = self.worker
        while True:
            version = member.world_version
            world = World(version, member.rank, member.world_size)
            if member.world_version == version:
                return world

    def _begin(
        self, op: str, step: int, timeout: float, expected: int | None = None
    ) -> _Call | None:
        """Fix the world and the journal position; None for a world of one (nothing to do)."""
        world = self.world()
        if expected is not None and world.version != expected:
            raise WorldChangedError(step, self.worker.assignment)
        if world.size == 1:
            return None
        call = _Call(
            owner=self,
            op=op,
            step=step,
            world=world,
            deadline=time.monotonic() + timeout,
            timeout=timeout,
            events=self.keys.step_events(world.version, step, op),
        )
        try:
            self.retry(self._cleanup, call, "deleting finished keys")
            recent: Any = self.retry(
                lambda: self.conn.xrevrange(self.keys.journal, "+", "-", count=JOURNAL_LOOKBACK),
                call,
                "reading the journal",
            )
        except redis.RedisError as exc:
            raise CollectiveError(f"{call.what()}: Redis failed: {exc}") from exc
        rows = entries(recent)
        call.see_journal(rows)
        call.positions = {call.events: ZERO, self.keys.journal: rows[0].id if rows else ZERO}
        call.written.append(call.events)
        return call

    def _run(self, call: _Call, body: Any) -> Any:
        try:
            return body()
        except redis.RedisError as exc:
            raise CollectiveError(f"{call.what()}: Redis failed: {exc}") from exc
        finally:
            self._done.append(call.written)

    def _cleanup(self) -> None:
        while len(self._done) > 1:
            keys = self._done[0]
            if keys:
                self.conn.unlink(*keys)
            self._done.popleft()

    def retry(self, op: Callable[[], T], call: _Call, what: str) -> T:
        """`op` retried with backoff while Redis is unreachable, until the call's deadline.

        Every Redis operation of a collective is idempotent (SET of the same bytes, GET,
        XREAD from the same positions, a notice readers dedupe by rank), so a restart of
        Redis with its AOF costs the step time, not the step.
        """
        return with_retry(
            op, self._never, self.link, f"{call.what()}: {what}", deadline=call.deadline
        )

    def _store(self, call: _Call, items: list[tuple[str, list[blobs.Part]]]) -> None:
        call.written.extend(key for key, _ in items)
        self.retry(lambda: self._store_once(items), call, "storing chunks")

    def _store_once(self, items: list[tuple[str, list[blobs.Part]]]) -> None:
        if not self.fast_set:
            self._store_routed(items)
            return
        conn = self.conn
        if not isinstance(conn, RedisCluster):
            failed = _send_sets(conn.connection_pool, items)
        else:
            by_node: dict[str, tuple[Any, list[tuple[str, list[blobs.Part]]]]] = {}
            for key, parts in items:
                node = conn.get_node_from_key(key)
                pool = conn.get_redis_connection(node).connection_pool
                by_node.setdefault(node.name, (pool, []))[1].append((key, parts))
            try:
                failed = [
                    item for pool, group in by_node.values() for item in _send_sets(pool, group)
                ]
            except UNAVAILABLE:
                failed = items  # a primary is gone: let redis-py find the new slot owners
        if failed:  # MOVED/ASK (or a node down): redis-py routes and refreshes its slot map
            self._store_routed(failed)

    def _store_routed(self, items: list[tuple[str, list[blobs.Part]]]) -> None:
        """SETs through the client's own pipeline: one copy of each value (joined parts)."""
        pipe = self.conn.pipeline(transaction=False)
        for key, parts in items:
            pipe.set(key, blobs.join(parts), px=TTL_MS)
        pipe.execute()

    def _fetch(self, call: _Call, key: str) -> dict[str, np.ndarray]:
        return next(self._fetch_all(call, [key], 0))

    def _fetch_all(
        self, call: _Call, keys: list[str], chunk_bytes: int
    ) -> Iterator[dict[str, np.ndarray]]:
        """The chunks at `keys`, in order: GETs pipelined, at most FETCH_BYTES per round trip
        (`chunk_bytes`: the size of one)."""
        per_trip = max(1, FETCH_BYTES // max(chunk_bytes, 1))
        for start in range(0, len(keys), per_trip):
            group = keys[start : start + per_trip]
            raws = self.retry(functools.partial(self._get_all, group), call, f"reading {group[0]}")
            for key, raw in zip(group, raws, strict=True):
                if raw is None:
                    call.check_world()
                    raise CollectiveError(f"{call.what()}: {key} is gone (expired or deleted)")
                yield blobs.unpack(raw)

    def _get_all(self, keys: list[str]) -> list[Any]:
        if len(keys) == 1:
            return [self.conn.get(keys[0])]
        pipe = self.conn.pipeline(transaction=False)
        for key in keys:
            pipe.get(key)
        return pipe.execute()

    def _allreduce(
        self, call: _Call, layout: Layout, flats: dict[str, np.ndarray], transport: Transport
    ) -> dict[str, np.ndarray]:
        keys, world, step = self.keys, call.world, call.step
        wire = _half if transport == "float16" else _same
        shape = layout.digest if transport == "float32" else f"{layout.digest}/{transport}"
        n, me = world.size, world.rank
        total = sum(f.nbytes for f in flats.values())
        per_rank = blobs.pieces(-(-total // n), self.max_value_bytes)
        k = n * per_rank
        cuts = _bounds(layout.sizes(), k)
        owned = range(me * per_rank, (me + 1) * per_rank)
        others = set(range(n)) - {me}
        tags = self.placement.tags()
        where = placement.encode(tags)

        def piece(i: int, vectors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
            return {g: vectors[g][cuts[g][i]] for g in cuts}

        def check(got: dict[str, np.ndarray], i: int, rank: int) -> dict[str, np.ndarray]:
            want = {g: cuts[g][i].stop - cuts[g][i].start for g in cuts}
            have = {g: a.size for g, a in got.items()}
            if have != want or any(a.ndim != 1 for a in got.values()):
                raise CollectiveError(
                    f"{call.what()}: chunk {i} from rank {rank} holds {have}, expected {want}"
                )
            return got

        # 1. scatter the chunks other ranks own
        self._store(
            call,
            [
                (
                    keys.grad(world.version, step, me, i, placement.tag_of(tags, i)),
                    blobs.pack(wire(piece(i, flats), call)),
                )
                for i in range(k)
                if i not in owned
            ],
        )
        call.notify("scatter", l=shape, t=where)

        # 2. reduce the chunks this rank owns, as contributions arrive
        sums = {
            i: {g: a.astype(np.float64) for g, a in wire(piece(i, flats), call).items()}
            for i in owned
        }
        chunk_bytes = -(-total // k)
        for batch in call.arrived("scatter", others):
            wanted = []
            for rank, notice in batch:
                if text(notice.get(b"l", b"")) != shape:
                    raise CollectiveError(
                        f"{call.what()}: rank {rank} passed tensors of another layout or "
                        "transport (names, dtypes, shapes or float16/float32 differ); every "
                        "rank must pass the same"
                    )
                theirs = call.tags(notice, rank)
                for i in owned:
                    tag = placement.tag_of(theirs, i)
                    wanted.append((rank, i, keys.grad(world.version, step, rank, i, tag)))
            chunks = self._fetch_all(call, [key for _, _, key in wanted], chunk_bytes)
            for (rank, i, _), chunk in zip(wanted, chunks, strict=True):
                for g, a in check(chunk, i, rank).items():
                    sums[i][g] += a
        result = {g: np.empty(size, dtype=g) for g, size in layout.sizes().items()}
        for i in owned:
            for a in sums[i].values():
                np.divide(a, n, out=a)
            for g, a in wire(sums[i], call).items():  # the owner keeps what the others get
                result[g][cuts[g][i]] = a
        del sums
        self._store(
            call,
            [
                (
                    keys.grad_reduced(world.version, step, i, placement.tag_of(tags, i)),
                    blobs.pack(wire(piece(i, result), call)),
                )
                for i in owned
            ],
        )
        call.notify("reduced", t=where)

        # 3. gather the chunks the other ranks reduced
        for batch in call.arrived("reduced", others):
            wanted = []
            for rank, notice in batch:
                theirs = call.tags(notice, rank)
                for i in range(rank * per_rank, (rank + 1) * per_rank):
                    tag = placement.tag_of(theirs, i)
                    wanted.append((rank, i, keys.grad_reduced(world.version, step, i, tag)))
            chunks = self._fetch_all(call, [key for _, _, key in wanted], chunk_bytes)
            for (rank, i, _), chunk in zip(wanted, chunks, strict=True):
                for g, a in check(chunk, i, rank).items():
                    result[g][cuts[g][i]] = a
        return unflatten(layout, result)

    def _broadcast(
        self, call: _Call, tensors: Mapping[str, np.ndarray] | None, root: int
    ) -> dict[str, np.ndarray]:
        world = call.world
        receivers = set(range(world.size)) - {root}
        pieces: list[tuple[str, list[blobs.Part]]] = []
        if world.rank == root:
            assert tensors is not None
            groups = self._groups(call, tensors)
            tags = self.placement.tags()
            pieces = [
                (
                    self.keys.grad_broadcast(
                        world.version, call.step, i, placement.tag_of(tags, i)
                    ),
                    blobs.pack(group),
                )
                for i, group in enumerate(groups)
            ]
            self._store(call, pieces)
            call.notify("sent", n=len(pieces), t=placement.encode(tags))
            result = dict(tensors)
        else:
            _, notice = next(call.arrivals("sent", {root}))
            theirs = call.tags(notice, root)
            result = {}
            for i in range(int(notice.get(b"n", b"0"))):
                key = self.keys.grad_broadcast(
                    world.version, call.step, i, placement.tag_of(theirs, i)
                )
                result.update(self._fetch(call, key))
            call.notify("got")
        for _ in call.arrivals("got", receivers - {world.rank}):
            pass
        if world.rank == root:  # every receiver has its copy: the pieces can go now
            done = [key for key, _ in pieces]
            self.retry(lambda: self.conn.unlink(*done), call, "deleting the pieces")
            call.written = [key for key in call.written if key not in done]
        return result

    def _groups(self, call: _Call, tensors: Mapping[str, np.ndarray]) -> list[dict[str, Any]]:
        """Whole tensors packed into blobs of at most `max_value_bytes` each."""
        budget = self.max_value_bytes - 64 * 1024
        groups: list[dict[str, Any]] = [{}]
        used = 0
        for name, array in tensors.items():
            size = np.asarray(array).nbytes + blobs.TENSOR_ALIGN
            if size > budget:
                raise CollectiveError(
                    f"{call.what()}: tensor {name!r} is {size} bytes; broadcast sends whole "
                    f"tensors of at most {budget} bytes (max_value_bytes {self.max_value_bytes})"
                )
            if used + size > budget and groups[-1]:
                groups.append({})
                used = 0
            groups[-1][name] = array
            used += size
        return groups
