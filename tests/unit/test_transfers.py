"""Transfer scheduling under GPU advice, on a manual clock: the seed's delays, order and staging."""

from __future__ import annotations

import pytest

from cohort.coordinator import gpu_rules
from cohort.events.clock import ManualClock
from cohort.events.models import GpuDevice, GpuReading
from cohort.worker.membership import view as views
from cohort.worker.membership.transfers import MB, TransferScheduler
from cohort.worker.membership.view import GpuAdvice, View

CALM = GpuAdvice()
PRESSURE = GpuAdvice(prefetch_factor=0.5, prioritise_model_files=True, rules=("mem",))
HOT = GpuAdvice(delay_seconds=30.0, rules=("hot",))


class Setting:
    def __init__(self, advice: GpuAdvice = CALM, training: bool = False) -> None:
        self.advice, self.training = advice, training
        self.clock = ManualClock()
        self.queue = TransferScheduler(lambda: self.advice, lambda: self.training, self.clock)


def test_without_advice_a_transfer_starts_at_once() -> None:
    s = Setting()
    slot = s.queue.schedule_transfer(10 * MB, "dataset")
    assert slot.start_at == s.clock.now() and slot.reasons == ()
    assert [d.transfer for d in s.queue.due()] == [slot.transfer]


def test_memory_pressure_delays_dataset_files_30_s_and_lets_model_files_go_first() -> None:
    s = Setting(PRESSURE)
    data = s.queue.schedule_transfer(MB, "dataset", priority=5)
    model = s.queue.schedule_transfer(MB, "model")
    assert data.start_at == s.clock.now() + 30 and model.start_at == s.clock.now()
    assert [d.transfer.kind for d in s.queue.due()] == ["model"]
    s.clock.advance(29.9)
    assert [d.transfer.kind for d in s.queue.due()] == ["model"]
    s.clock.advance(0.1)
    # both due: model files still first, though the dataset transfer has the higher priority
    assert [d.transfer.kind for d in s.queue.due()] == ["model", "dataset"]


def test_a_hot_gpu_delays_every_transfer_60_s_and_a_longer_rule_wins() -> None:
    s = Setting(HOT)
    assert s.queue.schedule_transfer(MB, "model").start_at == s.clock.now() + 60
    s.advice = GpuAdvice(delay_seconds=90.0)
    assert s.queue.schedule_transfer(MB, "dataset").start_at == s.clock.now() + 90


def test_a_delay_ends_early_when_the_advice_clears() -> None:
    s = Setting(HOT)
    s.queue.schedule_transfer(MB, "dataset")
    s.clock.advance(10)
    assert s.queue.due() == []
    s.advice = CALM
    assert len(s.queue.due()) == 1


def test_above_100_mb_a_transfer_is_staged_while_training_and_starts_after() -> None:
    s = Setting(training=True)
    big = s.queue.schedule_transfer(100 * MB + 1, "checkpoint")
    small = s.queue.schedule_transfer(100 * MB, "dataset")
    assert big.staged and not small.staged
    assert [d.transfer for d in s.queue.due()] == [small.transfer]
    s.queue.start(small.transfer)
    s.training = False
    assert [d.transfer for d in s.queue.due()] == [big.transfer]


def test_priority_then_arrival_orders_transfers_of_one_kind() -> None:
    s = Setting()
    low = s.queue.schedule_transfer(MB, "dataset", priority=0)
    s.clock.advance(1)
    high = s.queue.schedule_transfer(MB, "dataset", priority=3)
    later = s.queue.schedule_transfer(MB, "dataset", priority=0)
    assert [d.transfer for d in s.queue.due()] == [high.transfer, low.transfer, later.transfer]


def test_stats_count_pending_staged_and_the_time_started_ones_waited() -> None:
    s = Setting(PRESSURE, training=True)
    data = s.queue.schedule_transfer(MB, "dataset")
    s.queue.schedule_transfer(200 * MB, "dataset")
    s.clock.advance(30)
    s.queue.start(data.transfer)
    assert s.queue.stats() == {"pending": 1, "staged": 1, "delayed_seconds": 30.0}


@pytest.mark.parametrize(
    "args, says",
    [((-1, "dataset"), "size=-1"), ((1, "video"), "kind='video'"), ((1, "model", 1.5), "1.5")],
)
def test_bad_input_is_refused_naming_the_value(args: tuple, says: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError, match=says.replace("(", r"\(")):
        Setting().queue.schedule_transfer(*args)


def test_a_hot_reading_through_the_default_rules_delays_a_workers_transfers() -> None:
    """From a reading (what the NVML probe sends) through the coordinator's default rules
    and the worker's view of the journaled advice, to the scheduler."""
    reading = GpuReading(
        at=1.0, job="j", worker="w",
        devices=(GpuDevice(index=0, memory_total=100, memory_used=90, temperature=91.0),),
    )  # fmt: skip
    issues, _ = gpu_rules.evaluate(gpu_rules.DEFAULT_RULES, frozenset(), reading)
    seen = views.fold([issue.fact(1.0, "j") for issue in issues], View(worker="w"))
    advice = views.gpu_advice(seen)
    s = Setting(advice)
    model = s.queue.schedule_transfer(MB, "model")
    data = s.queue.schedule_transfer(MB, "dataset")
    assert model.start_at == s.clock.now() + 60 and model.reasons == ("GPU hot",)
    assert data.reasons == ("GPU hot", "GPU memory pressure")
