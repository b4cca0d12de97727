"""Hierarchical allreduce: the ranks of one host reduce through shared memory first.

After the Zerfoo seed's AllReduceStrategy (local first, then across nodes). For one call:

1. local: every rank but its host's leader (the host's lowest rank) puts its vectors in a
   shared memory segment of its own and says so on the call's notice stream; the leader
   sums them with its own, in float64 (integers in int64), straight from the segments (no
   byte through Redis);
2. across hosts: the leaders, renumbered 0..H-1, run the flat allreduce of
   `redis_collective.py` over their hosts' sums scaled by H/N, whose mean is the sum of
   every rank over N; with one host there is nothing to exchange;
3. back: the leader puts the result in a segment, its ranks copy it out and say so, and
   the leader removes it.

The notices go through the step's stream like the flat path's, so a WorldChanged in the
journal wakes every waiter: the call raises WorldChangedError after removing every segment
of the call on its host (its own, and those of a rank that was killed: their names are
fixed by the call) and the Redis keys it wrote. A process killed outright has its own
segments removed by Python's resource tracker as well. With one rank per host this is the
flat allreduce.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import numpy as np
import redis

from cohort.events.connection import text
from cohort.worker.collective import tensors as blobs
from cohort.worker.collective.layout import Transport, flatten, unflatten
from cohort.worker.collective.redis_collective import (
    Collective,
    Participant,
    World,
    _Call,
    accumulator,
)
from cohort.worker.errors import CollectiveError

SHM_PREFIX = "cohort-"
LOCAL, HOSTS = "-local", "-hosts"
"""Suffixes of an op's host stage (its notices) and of the leaders' exchange."""


@dataclass(frozen=True, slots=True)
class Hosts:
    """How the ranks of a world sit on hosts: `groups` are each host's ranks, in order of
    their lowest rank; a host's leader is its lowest rank."""

    groups: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, hosts: Sequence[str]) -> Hosts:
        by_host: dict[str, list[int]] = {}
        for rank, host in enumerate(hosts):
            by_host.setdefault(host, []).append(rank)
        return cls(tuple(tuple(ranks) for ranks in by_host.values()))

    def group_of(self, rank: int) -> tuple[int, ...]:
        return next(g for g in self.groups if rank in g)

    def index_of(self, rank: int) -> int:
        return next(i for i, g in enumerate(self.groups) if rank in g)

    @property
    def flat(self) -> bool:
        """One rank per host: nothing to reduce locally."""
        return all(len(g) == 1 for g in self.groups)

    def led_by(self, rank: int) -> Hosts:
        """The same hosts with `rank` first in its group: it leads its host (a broadcast's
        root sends for its host itself)."""
        return Hosts(
            tuple((rank, *(r for r in g if r != rank)) if rank in g else g for g in self.groups)
        )


def segment_name(
    job: str, world: int, step: int, group: Sequence[int], rank: int, kind: str
) -> str:
    """The segment `rank` writes (`kind` "c": its contribution, "r": the leader's result):
    fixed by the call, so a survivor can remove a killed rank's."""
    job_part = hashlib.sha1(job.encode()).hexdigest()[:8]
    call = hashlib.sha1(f"{world}|{step}|{','.join(map(str, group))}".encode()).hexdigest()[:10]
    return f"{SHM_PREFIX}{job_part}-{call}-{rank}{kind}"


def job_segments_prefix(job: str) -> str:
    """What every segment of `job` is named with (a test lists /dev/shm by it)."""
    return f"{SHM_PREFIX}{hashlib.sha1(job.encode()).hexdigest()[:8]}-"


def _unlink(name: str) -> None:
    """Remove segment `name` if it exists, without tracking it in this process."""
    try:
        import _posixshmem  # type: ignore[import-not-found]

        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        pass
    except ImportError:  # pragma: no cover - not POSIX
        with contextlib.suppress(FileNotFoundError):
            SharedMemory(name).unlink()


def _remove(shm: SharedMemory) -> None:
    """Close and remove a segment this process created (and stop tracking it)."""
    shm.close()
    try:
        shm.unlink()
    except FileNotFoundError:  # a peer removed it first (an abort): stop tracking it
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]


def _open(name: str) -> SharedMemory:
    """Another process's segment, not tracked here (its creator removes it)."""
    shm = SharedMemory(name)
    resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    return shm


def _vectors(buf: Any, sizes: Mapping[str, int]) -> dict[str, np.ndarray]:
    """The dtype vectors laid end to end in `buf`, as views."""
    out, at = {}, 0
    for group, size in sizes.items():
        dtype = np.dtype(group)
        out[group] = np.frombuffer(buf, dtype=dtype, count=size, offset=at)
        at += size * dtype.itemsize
    return out


def _nbytes(sizes: Mapping[str, int]) -> int:
    return sum(size * np.dtype(g).itemsize for g, size in sizes.items())


class HierarchicalCollective:
    """allreduce for one rank: through shared memory on its host, through Redis across
    hosts. `hosts()`: the host of each rank of the current world (default: the worker's
    `rank_hosts()`, from the node each member described in its Join)."""

    def __init__(
        self,
        flat: Collective,
        hosts: Callable[[], Sequence[str]] | None = None,
    ) -> None:
        self.flat = flat
        worker: Participant = flat.worker
        self._hosts = hosts or getattr(worker, "rank_hosts", None)
        if self._hosts is None:
            raise CollectiveError("the hierarchical allreduce needs the host of every rank")
        self.job = flat.keys.job

    def allreduce(
        self,
        tensors: Mapping[str, np.ndarray],
        step: int,
        timeout: float = 60.0,
        world: int | None = None,
        transport: Transport = "float32",
    ) -> dict[str, np.ndarray]:
        """The mean of `tensors` over the ranks of the current world, as the flat one."""
        current, layout = self._layout()
        if current.size == 1 or layout.flat or (world is not None and world != current.version):
            return self.flat.allreduce(tensors, step, timeout, world, transport)  # or raises
        return _HostCall(self, "allreduce", current, layout, step, timeout, transport).run(tensors)

    def broadcast(
        self,
        tensors: Mapping[str, np.ndarray] | None,
        root: int,
        step: int,
        timeout: float = 60.0,
        world: int | None = None,
    ) -> dict[str, np.ndarray]:
        """`root`'s tensors on every rank: through Redis to one rank per host (`root` for
        its own), through shared memory to the others."""
        current, layout = self._layout()
        if current.size == 1 or layout.flat or (world is not None and world != current.version):
            return self.flat.broadcast(tensors, root, step, timeout, world)
        if not 0 <= root < current.size:
            raise CollectiveError(
                f"broadcast root {root} is not a rank of a world of {current.size}"
            )
        if current.rank == root and tensors is None:
            raise CollectiveError(f"rank {root} is the broadcast root but passed no tensors")
        layout = layout.led_by(root)
        call = _HostCall(self, "broadcast", current, layout, step, timeout, "float32")
        return call.broadcast(tensors, root)

    def barrier(self, step: int, timeout: float = 60.0, world: int | None = None) -> None:
        """Every rank of the world reached the barrier of `step`: each host's ranks meet
        their leader, the leaders meet through Redis, the leaders release their hosts."""
        current, layout = self._layout()
        if current.size == 1 or layout.flat or (world is not None and world != current.version):
            self.flat.barrier(step, timeout, world)
            return
        _HostCall(self, "barrier", current, layout, step, timeout, "float32").barrier()

    def _layout(self) -> tuple[World, Hosts]:
        current = self.flat.world()
        assert self._hosts is not None
        hosts = tuple(self._hosts())
        if len(hosts) != current.size:
            raise CollectiveError(
                f"{len(hosts)} hosts named for a world of {current.size} ranks: {hosts!r}"
            )
        return current, Hosts.of(hosts)


class _HostCall:
    """One hierarchical allreduce of one rank."""

    def __init__(
        self,
        owner: HierarchicalCollective,
        op: str,
        world: World,
        hosts: Hosts,
        step: int,
        timeout: float,
        transport: Transport,
    ) -> None:
        self.owner, self.op, self.world, self.hosts = owner, op, world, hosts
        self.step, self.timeout, self.transport = step, timeout, transport
        self.group = hosts.group_of(world.rank)
        self.leader = self.group[0]
        self.calls: list[_Call] = []
        self.created: list[SharedMemory] = []

    def name(self, rank: int, kind: str) -> str:
        """The segment `rank` writes in this call (`kind` c or r, prefixed by the op's
        initial: an allreduce and a broadcast of one step never share a name)."""
        job, version = self.owner.job, self.world.version
        return segment_name(job, version, self.step, self.group, rank, f"{self.op[0]}{kind}")

    def begin(self, stage: str, world: World) -> _Call:
        call = self.owner.flat.begin_in(world, self.op + stage, self.step, self.timeout)
        self.calls.append(call)
        return call

    def guarded(self, body: Callable[[], Any]) -> Any:
        """`body`, and on any failure nothing of the call left behind; the segments this
        rank created are removed either way."""
        try:
            return body()
        except BaseException:
            self._abort()
            raise
        finally:
            for shm in self.created:
                _remove(shm)

    def leaders(self) -> World:
        """The hosts' leaders as a world of their own: host i is rank i."""
        return World(
            self.world.version,
            self.hosts.index_of(self.world.rank),
            len(self.hosts.groups),
            tuple(self.world.member(group[0]) for group in self.hosts.groups),
        )

    # ------------------------------------------------------------ barrier and broadcast
    def barrier(self) -> None:
        def body() -> None:
            local = self.begin(LOCAL, self.world)
            members = set(self.group) - {self.leader}
            if self.world.rank != self.leader:
                local.notify("arrived")
                next(local.arrivals("released", {self.leader}))
                return
            for _ in local.arrivals("arrived", members):
                pass
            self.owner.flat.barrier_in(self.begin(HOSTS, self.leaders()))
            local.notify("released")

        self.guarded(body)

    def broadcast(
        self, tensors: Mapping[str, np.ndarray] | None, root: int
    ) -> dict[str, np.ndarray]:
        def body() -> dict[str, np.ndarray]:
            local = self.begin(LOCAL, self.world)
            members = set(self.group) - {self.leader}
            if self.world.rank != self.leader:
                _, notice = next(local.arrivals("result", {self.leader}))
                size = int(notice.get(b"n", b"0"))
                shared = _open(self.name(self.leader, "r"))
                try:
                    raw = bytes(shared.buf[:size]) if shared.buf is not None else b""
                finally:
                    shared.close()
                got = {k: v.copy() for k, v in blobs.unpack(raw).items()}
                local.notify("copied")
                return got
            root_host = self.hosts.index_of(root)
            mine = tensors if self.world.rank == root else None
            result = self.owner.flat.broadcast_in(
                self.begin(HOSTS, self.leaders()), mine, root_host
            )
            if members:
                packed = b"".join(bytes(part) for part in blobs.pack(result))
                shared = self._create(self.name(self.leader, "r"), len(packed))
                view = shared.buf
                assert view is not None
                view[: len(packed)] = packed
                del view
                local.notify("result", n=len(packed))
                for _ in local.arrivals("copied", members):
                    pass
            return result

        return self.guarded(body)

    def run(self, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        layout, flats = flatten(tensors)

        def body() -> dict[str, np.ndarray]:
            local = self.begin(LOCAL, self.world)
            if self.world.rank == self.leader:
                return self._lead(local, layout.digest, layout.sizes(), flats)
            return self._follow(local, layout.digest, layout.sizes(), flats)

        return unflatten(layout, self.guarded(body))

    # ------------------------------------------------------------ the host's leader
    def _lead(
        self, local: _Call, digest: str, sizes: dict[str, int], flats: dict[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        sums = {g: v.astype(accumulator(g)) for g, v in flats.items()}
        members = set(self.group) - {self.leader}
        for rank, notice in local.arrivals("local", members):
            if text(notice.get(b"l", b"")) != digest:
                raise CollectiveError(
                    f"{local.what()}: rank {rank} passed tensors of another layout; every "
                    "rank must pass the same names, dtypes and shapes"
                )
            shm = _open(self.name(rank, "c"))
            try:
                for g, v in _vectors(shm.buf, sizes).items():
                    sums[g] += v
                del v
            finally:
                shm.close()
        result = self._across(sums)
        shared = self._create(self.name(self.leader, "r"), _nbytes(sizes))
        view = _writable(shared.buf, sizes)
        for g in sizes:
            view[g][...] = result[g]
        del view
        local.notify("result")
        for _ in local.arrivals("copied", members):
            pass
        return result

    def _across(self, sums: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The mean over every rank, from this host's sums: the leaders' flat allreduce of
        sum x H/N (whose mean over the H hosts is the sum over all N, over N). Integer
        vectors are summed, exactly: the flat allreduce sums them too."""
        h, n = len(self.hosts.groups), self.world.size
        scaled = {
            g: s.astype(g) if s.dtype.kind == "i" else (s * (h / n)).astype(g)
            for g, s in sums.items()
        }
        if h == 1:
            return scaled
        return self.owner.flat.allreduce_in(
            self.begin(HOSTS, self.leaders()), scaled, self.transport
        )

    # ------------------------------------------------------------ the host's other ranks
    def _follow(
        self, local: _Call, digest: str, sizes: dict[str, int], flats: dict[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        mine = self._create(self.name(self.world.rank, "c"), _nbytes(sizes))
        view = _writable(mine.buf, sizes)
        for g in sizes:
            view[g][...] = flats[g]
        del view
        local.notify("local", l=digest)
        next(local.arrivals("result", {self.leader}))
        shared = _open(self.name(self.leader, "r"))
        try:
            result = {g: v.copy() for g, v in _vectors(shared.buf, sizes).items()}
        finally:
            shared.close()
        local.notify("copied")
        return result

    # ------------------------------------------------------------ resources
    def _create(self, name: str, size: int) -> SharedMemory:
        shm = SharedMemory(name, create=True, size=max(1, size))
        self.created.append(shm)
        return shm

    def _abort(self) -> None:
        """Nothing of this call stays behind: every segment of the host's ranks (a killed
        rank's too) and the Redis keys this rank wrote."""
        mine = {shm.name for shm in self.created}  # removed in `run`'s finally
        for rank in self.group:
            for kind in ("c", "r"):
                if self.name(rank, kind) not in mine:
                    _unlink(self.name(rank, kind))
        me = self.world.member(self.world.rank)
        peers = [self.world.member(rank) for rank in self.group if rank != self.world.rank]
        for writers in ([me], peers):  # its own notices, even if no call began; then a
            # killed peer's: refused under per-worker credentials, they expire (TTL) there
            self._unlink_streams(writers)
        for call in self.calls:
            if call.written:
                with contextlib.suppress(redis.RedisError):  # else they expire (TTL)
                    self.owner.flat.conn.unlink(*call.written)

    def _unlink_streams(self, writers: list[str]) -> None:
        keys, version = self.owner.flat.keys, self.world.version
        streams = [
            keys.step_events(version, self.step, self.op + stage, writer)
            for writer in writers
            for stage in (LOCAL, HOSTS)
        ]
        with contextlib.suppress(redis.RedisError):
            if streams:
                self.owner.flat.conn.unlink(*streams)


def _writable(buf: Any, sizes: Mapping[str, int]) -> dict[str, np.ndarray]:
    """The dtype vectors laid end to end in `buf`, writable."""
    out, at = {}, 0
    for group, size in sizes.items():
        dtype = np.dtype(group)
        out[group] = np.ndarray((size,), dtype=dtype, buffer=buf, offset=at)
        at += size * dtype.itemsize
    return out
