"""What the leader sees but never journals: heartbeats, step reports, step times.

Heartbeats and step reports are nearly all of the inbox's traffic and change
nothing on their own, so they stay out of the journal and out of `JobState`.
`Liveness` is the leader's volatile view of them. It is mutable on purpose:
copying a dict per heartbeat would cost more than everything else the leader
does. `observe` is its only writer; `decide` only reads it. A new leader
rebuilds it by observing the inbox window before the cursor (no decisions).

Times are the Redis server's clock (an inbox entry's ID), so workers' clocks
never matter and every coordinator measures silence the same way.

Connections are the other sign of life: a running worker keeps a subscription to its
presence channel (`Keys.presence`), and the leader counts them on the server that owns the
job's slot (`connected`). A member seen subscribed and then without one is "closed" from
that reading on; one never seen subscribed (an older worker, a simulated one) is judged by
its silence alone. A reading from another server (a restart, a failover: every client lost
its connections at once) starts the count again instead of closing anybody.

Silence is counted only while the inbox could take entries: from an entry ahead of the
server's clock arriving to the leader's repair of it, no worker could be heard (its XADDs
were refused, or took IDs the leader does not read yet), so that time is nobody's silence
(`blind`, `silence`).
"""

from __future__ import annotations

from collections import defaultdict
from statistics import median

from cohort.events.models import (
    Command,
    DataRefused,
    GpuReading,
    Heartbeat,
    Join,
    ProcessExited,
    StepDone,
    TransfersWaiting,
)

KEEP_STEPS = 256  # step reports and times older than this many steps are dropped
KEEP_REFUSALS = 1024  # (world, accused) pairs whose refusals are kept, the oldest dropped
KEEP_BLIND = 1024  # spans of an unusable inbox kept (an attack every turn: the oldest dropped)


class Liveness:
    def __init__(self) -> None:
        self.last_seen: dict[str, float] = {}
        self.progress: dict[str, tuple[int, int]] = {}  # worker -> (world, last step done)
        self.reported: dict[tuple[int, int], set[str]] = defaultdict(set)  # (world, step)
        self.step_times: dict[int, dict[str, float]] = defaultdict(dict)
        self._medians: dict[int, float] = {}  # step -> median of its times, until a new report
        self.digests: dict[int, dict[str, str]] = defaultdict(dict)  # step -> worker -> digest
        self.losses: dict[str, float] = {}
        self.figures: dict[str, dict[str, float]] = {}
        """Each worker's figures (`job.record`) as its latest report that had any said them."""
        self.gpus: dict[str, GpuReading] = {}
        self.transfers: dict[str, TransfersWaiting] = {}
        self.refused: dict[tuple[int, str], set[str]] = {}
        """(world, accused) -> the ranks that refused its data (DataRefused)."""
        self.commands = 0
        self.server = ""
        """The server (its run ID) the connection readings came from."""
        self.connected_once: set[str] = set()
        """Members seen subscribed to their presence channel on `server`."""
        self.closed: dict[str, float] = {}
        """Member -> server time of the first reading that found none of its connections."""
        self.blinded: list[tuple[float, float]] = []
        """Server-time spans (from, until), in order and apart, when the inbox could not
        take an honest entry (`blind`): not counted as anybody's silence."""

    def observe(self, command: Command, received_at: float) -> None:
        """Record what `command` says about its sender, received at server time `received_at`."""
        self.commands += 1
        worker = command.worker
        if isinstance(command, ProcessExited):
            return  # its launcher's word of its death: no sign of its life
        if received_at > self.last_seen.get(worker, 0.0):
            self.last_seen[worker] = received_at
        match command:
            case StepDone():
                self._done(command)
            case Heartbeat() if command.step is not None and command.world is not None:
                self._progress(worker, command.world, command.step)
            case GpuReading():
                self.gpus[worker] = command
            case TransfersWaiting():
                self.transfers[worker] = command
            case Join():
                self.progress.pop(worker, None)
            case DataRefused():
                self.refused.setdefault((command.world, command.accused), set()).add(worker)
                while len(self.refused) > KEEP_REFUSALS:
                    del self.refused[next(iter(self.refused))]

    def _done(self, command: StepDone) -> None:
        worker = command.worker
        self._progress(worker, command.world, command.step)
        self.step_times[command.step][worker] = command.step_time
        self._medians.pop(command.step, None)
        if command.digest is not None:
            self.digests[command.step][worker] = command.digest
        if command.loss is not None:
            self.losses[worker] = command.loss
        if command.metrics:
            self.figures[worker] = command.metrics

    def _progress(self, worker: str, world: int, step: int) -> None:
        old_world, old_step = self.progress.get(worker, (-1, -1))
        if (world, step) <= (old_world, old_step):
            return
        first = old_step + 1 if world == old_world else step
        for s in range(max(first, step - KEEP_STEPS), step + 1):
            self.reported[(world, s)].add(worker)
        self.progress[worker] = (world, step)

    def all_reported(self, ranks: tuple[str, ...], world: int, step: int) -> bool:
        """Has every rank of `world` finished `step`?"""
        done = self.reported.get((world, step))
        return done is not None and len(done) >= len(ranks) and done.issuperset(ranks)

    def any_reported(self, ranks: tuple[str, ...], world: int, step: int) -> bool:
        done = self.reported.get((world, step))
        return bool(done) and not done.isdisjoint(ranks)  # type: ignore[union-attr]

    def timed(self, step: int) -> tuple[dict[str, float], float] | None:
        """Each worker's time for `step` and the median of them all, if two or more reported
        one (the median is computed once per step, until another report of it comes)."""
        times = self.step_times.get(step)
        if not times or len(times) < 2:
            return None
        middle = self._medians.get(step)
        if middle is None:
            middle = self._medians[step] = median(times.values())
        return times, middle

    def digest_groups(self, ranks: tuple[str, ...], step: int) -> dict[str, tuple[str, ...]]:
        """Digest -> the ranks that reported it for `step` (ranks that sent none are left out)."""
        reported = self.digests.get(step, {})
        groups: dict[str, list[str]] = defaultdict(list)
        for worker in ranks:
            if worker in reported:
                groups[reported[worker]].append(worker)
        return {digest: tuple(workers) for digest, workers in groups.items()}

    def connected(self, server: str, counts: dict[str, int], at: float) -> None:
        """A reading of server `server` at server time `at`: each member's subscriptions to
        its presence channel. A member seen with one before and none now is closed as of
        `at` (unless already closed earlier); one with one again is not closed any more."""
        if server != self.server:
            self.server, self.connected_once, self.closed = server, set(), {}
        for worker, count in counts.items():
            if count > 0:
                self.connected_once.add(worker)
                self.closed.pop(worker, None)
            elif worker in self.connected_once:
                self.closed.setdefault(worker, at)

    def forget(self, worker: str) -> None:
        self.connected_once.discard(worker)
        self.closed.pop(worker, None)
        self.last_seen.pop(worker, None)
        self.progress.pop(worker, None)
        self.losses.pop(worker, None)
        self.figures.pop(worker, None)
        self.gpus.pop(worker, None)
        self.transfers.pop(worker, None)

    def prune(self, committed: int) -> None:
        """Drop reports of steps long committed, so memory stays bounded."""
        horizon = committed - KEEP_STEPS
        for key in [k for k in self.reported if k[1] < horizon]:
            del self.reported[key]
        for step in [s for s in self.step_times if s < horizon]:
            del self.step_times[step]
            self._medians.pop(step, None)
        for step in [s for s in self.digests if s < horizon]:
            del self.digests[step]

    def blind(self, since: float, until: float) -> None:
        """The inbox could not take honest entries from `since` to `until` (server time):
        an entry ahead of the clock arrived after `since`, and was repaired at `until`."""
        if until <= since:
            return
        spans = self.blinded
        if spans and since <= spans[-1][1]:  # overlaps the last span (or comes before it)
            since = min(since, spans[-1][0])
            until = max(until, spans.pop()[1])
        spans.append((since, until))
        if len(spans) > KEEP_BLIND:
            del spans[0]

    def silence(self, last_seen: float, now: float) -> float:
        """Seconds from `last_seen` to `now` that the inbox could take entries in: a worker's
        silence, without the spans when nobody could be heard (`blind`)."""
        quiet = now - last_seen
        for since, until in reversed(self.blinded):  # (usually none; the newest first)
            if until <= last_seen:
                break
            quiet -= max(0.0, min(until, now) - max(since, last_seen))
        return quiet

    def grace(self, workers: list[str], since: float) -> None:
        """Members this view has never heard from count as seen at `since` (a new leader)."""
        for worker in workers:
            self.last_seen.setdefault(worker, since)

    def excuse(self, workers: list[str], until: float) -> None:
        """Members count as seen at `until` at the latest: silence while the leader itself
        could not reach Redis says nothing about them (they could not reach it either)."""
        for worker in workers:
            if self.last_seen.get(worker, 0.0) < until:
                self.last_seen[worker] = until
            self.closed.pop(worker, None)  # a reading after the outage closes it again
