"""The hierarchical allreduce against the flat one and gloo: 4 ranks as 2 hosts x 2.

`HierarchicalCollective` sums each host's ranks through shared memory and sends only one
vector per host through Redis; the flat `Collective.allreduce` sends every rank's. Both
run here against a private redis-server (AOF off), beside torch.distributed gloo, in one
run, with bench/allreduce.py's ranks and process launcher: a run is a (flat) barrier then
one allreduce of float32, timed by its slowest rank; the figure is the median over runs.

Bytes through Redis come from the server's INFO stats: `total_net_input_bytes` (what the
ranks wrote) and `+ total_net_output_bytes` (what they read), the difference over a cell
divided by its calls (warm-up included). They count every byte on the wire, so they carry
the barrier before each call and the notices as well as the payload; in theory the
payload alone is N*S written and (3N-2)*S in+out for N ranks, H*S and (3H-2)*S for H hosts.
The "hosts" are named to the collective (A,A,B,B); every process is on this machine, so
the shared memory stage competes with the rest for the same cores.

    python -m bench.hierarchy [--sizes 1,16,64] [--runs 5]
"""

from __future__ import annotations

import argparse
from typing import Any

from bench.allreduce import MIB, time_allreduce, time_gloo, torch_available
from bench.results import Section
from cohort.events.connection import Client
from cohort.localredis import LocalRedis

HOSTS = ("A", "A", "B", "B")


def through(conn: Client) -> tuple[int, int]:
    """Bytes the server has read from and written to its clients so far."""
    stats = conn.info("stats")
    return int(stats["total_net_input_bytes"]), int(stats["total_net_output_bytes"])


def per_call(
    conn: Client, url: str, size: int, runs: int, hosts: tuple[str, ...] | None
) -> dict[str, float]:
    """One cell: its median seconds, its error, and its bytes into / through Redis per call."""
    before = through(conn)
    seconds, error = time_allreduce(url, len(HOSTS), size, runs, hosts=hosts)
    after = through(conn)
    written, read = (a - b for a, b in zip(after, before, strict=True))
    calls = runs + 1  # the warm-up call moves the same bytes
    return {
        "s": seconds,
        "error": error,
        "written": written / calls,
        "through": (written + read) / calls,
    }


def measure(sizes_mib: tuple[int, ...] = (1, 16, 64), runs: int = 5) -> Section:
    n, h = len(HOSTS), len(set(HOSTS))
    gloo = torch_available()
    section = Section(
        key="hierarchy",
        title=f"Hierarchical allreduce, {n} ranks as {h} hosts x {n // h}, vs flat and gloo, "
        "float32",
        command=f"python -m bench.hierarchy --sizes {','.join(map(str, sizes_mib))} "
        f"--runs {runs}",
        header=["MiB per rank", "hierarchical ms", "flat ms", "gloo ms", "time hier/flat",
                "time hier/gloo", "hier MiB written", "flat MiB written", "written hier/flat",
                "hier MiB in+out", "flat MiB in+out", "in+out hier/flat", "max rel. error hier"],
    )  # fmt: skip
    raw: dict[str, Any] = {"hosts": ",".join(HOSTS), "calls_per_cell": runs + 1, "cells": []}
    with LocalRedis(appendonly=False) as server:
        conn = server.client()
        for mib in sizes_mib:
            size = mib * MIB
            g = time_gloo(n, size, runs) if gloo else float("nan")
            flat = per_call(conn, server.url, size, runs, hosts=None)
            hier = per_call(conn, server.url, size, runs, hosts=HOSTS)
            section.rows.append(
                [str(mib), f"{hier['s'] * 1e3:.1f}", f"{flat['s'] * 1e3:.1f}",
                 f"{g * 1e3:.1f}", f"{hier['s'] / flat['s']:.2f}", f"{hier['s'] / g:.2f}",
                 f"{hier['written'] / MIB:.2f}", f"{flat['written'] / MIB:.2f}",
                 f"{hier['written'] / flat['written']:.2f}",
                 f"{hier['through'] / MIB:.2f}", f"{flat['through'] / MIB:.2f}",
                 f"{hier['through'] / flat['through']:.2f}", f"{hier['error']:.1e}"]
            )  # fmt: skip
            raw["cells"].append({"mib": mib, "gloo_s": g, "flat": flat, "hierarchical": hier})
            print(" | ".join(section.rows[-1]), flush=True)
        conn.close()
    section.notes = [
        "Bytes are the server's INFO stats (total_net_input_bytes for written; plus "
        "total_net_output_bytes for in+out) over each cell, divided by its calls: the "
        "barrier before each call and the notices are in them. The payload alone would be "
        f"N*S vs H*S written ({h}/{n} = {h / n:.2f}) and (3N-2)*S vs (3H-2)*S in+out "
        f"({3 * h - 2}/{3 * n - 2} = {(3 * h - 2) / (3 * n - 2):.2f}), N = {n} ranks, "
        f"H = {h} hosts.",
        "All four ranks, the server and gloo share this machine's cores: the hosts are only "
        "named to the collective. The host stage (shared memory, float64 sums) and the "
        "leaders' exchange run one after the other, so where Redis is not the bottleneck "
        "the hierarchical call can be slower than the flat one here while moving fewer "
        "bytes; the gain it is built for is a server that many ranks per host keep busy.",
        "Both cohort collectives meet at a flat barrier before each timed call, so the "
        "times compare the allreduce alone. The error column is the hierarchical result's "
        "largest absolute difference from the exact (float64) mean, relative to the mean's "
        "largest magnitude.",
    ]
    if not gloo:
        section.notes.append("torch is not installed here: the gloo columns are empty.")
    section.raw = raw
    return section


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,16,64", help="MiB of float32 per rank")
    parser.add_argument("--runs", type=int, default=5, help="timed runs per cell (median)")
    args = parser.parse_args()
    try:
        sizes = tuple(map(int, args.sizes.split(",")))
    except ValueError:
        parser.error(f"--sizes {args.sizes!r}: give e.g. 1,16,64")
    print(measure(sizes, args.runs).markdown())


if __name__ == "__main__":
    main()
