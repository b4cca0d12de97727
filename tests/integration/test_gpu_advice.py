"""GPU advice end to end: a worker's readings reach the leader through Redis, and the advice
comes back to the worker through the journal."""

from __future__ import annotations

import pytest

from cohort.events.models import GpuAdviceCleared, GpuAdviceIssued, GpuDevice
from cohort.worker.membership.client import Worker
from cohort.worker.membership.view import GpuAdvice
from tests.helpers import wait_until
from tests.integration.cluster import Cluster

pytestmark = [pytest.mark.redis_server, pytest.mark.slow]


class FakeGpu:
    """A probe whose memory use the test sets."""

    available = True
    status = "fake GPU"

    def __init__(self) -> None:
        self.used = 10

    def sample(self) -> tuple[GpuDevice, ...]:
        return (
            GpuDevice(
                index=0, name="Fake A100", memory_total=100, memory_used=self.used, temperature=60.0
            ),
        )

    def close(self) -> None:
        pass


def test_memory_pressure_reduces_prefetch_and_the_advice_clears_when_it_drops(
    cluster: Cluster,
) -> None:
    cluster.coordinator("c1", "--min-workers", "1")
    gpu = FakeGpu()
    worker = Worker(cluster.conn, cluster.job, worker_id="g", gpu_interval=0.1, gpu_probe=gpu)
    changes: list[GpuAdvice] = []
    worker.on_advice(changes.append)
    worker.join()
    try:
        assert worker.advice.prefetch_factor == 1.0
        gpu.used = 92
        wait_until(
            lambda: worker.advice.prefetch_factor == 0.5,
            20,
            message="reduce-prefetch advice reached the worker",
        )
        assert worker.advice.prioritise_model_files  # the seed's 80 % rule fires too
        gpu.used = 50
        wait_until(lambda: worker.advice.prefetch_factor == 1.0, 20, message="the advice cleared")
        assert not worker.advice.prioritise_model_files
        assert changes and changes[-1].prefetch_factor == 1.0
    finally:
        worker.leave()
    issued = [f for _, f in cluster.of_type(GpuAdviceIssued)]
    cleared = [f for _, f in cluster.of_type(GpuAdviceCleared)]
    assert {f.action for f in issued} == {"reduce_prefetch", "prioritise_model_files"}
    assert all(f.worker == "g" and f.device == 0 and f.value == 92.0 for f in issued)
    assert len(cleared) == len(issued) and all(f.value == 50.0 for f in cleared)
