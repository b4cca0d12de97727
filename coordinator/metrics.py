"""Prometheus metrics of one coordinator (`cohort coordinator --metrics-port P`).

Gauges describe the job as this coordinator's folded state sees it (followers
report them too, so a dashboard keeps working across failovers); counters count
what this process did. Each coordinator has its own registry: nothing global.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from cohort.coordinator import spares
from cohort.coordinator.progress import progress
from cohort.coordinator.state import JobState
from cohort.events.models import FailureCause, TransfersWaiting

UNKNOWN = float("nan")
"""What a progress gauge reads while it cannot be known (Prometheus's convention)."""

STEP_TIME_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class Metrics:
    def __init__(self, job: str, coordinator: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"job": job, "coordinator": coordinator}
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, list(labels), registry=r).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, list(labels), registry=r).labels(**labels)

        self.leading = gauge("cohort_leading", "1 if this coordinator holds the lease")
        self.leader_epoch = gauge("cohort_leader_epoch", "Epoch of the current leader")
        self.world_size = gauge("cohort_world_size", "Ranks in the current world")
        self.world_version = gauge("cohort_world_version", "Current world version")
        self.members = gauge("cohort_members", "Members of the job (any status)")
        self.paused = gauge("cohort_training_paused", "1 while training is paused")
        self.last_step = gauge("cohort_last_committed_step", "Last committed step")
        self.inbox_lag = gauge("cohort_inbox_lag_seconds", "Age of the oldest unread command")
        self._failures_and_spares(gauge, labels)
        self.elections = gauge("cohort_elections", "Leader elections since the job began")
        self.steps_per_second = gauge(
            "cohort_steps_per_second", "Steps committed per second over the last commits"
        )
        self.epoch_progress = gauge(
            "cohort_epoch_progress", "Fraction of the current epoch's samples used (0..1)"
        )
        self.steps_left = gauge("cohort_steps_left", "Steps to the job's configured length")
        self.eta = gauge("cohort_eta_seconds", "Estimated seconds to the job's configured end")
        self.workloads = gauge("cohort_gpu_workloads", "GPU workloads the members registered")
        self.workload_memory = gauge(
            "cohort_gpu_workload_memory_bytes", "GPU memory the registered workloads hold"
        )
        self.transfers_pending = gauge(
            "cohort_transfers_pending", "Transfers the workers wait to start (leader only)"
        )
        self.transfers_staged = gauge(
            "cohort_transfers_staged", "Of them, staged until training stops (leader only)"
        )
        self.transfer_delay = gauge(
            "cohort_transfer_delay_seconds",
            "Seconds the workers' started transfers waited, in all (leader only)",
        )
        self.commands = counter("cohort_commands", "Inbox commands this coordinator decided")
        self.facts = counter("cohort_facts", "Facts this coordinator appended")
        self.dead = counter("cohort_dead_letters", "Inbox entries this coordinator rejected")
        self.forged = counter(
            "cohort_forged_commands",
            "Of the dead letters, commands whose signature did not prove the worker they name",
        )
        self.failovers = counter("cohort_failovers", "Times this coordinator took over the lead")
        self.step_time = Histogram(
            "cohort_step_time_seconds",
            "Step time reported by workers",
            list(labels),
            buckets=STEP_TIME_BUCKETS,
            registry=r,
        ).labels(**labels)

    def _failures_and_spares(
        self, gauge: Callable[[str, str], Gauge], labels: dict[str, str]
    ) -> None:
        """How many members failed, by the sign they gave, and the spares that replace them."""
        self.failed = gauge("cohort_workers_failed", "Workers failed since the job began")
        by_cause = Gauge(
            "cohort_workers_failed_by_cause",
            "Of them, by the sign they gave: silent (no heartbeat), disconnected (connections "
            "closed past the grace), exited (a launcher saw the process end)",
            [*labels, "cause"],
            registry=self.registry,
        )
        self.failed_by = {c: by_cause.labels(**labels, cause=c) for c in get_args(FailureCause)}
        self.spares_ready = gauge("cohort_spares_ready", "Warm spares ready to take a lost rank")
        self.promotions = gauge(
            "cohort_spare_promotions",
            "Spares promoted into a lost rank's place since the job began",
        )

    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serve /metrics in a daemon thread; returns the port (useful with port 0)."""
        server, _ = start_http_server(port, addr=addr, registry=self.registry)
        return int(server.server_port)

    def transfers(self, queues: Iterable[TransfersWaiting]) -> None:
        """The workers' transfer queues as they last reported them (the leader sees them)."""
        queues = list(queues)
        self.transfers_pending.set(sum(q.pending for q in queues))
        self.transfers_staged.set(sum(q.staged for q in queues))
        self.transfer_delay.set(sum(q.delayed for q in queues))

    def update(self, state: JobState, leading: bool, lag_seconds: float, now: float) -> None:
        """Set every gauge from `state`; `now` (the clock that stamped its facts) dates the
        estimated time to the end."""
        self.leading.set(1 if leading else 0)
        self.leader_epoch.set(state.leader_epoch)
        self.world_size.set(len(state.ranks))
        self.world_version.set(state.world_version)
        self.members.set(len(state.members))
        self.paused.set(1 if state.paused else 0)
        self.last_step.set(state.last_committed)
        self.inbox_lag.set(lag_seconds)
        counters = state.counters
        self.failed.set(counters.failed)
        self.failed_by["disconnected"].set(counters.disconnected)
        self.failed_by["exited"].set(counters.exited)
        self.failed_by["silent"].set(counters.failed - counters.disconnected - counters.exited)
        self.spares_ready.set(len(spares.ready(state)))
        self.promotions.set(counters.promotions)
        self.elections.set(state.counters.elections)
        workloads = [w for member in state.members.values() for w in member.workloads]
        self.workloads.set(len(workloads))
        self.workload_memory.set(sum(w.memory for w in workloads))
        ahead = progress(state, now)
        for gauge, value in (
            (self.steps_per_second, ahead.steps_per_second),
            (self.epoch_progress, ahead.epoch_progress),
            (self.steps_left, ahead.steps_left),
            (self.eta, ahead.eta_seconds),
        ):
            gauge.set(UNKNOWN if value is None else value)
