"""Tensors on their way to the collective through Redis, which works on host numpy arrays,
and their means on the way back: one `Staging` per device, one slot per bucket.

- CPU ("views"): float16/32/64 tensors are zero-copy numpy views and the mean is written
  back in place, or not at all where the collective wrote it into them already.
- CUDA ("pinned"): a bucket is packed (per dtype it is averaged in) into one device buffer
  on a side stream, which first waits for the caller's stream and any event a gradient hook
  recorded; one non-blocking copy takes it to a pinned host buffer kept for the slot, and
  the host waits for that copy alone: the one host sync a copy to Redis needs. The mean goes
  back on the caller's stream: into the pinned buffer (unless the collective wrote it
  there), one non-blocking copy to the device buffer, one foreach copy into the tensors;
  the optimizer's kernels queue behind it and the host waits for nothing.
- Any other device ("copies"): a blocking copy each way, as `Tensor.cpu()` does.

bfloat16 (and any float numpy lacks) is averaged as float32; other dtypes cannot be.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from cohort.worker.errors import StateError

Path = Literal["views", "pinned", "copies"]
AVERAGED = (torch.float16, torch.float32, torch.float64)
"""dtypes the collective averages as they are; other floats go through float32."""


def path_for(device_type: str) -> Path:
    """How tensors of a device of type `device_type` reach the host (see the module doc)."""
    if device_type == "cpu":
        return "views"
    if device_type == "cuda":
        return "pinned"
    return "copies"


def staging_for(device: torch.device) -> Staging:
    """The staging for tensors on `device`."""
    if path_for(device.type) == "pinned":
        return PinnedStaging(device)
    return Staging()


def averaged_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor of `dtype` is averaged in; StateError for one that is no float."""
    if dtype in AVERAGED:
        return dtype
    if not dtype.is_floating_point:
        raise StateError(f"cannot average a tensor of dtype {dtype}; only floating point")
    return torch.float32  # bfloat16 (and other floats numpy lacks)


def averaged_array(tensor: torch.Tensor) -> np.ndarray:
    """`tensor` as a numpy array the collective can average (a view for CPU f16/f32/f64)."""
    t = tensor.detach()
    t = t.to(averaged_dtype(t.dtype))
    return t.cpu().contiguous().numpy()


def write_back(tensor: torch.Tensor, array: np.ndarray) -> None:
    """Copy the averaged `array` into `tensor` (rounding once to its dtype, moving devices)."""
    if _is_memory_of(array, tensor):
        return  # the mean was written into the tensor's own memory already
    if not array.flags.writeable:
        array = array.copy()  # torch.from_numpy warns on read-only memory
    with torch.no_grad():
        tensor.copy_(torch.from_numpy(array).reshape(tensor.shape))


def _is_memory_of(array: np.ndarray, tensor: torch.Tensor) -> bool:
    """Whether `array` is exactly `tensor`'s CPU memory (a view, as averaged_array gives)."""
    return (
        tensor.device.type == "cpu"
        and tensor.is_contiguous()
        and tensor.is_floating_point()
        and array.dtype.itemsize == tensor.element_size()
        and array.size == tensor.numel()
        and array.__array_interface__["data"][0] == tensor.data_ptr()
    )


@dataclass(frozen=True)
class Group:
    """The tensors of one slot averaged in one dtype: their places in the slot, and where
    each lies in the group's flat buffers."""

    dtype: torch.dtype
    members: tuple[int, ...]
    spans: tuple[tuple[int, int], ...]

    @property
    def size(self) -> int:
        return self.spans[-1][1] if self.spans else 0


def groups_of(tensors: Sequence[torch.Tensor]) -> tuple[Group, ...]:
    """`tensors` grouped by the dtype each is averaged in, in order of first appearance,
    each group's members packed one after the other."""
    members: dict[torch.dtype, list[int]] = {}
    for i, tensor in enumerate(tensors):
        members.setdefault(averaged_dtype(tensor.dtype), []).append(i)
    out = []
    for dtype, indices in members.items():
        spans, at = [], 0
        for i in indices:
            spans.append((at, at + tensors[i].numel()))
            at += tensors[i].numel()
        out.append(Group(dtype, tuple(indices), tuple(spans)))
    return tuple(out)


Buffers = tuple[tuple[Group, ...], list[torch.Tensor], list[torch.Tensor]]


class Staging:
    """The CPU's staging (views), also any device's but CUDA's (blocking copies)."""

    path: Path = "views"

    def ready(self) -> Any:
        """Called where a gradient was just made (a hook): what `to_host` must wait for
        before reading it (None: nothing, the caller's order suffices)."""
        return None

    def to_host(
        self, slot: Hashable, tensors: Sequence[torch.Tensor], ready: Sequence[Any] = ()
    ) -> list[np.ndarray]:
        """Each of `tensors` as a host array to average (`ready`: what `ready()` gave)."""
        return [averaged_array(t) for t in tensors]

    def from_host(
        self, slot: Hashable, tensors: Sequence[torch.Tensor], means: Sequence[np.ndarray]
    ) -> None:
        """Write each mean into its tensor (the same `slot` as `to_host` took them)."""
        for tensor, mean in zip(tensors, means, strict=True):
            write_back(tensor, mean)


class PinnedStaging(Staging):
    """CUDA's staging: pinned host buffers, a side stream, events (see the module doc)."""

    path: Path = "pinned"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._buffers: dict[Hashable, Buffers] = {}
        """Per slot: its groups, and each group's device and pinned host buffers."""

    def ready(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def to_host(
        self, slot: Hashable, tensors: Sequence[torch.Tensor], ready: Sequence[Any] = ()
    ) -> list[np.ndarray]:
        if any(t.device != self.device for t in tensors):
            return super().to_host(slot, tensors, ready)  # a stray tensor elsewhere: as before
        groups, on_device, on_host = self._buffers_for(slot, tensors)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        for event in ready:
            if event is not None:
                self.stream.wait_event(event)
        with torch.cuda.stream(self.stream), torch.no_grad():
            for group, flat, host in zip(groups, on_device, on_host, strict=True):
                parts = [tensors[i].detach().reshape(-1) for i in group.members]
                torch._foreach_copy_([flat[a:b] for a, b in group.spans], parts)
                host.copy_(flat, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.stream)
        copied.synchronize()  # the collective reads host memory: the copy's one host sync
        arrays: list[np.ndarray] = [np.empty(0)] * len(tensors)
        for group, host in zip(groups, on_host, strict=True):
            flat_host = host.numpy()
            for i, (a, b) in zip(group.members, group.spans, strict=True):
                arrays[i] = flat_host[a:b].reshape(tuple(tensors[i].shape))
        return arrays

    def from_host(
        self, slot: Hashable, tensors: Sequence[torch.Tensor], means: Sequence[np.ndarray]
    ) -> None:
        known = self._buffers.get(slot)
        if known is None or any(t.device != self.device for t in tensors):
            super().from_host(slot, tensors, means)
            return
        groups, on_device, on_host = known
        with torch.no_grad():
            for group, flat, host in zip(groups, on_device, on_host, strict=True):
                flat_host = host.numpy()
                for i, (a, b) in zip(group.members, group.spans, strict=True):
                    view = flat_host[a:b]
                    mean = means[i].reshape(-1)
                    if mean.__array_interface__["data"][0] != view.__array_interface__["data"][0]:
                        np.copyto(view, mean, casting="same_kind")
                flat.copy_(host, non_blocking=True)  # on the caller's stream: ordered before
                targets = [tensors[i] for i in group.members]  # the optimizer's kernels
                sources = [
                    flat[a:b].view(tuple(tensors[i].shape))
                    for i, (a, b) in zip(group.members, group.spans, strict=True)
                ]
                torch._foreach_copy_(targets, sources)

    def _buffers_for(self, slot: Hashable, tensors: Sequence[torch.Tensor]) -> Buffers:
        """The slot's buffers, made again if its tensors changed (sizes or dtypes)."""
        groups = groups_of(tensors)
        known = self._buffers.get(slot)
        if known is not None and known[0] == groups:
            return known
        on_device = [torch.empty(g.size, dtype=g.dtype, device=self.device) for g in groups]
        on_host = [torch.empty(g.size, dtype=g.dtype, pin_memory=True) for g in groups]
        self._buffers[slot] = (groups, on_device, on_host)
        return self._buffers[slot]


def lands_later(device_type: str, numel: int) -> bool:
    """Whether a recorded figure of this device and size is read at the report, not now:
    a one-number CUDA tensor (reading it at once would wait for the GPU at every step)."""
    return path_for(device_type) == "pinned" and numel == 1


class Landing:
    """A one-number CUDA tensor on its way to pinned host memory, copied non-blocking as it
    is made; `float()` waits for that copy alone (not for what the GPU queued after it)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        value = tensor.detach().reshape(())
        self.host = torch.empty((), dtype=value.dtype, pin_memory=True)
        self.host.copy_(value, non_blocking=True)
        self.copied = torch.cuda.Event()
        self.copied.record(torch.cuda.current_stream(value.device))

    def __float__(self) -> float:
        self.copied.synchronize()
        return float(self.host)


class HostCopies:
    """Copies of tensors on the host, taken now and read later (a checkpoint's state, which
    the next step would change): a CPU tensor is cloned; a CUDA one is copied into pinned
    memory without waiting, on its device's current stream, so the step after it (queued
    on the same stream) cannot change it first; `wait` blocks until the copies landed."""

    def __init__(self) -> None:
        self._events: list[Any] = []
        self._devices: set[torch.device] = set()

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """A contiguous host copy of `tensor` (its data there once `recorded` then `wait`)."""
        tensor = tensor.detach()
        if path_for(tensor.device.type) != "pinned":
            return tensor.to("cpu", copy=True, memory_format=torch.contiguous_format)
        copy = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        copy.copy_(tensor, non_blocking=True)
        self._devices.add(tensor.device)
        return copy

    def recorded(self) -> HostCopies:
        """Mark the end of the copies taken so far on each device's stream."""
        for device in self._devices:
            self._events.append(torch.cuda.current_stream(device).record_event())
        self._devices = set()
        return self

    def wait(self) -> None:
        for event in self._events:
            event.synchronize()
        self._events = []
