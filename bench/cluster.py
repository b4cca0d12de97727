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

from cohort.localredis import LocalCluster, LocalRedis

from .allreduce import MIB, raw_throughput, time_allreduce

GIB = 1024 * MIB


def model(workers: int, size: int, rate: float, primaries: tuple[int, ...]) -> list[str]:
    """Markdown rows: per-primary bytes and the server-bound step time for each M."""
    through = (3 * workers - 2) * size
    rows = [
        "| primaries M | GB through the servers per step | GB per primary per step "
        "| server-bound step time at R |",
        "|---|---|---|---|",
    ]
    for m in primaries:
        rows.append(
            f"| {m} | {through / 1e9:.1f} | {through / m / 1e9:.1f} | {through / m / rate:.1f} s |"
        )
    per_rank = 3 * size * (workers - 1) / workers
    rows.append(
        f"\nEach rank also moves {per_rank / 1e9:.2f} GB per step through its own link "
        f"({per_rank / 12.5e9:.2f} s at 100 Gb/s), whatever M is."
    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="16,64", help="MiB of float32 per allreduce")
    parser.add_argument("--ranks", default="3", help="world sizes")
    parser.add_argument("--runs", type=int, default=5, help="timed runs per cell (median)")
    parser.add_argument("--model-workers", type=int, default=64)
    parser.add_argument("--model-gib", type=float, default=1.0, help="gradient GiB per step")
    parser.add_argument(
        "--model-rate", type=float, help="GB/s per primary for the model (default: measured)"
    )
    args = parser.parse_args()
    sizes = [int(s) * MIB for s in args.sizes.split(",")]
    worlds = [int(n) for n in args.ranks.split(",")]

    with (
        LocalRedis(appendonly=False) as single,
        LocalCluster(primaries=3, replicas=0, appendonly=False) as cluster,
    ):
        print(f"{os.cpu_count()} CPUs; one redis-server vs a cluster of 3 primaries (AOF off)\n")
        rate = {}
        for size in sizes:
            raw = raw_throughput(single.url, size, args.runs)
            rate[size] = 2 / (1 / raw["set_parts"] + 1 / raw["get"])
        print("| ranks | MiB | 1 server ms | 3 primaries ms | speedup | ideal (servers only) |")
        print("|---|---|---|---|---|---|")
        for n in worlds:
            for size in sizes:
                one, _ = time_allreduce(single.url, n, size, args.runs)
                three, _ = time_allreduce(cluster.url, n, size, args.runs)
                print(
                    f"| {n} | {size // MIB} | {one * 1e3:.1f} | {three * 1e3:.1f} | "
                    f"{one / three:.2f} | 3 |",
                    flush=True,
                )
        best = args.model_rate * 1e9 if args.model_rate else max(rate.values())
        print(
            "\nper-server rate R (one client, SET parts + GET, in+out): "
            + ", ".join(f"{size // MIB} MiB {r / 1e9:.2f} GB/s" for size, r in rate.items())
        )
        size = int(args.model_gib * GIB)
        print(
            f"\nmodel: {args.model_workers} workers, {args.model_gib:g} GiB of gradients, "
            f"R = {best / 1e9:.2f} GB/s per primary\n"
        )
        print("\n".join(model(args.model_workers, size, best, (1, 3, 6, 12))))


if __name__ == "__main__":
    main()
