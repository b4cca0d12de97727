"""Every benchmark in one command; BENCHMARKS.md is written from the results.

    python -m bench                 # the full suite (about 2 h on 2 cores), writes BENCHMARKS.md
    python -m bench --quick         # smaller sizes and fewer runs; prints, writes nothing
    python -m bench --only replay,failover   # re-runs these two, keeps the other sections
    python -m bench --only torchft  # TorchFT's three sections (pip install -e '.[bench]')
    python -m bench --page          # writes BENCHMARKS.md again from BENCHMARKS.json, runs nothing

A benchmark that fails is reported by name and the others still run; the exit
code is 1 if any failed.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from bench import (
    allreduce,
    archive,
    chaos,
    checkpoint,
    cluster,
    compress,
    control_plane,
    failover,
    figures,
    goodput,
    healing,
    hierarchy,
    launched,
    loader,
    network,
    order,
    overhead,
    peer_death,
    presence,
    replay,
    sharded,
    soak,
    throughput,
    torchft_peer,
)
from bench.results import Section, publish, rewrite

FULL: dict[str, Callable[[], Section]] = {
    "ingest": lambda: control_plane.measure(100_000, 1000, 3),
    "replay": lambda: replay.measure(1_000_000, 3),
    "archive": lambda: archive.measure(1_000_000, 100_000, 50_000, 5),
    "soak": lambda: soak.measure(1000, 60),
    "soak-signed": lambda: soak.measure(1000, 60, signed=True),
    "overhead": lambda: overhead.measure((8, 64, 256), 100),
    "failover": lambda: failover.measure(5),
    "peer_death": lambda: peer_death.measure(3),
    "goodput": lambda: goodput.measure(60, 60, 5, 100, runs=3),
    "launched": lambda: launched.measure(4, 60, 60, 5, 100),
    "healing": lambda: healing.measure(4, 60, 60, 5),
    "sharded": lambda: sharded.measure(60, 60, 10, sharded.CHECKPOINT_EVERY),
    "presence": lambda: presence.measure((10, 100, 1000), (0, 1000), 200),
    "allreduce": lambda: allreduce.measure((1, 16, 64), (2, 4), 5),
    "hierarchy": lambda: hierarchy.measure((1, 16, 64), 5),
    "compress": lambda: compress.measure((2, 4), 16, 1024, 5),
    "cluster": lambda: cluster.measure((16, 64), (3,), 5),
    # at 10 Gbit/s this machine's 2 cores bound every cell at 4 ranks already
    "netsim": lambda: network.measure((1000, 10000), (4, 8), (16, 64), 2, most_ranks={10000: 4}),
    "checkpoint": lambda: checkpoint.measure(3),
    "order": lambda: order.measure((60_000, 1_000_000, 10_000_000), 5),
    "loader": lambda: loader.run(200, 100, 5, 3),
    "throughput": lambda: throughput.measure((2, 4), ("1m", "25m"), 3),
    "throughput-signed": lambda: throughput.measure(
        (2, 4), ("1m",), 3, routes=throughput.SIGNED_ROUTES, key="throughput-signed"
    ),
    "throughput-netsim": lambda: throughput.measure(
        (4,), ("1m", "25m"), 3, key="throughput-netsim", mbit=1000
    ),
    "throughput-exact": lambda: throughput.measure(
        (2,), ("1m", "25m"), 3, routes=throughput.EXACT_ROUTES, key="throughput-exact"
    ),
    "figures": lambda: figures.measure(5, 100),
    "chaos": lambda: chaos.measure(10),
    "chaos-ha": lambda: chaos.measure_ha(10),
    "torchft-healing": lambda: torchft_peer.measure_healing(2, 60, 60, 10),
    "torchft-throughput": lambda: torchft_peer.measure_throughput(2, 200, 3),
    "torchft-survives": lambda: torchft_peer.measure_survives(2, 90, 15),
}
QUICK: dict[str, Callable[[], Section]] = {
    "ingest": lambda: control_plane.measure(20_000, 200, 1),
    "replay": lambda: replay.measure(50_000, 1),
    "archive": lambda: archive.measure(5_000, 1_000, 1_000, 1),
    "soak": lambda: soak.measure(1000, 5),
    "soak-signed": lambda: soak.measure(1000, 5, signed=True),
    "overhead": lambda: overhead.measure((8, 64), 20),
    "failover": lambda: failover.measure(2),
    "peer_death": lambda: peer_death.measure(1, ("cohort:host",)),
    "goodput": lambda: goodput.measure(5, 8, 1, 100),
    "launched": lambda: launched.measure(2, 5, 8, 1, 100),
    "healing": lambda: healing.measure(2, 5, 8, 1),
    "sharded": lambda: sharded.measure(5, 8, 1, 5),
    "presence": lambda: presence.measure((10, 100), (0, 100), 20),
    "allreduce": lambda: allreduce.measure((1,), (2,), 3),
    "hierarchy": lambda: hierarchy.measure((1,), 2),
    "compress": lambda: compress.measure((2,), 4, 256, 2, steps=60),
    "cluster": lambda: cluster.measure((16,), (3,), 3),
    "netsim": lambda: network.measure((1000,), (4,), (1,), 1),
    "checkpoint": lambda: checkpoint.measure(1, steps=2),
    "order": lambda: order.measure((60_000, 1_000_000), 3),
    "loader": lambda: loader.run(40, 100, 5, 1),
    "throughput": lambda: throughput.measure((2,), ("1m",), 1, steps=10),
    "throughput-signed": lambda: throughput.measure(
        (2,), ("1m",), 1, steps=10, routes=throughput.SIGNED_ROUTES, key="throughput-signed"
    ),
    "throughput-netsim": lambda: throughput.measure(
        (2,), ("1m",), 1, steps=10, key="throughput-netsim", mbit=1000
    ),
    "throughput-exact": lambda: throughput.measure(
        (2,), ("1m",), 1, steps=10, routes=throughput.EXACT_ROUTES, key="throughput-exact"
    ),
    "figures": lambda: figures.measure(1, 20),
    "chaos": lambda: chaos.measure(0.5),
    "chaos-ha": lambda: chaos.measure_ha(0.5),
    "torchft-healing": lambda: torchft_peer.measure_healing(
        2, 2, 10, 1, sides=("cohort-spare", "torchft", "torchft-stock")
    ),
    "torchft-throughput": lambda: torchft_peer.measure_throughput(2, 30, 1),
    "torchft-survives": lambda: torchft_peer.measure_survives(2, 8, 2, cases=("leave",)),
}
GROUPS = {"torchft": ("torchft-healing", "torchft-throughput", "torchft-survives")}
"""Names that stand for several sections in --only."""


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer runs")
    parser.add_argument("--only", default="", help=f"comma-separated subset of {','.join(FULL)}")
    parser.add_argument("--out", type=Path, help="write here (default: BENCHMARKS.md, full only)")
    parser.add_argument(
        "--page", action="store_true", help="write the page again from its JSON; run nothing"
    )
    args = parser.parse_args()
    if args.page:
        out = args.out or Path("BENCHMARKS.md")
        rewrite(out, list(FULL))
        print(f"wrote {out} from {out.with_suffix('.json')}")
        return 0
    suite = QUICK if args.quick else FULL
    named = [name.strip() for name in args.only.split(",") if name.strip()]
    chosen = [part for name in named for part in GROUPS.get(name, (name,))] or list(suite)
    unknown = [name for name in chosen if name not in suite]
    if unknown:
        choices = ", ".join([*suite, *GROUPS])
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {choices}")
    out = args.out or (None if args.quick else Path("BENCHMARKS.md"))

    sections, failed = [], []
    for name in chosen:
        print(f"== {name}", flush=True)
        start = time.perf_counter()
        try:
            section = suite[name]()
        except Exception:
            traceback.print_exc()
            failed.append(name)
            continue
        print(section.markdown(), flush=True)
        print(f"({name}: {time.perf_counter() - start:.0f} s)", flush=True)
        sections.append(section)
    command = "python -m bench" + (" --quick" if args.quick else "")
    command += f" --only {','.join(named)}" if args.only else ""
    if out is not None and sections:
        publish(out, sections, command, list(FULL))
        print(f"wrote {out} and {out.with_suffix('.json')}")
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
