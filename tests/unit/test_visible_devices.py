"""CUDA_VISIBLE_DEVICES as CUDA reads it, and the NVML devices its entries name (faked NVML
facts: UUIDs, PCI bus ids, models, MIG instances)."""

from __future__ import annotations

import pytest

from cohort.worker.telemetry.visible import (
    NvmlGpu,
    NvmlMig,
    Target,
    cuda_devices,
    nvml_targets,
    visible_entries,
)


@pytest.mark.parametrize(
    ("text", "entries"),
    [
        ("0,1,2", ("0", "1", "2")),
        (" 2, 0 ", ("2", "0")),
        ("1gpu,3", ("1", "3")),  # CUDA reads the leading number, as strtoul does
        ("0,1,-1,2", ("0", "1")),  # a negative entry ends the list
        ("0,x,1", ("0",)),
        ("", ()),
        ("-1", ()),
        ("NoDevFiles", ()),
        ("0,1,0", ()),  # a device named twice hides them all
        ("GPU-ab12,GPU-cd34", ("GPU-ab12", "GPU-cd34")),
        ("GPU-ab12,1", ("GPU-ab12",)),  # the first entry's kind, then no other
        ("MIG-1f2e,MIG-9a8b", ("MIG-1f2e", "MIG-9a8b")),
        ("MIG-1f2e,GPU-ab12", ("MIG-1f2e",)),
    ],
)
def test_visible_devices_are_read_as_cuda_reads_them(text: str, entries: tuple[str, ...]) -> None:
    assert visible_entries(text) == entries


A100 = "NVIDIA A100-SXM4-80GB"


def gpu(index: int, bus: str, name: str = A100, migs: tuple[str, ...] | None = None) -> NvmlGpu:
    instances = tuple(NvmlMig(slot, uuid) for slot, uuid in enumerate(migs or ()))
    return NvmlGpu(index, f"GPU-{index}abc-{bus}", name, f"00000000:{bus}:00.0",
                   migs is not None, instances)  # fmt: skip


NODE = (gpu(0, "1B"), gpu(1, "3B"), gpu(2, "89"), gpu(3, "B2"))


def indices(mapped: tuple[Target, ...]) -> list[tuple[int, int | None]]:
    return [(t.index, t.ordinal) for t in mapped]


def test_a_gpu_uuid_whole_or_a_unique_prefix_names_its_gpu_as_cuda_0() -> None:
    whole = nvml_targets(("GPU-2abc-89",), NODE, pci_order=False)
    assert indices(whole.targets) == [(2, 0)] and whole.problem == ""
    assert nvml_targets(("GPU-3",), NODE, False).targets[0].index == 3


def test_a_mig_uuid_names_its_instance_under_its_gpu() -> None:
    node = (gpu(0, "1B"), gpu(1, "3B", migs=("MIG-aa11", "MIG-bb22")))
    (target,) = nvml_targets(("MIG-bb",), node, False).targets
    assert (target.index, target.mig_slot, target.uuid, target.ordinal) == (1, 1, "MIG-bb22", 0)
    assert target.label == "1 (MIG-bb22)"


def test_indices_of_identical_gpus_follow_pci_bus_order_not_nvml_s_numbering() -> None:
    """NVML's own numbering is not promised to be PCI bus order; CUDA's is, for identical
    GPUs (and always under CUDA_DEVICE_ORDER=PCI_BUS_ID)."""
    shuffled = (gpu(0, "89"), gpu(1, "1B"), gpu(2, "B2"), gpu(3, "3B"))
    mapped = nvml_targets(("0", "3"), shuffled, pci_order=False)
    assert indices(mapped.targets) == [(1, 0), (2, 1)]


def test_indices_of_mixed_gpus_in_cuda_s_default_order_name_nothing_and_say_the_fix() -> None:
    mixed = (gpu(0, "1B"), gpu(1, "3B", name="NVIDIA T4"))
    mapped = nvml_targets(("1",), mixed, pci_order=False)
    assert mapped.targets == ()
    assert mapped.problem == (
        "CUDA_VISIBLE_DEVICES entry '1' is an index in CUDA's default order (fastest first), "
        "which NVML cannot tell among this node's different GPUs (NVIDIA A100-SXM4-80GB, "
        "NVIDIA T4): set CUDA_DEVICE_ORDER=PCI_BUS_ID or give GPU UUIDs (nvidia-smi -L)"
    )
    assert indices(nvml_targets(("1",), mixed, pci_order=True).targets) == [(1, 0)]
    assert indices(nvml_targets(("GPU-1",), mixed, pci_order=False).targets) == [(1, 0)]


def test_entries_map_up_to_the_first_that_names_no_device_here() -> None:
    mapped = nvml_targets(("1", "7", "2"), NODE, False)
    assert indices(mapped.targets) == [(1, 0)]
    assert mapped.problem == "CUDA_VISIBLE_DEVICES entry '7' is beyond this node's 4 GPU(s)"
    ambiguous = nvml_targets(("GPU-",), NODE, False)
    assert ambiguous.targets == () and ambiguous.problem.endswith("names more than one device")


def test_a_process_given_nothing_reads_every_gpu_and_one_given_none_reads_none() -> None:
    assert indices(nvml_targets(None, NODE, False).targets) == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert nvml_targets((), NODE, False) == nvml_targets((), NODE, True)
    assert nvml_targets((), NODE, False).targets == ()
    mixed = (gpu(0, "1B"), gpu(1, "3B", name="NVIDIA T4"))
    assert indices(nvml_targets(None, mixed, False).targets) == [(0, None), (1, None)]


def test_a_node_s_devices_are_its_gpus_and_the_instances_of_its_mig_gpus_by_uuid() -> None:
    node = (
        gpu(0, "1B"),
        gpu(1, "3B", migs=("MIG-aa11", "MIG-bb22", "MIG-cc33")),
        gpu(2, "89", migs=()),  # MIG mode on, no instance made: nothing to open
        NvmlGpu(3, ""),  # lost: no UUID to give
    )
    assert cuda_devices(node) == ("GPU-0abc-1B", "MIG-aa11", "MIG-bb22", "MIG-cc33")
