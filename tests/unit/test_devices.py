"""Which device a rank opens: the decision, with the CUDA facts given."""

from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")

from cohort.worker.pytorch.devices import choose, current, rank_device  # noqa: E402


def test_without_a_cuda_device_a_rank_trains_on_the_cpu() -> None:
    assert choose(3, 0) is None
    assert choose(None, 0) is None


def test_a_process_given_one_gpu_opens_it_whatever_its_local_rank() -> None:
    assert [choose(local, 1) for local in (0, 1, 7)] == [0, 0, 0]


def test_a_process_that_sees_every_gpu_takes_its_local_ranks_modulo_their_count() -> None:
    assert [choose(local, 4) for local in (0, 1, 3, 4, 6)] == [0, 1, 3, 0, 2]
    assert choose(None, 4) == 0


def test_on_this_machine_the_device_is_what_cuda_reports() -> None:
    import torch

    device = rank_device(1)
    assert device.type == ("cuda" if torch.cuda.device_count() else "cpu")


def test_a_thread_cohort_starts_makes_the_ranks_gpu_current_and_leaves_the_cpu_alone() -> None:
    on_gpu = current(torch.device("cuda", 1))  # entered only where CUDA is: not here
    assert isinstance(on_gpu, torch.cuda.device) and on_gpu.idx == 1
    assert isinstance(current(torch.device("cpu")), contextlib.nullcontext)
