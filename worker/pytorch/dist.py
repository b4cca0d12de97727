"""cohort as the membership service of torch.distributed, and a watchdog that breaks hangs.

For every world the coordinator journals, `ElasticProcessGroup.init_process_group` gives this
worker its rank and the world size from the journal and a fresh `TCPStore` hosted by the world's
rank 0 (its host:port published in Redis under a key per world version), then calls
`torch.distributed.init_process_group(backend, store=..., rank=..., world_size=...)`.

The hang. When a peer's host dies or the network drops it (no FIN/RST ever arrives), or a
peer hangs alive, the survivors block inside the collective until the backend's timeout
(10-30 minutes by default). On one host a SIGKILLed peer is seen at once (the kernel resets
its sockets); the hang needs a peer whose connections stay open.

What breaks it, measured on torch 2.13 (CPU, gloo): from another thread,
`ProcessGroup.abort()`, the gloo backend's `abort()`, `_abort_process_group()`,
`destroy_process_group()` and `shutdown()` all return at once, and the blocked `all_reduce`
still waits for gloo's own timeout. So the collective must not block the training thread:
`ElasticProcessGroup.all_reduce/broadcast/barrier` issue it with `async_op=True` and `wait` on the
work's future and on the `Watchdog` at once. The watchdog follows the worker's view of the
journal; when a WorkerFailed/WorkerLeft removes a rank of this world, or a newer world
starts, it wakes the waiter, which raises `WorldChangedError` within the journal's latency
(the coordinator decides at heartbeat_timeout). The abandoned group is left to gloo's timeout:
its destructor would wait for the hung op (also at interpreter exit), so it is pinned
(`graveyard`) until its works finish, and the default group is replaced by the next world's.
The watchdog also calls `abort()` on the group, which is what unblocks NCCL (a no-op for
gloo in 2.13).

Tensors handed to an abandoned collective may still be written by it later; drop them
(the aborted step is rolled back anyway).

NCCL (docs/gpu.md, "The NCCL route's step protocol"): the watchdog aborts the group only
when a collective of the world is in flight as it ends (a waiter, or a tracked work not
complete on its device): a world that merely moved on after its works completed keeps its
group until `close` destroys it, so no abort ever cuts a committed step's kernels. Before
the group exists, `nccl_environment` sets TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (clean up
only): an NCCL error or timeout aborts the communicator but never tears the process down,
so the journal, not a SIGABRT, decides what a peer's death means. A group abandoned with
works in flight is aborted, not pinned (gloo's is pinned, as above).
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from cohort.events.connection import Client
from cohort.events.errors import InvalidValueError
from cohort.events.keys import Keys, by
from cohort.worker.errors import (
    RemovedError,
    RendezvousError,
    Stopped,
    WaitTimeoutError,
    WorkerError,
    WorldChangedError,
)
from cohort.worker.membership.client import Worker
from cohort.worker.membership.view import View

log = logging.getLogger("cohort.torchdist")
T = TypeVar("T")

STORE_TTL_MS = 10 * 60 * 1000
"""The published host:port of a world's store expires after this."""
WAKE_S = 0.25
"""How often blocked waits recheck the world (the journal and the work wake them at once)."""
ARRIVE_POLL_S = 0.02
"""How often ranks entering a world poll the store for the others (between watchdog waits)."""


def _pin(obj: Any) -> Any:
    """Keep `obj` alive even through interpreter exit (one reference nobody owns).

    A gloo group with a hung op blocks in its destructor until the op times out (joins its
    threads), also when Python frees it at exit; a pinned group is never freed while hung.
    """
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
    return obj


def _unpin(obj: Any) -> None:
    ctypes.pythonapi.Py_DecRef(ctypes.py_object(obj))


def store_key(job: str, world: int, writer: str) -> str:
    """Where rank 0 of `world`, worker `writer`, publishes its TCPStore's host:port (a stream
    of one entry). Among the collective's keys, named for its writer: under per-worker
    credentials nobody else can write it, so no worker can send the ranks to a store of its
    own (docs/identity.md)."""
    return by(f"{Keys(job).prefix}:grad:tcpstore:{world}", writer)


def default_host() -> str:
    """The address peers dial for this host's store: $COHORT_DIST_HOST, else the FQDN."""
    return os.environ.get("COHORT_DIST_HOST") or socket.getfqdn()


ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
"""How ProcessGroupNCCL's own watchdog acts on an NCCL error or timeout (torch 2.13: 0
nothing, 1 abort the communicators and tear the process down, 2 abort them only, 3, the
default, tear down without aborting)."""
CLEAN_UP_ONLY = "2"
BLOCKING_WAIT = "TORCH_NCCL_BLOCKING_WAIT"
NONBLOCKING = "TORCH_NCCL_USE_COMM_NONBLOCKING"
"""Set, NCCL's `work.wait()` blocks the host and replaces the asynchronous error handling."""


def nccl_environment(environ: Mapping[str, str]) -> tuple[dict[str, str], str | None]:
    """What NCCL's process group needs set in `environ` before it is made, and what to say
    about it (None: nothing). TORCH_NCCL_ASYNC_ERROR_HANDLING=2: an error or a timeout aborts
    the communicator, which ends its kernels (a peer's death cannot hang the GPU, nor an
    abandoned group's work outlive `collective_timeout`), and never tears the process down
    (1 and the default 3 would SIGABRT a survivor before the journal says a peer died).
    TORCH_NCCL_USE_COMM_NONBLOCKING=1: the communicator forms without blocking the process
    group's creation, so a peer lost while it forms leaves a group the watchdog can abort
    (a blocking ncclCommInitRank cannot be). A value the user set stays, and is said.
    InvalidValueError for TORCH_NCCL_BLOCKING_WAIT on: cohort's step protocol waits for
    NCCL's works itself, off the training thread."""
    for name in (BLOCKING_WAIT, "NCCL_BLOCKING_WAIT"):
        if environ.get(name, "0").strip() not in ("", "0"):
            raise InvalidValueError(
                f"${name}={environ[name]!r}: cohort waits for NCCL's collectives itself, "
                "on a thread its watchdog can break; a blocking wait would hang the training "
                f"thread on a dead peer. Unset {name} (or set it to 0)"
            )
    updates: dict[str, str] = {}
    kept: list[str] = []
    for names, value, why in (
        ((ASYNC_ERROR_HANDLING, "NCCL_ASYNC_ERROR_HANDLING"), CLEAN_UP_ONLY,
         "abort the communicator on an error without tearing the process down"),
        ((NONBLOCKING,), "1", "form the communicator so that a lost peer's world can be "
         "aborted while it forms"),
    ):  # fmt: skip
        users = next((name for name in names if environ.get(name)), None)
        if users is None:
            updates[names[0]] = value
        else:
            kept.append(f"${users}={environ[users]} is the user's: kept (cohort would set "
                        f"{names[0]}={value}, {why})")  # fmt: skip
    return updates, "; ".join(kept) or None


def group_options(backend: str, device: torch.device) -> dict[str, Any]:
    """`init_process_group`'s options for `backend` with this rank on `device`: NCCL's
    group is bound to the rank's GPU (`device_id`: its communicator is formed at once, on
    that GPU, not at the first collective on whatever device is current)."""
    if backend == "nccl" and device.type == "cuda":
        return {"device_id": device}
    return {}


def ddp_devices(devices: Iterable[torch.device]) -> dict[str, Any]:
    """DDP's `device_ids` and `output_device` for a module whose parameters are on
    `devices`: its GPU for a module on one GPU, None for a CPU or multi-device module
    (as DDP requires)."""
    found = set(devices)
    if len(found) == 1:
        (device,) = found
        if device.type == "cuda":
            return {"device_ids": [device.index], "output_device": device.index}
    return {"device_ids": None, "output_device": None}


def aborts_when_abandoned(backend: str) -> bool:
    """Whether a group left with works in flight is aborted rather than pinned: NCCL's abort
    ends its kernels; gloo's (2.13) is a no-op, and its destructor would wait for the
    work (see the module doc)."""
    return backend == "nccl"


@dataclass(frozen=True)
class DistWorld:
    """One world as torch.distributed sees it: this rank, the size, the store to meet in."""

    version: int
    rank: int
    size: int
    start_step: int
    ranks: tuple[str, ...]
    store: dist.Store = field(repr=False, compare=False)


def lost(view: View, world: DistWorld) -> str | None:
    """Why `world` is over according to `view`, or None while it stands."""
    if view.removed:
        return f"this worker was removed ({view.removed_reason})"
    if view.world_version > world.version:
        return f"world {view.world_version} replaced world {world.version}"
    gone = [w for w in world.ranks if w not in view.members]
    if gone:
        return f"rank(s) {gone} of world {world.version} left or failed"
    return None


def ends_quietly(view: View) -> bool:
    """Whether a world's end is no news: the job finished (its ranks leave), or this worker
    left it by itself (nothing to join again for). With no collective waiting, such an end
    is logged at DEBUG only."""
    return view.finished is not None or view.left


class Watchdog:
    """Follows the worker's view; trips once the journal says this world's peers changed.

    Tripping sets `tripped`, wakes every `wait`er and aborts `group` (effective for NCCL).
    """

    def __init__(
        self, worker: Worker, world: DistWorld, group: dist.ProcessGroup | None = None
    ) -> None:
        self.worker = worker
        self.world = world
        self.group = group
        self.tripped = threading.Event()
        self.reason = ""
        self.tripped_at: float | None = None
        """time.monotonic() when it tripped (for measuring how fast a hang was broken)."""
        self._lock = threading.Lock()
        self._waiters: set[threading.Event] = set()
        self._on_trip: list[Callable[[], None]] = []
        self.in_flight: Callable[[], bool] = lambda: False
        """Whether a work of the world's group is not complete (on its device)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"cohort-watchdog-{world.version}", daemon=True
        )

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                view = self.worker.wait_for(
                    lambda v: lost(v, self.world) is not None or self._stop.is_set(), WAKE_S
                )
            except WaitTimeoutError:
                continue
            except RemovedError as exc:
                self.trip(str(exc), quiet=ends_quietly(self.worker.view))
                return
            except Stopped:
                self.trip("the worker was stopped", quiet=ends_quietly(self.worker.view))
                return
            if self._stop.is_set():  # closed: the world ends with no collective left to break
                return
            reason = lost(view, self.world)
            if reason is not None:
                self.trip(reason, quiet=ends_quietly(view))
                return

    def trip(self, reason: str, quiet: bool = False) -> None:
        """The world is over for `reason`: wake every waiter, break the group. Said as a
        warning when a collective was cut short, else at INFO, or at DEBUG when `quiet` (a
        finished job's last world, ended by its ranks leaving)."""
        with self._lock:
            if self.tripped.is_set():
                return
            self.reason = reason
            self.tripped_at = time.monotonic()
            self.tripped.set()
            waiters = list(self._waiters)
            callbacks, self._on_trip = self._on_trip, []
        if waiters:  # a collective is waiting in this world: it is cut short, say so
            log.warning(
                "world %d is over: %s; breaking its collectives", self.world.version, reason
            )
        else:  # nothing was broken; at the end of a job, not even news
            level = logging.DEBUG if quiet else logging.INFO
            log.log(level, "world %d is over: %s", self.world.version, reason)
        for event in waiters:
            event.set()
        for callback in callbacks:
            callback()
        if self.group is not None and (waiters or self.in_flight()):
            self.abort()

    def abort(self) -> None:
        """Abort the world's group: what unblocks NCCL's kernels (gloo ignores it, see the
        module doc). Only when a collective is in flight: a world that moved on after its
        works completed keeps its group, so no abort cuts a committed step's kernels."""
        if self.group is None:
            return
        try:
            self.group.abort()
        except Exception:
            log.debug("abort of world %d's group failed", self.world.version, exc_info=True)

    def on_trip(self, callback: Callable[[], None]) -> None:
        """Call `callback()` when the watchdog trips (at once if it has)."""
        with self._lock:
            if not self.tripped.is_set():
                self._on_trip.append(callback)
                return
        callback()

    def wait(self, done: threading.Event, timeout: float | None = None) -> bool:
        """Block until `done` is set or the watchdog trips (None: no limit). True if `done`
        was set in a world that is not over; tripping sets `done` too, to wake the waiter
        at once, so False says the world ended (or the time ran out) whatever `done` is."""
        with self._lock:
            if self.tripped.is_set():
                return False
            self._waiters.add(done)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not done.is_set() and not self.tripped.is_set():
                left = WAKE_S if deadline is None else min(WAKE_S, deadline - time.monotonic())
                if left <= 0:
                    break
                done.wait(left)
            return done.is_set() and not self.tripped.is_set()
        finally:
            with self._lock:
                self._waiters.discard(done)


class _Running:
    """A side thread as a work: completed once it ends."""

    def __init__(self, done: threading.Event) -> None:
        self.done = done

    def is_completed(self) -> bool:
        return self.done.is_set()


class ElasticProcessGroup:
    """Rank, world size and a fresh store for each of the worker's worlds; guarded collectives.

    The training loop calls `init_process_group()` at the start of every world (after a
    WorldChangedError) and runs its collectives through `all_reduce`/`broadcast`/`barrier`
    (or passes its own async works to `wait`), which raise WorldChangedError when the world
    is over, within a second of the coordinator's decision, instead of hanging.
    """

    def __init__(
        self,
        worker: Worker,
        conn: Client,
        job: str,
        host: str | None = None,
        timeout: float = 60.0,
        collective_timeout: timedelta = timedelta(minutes=5),
    ) -> None:
        self.worker = worker
        self.conn = conn
        self.job = job
        self.host = host or default_host()
        self.timeout = timeout
        self.collective_timeout = collective_timeout
        self.world: DistWorld | None = None
        self.watchdog: Watchdog | None = None
        self.group: dist.ProcessGroup | None = None
        self.backend = "gloo"
        """The current (or last) world's backend."""
        self.graveyard: list[tuple[Any, list[dist.Work]]] = []
        """Abandoned (group, store) pairs with their unfinished works: see the module doc."""
        self._works: list[dist.Work] = []

    # ------------------------------------------------------------ worlds
    def init_process_group(self, backend: str = "gloo", **options: Any) -> DistWorld:
        """Join torch.distributed in the worker's current world (waiting for a rank in one).

        Leaves the previous world's group first. `options` go to
        `torch.distributed.init_process_group` (e.g. `device_id` for NCCL).
        """
        deadline = time.monotonic() + self.timeout
        self.close()
        assignment = self.worker.wait_active(self.timeout)
        view = self.worker.view
        if view.world_version != assignment.world_version:  # moved on meanwhile: start over
            return self.init_process_group(backend, **options)
        if backend == "nccl":
            self._nccl_environment()
        world = self._store(view, deadline)
        self.world = world
        self.backend = backend
        self.watchdog = Watchdog(self.worker, world)
        self.watchdog.in_flight = self._in_flight
        self.watchdog.start()
        self._arrive(world, deadline)
        try:
            dist.init_process_group(
                backend,
                store=dist.PrefixStore("pg", world.store),
                rank=world.rank,
                world_size=world.size,
                timeout=self.collective_timeout,
                **options,
            )
        except Exception as exc:  # a peer died between arriving and connecting
            self._world_changed(exc, step=world.start_step)
            raise
        self.group = dist.distributed_c10d._get_default_group()
        self.watchdog.group = self.group
        if self.watchdog.tripped.is_set():
            self.watchdog.abort()  # tripped before the group existed: nothing of it may run
        log.info("rank %d of %d in world %d (%s)", world.rank, world.size, world.version, backend)
        return world

    def _store(self, view: View, deadline: float) -> DistWorld:
        """A fresh TCPStore for the view's world: rank 0 hosts and publishes, the others dial."""
        assignment = view.assignment
        assert assignment is not None
        version, rank = assignment.world_version, assignment.rank
        key = store_key(self.job, version, view.ranks[0])
        wait = timedelta(seconds=self.timeout)
        if rank == 0:
            try:
                store = dist.TCPStore(
                    self.host, 0, None, True, timeout=wait, wait_for_workers=False
                )
            except Exception as exc:
                raise RendezvousError(
                    f"rank 0 of world {version} could not host a TCPStore on {self.host!r}: {exc}"
                ) from exc
            pipe = self.conn.pipeline(transaction=False)
            pipe.xadd(key, {"host": self.host, "port": store.port, "worker": self.worker.id})
            pipe.pexpire(key, STORE_TTL_MS)
            pipe.execute()
        else:
            host, port = self._published(key, version, deadline)
            try:
                store = dist.TCPStore(host, port, None, False, timeout=wait)
            except Exception as exc:
                self._world_changed(exc, step=assignment.start_step, world=version)
                raise RendezvousError(
                    f"rank {rank} of world {version} could not reach the store at "
                    f"{host}:{port}: {exc}"
                ) from exc
        return DistWorld(
            version=version,
            rank=rank,
            size=assignment.world_size,
            start_step=assignment.start_step,
            ranks=view.ranks,
            store=store,
        )

    def _published(self, key: str, version: int, deadline: float) -> tuple[str, int]:
        """rank 0's host:port for `version`, waiting on the stream (XREAD BLOCK)."""
        while True:
            rows: Any = self.conn.xrange(key, "-", "+", count=1)
            if not rows:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RendezvousError(
                        f"rank 0 of world {version} published no store at {key} within "
                        f"{self.timeout:g} s"
                    )
                if self.worker.world_version > version:
                    raise WorldChangedError(version, self.worker.assignment)
                self.conn.xread({key: "0"}, block=max(1, int(min(left, WAKE_S) * 1000)))
                continue
            fields = {k.decode(): v.decode() for k, v in rows[0][1].items()}
            return fields["host"], int(fields["port"])

    def _arrive(self, world: DistWorld, deadline: float) -> None:
        """Wait in the store until every rank arrived, so the backend's connect cannot hang."""
        dog = self.watchdog
        assert dog is not None
        try:
            world.store.add(f"arrived:{world.rank}", 1)
            count = world.store.add("arrived", 1)
            while count < world.size:
                if dog.tripped.wait(ARRIVE_POLL_S):
                    raise WorldChangedError(world.start_step, self.worker.assignment)
                if time.monotonic() > deadline:
                    raise RendezvousError(
                        f"world {world.version}: {count} of {world.size} ranks arrived within "
                        f"{self.timeout:g} s"
                    )
                count = world.store.add("arrived", 0)
        except WorkerError:
            raise
        except Exception as exc:  # the store's host (rank 0) is gone
            self._world_changed(exc, step=world.start_step)
            raise RendezvousError(f"world {world.version}: the store failed: {exc}") from exc

    def _world_changed(self, exc: Exception, step: int, world: int | None = None) -> None:
        """Raise WorldChangedError from `exc` if the journal says the world is (soon) over."""
        if self.watchdog is not None and world is None:
            if self.ends_after_failure():
                raise WorldChangedError(step, self.worker.assignment) from exc
            return
        version = world if world is not None else self.worker.world_version
        if self.worker.wait_for_change(version, self._grace()):
            raise WorldChangedError(step, self.worker.assignment) from exc

    def ends_after_failure(self) -> bool:
        """After a collective of this world's group failed: wait (up to the grace) for the
        journal to end the world, and say whether it did. Until then no other collective of
        the group may start: a peer still inside the failed one would take its bytes for
        the failed one's (gloo then aborts that peer's process: "Received data size doesn't
        match expected size")."""
        dog = self.watchdog
        return dog is not None and dog.tripped.wait(self._grace())

    def _grace(self) -> float:
        """How long a failed operation waits for the journal to explain it."""
        config = self.worker.view.config
        return (config.heartbeat_timeout if config is not None else 5.0) + 2.0

    def _nccl_environment(self) -> None:
        """TORCH_NCCL_ASYNC_ERROR_HANDLING as `nccl_environment` decides, before the group."""
        updates, said = nccl_environment(os.environ)
        os.environ.update(updates)
        if said is not None:
            log.info("%s", said)

    def _in_flight(self) -> bool:
        """Whether a tracked work of the current group is not complete (NCCL: on the GPU)."""
        return any(not w.is_completed() for w in self._works)

    def close(self) -> None:
        """Leave the current world's group. One with unfinished works is aborted (NCCL:
        its kernels end, at once rather than at `collective_timeout`) or pinned (gloo)."""
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.group is not None:
            pending = [w for w in self._works if not w.is_completed()]
            if pending and aborts_when_abandoned(self.backend):
                assert self.watchdog is not None
                self.watchdog.abort()
            elif pending:
                assert self.world is not None
                self.graveyard.append((_pin((self.group, self.world.store)), pending))
            if dist.is_initialized():
                dist.destroy_process_group()
        kept = []
        for pinned, works in self.graveyard:
            if all(w.is_completed() for w in works):
                _unpin(pinned)  # its ops ended (gloo's timeout): the destructor will not block
            else:
                kept.append((pinned, works))
        self.graveyard = kept
        self.group = None
        self.world = None
        self.watchdog = None
        self._works = []

    # ------------------------------------------------------------ guarded collectives
    def track(self, work: Any) -> None:
        """Keep `work` with its group: pinned with it if the world is abandoned first."""
        self._works = [w for w in self._works if not w.is_completed()]
        self._works.append(work)

    def wait(self, work: dist.Work, step: int) -> None:
        """Wait for `work` (an async_op=True collective); WorldChangedError if the world ends."""
        dog = self.watchdog
        if dog is None:
            raise RendezvousError("no process group: call init_process_group() first")
        self.track(work)
        done = threading.Event()
        work.get_future().add_done_callback(lambda _: done.set())
        if not dog.wait(done):  # no result, or one of a world that is over
            raise WorldChangedError(step, self.worker.assignment)
        try:
            work.wait()
        except Exception as exc:  # e.g. "Connection reset by peer": ask the journal why
            self._world_changed(exc, step)
            raise

    def fence(self, works: Sequence[dist.Work], completion: Any, step: int) -> None:
        """Wait until the data of `works` is where it lands (`completion.fence`: gloo's
        `wait()`, or a CUDA sync after NCCL's), on a side thread, under the watchdog:
        WorldChangedError once the world is over, or if a work failed and the journal
        explains it within the grace; else the failure stands."""
        dog = self.watchdog
        if dog is None:
            raise RendezvousError("no process group: call init_process_group() first")
        done, failed = threading.Event(), []

        def fence() -> None:
            try:
                completion.fence(works)
            except Exception as error:  # gloo: "Connection closed by peer"; NCCL: aborted
                failed.append(error)
            finally:
                done.set()

        threading.Thread(target=fence, name="cohort-fence", daemon=True).start()
        if not dog.wait(done):
            raise WorldChangedError(step, self.worker.assignment)
        if failed:
            log.warning("world %d broke in step %d's collectives: %s", dog.world.version, step,
                        failed[0])  # fmt: skip
            self._world_changed(failed[0], step)
            raise failed[0]

    def on_side(self, body: Callable[[Any], T], step: int) -> T:
        """`body(group)` (collectives of its own on this world's `group`, such as DCP's
        save) on a side thread, waited for under the watchdog: WorldChangedError once the
        world is over before it returns. The thread counts as a work in flight until it
        ends, so a world left meanwhile pins its group in the graveyard (gloo: destroying a
        group with an operation inside would block) rather than destroying it; a peer that
        moved on to the next world never answers it. Its own exception is raised as is."""
        dog, group = self.watchdog, self.group
        if dog is None or group is None:
            raise RendezvousError("no process group: call init_process_group() first")
        done, out, failed = threading.Event(), [], []

        def run() -> None:
            try:
                out.append(body(group))
            except BaseException as error:  # DCP's CheckpointException is a BaseException
                failed.append(error)
            finally:
                done.set()

        self.track(_Running(done))
        threading.Thread(target=run, name="cohort-guarded", daemon=True).start()
        if not dog.wait(done):
            raise WorldChangedError(step, self.worker.assignment)
        if failed:
            raise failed[0]
        return out[0]

    def all_reduce(
        self, tensor: torch.Tensor, step: int, op: Any = dist.ReduceOp.SUM
    ) -> torch.Tensor:
        work = dist.all_reduce(tensor, op=op, async_op=True)
        assert work is not None
        self.wait(work, step)
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int, step: int) -> torch.Tensor:
        work = dist.broadcast(tensor, src=src, async_op=True)
        assert work is not None
        self.wait(work, step)
        return tensor

    def barrier(self, step: int) -> None:
        work = dist.barrier(async_op=True)
        assert work is not None
        self.wait(work, step)

    def guarded(self, step: int) -> Callable[[dist.Work], None]:
        """`wait` bound to `step`, for loops that issue their own async collectives."""
        return lambda work: self.wait(work, step)
