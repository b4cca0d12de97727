"""TorchFT beside cohort (bench/torchft_peer.py): the quick form of its three sections runs,
measures both sides in the same run and leaves nothing running, the lighthouse included (the
`quick_bench` fixture counts what is left).

torchft comes with the `bench` extra; without it these tests skip here and fail where
COHORT_REQUIRE_TORCHFT=1 (.ci/run installs the extra and sets it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.integration.quickbench import QuickBench

pytestmark = pytest.mark.slow


def _needs_torchft() -> None:
    if importlib.util.find_spec("torchft") is None:
        reason = "torchft is not installed (pip install -e '.[bench]')"
        if os.environ.get("COHORT_REQUIRE_TORCHFT") == "1":
            pytest.fail(f"{reason}; COHORT_REQUIRE_TORCHFT=1 asks for these tests")
        pytest.skip(reason)


def _measured(result: subprocess.CompletedProcess[str], tmp_path: Path) -> dict[str, Any]:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return {s["key"]: s for s in json.loads((tmp_path / "B.json").read_text())}


def test_the_quick_torchft_healing_run_kills_a_group_and_a_rank_in_the_same_run(
    tmp_path: Path, quick_bench: QuickBench
) -> None:
    """cohort run with a spare, TorchFT with the hook fix and TorchFT as shipped: each loses
    a rank (a group) to SIGKILL; the survivors commit again, the lost place trains again."""
    _needs_torchft()
    (section,) = _measured(quick_bench.quick("torchft-healing", timeout=300), tmp_path).values()
    assert section["command"] == (
        "python -m bench.torchft_peer healing --ranks 2 --failure-free 2 --every 10 --kills 1"
        " --sides cohort-spare,torchft,torchft-stock"
    )
    raw = section["raw"]
    assert set(raw) == {"cohort-spare", "torchft", "torchft-stock"}
    assert [row[0].split(",")[0] for row in section["rows"]] == [
        "cohort run --spares 1 (defaults: a warm spare)",
        "TorchFT",
        "TorchFT",
        "cohort / TorchFT (lighthouse defaults",
    ]
    for side in raw.values():
        assert side["run"]["failure_free"] > 0 and len(side["faults"]) == 1
    cohort, torchft = raw["cohort-spare"]["faults"][0], raw["torchft"]["faults"][0]
    # the lighthouse waits out its 5 s heartbeat timeout before a quorum without the dead
    # group; cohort's launcher tells the leader at once
    assert 5 < torchft["survivors"] < 60 and 0 < cohort["survivors"] < 5
    assert torchft["place"] < 60 and cohort["place"] < 5
    assert cohort["skipped"] == 0 and torchft["skipped"] > 0
    assert torchft["survivors_died"] == 0  # the fix keeps the survivor alive
    # ratios against cohort in the same run: TorchFT's seconds over cohort's, and the row of
    # cohort's healing and goodput over TorchFT's
    assert float(section["rows"][1][-1]) > 1
    assert float(section["rows"][3][1]) < 1 and float(section["rows"][3][7]) > 0


def test_the_quick_torchft_throughput_and_survival_runs_measure_both_sides(
    tmp_path: Path, quick_bench: QuickBench
) -> None:
    """Plain DDP, ElasticJob's gloo route and TorchFT in one round; a peer leaving cleanly
    under cohort run and under TorchFT."""
    _needs_torchft()
    got = _measured(quick_bench.quick("torchft-throughput,torchft-survives", timeout=300), tmp_path)
    rounds = got["torchft-throughput"]["raw"]["rounds"]
    assert len(rounds) == 1 and set(rounds[0]) == {"ddp", "gloo", "torchft"}
    assert all(rate > 0 for rate in rounds[0].values())
    rows = got["torchft-throughput"]["rows"]
    assert [row[0].split(" ")[0] for row in rows] == ["plain", "cohort", "TorchFT"]
    assert rows[0][3] == "1.00"  # DDP against itself
    survives = got["torchft-survives"]
    assert survives["command"] == (
        "python -m bench.torchft_peer survives --ranks 2 --hold 8 --down 2 --cases leave"
    )
    leave = survives["raw"]["leave"]
    # the lighthouse drops the leaver after its 5 s heartbeat timeout (no graceful leave)
    assert 4 < leave["torchft"]["again"] < 8 and leave["torchft"]["died"] == 0
    (row,) = survives["rows"]
    cohort = leave["cohort"]["again"]
    assert row[1] == ("not within 8" if cohort == float("inf") else f"{cohort:.2f}")
