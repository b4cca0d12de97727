"""The GPU smoke suite keeps working where no GPU is: `python -m bench.gpu --cpu --quick`
runs its rows on gloo (here a real `cohort run` of the Redis route), says which rows need
a GPU, and leaves nothing running. Without --cpu, a machine without CUDA is said and not
failed."""

from __future__ import annotations

import os
import sys

import pytest

from tests.integration.quickbench import QuickBench

if os.environ.get("CI") != "true":
    pytest.importorskip("torch")  # CI installs torch: there a missing torch must fail


def test_the_cpu_table_runs_a_real_row_and_names_what_needs_a_gpu(
    quick_bench: QuickBench,
) -> None:
    rows = "redis,n-gpu,nvml"
    got = quick_bench.run(
        [sys.executable, "-m", "bench.gpu", "--cpu", "--quick", "--rows", rows], timeout=120
    )
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-3000:]
    assert "GPU smoke suite: CPU only, gloo (--cpu)" in got.stdout
    assert "| Redis route, 2 ranks (zero-copy views) | pass | 16 steps in" in got.stdout
    assert "| n-gpu | needs a GPU |" in got.stdout and "| nvml | needs a GPU |" in got.stdout


def test_without_cuda_and_without_cpu_it_says_so_and_exits_0(quick_bench: QuickBench) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the suite would run its GPU table")
    got = quick_bench.run([sys.executable, "-m", "bench.gpu"], timeout=60)
    assert got.returncode == 0 and "no CUDA device here" in got.stdout
    assert "python -m bench.gpu --cpu" in got.stdout and "| check |" not in got.stdout


def test_an_unknown_row_is_refused_naming_it(quick_bench: QuickBench) -> None:
    got = quick_bench.run([sys.executable, "-m", "bench.gpu", "--rows", "redis,nvlm"])
    assert got.returncode == 2 and "--rows nvlm: not a row" in got.stderr
