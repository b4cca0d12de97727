"""The benchmark suite keeps working: the quick version of every section of
`python -m bench` runs here (netsim and throughput-netsim in test_netsim.py, chaos and a
column of chaos-ha per topology in test_chaos.py), writes its page and raw JSON, and leaves
no process it started running, when it fails midway as well (the `quick_bench` fixture
counts them: quickbench.py).

Timing goals are not asserted here (BENCHMARKS.md holds them); this checks that each
section runs, measures something and records it the way `python -m bench` documents.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import require_torch
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


def test_a_peer_death_run_that_fails_midway_leaves_no_torchrun_worker_running(
    quick_bench: QuickBench,
) -> None:
    """It raises after its kill, once torchrun restarted the workers (each in a session of
    its own, none has logged yet): every agent and worker still ends (the fixture counts),
    and the run's logs are kept where it says, the failure's only record (then removed)."""
    require_torch()
    argv = [sys.executable, "-m", "tests.integration.failing_peer_death"]
    result = quick_bench.run(argv, timeout=300)
    assert result.returncode != 0 and "induced failure" in result.stderr, result.stderr[-3000:]
    kept = re.search(r"the failed run's logs are kept in (\S+)", result.stderr)
    assert kept is not None, result.stderr[-3000:]
    logs = Path(kept.group(1))
    assert (logs / "agent1.out").exists()
    shutil.rmtree(logs)


def test_the_quick_control_plane_replay_and_soak_sections_measure_what_they_name(
    tmp_path: Path, quick_bench: QuickBench
) -> None:
    """The four sections that need no torch, in one run (they share its start-up)."""
    got = _measured(quick_bench.quick("ingest,replay,soak,soak-signed"), tmp_path)
    assert set(got) == {"ingest", "replay", "soak", "soak-signed"}
    ingest = got["ingest"]
    assert ingest["command"] == (
        "python -m bench.control_plane --commands 20000 --workers 200 --runs 1"
    )
    assert ingest["raw"]["ingest"][0] > 0 and ingest["raw"]["xrange"][0] > 0
    assert ingest["raw"]["facts"] > 0
    replay = got["replay"]
    assert replay["command"] == "python -m bench.replay --facts 50000 --runs 1"
    stages = {"zero", "read", "peer", "cli", "snapshot", "fold", "unpack", "validate"}
    assert replay["raw"]["facts"] == 50_000 and set(replay["raw"]["seconds"]) == stages
    assert all(t > 0 for t in replay["raw"]["seconds"].values())
    assert all(len(times) == 1 for times in replay["raw"]["runs"].values())
    for key, flag in (("soak", ""), ("soak-signed", " --signed")):
        soak = got[key]
        assert soak["command"] == f"python -m bench.soak --workers 1000 --seconds 5{flag}"
        raw = soak["raw"]
        assert raw["steps"] > 0 and raw["batches"] > 0 and raw["seconds"] >= 5
        assert 0 < raw["lag_p50_s"] <= raw["lag_p99_s"]
        assert raw["cpu_share"] > 0 and raw["rss_peak_mb"] > 0


def test_the_quick_archive_run_keeps_the_journal_in_redis_under_its_hot_size(
    tmp_path: Path, quick_bench: QuickBench
) -> None:
    out = tmp_path / "B.md"
    result = quick_bench.quick("archive")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "`python -m bench.archive --steps 5000 --hot 1000 --every 1000 --runs 1`" in (
        out.read_text()
    )
    (section,) = json.loads(out.with_suffix(".json").read_text())
    archived, whole, rows = (section["raw"][k] for k in ("archived", "whole", "rows"))
    assert rows[-1][0] == 5000 and archived["samples"] >= 40
    assert archived["segments"] >= 2 and whole["segments"] == 0
    # about its hot size (1000): a segment still being written on a loaded machine (the suite's
    # workers beside it) lets the journal run past it for a while; the whole journal holds 5000+
    assert whole["last_entries"] > 5000 and archived["most_entries"] < 2000
    assert all(t > 0 for t in section["raw"]["replay_seconds"]["archived"])


def test_the_quick_peer_death_run_times_both_sides_back_to_training(
    tmp_path: Path, quick_bench: QuickBench
) -> None:
    """cohort's survivor and torchrun on cohort (agent 1, hosting nothing, lost with its
    worker): each measured a time. The quick run leaves torchrun's own c10d store to the
    test above, which runs it up to its kill (each torchrun case takes about a minute)."""
    require_torch()
    (section,) = _measured(quick_bench.quick("peer_death"), tmp_path).values()
    assert section["command"] == "python -m bench.peer_death --runs 1 --cases cohort:host"
    (cohort,) = section["raw"]["cohort"]
    assert cohort > 0
    torchrun = section["raw"]["torchrun"]
    # a time, or inf (not back within the limit), never nan: no store host, no job lost
    assert set(torchrun) == {"cohort:host"} and torchrun["cohort:host"][0] > 0


def test_the_quick_goodput_run_kills_and_replaces_a_worker_on_each_side(
    tmp_path: Path, quick_bench: QuickBench
) -> None:
    require_torch()
    (section,) = _measured(quick_bench.quick("goodput"), tmp_path).values()
    assert section["command"] == (
        "python -m bench.goodput --failure-free 5 --every 8 --kills 1 --checkpoint-every 100"
        " --runs 1"
    )
    ((cohort,), (torchrun,)) = section["raw"]["cohort"], section["raw"]["torchrun"]
    for run in (cohort, torchrun):
        assert run["failure_free"] > 0 and run["seconds"] >= 8 and len(run["outages"]) == 1
    assert cohort["counted"] > 0 and cohort["goodput"] > 0  # cohort's survivor never stops


@pytest.mark.slow
def test_the_quick_launched_run_heals_under_each_launcher(
    tmp_path: Path, quick_bench: QuickBench
) -> None:
    """`cohort run` and torchrun --standalone (as shipped and with its store fix), a rank
    SIGKILLed under each."""
    require_torch()
    (section,) = _measured(quick_bench.quick("launched"), tmp_path).values()
    assert section["command"] == (
        "python -m bench.launched --ranks 2 --failure-free 5 --every 8 --kills 1"
        " --checkpoint-every 100"
    )
    assert set(section["raw"]) == {"cohort", "torchrun", "torchrun_unshared_store"}
    for side in section["raw"].values():
        assert side["failure_free"] > 0 and side["seconds"] >= 8
        assert len(side["training_again"]) == len(side["redone"]) == 1
    assert section["raw"]["cohort"]["counted"] > 0


@pytest.mark.slow
def test_the_quick_healing_run_times_each_way_of_noticing_a_death(
    tmp_path: Path, quick_bench: QuickBench
) -> None:
    """cohort run with a spare (its defaults, and connections alone), without one, with the
    heartbeat alone, and torchrun: a rank SIGKILLed under each, the next commit timed."""
    require_torch()
    (section,) = _measured(quick_bench.quick("healing"), tmp_path).values()
    assert section["command"] == (
        "python -m bench.healing --ranks 2 --failure-free 5 --every 8 --kills 1"
    )
    assert set(section["raw"]) == {"spare", "connections", "no spare", "heartbeat", "torchrun"}
    for side in section["raw"].values():
        assert side["failure_free"] > 0 and side["seconds"] >= 8
        assert len(side["training_again"]) == 1
    raw = section["raw"]
    # the heartbeat alone waits out its 5 s timeout; the launcher's word does not
    assert raw["heartbeat"]["training_again"][0] > 5 > raw["spare"]["training_again"][0]


@pytest.mark.slow
def test_the_quick_sharded_run_heals_hsdp_from_peers_and_torchrun_from_dcp(
    tmp_path: Path, quick_bench: QuickBench
) -> None:
    """HSDP 2 x 2 of the LM example under cohort run with a spare and without, FSDP over 4
    under cohort run with DCP checkpoints, TorchFT's HSDP, and FSDP under torchrun
    restarting from DCP checkpoints: a rank SIGKILLed under each; cohort's HSDP redoes no
    step, with a spare every rank trains again in the first world after, its FSDP rewinds
    to a checkpoint and trains on at 3, and TorchFT's broken group trains again with its
    shards from the other group."""
    require_torch()
    (section,) = _measured(quick_bench.quick("sharded"), tmp_path).values()
    assert section["command"] == (
        "python -m bench.sharded --failure-free 5 --every 8 --kills 1 --checkpoint-every 5"
    )
    raw = section["raw"]
    with_torchft = importlib.util.find_spec("torchft") is not None
    sides = {"spare", "no spare", "fsdp", "torchrun"}
    assert set(raw) == sides | ({"torchft"} if with_torchft else set())
    for side in raw.values():
        assert side["failure_free"] > 0 and side["seconds"] >= 8
        assert len(side["training_again"]) == len(side["redone"]) == 1
    assert raw["spare"]["redone"] == raw["no spare"]["redone"] == [0]  # no rewind
    # the spare takes the lost place in the world change itself
    assert raw["spare"]["whole_again"] == raw["spare"]["training_again"]
    # a rewind to the last checkpoint, of at most its interval's steps, then 3 ranks train
    assert raw["fsdp"]["training_again"][0] < 60 and 0 <= raw["fsdp"]["redone"][0] <= 5
    if with_torchft:
        # its restarted group commits again with its state taken from the live group, not
        # from step 0 (the step in flight at the kill may be logged again once: seen in 1
        # of 10 kills of a full run)
        assert raw["torchft"]["whole_again"][0] < 60 and raw["torchft"]["redone"][0] <= 1


def test_the_quick_presence_run_reads_each_member_s_connections_both_ways(
    tmp_path: Path, quick_bench: QuickBench
) -> None:
    """Both readings see every member connected before they are timed (the bench asserts
    it), and each timing is a positive number of seconds for each size."""
    (section,) = _measured(quick_bench.quick("presence"), tmp_path).values()
    assert section["command"] == (
        "python -m bench.presence --members 10,100 --others 0,100 --readings 20"
    )
    assert set(section["raw"]) == {"10/0", "10/100", "100/0", "100/100"}
    for cell in section["raw"].values():
        assert cell["cohort_s"] > 0 and cell["peer_s"] > 0
        assert cell["cohort_server_us"] > 0 and cell["peer_server_us"] > 0


def test_the_quick_allreduce_and_cluster_runs_time_each_transport_and_server(
    tmp_path: Path, quick_bench: QuickBench
) -> None:
    """Through one server in each transport (and gloo, with torch); one server against a
    3-primary cluster."""
    got = _measured(quick_bench.quick("allreduce,cluster"), tmp_path)
    allreduce, cluster = got["allreduce"], got["cluster"]
    assert allreduce["command"] == "python -m bench.allreduce --sizes 1 --ranks 2 --runs 3"
    assert set(allreduce["raw"]["server_rate"]) == {"1"}
    cells = {c["transport"]: c for c in allreduce["raw"]["cells"]}
    assert set(cells) == {"float32", "float16"}
    for cell in cells.values():
        assert cell["ranks"] == 2 and cell["mib"] == 1
        assert cell["cohort_s"] > 0 and cell["bound_s"] > 0
    assert cells["float32"]["error"] < 1e-6 and cells["float16"]["error"] < 1e-2
    assert cluster["command"] == "python -m bench.cluster --sizes 16 --ranks 3 --runs 3"
    times = cluster["raw"]["3x16MiB"]
    assert times["one_s"] > 0 and times["three_s"] > 0
    assert cluster["raw"]["rate_bytes_per_s"]["16"] > 0


def test_the_quick_checkpoint_and_loader_runs_price_each_way_against_its_peer(
    tmp_path: Path, quick_bench: QuickBench
) -> None:
    require_torch()
    got = _measured(quick_bench.quick("checkpoint,loader"), tmp_path)
    checkpoint, loader = got["checkpoint"], got["loader"]
    assert checkpoint["command"] == "python -m bench.checkpoint --runs 1 --steps 2"
    raw = checkpoint["raw"]
    assert all(raw["numpy"][k] > 0 for k in ("cohort_path", "peer", "background", "bytes"))
    assert all(raw["torch"][k] > 0 for k in ("params", "step", "cohort_path", "bytes"))
    assert raw["torch"]["steps"] == 2
    (recovery,) = raw["recovery_s"]
    assert recovery > 0
    assert loader["command"] == (
        "python -m bench.loader --steps 40 --decode 100 --compute 5 --runs 1"
    )
    assert loader["raw"]["steps"] == 40
    assert set(loader["raw"]["wait_s"]) == {"plain", "per step", "cohort"}
    assert all(len(w) == 1 and w[0] >= 0 for w in loader["raw"]["wait_s"].values())


def test_the_quick_signed_throughput_run_trains_each_route_with_credentials(
    tmp_path: Path, quick_bench: QuickBench
) -> None:
    """Every rank with a credential of its own and signed commands, beside the unsigned
    routes and DDP in the same round."""
    require_torch()
    (section,) = _measured(quick_bench.quick("throughput-signed"), tmp_path).values()
    assert section["command"] == (
        "python -m bench.throughput --ranks 2 --models 1m --runs 1 --steps 10"
        " --routes gloo,redis,gloo-signed,redis-signed"
    )
    assert section["raw"]["1m/2"]["steps"] == 10
    (round_,) = section["raw"]["1m/2"]["rounds"]
    assert set(round_) == {"ddp", "gloo", "redis", "gloo-signed", "redis-signed"}
    assert all(run["samples_s"] > 0 and run["cpu_ms"] > 0 for run in round_.values())


def test_the_quick_exact_throughput_run_trains_each_route_with_and_without_exact_sums(
    tmp_path: Path, quick_bench: QuickBench
) -> None:
    """Each route with exact sums (a constant global batch dealt strided) beside itself
    without them and DDP, in the same round; the notes give each ratio of the two."""
    require_torch()
    (section,) = _measured(quick_bench.quick("throughput-exact"), tmp_path).values()
    assert section["command"] == (
        "python -m bench.throughput --ranks 2 --models 1m --runs 1 --steps 10"
        " --routes gloo,gloo-exact,redis,redis-exact"
    )
    (round_,) = section["raw"]["1m/2"]["rounds"]
    assert set(round_) == {"ddp", "gloo", "gloo-exact", "redis", "redis-exact"}
    assert all(run["samples_s"] > 0 and run["cpu_ms"] > 0 for run in round_.values())
    assert any("1m/2 gloo: " in note and "1m/2 redis: " in note for note in section["notes"])
