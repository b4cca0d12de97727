"""A worker's side of the GPU rules: what it tells the leader of its GPUs, and the advice the
leader sends back.

Up go the GPU readings (a sampler thread), the workloads a script registers and the state of
the transfer queue; back comes `GpuAdviceIssued`/`Cleared`, folded into the View, handed to
the script's callbacks (a data loader adjusts its prefetch depth there) and honoured by the
transfer queue (`transfers.py`).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from pydantic import ValidationError

from cohort.events.errors import invalid_field
from cohort.events.models import (
    Command,
    GpuDevice,
    GpuReading,
    RegisterWorkload,
    TransfersWaiting,
    Workload,
)
from cohort.worker.errors import WorkerError
from cohort.worker.membership import view as views
from cohort.worker.membership.stamp import Stamp
from cohort.worker.membership.transfers import TransferScheduler
from cohort.worker.membership.view import GpuAdvice, View
from cohort.worker.telemetry import gpu
from cohort.worker.telemetry.gpu import GpuProbe


class AdviceChannel:
    """One worker's GPU reports to the leader and the leader's GPU advice back to it.

    `send` delivers a command and waits; `post` queues one without waiting (the outbox);
    `view` is the worker's current View. Readings are sampled every `interval` s from
    `probe` (None: no readings; probe None: NVML's, if it is there).
    """

    def __init__(
        self,
        stamp: Stamp,
        send: Callable[[Command], object],
        post: Callable[[Command], None],
        view: Callable[[], View],
        log: logging.Logger,
        interval: float | None = None,
        probe: GpuProbe | None = None,
    ) -> None:
        self._stamp = stamp
        self._send = send
        self._post = post
        self._view = view
        self.log = log
        self.interval = interval
        self.probe = probe
        self._callbacks: list[Callable[[GpuAdvice], None]] = []
        self._transfers: TransferScheduler | None = None

    @property
    def advice(self) -> GpuAdvice:
        """The coordinator's current GPU advice for this worker (prefetch factor, delays)."""
        return views.gpu_advice(self._view())

    @property
    def transfers(self) -> TransferScheduler:
        """The transfer queue: honours the current advice, and stages big transfers while
        the worker trains in a running world; made when first asked for."""
        if self._transfers is None:
            self._transfers = TransferScheduler(
                lambda: self.advice,
                lambda: self._view().active,
                self._stamp.clock,
                on_change=self.report_transfers,
            )
        return self._transfers

    def report_transfers(self, stats: dict[str, float]) -> None:
        """The queue as it is now, to the leader's view and metrics, without waiting."""
        if not self._view().member:
            return
        waiting = self._stamp(
            TransfersWaiting,
            pending=int(stats["pending"]),
            staged=int(stats["staged"]),
            delayed=stats["delayed_seconds"],
        )
        try:
            self._post(waiting)
        except WorkerError as exc:  # telemetry: a lost report is not the caller's problem
            self.log.warning(
                "worker %s could not report its transfers: %s", self._stamp.worker, exc
            )

    def register_workload(
        self, name: str, devices: tuple[int, ...], memory: int, priority: int, pid: int | None
    ) -> None:
        """Tell the leader of GPU workload `name` (`Worker.register_workload`)."""
        try:
            workload = Workload(
                name=name,
                pid=os.getpid() if pid is None else pid,
                devices=tuple(devices),
                memory=memory,
                priority=priority,
            )
        except ValidationError as exc:
            raise invalid_field("workload", exc) from None
        self._send(self._stamp(RegisterWorkload, workload=workload))

    def on_advice(self, callback: Callable[[GpuAdvice], None]) -> None:
        """Call `callback(advice)` whenever the advice changes."""
        self._callbacks.append(callback)

    def advice_changed(self, view: View) -> None:
        """Say the advice of `view` in the log and hand it to every callback (from the journal
        thread); a callback's exception is logged, not raised."""
        advice = views.gpu_advice(view)
        self.log.info(
            "worker %s GPU advice now: prefetch x%g, delay %gs, model files first: %s",
            self._stamp.worker,
            advice.prefetch_factor,
            advice.delay_seconds,
            advice.prioritise_model_files,
        )
        for callback in list(self._callbacks):
            try:
                callback(advice)
            except Exception:
                self.log.exception("GPU advice callback %r failed", callback)

    def sampler(self, stop: threading.Event) -> Callable[[], None] | None:
        """What a thread runs to send a GPU reading every `interval` s until `stop` is set
        (None: no interval, no readings)."""
        if not self.interval:
            return None
        probe = self.probe or gpu.probe(self.log)
        return gpu.GpuSampler(probe, self.send_reading, self.interval, stop, log=self.log).run

    def send_reading(self, devices: tuple[GpuDevice, ...]) -> None:
        """A GPU reading to the leader, while the worker is a member."""
        if self._view().member:
            self._send(self._stamp(GpuReading, devices=devices))
