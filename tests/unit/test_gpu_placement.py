"""One GPU per process: the launcher's plan of each slot's CUDA_VISIBLE_DEVICES from the node's
GPUs (indices, GPU UUIDs or MIG UUIDs), the number of ranks and of spares."""

from __future__ import annotations

import pytest

from cohort.launcher.gpus import NodeGpus, PlacementError, place, trainers_for

INDICES = NodeGpus(("0", "1", "2", "3"), "CUDA_VISIBLE_DEVICES='0,1,2,3'")
UUIDS = NodeGpus(("GPU-a", "GPU-b", "GPU-c"), "NVML sees 3 GPU(s)")
MIGS = NodeGpus(("MIG-1", "MIG-2", "MIG-3", "MIG-4"), "NVML sees 1 GPU(s), 4 MIG instance(s)")
NONE = NodeGpus((), "NVML library not found: no NVIDIA driver on this machine")


@pytest.mark.parametrize("gpus", [INDICES, UUIDS, MIGS])
def test_each_rank_then_each_spare_gets_a_device_of_its_own(gpus: NodeGpus) -> None:
    plan = place(gpus, trainers=2, spares=1)
    assert plan == gpus.devices[:3]
    assert len(set(plan)) == 3  # a promoted spare shares no GPU with a rank of its world


def test_a_node_without_gpus_gives_none_and_leaves_the_environment_as_it_is() -> None:
    assert place(NONE, trainers=8, spares=2) == ()
    assert place(NodeGpus((), "CUDA_VISIBLE_DEVICES=''"), trainers=2, spares=0) == ()


def test_more_processes_than_gpus_are_refused_naming_the_n_and_spares_that_fit() -> None:
    with pytest.raises(PlacementError) as refused:
        place(INDICES, trainers=4, spares=1)
    assert str(refused.value) == (
        "-n 4 --spares 1: 5 processes need 5 GPUs, one each; this node has 4 "
        "(CUDA_VISIBLE_DEVICES='0,1,2,3'): give -n 3 --spares 1, or CUDA_VISIBLE_DEVICES= "
        "(empty) to run on the CPU"
    )
    with pytest.raises(PlacementError, match=r"give -n 1 --spares 2,"):
        place(UUIDS, trainers=1, spares=5)
    with pytest.raises(PlacementError, match=r"-n 5 --spares 0: 5 processes need 5 GPUs"):
        place(MIGS, trainers=5, spares=0)


def test_gpu_ranks_leave_each_spare_a_gpu() -> None:
    assert trainers_for(INDICES, spares=0) == 4
    assert trainers_for(INDICES, spares=1) == 3
    assert place(INDICES, trainers_for(INDICES, 1), 1) == ("0", "1", "2", "3")


def test_gpu_ranks_are_refused_where_the_spares_leave_no_gpu_or_there_is_none() -> None:
    with pytest.raises(PlacementError) as refused:
        trainers_for(UUIDS, spares=3)
    assert str(refused.value) == (
        "-n gpu --spares 3: this node has 3 GPU(s) (NVML sees 3 GPU(s)), one per process: 3 "
        "spare(s) leave none for a rank; keep at most 2 spare(s)"
    )
    with pytest.raises(PlacementError) as none:
        trainers_for(NONE, spares=0)
    assert str(none.value) == (
        "-n gpu: this node has no GPU (NVML library not found: no NVIDIA driver on this "
        "machine); give a number of ranks (-n 2)"
    )
