"""When a data or model transfer may start, honouring the coordinator's GPU advice.

After the SeaweedFS GPU coordinator seed's transfer scheduler: under memory pressure a
dataset (or other) transfer waits 30 s and model files go first; while a GPU is hot
every transfer waits 60 s (or the advising rule's longer delay); a transfer above
100 MB is staged while training is active (the seed's fourth default rule) and starts
once training is not. `slot` is pure; `TransferScheduler` keeps the queue on an
injected clock and re-reads the advice each time it is asked, so a delay ends early
when the advice clears.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from cohort.events.clock import Clock, SystemClock
from cohort.events.errors import InvalidValueError
from cohort.worker.membership.view import GpuAdvice

Kind = Literal["model", "dataset", "checkpoint", "other"]
KINDS: tuple[Kind, ...] = ("model", "dataset", "checkpoint", "other")
MB = 1_000_000


@dataclass(frozen=True, slots=True)
class Policy:
    """The seed's numbers, as defaults."""

    memory_delay: float = 30.0
    """Seconds a transfer other than model files waits under GPU memory pressure."""
    hot_delay: float = 60.0
    """Seconds every transfer waits while a GPU is hot (a rule's longer delay wins)."""
    stage_above: int = 100 * MB
    """Bytes above which a transfer is staged while training is active."""


@dataclass(frozen=True, slots=True)
class Transfer:
    """A transfer asked for at `asked_at`: `size` bytes of `kind`, higher `priority` first."""

    id: int
    size: int
    kind: Kind
    priority: int
    asked_at: float


@dataclass(frozen=True, slots=True)
class Slot:
    """When `transfer` may start: at `start_at` (None: staged until training stops), and
    why it waits (empty: it may start at once)."""

    transfer: Transfer
    start_at: float | None
    reasons: tuple[str, ...] = ()

    @property
    def staged(self) -> bool:
        return self.start_at is None

    def due(self, now: float) -> bool:
        return self.start_at is not None and self.start_at <= now


def memory_pressure(advice: GpuAdvice) -> bool:
    """A memory rule is active: it reduced the prefetch or asked for model files first."""
    return advice.prefetch_factor < 1.0 or advice.prioritise_model_files


def hot(advice: GpuAdvice) -> bool:
    """A rule asked to delay transfers (by default: a GPU above its temperature)."""
    return advice.delay_seconds > 0


def slot(transfer: Transfer, advice: GpuAdvice, training: bool, policy: Policy = Policy()) -> Slot:
    """When `transfer` may start under `advice`, `training` saying whether steps run now."""
    delays: list[tuple[float, str]] = []
    if hot(advice):
        delays.append((max(policy.hot_delay, advice.delay_seconds), "GPU hot"))
    if memory_pressure(advice) and transfer.kind != "model":
        delays.append((policy.memory_delay, "GPU memory pressure"))
    reasons = tuple(why for _, why in delays)
    if training and transfer.size > policy.stage_above:
        return Slot(transfer, None, (*reasons, f"staged: above {policy.stage_above} bytes"))
    wait = max((seconds for seconds, _ in delays), default=0.0)
    return Slot(transfer, transfer.asked_at + wait, reasons)


def order(slots: list[Slot], advice: GpuAdvice) -> list[Slot]:
    """The order transfers start in: model files first under memory pressure, then by
    priority (higher first), then as asked."""
    models_first = memory_pressure(advice)

    def key(s: Slot) -> tuple[int, int, float, int]:
        t = s.transfer
        return (0 if models_first and t.kind == "model" else 1, -t.priority, t.asked_at, t.id)

    return sorted(slots, key=key)


class TransferScheduler:
    """The transfers a worker waits to start. `advice` and `training` are read at each call
    (a worker's: its current GPU advice, and whether it is in a running world)."""

    def __init__(
        self,
        advice: Callable[[], GpuAdvice],
        training: Callable[[], bool],
        clock: Clock | None = None,
        policy: Policy = Policy(),
        on_change: Callable[[dict[str, float]], None] | None = None,
    ) -> None:
        """`on_change(stats)`: called after a transfer is queued or started (a worker
        reports its queue to the leader there)."""
        self._advice, self._training = advice, training
        self._on_change = on_change
        self.clock: Clock = clock or SystemClock()
        self.policy = policy
        self._pending: dict[int, Transfer] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.delayed_seconds = 0.0
        """Seconds transfers waited in all (started ones), for the metrics."""

    def schedule_transfer(self, size: int, kind: str, priority: int = 0) -> Slot:
        """Queue a transfer of `size` bytes of `kind`; when it may start, as of now."""
        if not isinstance(size, int) or size < 0:
            raise InvalidValueError(
                f"size={size!r}: a transfer's size is a whole number of bytes >= 0"
            )
        if kind not in KINDS:
            raise InvalidValueError(f"kind={kind!r}: a transfer is one of {', '.join(KINDS)}")
        if not isinstance(priority, int):
            raise InvalidValueError(f"priority={priority!r}: a transfer's priority is an int")
        with self._lock:
            transfer = Transfer(next(self._ids), size, kind, priority, self.clock.now())  # type: ignore[arg-type]
            self._pending[transfer.id] = transfer
        self._changed()
        return self.slot_of(transfer)

    def slot_of(self, transfer: Transfer) -> Slot:
        return slot(transfer, self._advice(), self._training(), self.policy)

    def due(self) -> list[Slot]:
        """The pending transfers that may start now, in the order they should."""
        now, advice = self.clock.now(), self._advice()
        training = self._training()
        with self._lock:
            slots = [slot(t, advice, training, self.policy) for t in self._pending.values()]
        return order([s for s in slots if s.due(now)], advice)

    def start(self, transfer: Transfer) -> None:
        """`transfer` starts now: it leaves the queue; the time it waited is counted."""
        with self._lock:
            if self._pending.pop(transfer.id, None) is None:
                return
            self.delayed_seconds += max(0.0, self.clock.now() - transfer.asked_at)
        self._changed()

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self.stats())

    @property
    def pending(self) -> list[Slot]:
        """Every transfer still waiting, with when it may start, in start order."""
        advice, training = self._advice(), self._training()
        with self._lock:
            slots = [slot(t, advice, training, self.policy) for t in self._pending.values()]
        return order(slots, advice)

    def stats(self) -> dict[str, float]:
        """Pending transfers, staged ones, and the seconds started ones waited."""
        pending = self.pending
        return {
            "pending": len(pending),
            "staged": sum(s.staged for s in pending),
            "delayed_seconds": self.delayed_seconds,
        }
