"""Simulated hosts (bench/netsim.py): namespaces on one bridge, shaped links, servers on
hosts, and nothing left behind however a run ends.

Needs root; skips with the reason elsewhere (fails in CI as root: COHORT_REQUIRE_NETSIM=1).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bench import netsim
from tests.helpers import require_netsim, require_redis_server, wait_until
from tests.integration.quickbench import QuickBench

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.redis_server


@pytest.fixture(autouse=True)
def _namespaces() -> None:
    require_netsim()
    require_redis_server()


def ours(tag: str) -> list[str]:
    return [n for n in netsim.leftovers() if n.startswith(f"{tag}-")]


def test_a_server_on_one_host_answers_another_host_and_the_control_link() -> None:
    with netsim.Network() as net:
        server_host, client_host = net.host("redis", 1000), net.host("client", 1000)
        server = net.redis(server_host)
        assert server.url == f"redis://{server_host.address}:{server.port}/0"
        probe = subprocess.run(
            client_host.argv(["redis-cli", "-h", server_host.address, "-p", str(server.port),
                              "ping"]),
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        assert probe.stdout.strip() == "PONG", probe.stderr
        client = server.client()  # from this process, over the unshaped control link
        assert client.ping()
        client.close()
        # a host sees only its own link: this machine's addresses are not on it
        route = subprocess.run(
            client_host.argv(["ip", "-4", "route"]), capture_output=True, text=True, check=True
        )
        assert route.stdout.split()[0].startswith("10.213.") and "default" not in route.stdout


def test_a_one_primary_cluster_on_a_host_owns_every_slot() -> None:
    with netsim.Network() as net:
        cluster = net.cluster([net.host("c0", 1000)])
        client = cluster.client()
        client.set("{a}x", b"1")
        assert client.get("{a}x") == b"1"
        assert int(client.cluster_info()["cluster_slots_ok"]) == 16384  # type: ignore[attr-defined]
        client.close()


def test_a_link_carries_no_more_than_its_rate() -> None:
    """One TCP stream between two hosts over 100 Mbit/s links: the shaper holds it at the
    rate (the lower bound only says the link works; the bench measures how close it gets)."""
    got = netsim.link_rate(100, seconds=2.0)
    assert 30 < got <= 105


HOLDER = """
import json, signal, subprocess, sys, time
from bench import netsim
# Ctrl-C as at a terminal: a parent that ignores SIGINT (a shell's background job, as
# `.ci/run &` is) passes that on, and Python then installs no KeyboardInterrupt
signal.signal(signal.SIGINT, signal.default_int_handler)
with netsim.Network() as net:
    host = net.host("a", 1000)
    sleeper = net.popen(host, ["sleep", "600"])
    print(json.dumps({"tag": net.tag, "sleeper": sleeper.pid}), flush=True)
    while True:
        time.sleep(1)
"""


def _holder() -> tuple[subprocess.Popen[str], dict[str, object]]:
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(HOLDER)],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert holder.stdout is not None
    made = json.loads(holder.stdout.readline())
    return holder, made


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_run_removes_its_hosts_and_what_ran_on_them(sig: signal.Signals) -> None:
    holder, made = _holder()
    tag, sleeper = str(made["tag"]), int(str(made["sleeper"]))
    assert ours(tag) and _alive(sleeper)
    holder.send_signal(sig)
    holder.wait(30)
    wait_until(lambda: not ours(tag), 30, 0.05, f"namespaces of {tag} removed")
    wait_until(lambda: not _alive(sleeper), 30, 0.05, "the process on the host ended")


def test_clean_removes_what_a_killed_run_left_and_spares_live_runs() -> None:
    holder, made = _holder()
    live, live_sleeper = _holder()
    try:
        tag = str(made["tag"])
        holder.kill()  # SIGKILL: no cleanup of its own
        holder.wait(30)
        assert ours(tag)
        done = subprocess.run(
            [sys.executable, "-m", "bench.netsim", "--clean"],
            cwd=ROOT, capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        assert f"{tag}-a" in done.stdout and not ours(tag)
        assert not _alive(int(str(made["sleeper"])))
        assert ours(str(live_sleeper["tag"]))  # a running network is not another's leftover
    finally:
        live.send_signal(signal.SIGTERM)
        live.wait(30)


def test_the_quick_netsim_bench_sets_every_method_beside_its_link_limit(
    tmp_path: Path, quick_bench: QuickBench
) -> None:
    out = tmp_path / "B.md"
    result = quick_bench.quick("netsim")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "## Across a simulated network" in out.read_text()
    (section,) = json.loads(out.with_suffix(".json").read_text())
    cells = {c["method"]: c for c in section["raw"]["cells"]}
    wanted = {"flat", "cluster-1", "cluster-3", "flat-pairs", "hierarchical", "int8", "powersgd"}
    assert wanted <= set(cells)
    for method in wanted:
        assert cells[method]["s"] > 0 and cells[method]["limit_s"] > 0, method
    # the servers counted the flat call's bytes: 2(N-1)S leave the server, here N=4, S=1 MiB
    assert 6 * 2**20 <= cells["flat"]["bytes"] < 7 * 2**20
    assert cells["flat"]["link"] == "the server's link, out"
    assert cells["cluster-3"]["bytes"] < cells["cluster-1"]["bytes"]
    orphans = [n for n in netsim.leftovers() if not Path(f"/proc/{_pid_of(n)}").exists()]
    assert not orphans, f"the bench left {orphans}"


def _pid_of(netns: str) -> int:
    return int(netns[len(netsim.PREFIX) :].split("-")[0])


def test_the_quick_throughput_bench_trains_each_route_with_every_process_on_its_own_host(
    tmp_path: Path, quick_bench: QuickBench
) -> None:
    """DDP and both ElasticJob routes train every step with ranks, Redis and the coordinator
    on hosts of their own: gloo and the gloo route find each other by the hosts' addresses."""
    if os.environ.get("CI") != "true":
        pytest.importorskip("torch")
    out = tmp_path / "B.md"
    result = quick_bench.quick("throughput-netsim")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    page = out.read_text()
    assert "across a simulated network (1,000 Mbit/s links" in page
    assert "--mbit 1000" in page
    (section,) = json.loads(out.with_suffix(".json").read_text())
    (round_,) = section["raw"]["1m/2"]["rounds"]
    assert set(round_) == {"ddp", "gloo", "redis"}
    assert all(run["samples_s"] > 0 for run in round_.values())
