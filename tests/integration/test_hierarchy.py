"""The hierarchical allreduce with real processes: 4 ranks as 2 hosts x 2.

Ranks of one host reduce through shared memory; only the host leaders' sums go through
Redis. The mean equals numpy's, a broadcast from a rank that leads no host reaches every
rank, and a barrier passes; a rank killed mid-call and the world change that follows
leave no segment in /dev/shm and no key of the call in Redis.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from cohort.events.codec import FIELD, encode
from cohort.events.keys import Keys
from cohort.events.models import WorldChanged
from cohort.events.shards import Shard
from cohort.worker.collective.hierarchy import job_segments_prefix
from tests.helpers import wait_until
from tests.integration.cluster import Cluster
from tests.integration.hier_rank import ABORTED, tensors

pytestmark = [pytest.mark.redis_server, pytest.mark.slow]

HOSTS = "A,A,B,B"
SHM = Path("/dev/shm")


def segments(job: str) -> list[str]:
    return sorted(p.name for p in SHM.iterdir() if p.name.startswith(job_segments_prefix(job)))


def through(cluster: Cluster) -> int:
    stats = cluster.conn.info("stats")
    return int(stats["total_net_input_bytes"]) + int(stats["total_net_output_bytes"])


def run(cluster: Cluster, mode: str, mib: float, tag: str) -> tuple[list[dict], int, float]:
    """Every rank's result, the bytes through Redis meanwhile (in and out), and the slowest
    call (s)."""
    before = through(cluster)
    procs = [
        cluster.python(
            f"{tag}{r}",
            "-m",
            "tests.integration.hier_rank",
            cluster.url,
            cluster.job,
            str(r),
            HOSTS,
            str(cluster.tmp / f"{tag}{r}.npz"),
            mode,
            str(mib),
        )  # fmt: skip
        for r in range(4)
    ]
    for proc in procs:
        assert proc.wait(120) == 0, proc.output()[-3000:]
    received = through(cluster) - before
    seconds = max(
        json.loads(next(x for x in p.output().splitlines() if x.startswith("{")))["seconds"]
        for p in procs
    )
    assert not [p.name for p in procs if "leaked" in p.output()]
    results = []
    for r in range(4):
        with np.load(cluster.tmp / f"{tag}{r}.npz") as saved:
            results.append({k: saved[k] for k in saved.files})
    return results, received, seconds


def test_four_ranks_on_two_hosts_get_numpys_mean_with_fewer_bytes_through_redis(
    cluster: Cluster,
) -> None:
    mib = 4.0
    inputs = [tensors(r, mib) for r in range(4)]
    expected = {k: np.mean([t[k].astype(np.float64) for t in inputs], axis=0) for k in inputs[0]}
    hier, hier_bytes, hier_s = run(cluster, "hier", mib, "h")
    for result in hier:
        assert np.allclose(result["w"], expected["w"], rtol=1e-5, atol=1e-6)
        assert np.allclose(result["b"], expected["b"], rtol=1e-12, atol=1e-12)
        assert result["w"].dtype == np.float32 and result["b"].shape == (17, 3)
    assert all(np.array_equal(r["w"], hier[0]["w"]) for r in hier)  # every rank the same
    assert segments(cluster.job) == []
    cluster.conn.flushall()
    _, flat_bytes, flat_s = run(cluster, "flat", mib, "f")
    print(
        f"4 ranks as 2 hosts x 2, {mib:g} MiB: bytes through Redis hierarchical {hier_bytes} "
        f"vs flat {flat_bytes} ({flat_bytes / hier_bytes:.2f}x); slowest call "
        f"{hier_s:.3f} s vs {flat_s:.3f} s"
    )
    # S payload bytes cross the server (3N-2)S times flat (10S), (3H-2)S with H=2 hosts (4S)
    assert hier_bytes * 2 < flat_bytes


def test_a_broadcast_from_a_rank_that_leads_no_host_reaches_every_rank(cluster: Cluster) -> None:
    sent, _, _ = run(cluster, "bcast", 1.0, "b")
    mine = tensors(1, 1.0)
    for result in sent:  # through rank 1's host's memory, and through host B's leader
        assert np.array_equal(result["w"], mine["w"]) and np.array_equal(result["b"], mine["b"])
    assert segments(cluster.job) == []


def test_a_rank_killed_mid_call_and_the_world_change_leave_nothing_behind(
    cluster: Cluster,
) -> None:
    job = cluster.job
    keys = Keys(job)
    # Host B's ranks never come: host A's ranks are inside the call, waiting.
    a = [
        cluster.python(
            f"k{r}",
            "-m",
            "tests.integration.hier_rank",
            cluster.url,
            job,
            str(r),
            HOSTS,
            str(cluster.tmp / f"k{r}.npz"),
            "hier",
        )  # fmt: skip
        for r in (0, 1)
    ]
    wait_until(lambda: "entered" in a[0].output(), 30, message="rank 0 in the call")
    wait_until(lambda: len(segments(job)) == 1, 30, message="rank 1's contribution in /dev/shm")
    wait_until(
        lambda: cluster.conn.xlen(keys.step_events(1, 0, "allreduce-local", "w1")) >= 1,
        30,
        message="rank 1 said so",
    )
    a[1].kill(signal.SIGKILL)
    fact = WorldChanged(
        at=time.time(), job=job, version=2, start_step=0, epoch=0, ranks=("w0",),
        shards=(Shard(ranges=((0, 5),)),), reason="w1 failed",
    )  # fmt: skip
    cluster.conn.xadd(keys.journal, {FIELD: encode(fact)})
    assert a[0].wait(30) == ABORTED, a[0].output()[-3000:]
    assert segments(job) == []
    left = [k for k in cluster.conn.scan_iter(f"{keys.prefix}:grad:*")]
    assert left == [], left
