"""Which rows the GPU smoke suite (bench/gpu.py) runs on which machine, decided with the
machine faked, and how its throughput row counts (the suite itself runs in
tests/integration/test_gpu_bench.py on CPU, and on a GPU by hand)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.gpu import ROWS, Machine, Row, blocker, plan, samples_per_second, table

CPU = Machine(cuda=False, gpus=0)


def test_on_cpu_every_row_runs_on_gloo_but_those_only_a_gpu_can_check() -> None:
    assert CPU.backend == "gloo"
    assert dict(plan(CPU, quick=False)) == {
        row: ("needs a GPU" if row in ("copies", "n-gpu", "nvml") else None) for row in ROWS
    }
    assert "nccl-4" not in dict(plan(CPU, quick=True))  # two cores here, not four
    assert dict(plan(CPU, quick=True, only=["nccl-4"])) == {"nccl-4": None}


def test_each_rank_and_each_spare_needs_a_gpu_of_its_own() -> None:
    """NCCL refuses two ranks of one world on one GPU, and a spare takes a rank's place."""
    one, three, eight = (Machine(True, n) for n in (1, 3, 8))
    assert one.backend == "nccl"
    assert blocker("nccl-2", one) == "needs 3 GPUs"
    assert blocker("redis", one) == "needs 2 GPUs"
    assert blocker("compiled", one) == "needs 3 GPUs"  # its kill has a spare waiting
    assert blocker("n-gpu", one) is None and blocker("nvml", one) is None
    assert blocker("copies", one) is None
    assert blocker("nccl-2", three) is None and blocker("nccl-4", three) == "needs 5 GPUs"
    assert all(why is None for _, why in plan(eight, quick=False))


def test_throughput_is_the_world_as_fast_as_its_slowest_rank(tmp_path: Path) -> None:
    for pid, seconds in ((1, 2.0), (2, 4.0)):
        timing = {"device": "cuda:0", "name": "x", "steps": 100, "seconds": seconds}
        (tmp_path / f"{pid}.json").write_text(json.dumps(timing))
    assert samples_per_second(tmp_path, batch=32) == 2 * 32 * 100 / 4.0
    assert samples_per_second(tmp_path / "none", batch=32) == 0.0


def test_the_table_says_where_it_ran_and_each_row_verdict() -> None:
    page = table(CPU, [Row("Redis route", "pass", "40 steps"), Row("nvml", "needs a GPU")])
    assert page.splitlines()[0] == "GPU smoke suite: CPU only, gloo (--cpu)"
    assert "| Redis route | pass | 40 steps |" in page and "| nvml | needs a GPU |  |" in page
    assert Row("x", "FAIL").failed and not Row("bn", "fails (expected: ...)").failed
