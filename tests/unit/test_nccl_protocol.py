"""The NCCL route's decisions, driven with the device facts faked (no GPU here): the
environment NCCL's group is made in, its options and DDP's, which completion a bucket's
allreduce takes, when the watchdog aborts a group, and the step protocol of `GuardedMean`
(a step applies only once its collectives completed on the device in a world that stands)
with NCCL's asynchrony emulated on a one-rank gloo group. docs/gpu.md, "The NCCL route's
step protocol"."""

from __future__ import annotations

import threading
import types
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

from cohort.events.errors import InvalidValueError  # noqa: E402
from cohort.worker.errors import WorldChangedError  # noqa: E402
from cohort.worker.pytorch import completion  # noqa: E402
from cohort.worker.pytorch.completion import (  # noqa: E402
    DeviceCompletion,
    EmulatedDeviceCompletion,
    HostCompletion,
    completion_for,
)
from cohort.worker.pytorch.dist import (  # noqa: E402
    DistWorld,
    ElasticProcessGroup,
    Watchdog,
    aborts_when_abandoned,
    ddp_devices,
    group_options,
    nccl_environment,
)
from cohort.worker.pytorch.elastic import GuardedMean  # noqa: E402
from tests.helpers import wait_until  # noqa: E402

WORLD = DistWorld(version=3, rank=0, size=2, start_step=0, ranks=("me", "peer"), store=None)  # type: ignore[arg-type]
GPU0, GPU1, CPU = torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cpu")


# ------------------------------------------------------------ NCCL's environment
COHORTS = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_USE_COMM_NONBLOCKING": "1"}


def test_nccl_errors_abort_the_communicator_without_tearing_the_process_down() -> None:
    assert nccl_environment({}) == (COHORTS, None)
    assert nccl_environment({"TORCH_NCCL_BLOCKING_WAIT": "0"})[0] == COHORTS


def test_the_communicator_forms_without_blocking_so_a_lost_peer_can_abort_it() -> None:
    updates, said = nccl_environment({"TORCH_NCCL_USE_COMM_NONBLOCKING": "0"})
    assert updates == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
    assert said is not None and "$TORCH_NCCL_USE_COMM_NONBLOCKING=0 is the user's: kept" in said


@pytest.mark.parametrize("name", ["TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"])
def test_the_users_own_error_handling_is_kept_and_said(name: str) -> None:
    updates, said = nccl_environment({name: "1"})
    assert updates == {"TORCH_NCCL_USE_COMM_NONBLOCKING": "1"}
    assert said is not None and f"${name}=1 is the user's: kept" in said


@pytest.mark.parametrize("name", ["TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT"])
def test_a_blocking_wait_is_refused_with_the_fix(name: str) -> None:
    with pytest.raises(InvalidValueError, match=rf"\${name}='1'.*Unset {name}"):
        nccl_environment({name: "1"})


# ------------------------------------------------------------ placement of the group and DDP
def test_an_nccl_group_is_bound_to_the_ranks_gpu_and_gloo_to_nothing() -> None:
    assert group_options("nccl", GPU1) == {"device_id": GPU1}
    assert group_options("gloo", GPU1) == {}
    assert group_options("nccl", CPU) == {}


def test_ddp_gets_the_gpu_of_a_one_gpu_module_and_none_otherwise() -> None:
    assert ddp_devices([GPU1, GPU1]) == {"device_ids": [1], "output_device": 1}
    assert ddp_devices([CPU]) == {"device_ids": None, "output_device": None}
    assert ddp_devices([GPU0, GPU1]) == {"device_ids": None, "output_device": None}
    assert ddp_devices([]) == {"device_ids": None, "output_device": None}


def test_only_an_nccl_group_is_aborted_when_abandoned_with_works_in_flight() -> None:
    assert aborts_when_abandoned("nccl") and not aborts_when_abandoned("gloo")


# ------------------------------------------------------------ completion by device
def test_cuda_buckets_complete_on_the_device_and_cpu_ones_on_the_host() -> None:
    assert type(completion_for(GPU1, None)) is DeviceCompletion
    assert type(completion_for(GPU1, "device")) is DeviceCompletion
    assert type(completion_for(CPU, None)) is HostCompletion
    assert type(completion_for(CPU, "device")) is EmulatedDeviceCompletion
    with pytest.raises(InvalidValueError, match=r"COHORT_TORCH_COMPLETION='gpu'"):
        completion_for(CPU, "gpu")


def test_a_cuda_buckets_result_is_a_future_on_its_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """DDP (and the optimizer after it) waits on a result's CUDA events only if the Future
    was made with the bucket's device (torch.futures.Future, "devices")."""
    made: list[Any] = []

    class Future:
        def __init__(self, *, devices: list[Any] | None = None) -> None:
            made.append(devices)

    monkeypatch.setattr(completion.torch.futures, "Future", Future)

    class Bucket:
        device = GPU1

    DeviceCompletion(GPU1).result(Bucket())  # type: ignore[arg-type]
    assert made == [[GPU1]]


# ------------------------------------------------------------ the watchdog's abort
class Group:
    def __init__(self) -> None:
        self.aborted = 0

    def abort(self) -> None:
        self.aborted += 1


def test_a_world_that_moved_on_after_its_works_completed_keeps_its_group() -> None:
    """An ordinary world change never aborts: the committed step's kernels may still run
    on a slower rank's GPU as the next world is decided."""
    group = Group()
    dog = Watchdog(None, WORLD, group)  # type: ignore[arg-type]
    dog.in_flight = lambda: False
    dog.trip("world 4 replaced world 3")
    assert group.aborted == 0


def test_a_world_lost_with_a_work_in_flight_aborts_its_group() -> None:
    group = Group()
    dog = Watchdog(None, WORLD, group)  # type: ignore[arg-type]
    dog.in_flight = lambda: True
    dog.trip("rank(s) ['peer'] of world 3 left or failed")
    assert group.aborted == 1


def test_a_world_lost_with_a_collective_waiting_aborts_its_group() -> None:
    group = Group()
    dog = Watchdog(None, WORLD, group)  # type: ignore[arg-type]
    done = threading.Event()
    waiter = threading.Thread(target=dog.wait, args=(done,))
    waiter.start()
    wait_until(lambda: dog._waiters, 5, message="the collective waiting")
    dog.trip("rank(s) ['peer'] of world 3 left or failed")
    waiter.join(5)
    assert group.aborted == 1


# ------------------------------------------------------------ the step protocol
@pytest.fixture
def one_rank() -> Iterator[None]:
    """A one-rank gloo group: real works, whose completion the tests steer."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class Rdzv:
    """The process group's side GuardedMean uses: the watchdog, works tracked, and whether
    the journal explains a failed work within its grace."""

    def __init__(self, explains: bool = True) -> None:
        self.group = Group()
        self.watchdog = Watchdog(None, WORLD, self.group)  # type: ignore[arg-type]
        self.works: list[Any] = []
        self.explains = explains
        self.watchdog.in_flight = lambda: any(not w.is_completed() for w in self.works)

    fence = ElasticProcessGroup.fence  # the real guard of a step's fence
    worker = types.SimpleNamespace(assignment=None)

    def track(self, work: Any) -> None:
        self.works.append(work)

    def _world_changed(self, exc: Exception, step: int) -> None:
        if self.explains:
            raise WorldChangedError(step, None) from exc


class Held(EmulatedDeviceCompletion):
    """NCCL's asynchrony with the device's completion held back until `arrive` is set (or
    failed with `error`): the kernel still running, or hung on a dead peer."""

    def __init__(self) -> None:
        self.arrive = threading.Event()
        self.error: Exception | None = None
        self.fencing = threading.Event()

    def fence(self, works: Any) -> None:
        self.fencing.set()
        self.arrive.wait(30)
        if self.error is not None:
            raise self.error
        super().fence(works)


def launched() -> bool:
    return True


def test_a_deferred_result_goes_to_ddp_at_once_and_the_step_waits_for_the_device(
    one_rank: None,
) -> None:
    rdzv, held = Rdzv(), Held()
    mean = GuardedMean(rdzv, launched, held)
    mean.begin()
    result = mean.reduce(torch.ones(4))
    assert result.done()  # as NCCL's future: handed over as the kernel is enqueued
    settled: list[bool] = []
    settling = threading.Thread(target=lambda: settled.append(mean.settle(7)))
    settling.start()
    assert held.fencing.wait(5)
    assert settled == []  # the step does not apply while the device has not finished
    held.arrive.set()
    settling.join(5)
    assert settled == [True] and not mean.aborted
    assert torch.equal(result.value(), torch.ones(4))


def test_a_peer_lost_while_the_device_reduces_skips_the_step_and_aborts_the_group(
    one_rank: None,
) -> None:
    """NCCL's future completed at enqueue, so only the fence sees a dead peer's step: the
    journal trips the watchdog, the group is aborted (its kernel ends), nothing applies."""
    rdzv, held = Rdzv(), Held()
    mean = GuardedMean(rdzv, launched, held)
    mean.begin()
    mean.reduce(torch.ones(4))
    settled: list[bool] = []
    settling = threading.Thread(target=lambda: settled.append(mean.settle(7)))
    settling.start()
    wait_until(lambda: rdzv.watchdog._waiters, 5, message="the step waiting on its fence")
    rdzv.watchdog.trip("rank(s) ['peer'] of world 3 left or failed")
    settling.join(5)
    held.arrive.set()
    assert settled == [False] and mean.aborted
    assert rdzv.group.aborted == 1


def test_a_failed_work_skips_the_step_once_the_journal_explains_it(one_rank: None) -> None:
    rdzv, held = Rdzv(explains=True), Held()
    mean = GuardedMean(rdzv, launched, held)
    mean.begin()
    mean.reduce(torch.ones(4))
    held.error = RuntimeError("Connection closed by peer")
    held.arrive.set()
    assert mean.settle(7) is False and mean.aborted


def test_a_failed_work_the_journal_never_explains_is_raised(one_rank: None) -> None:
    rdzv, held = Rdzv(explains=False), Held()
    mean = GuardedMean(rdzv, launched, held)
    mean.begin()
    mean.reduce(torch.ones(4))
    held.error = RuntimeError("NCCL communicator was aborted")
    held.arrive.set()
    with pytest.raises(RuntimeError, match="communicator was aborted"):
        mean.settle(7)


def test_the_host_completion_hands_over_the_reduced_data_and_has_nothing_to_fence(
    one_rank: None,
) -> None:
    rdzv = Rdzv()
    mean = GuardedMean(rdzv, launched, HostCompletion())
    mean.begin()
    mean.scale = 2.0
    result = mean.reduce(torch.ones(3))
    assert torch.equal(result.wait(), torch.full((3,), 2.0))
    assert mean.settle(7) is True


def test_a_new_step_forgets_the_last_ones_works_and_abort(one_rank: None) -> None:
    rdzv, held = Rdzv(), Held()
    mean = GuardedMean(rdzv, launched, held)
    mean.reduce(torch.ones(2))
    mean.aborted = True
    mean.begin()
    assert not mean.aborted and mean.settle(8) is True  # nothing of step 8 to fence
