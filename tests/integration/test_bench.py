"""The benchmark suite keeps working: the quick version of every section of
`python -m bench` runs here (netsim and throughput-netsim in test_netsim.py, chaos in
test_chaos.py), writes its page and raw JSON, and leaves no process it started running,
when it fails midway as well (the `quick_bench` fixture counts them: quickbench.py).

Timing goals are not asserted here (BENCHMARKS.md holds them); this checks that each
section runs, measures something and records it the way `python -m bench` documents.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.integration.quickbench import QuickBench

ROOT = Path(__file__).resolve().parents[2]


def test_a_quick_run_writes_each_section_with_its_command_and_raw_medians(
    tmp_path: Path, quick_bench: QuickBench
) -> None:
    out = tmp_path / "B.md"
    result = quick_bench.quick("overhead,failover")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    page = out.read_text()
    assert "## Per-step coordination overhead" in page and "## Leader SIGKILL" in page
    assert "`python -m bench.failover --runs 2`" in page
    sections = {s["key"]: s for s in json.loads(out.with_suffix(".json").read_text())}
    assert set(sections) == {"overhead", "failover"}
    assert len(sections["failover"]["raw"]["seconds"]) == 2
    assert all(0 < t < 60 for t in sections["failover"]["raw"]["seconds"])
    assert {"8", "64"} == set(sections["overhead"]["raw"])

    # --only again replaces its own section and keeps the other
    again = quick_bench.quick("failover")
    assert again.returncode == 0, again.stderr[-3000:]
    kept = {s["key"]: s for s in json.loads(out.with_suffix(".json").read_text())}
    assert kept["overhead"] == sections["overhead"]
    assert kept["failover"]["raw"] != sections["failover"]["raw"]


def test_a_quick_throughput_run_measures_ddp_and_both_routes_in_each_round(
    tmp_path: Path, quick_bench: QuickBench
) -> None:
    """Real ranks, a real coordinator: each round's DDP and ElasticJob runs all trained every
    step (a rank that saw fewer commits fails the run) and were timed."""
    if os.environ.get("CI") != "true":
        pytest.importorskip("torch")  # CI installs torch: there a missing torch must fail
    out = tmp_path / "B.md"
    result = quick_bench.quick("throughput")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    page = out.read_text()
    assert "## Training throughput" in page
    assert "`python -m bench.throughput --ranks 2 --models 1m --runs 1 --steps 10`" in page
    assert "| 1m | 2 | 5 | torch.distributed (gloo, DDP) |" in page
    assert "| 1m | 2 | 5 | Redis |" in page
    (section,) = json.loads(out.with_suffix(".json").read_text())
    assert section["raw"]["1m/2"]["steps"] == 10
    (round_,) = section["raw"]["1m/2"]["rounds"]
    assert set(round_) == {"ddp", "gloo", "redis"}
    assert all(run["samples_s"] > 0 and run["cpu_ms"] > 0 for run in round_.values())


def test_an_unknown_benchmark_is_named_with_the_choices() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "bench", "--only", "nosuch"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "nosuch" in result.stderr and "replay" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_order_benchmark_prices_an_index_beside_a_materialised_permutation(
    tmp_path: Path, quick_bench: QuickBench
) -> None:
    out = tmp_path / "B.md"
    result = quick_bench.quick("order")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "## Epoch order" in out.read_text()
    (section,) = json.loads(out.with_suffix(".json").read_text())
    assert set(section["raw"]) == {"60000", "1000000"}
    for figures in section["raw"].values():
        assert all(figures[k] > 0 for k in ("epoch", "batch", "scalar", "epoch_peer"))


def test_a_quick_hierarchy_run_times_three_collectives_and_counts_fewer_bytes_through_redis(
    tmp_path: Path, quick_bench: QuickBench
) -> None:
    """4 ranks as 2 hosts x 2: the hierarchical and flat collectives (and gloo, with torch)
    are timed, and the hierarchical one writes about half the flat one's bytes to Redis
    (H/N of the payload; the byte counts do not depend on the machine's load)."""
    out = tmp_path / "B.md"
    result = quick_bench.quick("hierarchy")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    page = out.read_text()
    assert "## Hierarchical allreduce, 4 ranks as 2 hosts x 2" in page
    assert "`python -m bench.hierarchy --sizes 1 --runs 2`" in page
    assert "KeyError" not in result.stderr  # each rank's shared memory tracked by its own
    (section,) = json.loads(out.with_suffix(".json").read_text())
    (cell,) = section["raw"]["cells"]
    hier, flat = cell["hierarchical"], cell["flat"]
    assert hier["s"] > 0 and flat["s"] > 0 and hier["error"] < 1e-5
    assert 0.45 < hier["written"] / flat["written"] < 0.55
    assert 0.35 < hier["through"] / flat["through"] < 0.45


def test_a_quick_compress_run_counts_fewer_bytes_and_trains_like_exact(
    tmp_path: Path, quick_bench: QuickBench
) -> None:
    """int8 and PowerSGD against exact float32 through Redis (and gloo, with torch): fewer
    bytes through the server, small errors, and the example model's convergence figures."""
    out = tmp_path / "B.md"
    result = quick_bench.quick("compress")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "## Compressed allreduce through one Redis server" in out.read_text()
    (section,) = json.loads(out.with_suffix(".json").read_text())
    cells = {c["method"]: c for c in section["raw"]["cells"]}
    assert set(cells) == {"float32", "int8", "powersgd-4", "powersgd-16"}
    assert cells["float32"]["first"] < 1e-6
    assert cells["int8"]["through"] < cells["float32"]["through"] / 3
    assert cells["powersgd-4"]["through"] < cells["int8"]["through"]
    assert cells["int8"]["first"] < 0.02
    for figures in section["raw"]["convergence"].values():
        assert figures["identical"]


def test_a_quick_figures_run_times_each_phase_through_both_routes(
    tmp_path: Path, quick_bench: QuickBench
) -> None:
    """Two real ranks per route train plain, recording and reducing phases in one job."""
    if os.environ.get("CI") != "true":
        pytest.importorskip("torch")  # CI installs torch: there a missing torch must fail
    out = tmp_path / "B.md"
    result = quick_bench.quick("figures")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    page = out.read_text()
    assert "`python -m bench.figures --rounds 1 --phase 20`" in page
    (section,) = json.loads(out.with_suffix(".json").read_text())
    assert set(section["raw"]) == {"redis", "gloo"}
    for route in section["raw"].values():
        assert set(route) == {"plain", "record", "mean"} and all(t > 0 for t in route.values())


def _measured(result: subprocess.CompletedProcess[str], tmp_path: Path) -> dict[str, Any]:
    """Each section of a run that succeeded, by key, from the raw JSON beside its page."""
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return {s["key"]: s for s in json.loads((tmp_path / "B.json").read_text())}


def _needs_torch() -> None:
    if os.environ.get("CI") != "true":
        pytest.importorskip("torch")  # CI installs torch: there a missing torch must fail


def test_a_peer_death_run_that_fails_midway_leaves_no_torchrun_worker_running(
    quick_bench: QuickBench,
) -> None:
    """It raises after its kill, once torchrun restarted the workers (each in a session of
    its own, none has logged yet): every agent and worker still ends (the fixture counts)."""
    _needs_torch()
    argv = [sys.executable, "-m", "tests.integration.failing_peer_death"]
    result = quick_bench.run(argv, timeout=300)
    assert result.returncode != 0 and "induced failure" in result.stderr, result.stderr[-3000:]
