"""Which GPUs a process was given, and which NVML devices they are: pure, over facts.

A process sees the CUDA devices `CUDA_VISIBLE_DEVICES` names (all of them where it is unset),
in that order: its `cuda:0` is the first entry. An entry is an index, a GPU UUID (`GPU-…`) or
a MIG UUID (`MIG-…`), either UUID possibly cut short to a unique prefix. `cohort run` gives
each process one UUID; a scheduler or a user may give indices. NVML numbers GPUs its own way
(`nvmlDeviceGetHandleByIndex`, in practice PCI bus order) and knows nothing of the variable,
so the telemetry maps each entry to the NVML device it names (`nvml_targets`) and reads only
those. The facts come from NVML (`NvmlGpu`, read in `gpu.py`); nothing here does I/O.

An index is in CUDA's device order: PCI bus order under `CUDA_DEVICE_ORDER=PCI_BUS_ID`,
else CUDA's default "fastest first", which on a node of identical GPUs is PCI bus order
again and on mixed GPUs is a guess of CUDA's that NVML cannot repeat: there an index names
no device here (the probe says why once), and a UUID always does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"
ORDER_ENV = "CUDA_DEVICE_ORDER"


def visible_entries(text: str) -> tuple[str, ...]:
    """The devices `CUDA_VISIBLE_DEVICES=text` leaves a process, as CUDA reads it: the entries
    up to the first it cannot use (empty, negative such as `-1`, not an index or a UUID of the
    first entry's kind); none at all where one repeats. Indices are given back as numbers
    (`"1gpu"` reads as `"1"`, as CUDA's own parsing does), UUIDs as written."""
    entries: list[str] = []
    kind = _kind(text.split(",")[0].strip())
    if kind == "none":
        return ()
    for raw in text.split(","):
        entry = raw.strip()
        if kind == "index":
            digits = len(entry) - len(entry.lstrip("0123456789"))
            entry = str(int(entry[:digits])) if digits else ""
        if not entry or _kind(entry) != kind:
            break
        if entry in entries:
            return ()  # CUDA hides every device when one is named twice
        entries.append(entry)
    return tuple(entries)


def _kind(entry: str) -> str:
    if entry.startswith("GPU-"):
        return "gpu"
    if entry.startswith("MIG-"):
        return "mig"
    return "index" if entry[:1].isdigit() else "none"


@dataclass(frozen=True)
class NvmlMig:
    """A MIG instance of a GPU: its slot under the GPU (`nvmlDeviceGetMigDeviceHandleByIndex`)
    and its UUID (`MIG-…`)."""

    slot: int
    uuid: str


@dataclass(frozen=True)
class NvmlGpu:
    """A physical GPU as NVML tells it: its NVML index, UUID (`GPU-…`), model name, PCI bus id
    and, where MIG mode is on, its MIG instances."""

    index: int
    uuid: str
    name: str = ""
    pci_bus_id: str = ""
    mig: bool = False
    migs: tuple[NvmlMig, ...] = ()


@dataclass(frozen=True)
class Target:
    """A device a process reads: GPU `index` (NVML's) as a whole, or its MIG instance in
    `mig_slot`; `ordinal` the CUDA index this process knows it by (None: not known)."""

    index: int
    uuid: str
    mig_slot: int | None = None
    ordinal: int | None = None

    @property
    def label(self) -> str:
        """How logs name it: the NVML index, with the MIG UUID where it is an instance."""
        return str(self.index) if self.mig_slot is None else f"{self.index} ({self.uuid})"


@dataclass(frozen=True)
class Targets:
    """What a process reads, and why (`problem`) an entry of its variable maps to nothing."""

    targets: tuple[Target, ...]
    problem: str = ""


def cuda_devices(gpus: Sequence[NvmlGpu]) -> tuple[str, ...]:
    """One `CUDA_VISIBLE_DEVICES` entry per device a process can open alone, in NVML's order:
    each MIG instance of a GPU in MIG mode (a CUDA process uses one instance), each other
    GPU whole; UUIDs, which CUDA and NVML read alike whatever CUDA's device order (a GPU
    NVML cannot tell the UUID of, lost, is left out)."""
    devices: list[str] = []
    for gpu in gpus:
        if gpu.mig:
            devices.extend(m.uuid for m in gpu.migs)
        elif gpu.uuid:
            devices.append(gpu.uuid)
    return tuple(devices)


def nvml_targets(
    entries: tuple[str, ...] | None, gpus: Sequence[NvmlGpu], pci_order: bool
) -> Targets:
    """The NVML devices a process given `entries` (`visible_entries`; None: the variable is
    unset) reads, each with its CUDA ordinal: every GPU where nothing was given, else each
    entry's device in order, up to the first that names none here (as CUDA stops there).
    `pci_order`: `CUDA_DEVICE_ORDER=PCI_BUS_ID`."""
    by_cuda_order = _cuda_order(gpus, pci_order)
    if entries is None:
        if by_cuda_order is None:  # the ordinals are CUDA's guess: readings, but no cache
            return Targets(tuple(Target(g.index, g.uuid) for g in gpus))
        return Targets(tuple(Target(g.index, g.uuid, None, n) for n, g in enumerate(by_cuda_order)))
    found: list[Target] = []
    for ordinal, entry in enumerate(entries):
        target, problem = _named(entry, gpus, by_cuda_order)
        if target is None:
            return Targets(tuple(found), f"{VISIBLE_ENV} entry {entry!r} {problem}")
        found.append(Target(target.index, target.uuid, target.mig_slot, ordinal))
    return Targets(tuple(found))


def _cuda_order(gpus: Sequence[NvmlGpu], pci_order: bool) -> list[NvmlGpu] | None:
    """The GPUs in CUDA's device order, where NVML can tell it: PCI bus order when asked for,
    or when every GPU is the same model (CUDA's "fastest first" has nothing to choose by)."""
    if pci_order or len({g.name for g in gpus}) <= 1:
        return sorted(gpus, key=lambda g: (g.pci_bus_id.lower(), g.index))
    return None


def _named(
    entry: str, gpus: Sequence[NvmlGpu], by_cuda_order: list[NvmlGpu] | None
) -> tuple[Target | None, str]:
    """The device one entry names, or None and why."""
    if entry.startswith("GPU-"):
        matches = [Target(g.index, g.uuid) for g in gpus if g.uuid.startswith(entry)]
    elif entry.startswith("MIG-"):
        matches = [
            Target(g.index, m.uuid, m.slot)
            for g in gpus
            for m in g.migs
            if m.uuid.startswith(entry)
        ]
    elif by_cuda_order is None:
        names = ", ".join(sorted({g.name for g in gpus}))
        return None, (
            f"is an index in CUDA's default order (fastest first), which NVML cannot tell "
            f"among this node's different GPUs ({names}): set {ORDER_ENV}=PCI_BUS_ID or give "
            "GPU UUIDs (nvidia-smi -L)"
        )
    else:
        index = int(entry)
        if index >= len(by_cuda_order):
            return None, f"is beyond this node's {len(by_cuda_order)} GPU(s)"
        gpu = by_cuda_order[index]
        return Target(gpu.index, gpu.uuid), ""
    if len(matches) == 1:
        return matches[0], ""
    return None, "names no device NVML sees" if not matches else "names more than one device"
