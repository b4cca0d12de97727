"""Collectives over Redis for the ranks of one world: allreduce, broadcast and barrier.

allreduce is a reduce-scatter then an all-gather through the server. The tensors are
flattened into one vector per dtype and cut into K = N * P chunks (N ranks, P pieces per rank
so that no Redis value exceeds `max_value_bytes`); rank r owns chunks r*P .. r*P+P-1
(`worker/collective/layout.py`).

1. scatter: every rank SETs each chunk it does not own at `grad(world, step, rank, chunk)`,
   then adds a "scatter" notice (with a digest of its tensor layout) to its notice stream;
   where an owner's share is 1 MiB or more, owner by owner from the next rank on, with a
   "scatter/<owner>" notice after each owner's chunks (`STAGGER_BYTES`);
2. reduce: rank r GETs its chunks from every other rank as their notices arrive, checks each
   has the call's sizes and dtypes, sums them in float64 (also for float16/float32: one
   rounding at the end, not N), divides by N (integers: summed in int64, exactly, and not
   divided), casts back to the tensor's dtype, SETs the
   result at `grad_reduced(world, step, chunk)` and notifies;
3. gather: every rank GETs the other ranks' reduced chunks, checks and assembles them.

Every key a rank writes, its notice stream too, ends in `/<its worker>` (`Keys.by`), and a
reader names the keys of rank r from the world's rank -> worker map (`World.members`: the
WorldChanged's `ranks`), never from what a notice says. Each rank writes its own notice
stream per call and reads only those of the ranks it waits for; a notice counts as the
rank whose stream holds it, whatever its fields claim. With per-worker credentials a
worker's Redis user may write only keys ending in its own name (`acl.rules(worker=W)`), so
no rank can forge another's notice (an abort, tags pointing at its own keys) or overwrite
its chunks: what a rank reads as r's was written by r. A blob of r's that does not unpack
or has other sizes or dtypes than the call's fails the call at once with CorruptDataError
naming r, its worker and the key.

Bytes through the server for S payload bytes: in = (N-1)S scattered + S reduced = N*S;
out = (N-1)S to the owners + (N-1)S gathered = 2(N-1)S; in + out = (3N-2)S, i.e. each
rank's byte crosses the server (3N-2)/N times (a naive hub: every rank reads every other's
whole vector, N*S in + N(N-1)S out). How the bytes are sent and fetched is `wire.py`.

Waiting is one XREAD BLOCK over the other ranks' notice streams and the job's journal at
once (N streams for N ranks, all in the job's slot), so a WorldChanged wakes the waiter,
which raises `WorldChangedError`; the worker's view is also rechecked every `WAKE_S`. Every
key has a PX TTL, and the keys of an operation are unlinked when this rank starts the
operation after the next one: every operation here synchronises all ranks, so having
finished operation i+1 proves that every rank has finished i.

On Redis Cluster the chunk, reduced and broadcast keys carry a per-primary hash tag
(`placement.py`: chunk i on primary i mod M), so a step's bytes are spread over every
primary; each notice names the writer's tags (field `t`) and readers use them, so ranks
need not agree on the slot map. Tags only place a key: its name still ends in the writer's
own, so they cannot point a reader at another writer's key. The notice streams stay in the
job's slot: they are XREAD together with the journal.

A call's deadline (`timeout`, default $COHORT_COLLECTIVE_TIMEOUT or 60 s) counts the time
Redis answers, not the time it is away: what the worker's `Link` counts as outage moves the
deadline on, so a Redis restart of minutes costs the step its time, not the step. An outage
longer than `ride_out` ($COHORT_RIDE_OUT, default 5 minutes) ends the call with
`OutageTooLongError` naming the URL and the step.

Before a call writes blobs it checks the memory budget the leader publishes
(`events/budget.py`): a step whose blobs would leave less than a quarter of maxmemory for
the journal and inbox is refused before anything is written, and the refusing rank's
"abort" notice ends the call on every other rank at once (`MemoryBudgetError`, naming
maxmemory). A write Redis refuses for memory (OOM) ends the call the same way. A refused
call's blobs are unlinked by the ranks that wrote them. Only rank r can write its abort
(in its own stream): another rank cannot end the call in r's name.

A call is named by (world version, step, op): calling the same op twice for one step of one
world mixes their notices. The coordinator starts a new world on every membership change, so
an aborted step is retried in a new world and never collides with itself.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np
import redis

from cohort.events import budget
from cohort.events.codec import decode_fact
from cohort.events.connection import Client, text
from cohort.events.errors import DecodeError
from cohort.events.keys import Keys
from cohort.events.models import WorldChanged
from cohort.events.streams import ZERO, Entry, Stream, entries, read_reply
from cohort.worker.collective import calls, placement
from cohort.worker.collective import tensors as blobs
from cohort.worker.collective.layout import (
    TRANSPORTS,
    Chunk,
    Layout,
    Transport,
    alignment,
    bounds,
    flatten,
    piece,
    received,
    transported,
    unflatten,
    wire_bytes,
)
from cohort.worker.collective.wire import TTL_MS, Item, Wire

# Users import CollectiveError, CollectiveTimeoutError (cohort/__init__.py) and Transport from here.
from cohort.worker.errors import (
    BlobError,
    CollectiveError,
    CollectiveTimeoutError,
    CorruptDataError,
    MemoryBudgetError,
    WorldChangedError,
)
from cohort.worker.membership.retry import Link, ride_out_of, seconds_of, url_of, with_retry
from cohort.worker.membership.view import Assignment, WorldPlan

T = TypeVar("T")
LOG = logging.getLogger("cohort.collective")

ENV_TIMEOUT = "COHORT_COLLECTIVE_TIMEOUT"
DEFAULT_TIMEOUT = 60.0
"""Seconds a call may wait for its peers while Redis answers (outages do not count)."""
WAKE_S = 0.25
"""How often a blocked waiter rechecks the worker's view (the journal wakes it at once)."""
JOURNAL_LOOKBACK = 16
"""Journal entries checked at call start for a WorldChanged the worker has not folded yet."""
STAGGER_BYTES = 1024 * 1024
"""An owner's share of a call (its chunks from one rank) from which the scatter is
staggered: each owner notified as soon as its chunks are written, so that the server sends
chunks to owners while it still receives others' (its link busy both ways at once, where
one notice after all the writes leaves it idle one way, then the other). Below, a round
trip per owner costs more than the overlap gains."""
_NEVER = threading.Event()
"""The stop event of every retry here: never set, a call ends at its deadline instead."""
Notice = dict[bytes, bytes]


class Participant(Protocol):
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

    @property
    def ranks(self) -> tuple[str, ...]:
        """The worker holding each rank of the current world, in rank order."""
        ...


@dataclass(frozen=True, slots=True)
class World:
    """The world a call runs in, fixed when the call starts."""

    version: int
    rank: int
    size: int
    members: tuple[str, ...] = ()
    """The worker holding each rank, in rank order (the WorldChanged's `ranks`): every key
    holding a rank's data is named for that worker, and only it may write there."""

    @property
    def others(self) -> set[int]:
        """The ranks of this world but this one."""
        return set(range(self.size)) - {self.rank}

    def member(self, rank: int) -> str:
        """The worker of `rank`: the writer of every key and notice of that rank's."""
        if len(self.members) != self.size:
            raise CollectiveError(
                f"world {self.version} of {self.size} ranks names {len(self.members)} "
                f"workers ({list(self.members)[:8]}): a call needs the worker of each rank"
            )
        return self.members[rank]


@dataclass(frozen=True, slots=True)
class _Chunking:
    """How one allreduce cuts its vectors and tags its keys: what its three phases share."""

    layout: Layout
    transport: Transport
    count: int
    """Chunks of the whole call (K = N*P)."""
    per_rank: int
    """Chunks each rank owns (P): rank r owns chunks r*P .. r*P+P-1."""
    cuts: dict[str, list[slice]]
    """Where chunk i of each dtype vector lies (`layout.bounds`)."""
    chunk_bytes: int
    """The size of one chunk, at most: how many GETs one round trip can carry."""
    tags: tuple[str, ...]
    """The hash tags this rank writes its chunks with (() on one server)."""

    @property
    def signature(self) -> str:
        """The scatter notice's field `l`: every rank must pass the same layout and transport."""
        digest = self.layout.digest
        return digest if self.transport == "float32" else f"{digest}/{self.transport}"

    def owned(self, rank: int) -> range:
        return range(rank * self.per_rank, (rank + 1) * self.per_rank)

    @property
    def staggered(self) -> bool:
        """Whether each owner's share is large enough to be notified on its own."""
        return self.per_rank * self.chunk_bytes >= STAGGER_BYTES

    def scatter_phase(self, owner: int) -> str:
        """The notice that tells `owner` a rank's parts of its chunks are written."""
        return f"scatter/{owner}" if self.staggered else "scatter"

    def scatters(self, rank: int) -> list[tuple[str, list[int]]]:
        """What `rank` scatters, in order: (notice, the chunks it covers). Staggered, owner
        by owner from the next rank on (so no two ranks start on the same owner); else all
        at once."""
        size = self.count // self.per_rank
        if not self.staggered:
            return [("scatter", [i for i in range(self.count) if i not in self.owned(rank)])]
        owners = [(rank + k) % size for k in range(1, size)]
        return [(self.scatter_phase(o), list(self.owned(o))) for o in owners]

    def sent(self, i: int, vectors: Mapping[str, np.ndarray], what: str) -> Chunk:
        """Chunk i of `vectors` as it travels (float32 rounded to float16, or int8 blocks,
        under those transports)."""
        return transported(piece(self.cuts, i, vectors), self.transport, what)

    def decoded(self, chunk: Chunk, what: str) -> Chunk:
        """A chunk as it travelled, as float values again (int8 levels times their scales)."""
        return received(chunk, self.transport, what)

    def check(self, got: Chunk, i: int, source: Source, what: str) -> Chunk:
        """`got` decoded, if it has the sizes and dtypes of chunk i; else CorruptDataError
        naming the rank and key it came from."""
        where = f"{what}: chunk {i} from {source.name}"
        try:
            got = self.decoded(got, where)
        except CollectiveError as exc:
            raise source.refused(str(exc)) from None
        want = {g: (cut[i].stop - cut[i].start, self.arrives_as(g)) for g, cut in self.cuts.items()}
        have = {g: (a.size, a.dtype.str) for g, a in got.items()}
        if have != want or any(a.ndim != 1 for a in got.values()):
            raise source.refused(f"{where} holds {have}, expected {want} (size, dtype)")
        return got

    def arrives_as(self, group: str) -> str:
        """The dtype a vector of `group` has once a chunk of it is decoded: float32 values
        travel as float16 under that transport, and come back as float32 from int8."""
        return "<f2" if group == "<f4" and self.transport == "float16" else group


@dataclass(frozen=True, slots=True)
class Source:
    """Where a blob of a call was read: the rank whose data it is, its worker, the key."""

    rank: int
    worker: str
    key: str

    @property
    def name(self) -> str:
        return f"rank {self.rank} (worker {self.worker!r}, key {self.key})"

    def refused(self, why: str) -> CorruptDataError:
        """The error for a blob of this source that failed verification for `why` (which
        names the source)."""
        message = f"{why}; rank {self.rank}'s data failed verification"
        return CorruptDataError(message, self.rank, self.worker, self.key)


@dataclass
class _Call:
    """One collective call: its world, its notice stream and where it reads the journal."""

    owner: Collective
    op: str
    step: int
    world: World
    deadline: float
    """When the call gives up (time.monotonic), if Redis never went away meanwhile."""
    timeout: float
    events: str
    """This rank's own notice stream for the call (the others read it)."""
    outage: float = 0.0
    """The link's outage count when the call began: what it grew since extends the deadline."""
    positions: dict[str, str] = field(default_factory=dict)
    streams: dict[str, int] = field(default_factory=dict)
    """The notice stream of each other rank, and that rank: a notice counts as the rank
    whose stream it is in, whatever its fields say."""
    notices: dict[str, dict[int, Notice]] = field(default_factory=dict)
    written: list[str] = field(default_factory=list)
    standing: Callable[[], bool] | None = None
    """Set: the call is among the ranks of `world` even once the job has a newer world;
    it gives up only when this says one of them is gone from the job."""

    def what(self) -> str:
        return (
            f"{self.op} of {calls.call_name(self.step)} in world {self.world.version} "
            f"(rank {self.world.rank})"
        )

    def part_key(self, rank: int, i: int, tags: tuple[str, ...]) -> Source:
        """Where rank `rank` scatters its part of chunk i, placed as `tags` say."""
        worker = self.world.member(rank)
        key = self.owner.keys.grad(
            self.world.version, self.step, rank, i, worker, placement.tag_of(tags, i)
        )
        return Source(rank, worker, key)

    def reduced_key(self, rank: int, i: int, tags: tuple[str, ...]) -> Source:
        """Where rank `rank`, the owner of chunk i, stores its mean, placed as `tags` say."""
        worker = self.world.member(rank)
        key = self.owner.keys.grad_reduced(
            self.world.version, self.step, i, worker, placement.tag_of(tags, i)
        )
        return Source(rank, worker, key)

    def piece_key(self, root: int, i: int, tags: tuple[str, ...]) -> Source:
        """Where a broadcast's root stores piece i, placed as `tags` say."""
        worker = self.world.member(root)
        key = self.owner.keys.grad_broadcast(
            self.world.version, self.step, i, worker, placement.tag_of(tags, i)
        )
        return Source(root, worker, key)

    def remaining(self) -> float:
        """Seconds left before the deadline, not counting the time Redis was away."""
        extra = self.owner.link.outage() - self.outage
        return self.deadline + extra - time.monotonic()

    def retry(self, op: Callable[[], T], what: str) -> T:
        """`op` retried with backoff while Redis is unreachable, for as long as the owner
        rides out an outage (the deadline is not spent meanwhile).

        Every Redis operation of a collective is idempotent (SET of the same bytes, GET,
        XREAD from the same positions, a notice readers dedupe by rank), so a restart of
        Redis with its AOF costs the step time, not the step.
        """
        return with_retry(
            op, _NEVER, self.owner.link, f"{self.what()}: {what}", ride_out=self.owner.ride_out
        )

    def notify(self, phase: str, **extra: str | int) -> None:
        fields: dict[str, str | int] = {"p": phase, "r": self.world.rank, **extra}

        def send() -> None:
            pipe = self.owner.conn.pipeline(transaction=False)
            pipe.xadd(self.events, fields)  # type: ignore[arg-type]
            pipe.pexpire(self.events, TTL_MS)
            pipe.execute()

        # A notice sent twice after a lost reply is harmless: readers keep one per rank.
        self.retry(send, f"notifying {phase!r}")

    def arrivals(self, phase: str, ranks: set[int]) -> Iterator[tuple[int, Notice]]:
        """Each of `ranks` with its notice of `phase`, as the notices arrive."""
        for batch in self.arrived(phase, ranks):
            yield from batch

    def arrived(self, phase: str, ranks: set[int]) -> Iterator[list[tuple[int, Notice]]]:
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

    def tags(self, notice: Notice, rank: int) -> tuple[str, ...]:
        """The chunk tags `rank` wrote with, as its notice names them (they place its keys,
        never name another writer's: each key ends in the name of the rank's worker)."""
        try:
            return placement.decode(notice.get(b"t"))
        except ValueError as exc:
            raise self.noticed(rank).refused(f"{self.what()}: {exc}") from None

    def noticed(self, rank: int) -> Source:
        """`rank`'s notice stream of this call, as the source of what a notice says."""
        worker = self.world.member(rank)
        return Source(
            rank,
            worker,
            self.owner.keys.step_events(self.world.version, self.step, self.op, worker),
        )

    def check_world(self) -> None:
        member = self.owner.worker
        if self.standing is not None:
            if not self.standing():
                raise WorldChangedError(calls.training_step(self.step), member.assignment)
        elif member.world_version > self.world.version:
            raise WorldChangedError(calls.training_step(self.step), member.assignment)

    def look_again(self) -> None:
        """Read the journal this call has not seen yet, and check the world: a blob found
        gone most often means the job moved on while this rank could not see it (cut off
        from Redis, paused), and the world it is in is the answer to give, not the blob."""
        journal = Stream(self.owner.conn, self.owner.keys.journal)
        after = self.positions.get(journal.key, ZERO)
        for rows in journal.pages(
            after, attempt=lambda read: self.retry(read, "reading the journal")
        ):
            self.positions[journal.key] = rows[-1].id
            self.see_journal(rows)
        self.check_world()

    def see_journal(self, rows: list[Entry]) -> None:
        if self.standing is not None:
            return  # a newer world does not end this call: a rank gone does
        for _, fields in rows:
            raw = fields.get(b"e")
            if raw is None or b"WorldChanged" not in raw:
                continue
            try:
                fact = decode_fact(raw)
            except DecodeError:
                continue  # the worker's tail logs undecodable facts
            if isinstance(fact, WorldChanged) and fact.version > self.world.version:
                assignment = WorldPlan.of(fact).assignment_of(self.owner.worker.id)
                raise WorldChangedError(calls.training_step(self.step), assignment)

    def _read(self, phase: str, pending: set[int]) -> None:
        if self.standing is not None and not self.standing():
            self._last_look(phase, pending)
            return
        self.check_world()
        remaining = self.remaining()
        if remaining <= 0:
            raise CollectiveTimeoutError(
                f"{self.what()}: no {phase!r} from ranks {sorted(pending)} within "
                f"{self.timeout:g} s (while Redis answered); those ranks are slow, stuck or gone"
            )
        block = max(1, int(min(remaining, WAKE_S) * 1000))
        reply = self.retry(
            lambda: self.owner.conn.xread(self.positions, block=block),  # type: ignore[arg-type]
            "waiting for peers",
        )
        self._take(reply)

    def _last_look(self, phase: str, pending: set[int]) -> None:
        """A rank of the call's world is gone from the job: what the `pending` ranks sent
        before they went still counts, so read what is there (without waiting) before
        giving up. A finished job's ranks leave as their loops end, right after their
        last reduction: the one still reducing finds their answers here, not a world change.
        WorldChangedError only if one of them never answered."""
        reply = self.retry(
            lambda: self.owner.conn.xread(self.positions),  # type: ignore[arg-type]
            "reading what the ranks sent",
        )
        self._take(reply)
        if pending - self.notices.get(phase, {}).keys():
            raise WorldChangedError(calls.training_step(self.step), self.owner.worker.assignment)

    def _take(self, reply: Any) -> None:
        """The notices and journal entries of an XREAD reply, noted."""
        for key, rows in read_reply(reply).items():
            if rows:
                self.positions[key] = rows[-1].id
            if key == self.owner.keys.journal:
                self.see_journal(rows)
                continue
            rank = self.streams.get(key)
            if rank is None:
                continue
            for _, fields in rows:
                try:
                    kind = text(fields[b"p"])
                except (KeyError, UnicodeDecodeError):
                    continue
                if kind == "abort":  # rank `rank` speaking for itself: only it writes there
                    why = text(fields.get(b"why", b"no reason given"))
                    raise MemoryBudgetError(f"{self.what()}: rank {rank} refused the step: {why}")
                self.notices.setdefault(kind, {}).setdefault(rank, fields)


class Collective:
    """allreduce / broadcast / barrier for one rank; one instance per training process."""

    def __init__(
        self,
        conn: Client,
        job: str,
        worker: Participant,
        max_value_bytes: int = blobs.DEFAULT_MAX_VALUE_BYTES,
        timeout: float | None = None,
        ride_out: float | None = None,
    ) -> None:
        """`timeout`: each call's default deadline (else $COHORT_COLLECTIVE_TIMEOUT, else 60 s),
        outage time left out; `ride_out`: how long one Redis outage may last before a call
        gives up (else $COHORT_RIDE_OUT, else 300 s)."""
        self.conn = conn
        self.timeout = seconds_of(timeout, ENV_TIMEOUT, DEFAULT_TIMEOUT)
        self.ride_out = ride_out_of(ride_out)
        self.keys = Keys(job)
        self.worker = worker
        self.max_value_bytes = max_value_bytes
        self._done: deque[list[str]] = deque()
        self.placement = placement.Placement(conn, self.keys)
        self.wire = Wire(conn)
        link = getattr(worker, "link", None)
        self.link: Link = link if isinstance(link, Link) else Link(LOG, url_of(conn))
        self.on_corrupt: Callable[[CorruptDataError], None] | None = None
        """Called with a CorruptDataError before it is raised: the worker's loop names the
        writer to the leader and waits for the world without it (worker/loop/elastic.py)."""

    # ------------------------------------------------------------ public
    def allreduce(
        self,
        tensors: Mapping[str, np.ndarray],
        step: int,
        timeout: float | None = None,
        world: int | None = None,
        transport: Transport = "float32",
    ) -> dict[str, np.ndarray]:
        """The mean of `tensors` over the ranks of the current world (same names and shapes);
        integer tensors come back as their exact sum.

        `world`: the world version the caller prepared this step for. If the worker has
        already moved on to another world, WorldChangedError is raised instead of running
        the step in a world whose start (e.g. a weights broadcast) the caller never saw.

        `transport="float16"` sends float32 values as float16 (half the bytes through
        Redis); sums are still taken in float64, and every rank gets the same result,
        rounded to float16 once per contribution and once after the mean. Every rank
        of a step must pass the same transport. `transport="int8"` sends float32 values as
        int8 blocks with a scale each (about a quarter of the bytes): each chunk's owner
        decodes every contribution, sums them in float64 and sends the mean as int8 blocks
        again, which every rank (the owner too) decodes to the same bits. Error feedback,
        which makes the rounding harmless over steps, is `worker/collective/compressors.py`'s.
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
        timeout: float | None = None,
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

    def barrier(self, step: int, timeout: float | None = None, world: int | None = None) -> None:
        """Return once every rank of the current world reached the barrier of `step`."""
        call = self._begin("barrier", step, timeout, world)
        if call is None:
            return

        def arrive() -> None:
            call.notify("arrived")
            for _ in call.arrivals("arrived", call.world.others):
                pass

        self._run(call, arrive)

    def gather(
        self,
        values: Sequence[float],
        step: int,
        world: World,
        standing: Callable[[], bool] | None,
        timeout: float | None = None,
    ) -> list[tuple[float, ...]]:
        """Every rank's `values` (a few numbers: one notice each), in rank order, among the
        ranks of `world`: the world of the step the caller trained, which the job may have
        replaced since (its ranks still answer for that step, e.g. a metric reduced after
        an epoch's last step). Exact: the numbers travel as `float.hex`. Raises
        WorldChangedError once `standing()` says a rank it waits for left or failed (no
        `standing`: once the job has a newer world)."""
        mine = tuple(float(v) for v in values)
        if world.size == 1:
            return [mine]
        timeout = self.timeout if timeout is None else timeout
        call = self.begin_in(world, "gather", step, timeout, standing)

        def gather() -> list[tuple[float, ...]]:
            call.notify("value", x=",".join(v.hex() for v in mine))
            got = {world.rank: mine}
            for rank, notice in call.arrivals("value", world.others):
                got[rank] = _values(notice, len(mine), call.noticed(rank), call.what())
            return [got[rank] for rank in range(world.size)]

        return self._run(call, gather)  # type: ignore[no-any-return]

    # ------------------------------------------------------------ the machinery
    def world(self) -> World:
        """(version, rank, size, members) of the worker's current world, read consistently."""
        member = self.worker
        while True:
            version = member.world_version
            world = World(version, member.rank, member.world_size, tuple(member.ranks))
            if member.world_version == version:
                return world

    def _begin(
        self, op: str, step: int, timeout: float | None, expected: int | None = None
    ) -> _Call | None:
        """Fix the world and the journal position; None for a world of one (nothing to do)."""
        timeout = self.timeout if timeout is None else timeout
        world = self.world()
        if expected is not None and world.version != expected:
            raise WorldChangedError(calls.training_step(step), self.worker.assignment)
        if world.size == 1:
            return None
        return self.begin_in(world, op, step, timeout)

    def begin_in(
        self,
        world: World,
        op: str,
        step: int,
        timeout: float,
        standing: Callable[[], bool] | None = None,
    ) -> _Call:
        """A call of `op` among the ranks of `world` (the current world, or a group of its
        ranks renumbered 0..n-1, as the hierarchical allreduce's host leaders are); with
        `standing`, however the job has moved on since, while it says they all remain."""
        call = _Call(
            owner=self,
            op=op,
            step=step,
            world=world,
            deadline=time.monotonic() + timeout,
            timeout=timeout,
            events=self.keys.step_events(world.version, step, op, world.member(world.rank)),
            outage=self.link.outage(),
            standing=standing,
        )
        call.streams = {call.noticed(rank).key: rank for rank in sorted(world.others)}
        try:
            call.retry(self._cleanup, "deleting finished keys")
            recent: Any = call.retry(
                lambda: self.conn.xrevrange(self.keys.journal, "+", "-", count=JOURNAL_LOOKBACK),
                "reading the journal",
            )
        except redis.RedisError as exc:
            raise CollectiveError(f"{call.what()}: Redis failed: {exc}") from exc
        rows = entries(recent)
        call.see_journal(rows)
        call.positions = {stream: ZERO for stream in call.streams}
        call.positions[self.keys.journal] = rows[0].id if rows else ZERO
        call.written.append(call.events)
        return call

    def broadcast_in(
        self, call: _Call, tensors: Mapping[str, np.ndarray] | None, root: int
    ) -> dict[str, np.ndarray]:
        """`root`'s tensors on every rank of `call.world` (see `begin_in`)."""
        return self._run(call, lambda: self._broadcast(call, tensors, root))

    def barrier_in(self, call: _Call) -> None:
        """Return once every rank of `call.world` reached it (see `begin_in`)."""

        def arrive() -> None:
            call.notify("arrived")
            for _ in call.arrivals("arrived", call.world.others):
                pass

        self._run(call, arrive)

    def allreduce_in(
        self,
        call: _Call,
        tensors: Mapping[str, np.ndarray],
        transport: Transport = "float32",
    ) -> dict[str, np.ndarray]:
        """The mean of `tensors` over the ranks of `call.world` (see `begin_in`)."""
        layout, flats = flatten(tensors)
        return self._run(call, lambda: self._allreduce(call, layout, flats, transport))

    def _run(self, call: _Call, body: Any) -> Any:
        try:
            return body()
        except MemoryBudgetError:
            self._withdraw(call)
            raise
        except CorruptDataError as exc:
            if self.on_corrupt is not None:
                self.on_corrupt(exc)
            raise
        except redis.RedisError as exc:
            raise CollectiveError(f"{call.what()}: Redis failed: {exc}") from exc
        finally:
            self._done.append(call.written)

    # ------------------------------------------------------------ the memory budget
    def _check_budget(self, call: _Call, step_bytes: int) -> None:
        """Refuse the call on every rank if `step_bytes` (all ranks' blobs of the step) do
        not fit in the budget the leader published."""
        raw = call.retry(lambda: self.conn.get(self.keys.memory), "reading the memory budget")
        why = budget.refusal(budget.Memory.decode(raw), step_bytes)  # type: ignore[arg-type]
        if why is not None:
            self._abort(call, f"Redis at {self.link.where}: {why}")

    def _abort(self, call: _Call, why: str) -> None:
        """Tell the other ranks this call is refused, and raise MemoryBudgetError."""
        self._withdraw(call)
        try:
            call.notify("abort", why=why[:1000])
        except redis.RedisError as exc:  # a full server: the others time out instead
            LOG.warning("%s: could not tell the other ranks: %s", call.what(), exc)
        raise MemoryBudgetError(f"{call.what()}: {why}")

    def _withdraw(self, call: _Call) -> None:
        """Unlink the blobs this rank wrote for a refused call (its notices stay: a rank
        that has not read the abort yet must find it)."""
        blobs_written = [key for key in call.written if key != call.events]
        if blobs_written:
            try:
                call.retry(lambda: self.conn.unlink(*blobs_written), "deleting refused blobs")
            except redis.RedisError as exc:  # they expire with their TTL
                LOG.warning("%s: could not delete its blobs: %s", call.what(), exc)
        call.written = [call.events]

    def _cleanup(self) -> None:
        while len(self._done) > 1:
            keys = self._done[0]
            if keys:
                self.conn.unlink(*keys)
            self._done.popleft()

    def _store(self, call: _Call, items: list[Item]) -> None:
        call.written.extend(key for key, _ in items)
        try:
            self.wire.store(items, call.retry)
        except redis.OutOfMemoryError as exc:
            self._abort(
                call,
                f"Redis at {self.link.where} is out of memory ({exc}): raise maxmemory "
                "(CONFIG SET maxmemory, and in redis.conf), or send fewer bytes "
                "(transport='float16', smaller tensors or buckets)",
            )

    def _fetch(
        self, call: _Call, sources: list[Source], each_bytes: int
    ) -> Iterator[dict[str, np.ndarray]]:
        """The blobs of `sources`, unpacked, in order (`each_bytes`: the size of one, at
        most); a blob that does not unpack is CorruptDataError naming its rank."""
        keys = [source.key for source in sources]
        got = self.wire.fetch(keys, each_bytes, call.retry)
        for source, (key, raw) in zip(sources, got, strict=True):
            if raw is None:
                call.look_again()
                raise CollectiveError(f"{call.what()}: {key} is gone (expired or deleted)")
            try:
                yield blobs.unpack(raw)
            except BlobError as exc:
                raise source.refused(f"{call.what()}: {source.name}: {exc}") from None

    # ------------------------------------------------------------ allreduce
    def _allreduce(
        self, call: _Call, layout: Layout, flats: dict[str, np.ndarray], transport: Transport
    ) -> dict[str, np.ndarray]:
        """Reduce-scatter then all-gather, in the three phases of the module docstring."""
        plan = self._chunking(call, layout, flats, transport)
        payload = wire_bytes(flats, transport)
        self._check_budget(call, payload * call.world.size)  # each rank writes about its all
        self._scatter(call, plan, flats)
        result = self._reduce(call, plan, flats)
        self._gather(call, plan, result)
        return unflatten(layout, result)

    def _chunking(
        self, call: _Call, layout: Layout, flats: dict[str, np.ndarray], transport: Transport
    ) -> _Chunking:
        """Cut the vectors into N*P chunks, P per rank, so no value exceeds max_value_bytes."""
        total = sum(f.nbytes for f in flats.values())
        part = -(-total // call.world.size)
        per_rank = self.placement.pieces(part, blobs.pieces(part, self.max_value_bytes))
        k = call.world.size * per_rank
        cuts = bounds(layout.sizes(), k, alignment(transport))
        return _Chunking(
            layout, transport, k, per_rank, cuts, -(-total // k), self.placement.tags()
        )

    def _scatter(self, call: _Call, plan: _Chunking, flats: dict[str, np.ndarray]) -> None:
        """1. SET each chunk this rank does not own for its owner, then notify "scatter";
        staggered (large shares): owner by owner from the next rank on, each notified as
        soon as its chunks are written ("scatter/<owner>"), so that owners read while the
        others still write."""
        world, what = call.world, call.what()
        tags = placement.encode(plan.tags)
        for phase, owned in plan.scatters(world.rank):
            items = [
                (call.part_key(world.rank, i, plan.tags).key, blobs.pack(plan.sent(i, flats, what)))
                for i in owned
            ]
            self._store(call, items)
            call.notify(phase, l=plan.signature, t=tags)

    def _reduce(
        self, call: _Call, plan: _Chunking, flats: dict[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """2. Sum this rank's chunks over every rank (in float64) as contributions arrive,
        keep their mean in the result, SET it for the others and notify "reduced"."""
        mine, what = plan.owned(call.world.rank), call.what()
        sums = {
            i: {
                g: a.astype(accumulator(g))
                for g, a in plan.decoded(plan.sent(i, flats, what), what).items()
            }
            for i in mine
        }
        phase = plan.scatter_phase(call.world.rank)
        for i, chunk in self._receive(call, plan, phase, self._contributions):
            for g, a in chunk.items():
                sums[i][g] += a
        result = {g: np.empty(size, dtype=g) for g, size in plan.layout.sizes().items()}
        items = []
        for i in mine:
            for a in sums[i].values():
                if a.dtype.kind == "f":  # integers are summed (exact sums), not averaged
                    np.divide(a, call.world.size, out=a)
            travelling = transported(_typed(sums[i], plan.transport), plan.transport, what)
            for g, a in plan.decoded(travelling, what).items():
                result[g][plan.cuts[g][i]] = a  # the owner keeps what the others decode
            items.append(
                (call.reduced_key(call.world.rank, i, plan.tags).key, blobs.pack(travelling))
            )
        del sums
        self._store(call, items)
        call.notify("reduced", t=placement.encode(plan.tags))
        return result

    def _gather(self, call: _Call, plan: _Chunking, result: dict[str, np.ndarray]) -> None:
        """3. GET the chunks the other ranks reduced into `result`, as their notices arrive."""
        for i, chunk in self._receive(call, plan, "reduced", self._reduced):
            for g, a in chunk.items():
                result[g][plan.cuts[g][i]] = a

    def _receive(
        self,
        call: _Call,
        plan: _Chunking,
        phase: str,
        keys_of: Callable[[_Call, _Chunking, int, Notice], list[tuple[int, Source]]],
    ) -> Iterator[tuple[int, Chunk]]:
        """(i, chunk i) from every other rank as its `phase` notice arrives: `keys_of` names
        the chunks a rank has for this one, and their keys. The chunks of every rank already
        there come in as few round trips as FETCH_BYTES allows."""
        for batch in call.arrived(phase, call.world.others):
            wanted = [
                (i, source)
                for rank, notice in batch
                for i, source in keys_of(call, plan, rank, notice)
            ]
            chunks = self._fetch(call, [source for _, source in wanted], plan.chunk_bytes)
            for (i, source), chunk in zip(wanted, chunks, strict=True):
                yield i, plan.check(chunk, i, source, call.what())

    def _contributions(
        self, call: _Call, plan: _Chunking, rank: int, notice: Notice
    ) -> list[tuple[int, Source]]:
        """The keys of `rank`'s parts of the chunks this rank owns, after its scatter notice
        shows it passed the same layout and transport."""
        if text(notice.get(b"l", b"")) != plan.signature:
            raise CollectiveError(
                f"{call.what()}: rank {rank} passed tensors of another layout or "
                "transport (names, dtypes, shapes or float16/float32 differ); every "
                "rank must pass the same"
            )
        theirs = call.tags(notice, rank)
        return [(i, call.part_key(rank, i, theirs)) for i in plan.owned(call.world.rank)]

    def _reduced(
        self, call: _Call, plan: _Chunking, rank: int, notice: Notice
    ) -> list[tuple[int, Source]]:
        """The keys of the chunks `rank` reduced, as its notice tags them."""
        theirs = call.tags(notice, rank)
        return [(i, call.reduced_key(rank, i, theirs)) for i in plan.owned(rank)]

    # ------------------------------------------------------------ broadcast
    def _broadcast(
        self, call: _Call, tensors: Mapping[str, np.ndarray] | None, root: int
    ) -> dict[str, np.ndarray]:
        """The root SETs its tensors in pieces, the others GET them; the root unlinks them
        once every receiver said it has them."""
        world = call.world
        sent: list[str] = []
        if world.rank == root:
            assert tensors is not None
            sent = self._send_pieces(call, tensors)
            result = dict(tensors)
        else:
            result = self._get_pieces(call, root)
            call.notify("got")
        for _ in call.arrivals("got", set(range(world.size)) - {root, world.rank}):
            pass
        if sent:  # every receiver has its copy: the pieces can go now
            call.retry(lambda: self.conn.unlink(*sent), "deleting the pieces")
            call.written = [key for key in call.written if key not in sent]
        return result

    def _send_pieces(self, call: _Call, tensors: Mapping[str, np.ndarray]) -> list[str]:
        """SET `tensors` in pieces of at most max_value_bytes and notify "sent"; their keys."""
        tags = self.placement.tags()
        self._check_budget(call, sum(np.asarray(a).nbytes for a in tensors.values()))
        pieces = [
            (call.piece_key(call.world.rank, i, tags).key, blobs.pack(group))
            for i, group in enumerate(self._groups(call, tensors))
        ]
        self._store(call, pieces)
        call.notify("sent", n=len(pieces), t=placement.encode(tags))
        return [key for key, _ in pieces]

    def _get_pieces(self, call: _Call, root: int) -> dict[str, np.ndarray]:
        """The root's tensors, once its notice arrives: every piece in pipelined round trips."""
        _, notice = next(call.arrivals("sent", {root}))
        theirs = call.tags(notice, root)
        count = _count(notice, call.noticed(root), call.what())
        sources = [call.piece_key(root, i, theirs) for i in range(count)]
        result: dict[str, np.ndarray] = {}
        for got in self._fetch(call, sources, self.max_value_bytes):
            result.update(got)
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


def accumulator(dtype: str) -> type[np.generic]:
    """What a vector of `dtype` is summed in: int64 for integers (exact, whatever the order:
    worker/pytorch/exact.py sends its sums so), float64 for the rest."""
    return np.int64 if np.dtype(dtype).kind in "iu" else np.float64


def _typed(sums: Chunk, transport: Transport) -> Chunk:
    """A chunk's float64 sums back in their own dtypes, but for float32 values under a
    transport that rounds them itself (float16, int8): each is rounded once, at the end,
    and a reduced chunk travels no wider than the contributions did."""
    return {
        g: a if g == "<f4" and transport != "float32" else a.astype(g, copy=False)
        for g, a in sums.items()
    }


def _count(notice: Notice, source: Source, what: str) -> int:
    """The number of pieces a broadcast's root says it sent (field `n`)."""
    said = notice.get(b"n", b"0")
    try:
        count = int(said)
    except ValueError:
        count = -1
    if not 0 <= count <= 1_000_000:
        raise source.refused(f"{what}: {source.name} says it sent {said[:32]!r} pieces")
    return count


def _values(notice: Notice, expected: int, source: Source, what: str) -> tuple[float, ...]:
    """The numbers a rank gathered (field `x`: `float.hex` values, comma-separated), if it
    sent as many as this rank did."""
    said = notice.get(b"x", b"")
    try:
        values = tuple(float.fromhex(part) for part in text(said).split(",") if part)
    except (ValueError, UnicodeDecodeError):
        values = None
    if values is None or len(values) != expected:
        raise source.refused(
            f"{what}: {source.name} sent {said[:64]!r}, not {expected} float.hex number(s)"
        )
    return values
