"""allreduce through one Redis server vs a 3-primary Redis Cluster, in the same run; and a
model of what more primaries buy for a big job.

Both deployments are private redis-servers on this machine (AOF off; the cluster has no
replicas, so the comparison is of bandwidth, not of replication). A cell is `bench.allreduce`'s:
barrier, then allreduce of one float32 vector per rank, the slowest rank's time, median of
the runs. On the cluster `Collective` spreads the chunks of a step over the primaries
(chunk i on primary i mod M), so the (3N-2)S bytes of an allreduce are divided over M
server threads instead of one.

The model: an allreduce of S bytes over N ranks moves (3N-2)S bytes through the servers,
(3N-2)S/M per primary when the chunks are spread evenly. At the per-server rate R measured
here (one client, in+out, SET via parts then GET), a step cannot take less than
(3N-2)S/(M*R) on the servers; each rank also moves about 3S(N-1)/N bytes through its own
network link, which no number of primaries shortens.

    python -m bench.cluster [--sizes 16,64] [--ranks 3] [--runs 5] [--model-workers 64]
"""

from __future__ import annotations

import argparse
import os

from bench.allreduce import MIB, cell_options, raw_throughput, time_allreduce
from bench.results import Section
from cohort.localredis import LocalCluster, LocalRedis

GIB = 1024 * MIB


def model(workers: int, size: int, rate: float, primaries: tuple[int, ...]) -> list[list[str]]:
    """Rows: per-primary bytes and the server-bound step time for each M."""
    through = (3 * workers - 2) * size
    return [
        [str(m), f"{through / 1e9:.1f}", f"{through / m / 1e9:.1f}", f"{through / m / rate:.1f}"]
        for m in primaries
    ]


def measure(
    sizes_mib: tuple[int, ...] = (16, 64),
    worlds: tuple[int, ...] = (3,),
    runs: int = 5,
    model_workers: int = 64,
    model_gib: float = 1.0,
) -> Section:
    sizes = [s * MIB for s in sizes_mib]
    section = Section(
        key="cluster",
        title="allreduce on one Redis server vs a 3-primary Redis Cluster (same run)",
        command=f"python -m bench.cluster --sizes {','.join(map(str, sizes_mib))} "
        f"--ranks {','.join(map(str, worlds))} --runs {runs}",
        header=["ranks", "MiB", "1 server ms", "3 primaries ms", "speedup",
                "ideal (servers only)"],
    )  # fmt: skip
    raw: dict[str, object] = {}
    with (
        LocalRedis(appendonly=False) as single,
        LocalCluster(primaries=3, replicas=0, appendonly=False) as cluster,
    ):
        rate = {}
        for size in sizes:
            got = raw_throughput(single.url, size, runs)
            rate[size] = 2 / (1 / got["set_parts"] + 1 / got["get"])
        for n in worlds:
            for size in sizes:
                one, _ = time_allreduce(single.url, n, size, runs)
                three, _ = time_allreduce(cluster.url, n, size, runs)
                section.rows.append(
                    [str(n), str(size // MIB), f"{one * 1e3:.1f}", f"{three * 1e3:.1f}",
                     f"{one / three:.2f}", "3"]
                )  # fmt: skip
                raw[f"{n}x{size // MIB}MiB"] = {"one_s": one, "three_s": three}
    best = max(rate.values())
    size = int(model_gib * GIB)
    per_rank = 3 * size * (model_workers - 1) / model_workers
    rows = model(model_workers, size, best, (1, 3, 6, 12))
    section.notes = [
        f"{os.cpu_count()} cores run the ranks and every redis-server here, so a cluster "
        "cannot show its scaling on this machine: three server threads and the ranks share "
        "two cores. The speedup column is what 2 cores allow, not what 3 machines give.",
        "Per-server rate R (one client, SET parts + GET, in+out): "
        + ", ".join(f"{s // MIB} MiB {r / 1e9:.2f} GB/s" for s, r in rate.items())
        + ".",
        f"Model: {model_workers} workers, {model_gib:g} GiB of gradients per step, "
        f"R = {best / 1e9:.2f} GB/s per primary; (3N-2)S bytes through the servers, divided "
        "over M primaries:",
        "",
        "| primaries M | GB through the servers per step | GB per primary per step "
        "| server-bound step time at R, s |",
        "|---|---|---|---|",
        *("| " + " | ".join(row) + " |" for row in rows),
        "",
        f"Each rank also moves {per_rank / 1e9:.2f} GB per step through its own link "
        f"({per_rank / 12.5e9:.2f} s at 100 Gb/s), whatever M is.",
    ]
    raw["rate_bytes_per_s"] = {s // MIB: r for s, r in rate.items()}
    section.raw = raw
    return section


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cells = cell_options(parser, sizes="16,64", ranks="3")
    parser.add_argument("--model-workers", type=int, default=64)
    parser.add_argument("--model-gib", type=float, default=1.0, help="gradient GiB per step")
    args = parser.parse_args()
    section = measure(*cells(args), args.runs, args.model_workers, args.model_gib)
    print(section.markdown())


if __name__ == "__main__":
    main()
