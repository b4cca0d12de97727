"""When a bucket's allreduce is done: on the host (gloo) or on the device (NCCL).

gloo on CPU tensors completes a work's future once the data arrived: DDP's comm hook can
hand its result over from the future's callback, and a step whose backward returned holds
the world's gradients. NCCL completes the future as its kernel is enqueued (its value ready
with CUDA events), so a result handed over then says nothing about the data, and a failure
shows only later, on the device. A `Completion` is that difference, as a strategy chosen
by the tensors' device (`completion_for`): how the hook's result is made, and what a step
must wait for before it applies (`fence`, run on a side thread the watchdog guards).
docs/gpu.md, "The NCCL route's step protocol", says why the order is safe.

$COHORT_TORCH_COMPLETION=device makes CPU tensors take NCCL's path (the result handed over
at once, the data there only after the fence): the tests run the NCCL protocol on gloo so.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from cohort.events.errors import InvalidValueError

COMPLETION_ENV = "COHORT_TORCH_COMPLETION"
"""Test seam: "device" runs CPU tensors through the device path (NCCL's asynchrony)."""


class HostCompletion:
    """gloo on the CPU: a work's future completes once the reduced data is in the tensor."""

    deferred = False
    """Whether results are handed over before the data is there (a fence must follow)."""

    def result(self, tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        return torch.futures.Future()

    def hand_over(
        self,
        work: Any,
        tensor: torch.Tensor,
        finish: Callable[[Any], None],
    ) -> None:
        """Call `finish(done)` with the work's future once the result may go to DDP."""
        work.get_future().add_done_callback(finish)

    def fence(self, works: Sequence[Any]) -> None:
        """Wait for the data of `works` the step issued besides DDP's buckets (whose
        results DDP waited for, each with its data): their `wait()` on gloo returns once it
        arrived, or raises what broke them."""
        for work in works:
            work.wait()


class DeviceCompletion(HostCompletion):
    """NCCL on CUDA tensors. The result is a Future on the bucket's device, set from the
    work future's callback: torch runs it with streams that wait on NCCL's kernel, and
    `set_result` records events there, so DDP's and the optimizer's kernels are ordered
    after the allreduce (torch.futures.Future, "devices"). The fence blocks until the
    kernels ran on the device: `work.wait()` makes this thread's stream wait on NCCL's,
    and a blocking event recorded after it is synchronized (NCCL's `wait()` without
    TORCH_NCCL_BLOCKING_WAIT never blocks the host). A work that failed (NCCL's watchdog
    sets the error, then aborts the communicator, which ends the kernel) raises in the
    `wait()` after it."""

    deferred = True

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def result(self, tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        return torch.futures.Future(devices=[tensor.device])

    def fence(self, works: Sequence[Any]) -> None:
        with torch.cuda.device(self.device):
            for work in works:
                work.wait()
            event = torch.cuda.Event(blocking=True)
            event.record()
            event.synchronize()
            for work in works:  # NCCL's own abort (an error, a timeout) ended the kernel:
                work.wait()  # the exception it set on the work is raised now


class EmulatedDeviceCompletion(HostCompletion):
    """NCCL's asynchrony on gloo, for the tests: the result goes to DDP as the work is
    issued (NCCL's future completes as its kernel is enqueued), while gloo still writes
    the bucket; the data is the world's only after the fence (the host's: `work.wait()`,
    which for gloo blocks until it arrived, or raises)."""

    deferred = True

    def hand_over(
        self,
        work: Any,
        tensor: torch.Tensor,
        finish: Callable[[Any], None],
    ) -> None:
        issued: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        issued.set_result([tensor])  # "enqueued": the value is usable once fenced
        finish(issued)


def completion_for(device: torch.device, setting: str | None) -> HostCompletion:
    """The completion of collectives on `device`'s tensors: the device's own on CUDA, the
    host's on the CPU unless `setting` ($COHORT_TORCH_COMPLETION) is "device"."""
    if setting not in (None, "", "host", "device"):
        raise InvalidValueError(
            f"${COMPLETION_ENV}={setting!r}: say 'device' (NCCL's asynchrony, emulated on the "
            "CPU for tests) or leave it unset"
        )
    if device.type == "cuda":
        return DeviceCompletion(device)
    if setting == "device":
        return EmulatedDeviceCompletion()
    return HostCompletion()


def completion_of(device: torch.device) -> HostCompletion:
    """`completion_for` the device, as this process's environment says."""
    return completion_for(device, os.environ.get(COMPLETION_ENV))
