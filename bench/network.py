"""allreduce across a simulated network: each rank and each Redis server a host of its own,
every host's link shaped to one rate (bench/netsim.py), every route beside gloo's ring.

On loopback the cores bound everything; here the links do, as they do in a cluster. At a
link rate L, for N ranks and S bytes per rank, each method is set beside its link-bound
limit: the bytes that must cross the busiest link, divided by L. The bytes are what the
Redis servers counted (INFO total_net_input/output_bytes, per call, the barrier and notices
included); a rank's link carries what the servers sent and received, divided over the hosts
that talk to them. The busiest link of the flat allreduce through one server is the
server's own, outbound: 2(N-1)S of the (3N-2)S it moves leave through it, where a rank's
link carries 2(N-1)S/N in; gloo's ring moves 2(N-1)S/N through every rank's link each way.

Methods: the flat allreduce through one server; the same through a 1-primary and a
3-primary Redis Cluster (primaries on hosts of their own, chunks spread over them); the
hierarchical allreduce with 2 ranks per host (flat at that placement beside it: the same
host links); int8 blocks and PowerSGD rank 4 (bench.compress's layered gradients, 1024 x
1024 float32 matrices, their compression and error feedback timed); torch.distributed
gloo's all_reduce. A figure is the median over runs of the slowest rank's time, after a
barrier and a warm-up call.

    python -m bench.network [--rates 1000,10000] [--ranks 4,8] [--sizes 16,64] [--runs 3]
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import redis

from bench import netsim
from bench.allreduce import MIB, time_allreduce, time_gloo, torch_available
from bench.compress import time_method
from bench.results import Section, verdict

DIM = 1024
METHODS = ("flat", "cluster-1", "cluster-3", "flat-pairs", "hierarchical", "int8", "powersgd",
           "gloo")  # fmt: skip
NAMES = {
    "flat": "Redis, one server",
    "cluster-1": "Redis Cluster, 1 primary",
    "cluster-3": "Redis Cluster, 3 primaries",
    "flat-pairs": "Redis, one server, 2 ranks per host",
    "hierarchical": "Redis hierarchical, 2 ranks per host",
    "int8": "Redis, int8 blocks",
    "powersgd": "Redis, PowerSGD rank 4",
    "gloo": "gloo ring (torch.distributed)",
}
READING = (
    "Reading the misses: where 1.5 or more of the 2 cores are busy (every cell at 10 Gbit/s), "
    "the CPU bounds the call (each byte copied into and out of Redis, packed, summed and "
    "unpacked by numpy on the ranks), not a link. At 1 Gbit/s with a core or less busy, one "
    "server comes within 1.2-1.3x of what the order of its phases allows, the rest being "
    "each owner's wait for its last contributor before it reduces and sends its share; "
    "the phases' own floor (2NS/L) is above 1.3x of the limit at 4 ranks. A 3-primary "
    "cluster or the hierarchy moves the bound off the server's link: their limit counts "
    "the busiest link only, while each rank's own link carries 2(N-1)S/N in (at 4 ranks "
    "three quarters of a primary's), with the same phases on it, and the hierarchy adds "
    "its shared-memory stage on the cores."
)
LIMIT_SLACK = 1.3
"""Issue 35: every Redis figure within 1.3x of its link-bound limit."""


@dataclass(frozen=True)
class Counted:
    """Bytes per call into and out of each server, and the hosts that talked to them."""

    nodes: tuple[tuple[float, float], ...]
    hosts: int

    def busiest(self) -> tuple[float, str]:
        """The bytes over the busiest link, and which link that is."""
        into = max(i for i, _ in self.nodes)
        out = max(o for _, o in self.nodes)
        rank_in = sum(o for _, o in self.nodes) / self.hosts
        rank_out = sum(i for i, _ in self.nodes) / self.hosts
        server = "a primary's" if len(self.nodes) > 1 else "the server's"
        return max(
            (out, f"{server} link, out"),
            (into, f"{server} link, in"),
            (rank_in, "each rank host's link, in"),
            (rank_out, "each rank host's link, out"),
        )


def _totals(addresses: Sequence[tuple[str, int]]) -> list[tuple[int, int]]:
    out = []
    for host, port in addresses:
        probe = redis.Redis(host=host, port=port, socket_timeout=10)
        try:
            stats = probe.info("stats")
        finally:
            probe.close()
        out.append((int(stats["total_net_input_bytes"]), int(stats["total_net_output_bytes"])))
    return out


def counted(
    addresses: Sequence[tuple[str, int]], hosts: int, calls: int, timed: Callable[[], float]
) -> tuple[float, Counted]:
    """`timed()`'s seconds, and the bytes per call the servers at `addresses` moved meanwhile."""
    before = _totals(addresses)
    seconds = timed()
    after = _totals(addresses)
    nodes = tuple(
        ((a[0] - b[0]) / calls, (a[1] - b[1]) / calls) for a, b in zip(after, before, strict=True)
    )
    return seconds, Counted(nodes, hosts)


def _cpu_times() -> tuple[float, float]:
    """(busy, all) jiffies of every core of this machine so far (/proc/stat)."""
    fields = [float(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return sum(fields) - idle, sum(fields)


def busy_cores(timed: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """`timed()`'s cell with `cores`: how many of the machine's cores were busy meanwhile on
    average (everything on it: ranks, servers, spawning them). Near the core count, the
    cores bound the cell, not the links."""
    busy, total = _cpu_times()
    cell = timed()
    busy_after, total_after = _cpu_times()
    share = (busy_after - busy) / max(1.0, total_after - total)
    return {**cell, "cores": share * (os.cpu_count() or 1)}


class Testbed:
    """One network at one rate: N rank hosts, N/2 hosts for 2 ranks each, one Redis server,
    a 1-primary and a 3-primary cluster, every one on a host of its own."""

    def __init__(self, net: netsim.Network, mbit: int, n: int) -> None:
        self.mbit = mbit
        self.n = n
        self.ranks = [net.host(f"r{i}", mbit) for i in range(n)]
        pairs = [net.host(f"p{i}", mbit) for i in range(n // 2)]
        self.paired = [pairs[r // 2] for r in range(n)]
        self.single = net.redis(net.host("redis", mbit))
        self.one = net.cluster([net.host("c0", mbit)])
        self.three = net.cluster([net.host(f"k{i}", mbit) for i in range(3)])

    def run(self, method: str, size: int, runs: int) -> dict[str, Any]:
        """One cell: seconds, the busiest link's bytes per call and which link."""
        n, calls = self.n, runs + 1
        single = [(self.single.host, self.single.port)]
        cells: dict[str, tuple[list[tuple[str, int]], int, Callable[[], float]]] = {
            "flat": (single, n, lambda: time_allreduce(self.single.url, n, size, runs,
                                                       places=self.ranks)[0]),
            "cluster-1": (_nodes(self.one), n, lambda: time_allreduce(
                self.one.url, n, size, runs, places=self.ranks)[0]),
            "cluster-3": (_nodes(self.three), n, lambda: time_allreduce(
                self.three.url, n, size, runs, places=self.ranks)[0]),
            "flat-pairs": (single, n // 2, lambda: time_allreduce(
                self.single.url, n, size, runs, places=self.paired)[0]),
            "hierarchical": (single, n // 2, lambda: time_allreduce(
                self.single.url, n, size, runs, hosts=tuple(h.name for h in self.paired),
                places=self.paired)[0]),
            "int8": (single, n, lambda: self._compressed("int8", size, runs)),
            "powersgd": (single, n, lambda: self._compressed("powersgd-4", size, runs)),
        }  # fmt: skip
        if method == "gloo":
            seconds = time_gloo(n, size, runs, places=self.ranks)
            ring = 2 * (n - 1) * size / n
            return {"s": seconds, "bytes": ring, "link": "each rank host's link, each way"}
        addresses, hosts, timed = cells[method]
        seconds, count = counted(addresses, hosts, calls, timed)
        busiest, link = count.busiest()
        return {"s": seconds, "bytes": busiest, "link": link, "nodes": count.nodes}

    def _compressed(self, method: str, size: int, runs: int) -> float:
        layers = max(1, size // (DIM * DIM * 4))
        cell = time_method(self.single.url, self.n, layers, DIM, runs, method, self.ranks)
        return float(cell["s"])


def _nodes(cluster: Any) -> list[tuple[str, int]]:
    return [(node.host, node.port) for node in cluster.nodes]


def measure(
    rates: tuple[int, ...] = (1000, 10000),
    worlds: tuple[int, ...] = (4, 8),
    sizes_mib: tuple[int, ...] = (16, 64),
    runs: int = 3,
    methods: tuple[str, ...] = METHODS,
    most_ranks: dict[int, int] | None = None,
) -> Section:
    """Every cell of rates x worlds x sizes x methods; `most_ranks` caps the world at a rate
    (where the cores already bound every cell at fewer ranks)."""
    reason = netsim.available()
    if reason is not None:
        raise netsim.NetsimError(f"no simulated network here: {reason}")
    if not torch_available():
        methods = tuple(m for m in methods if m != "gloo")
    command = (
        f"python -m bench.network --rates {_csv(rates)} --ranks {_csv(worlds)} "
        f"--sizes {_csv(sizes_mib)} --runs {runs}"
        + ("" if methods == METHODS else f" --methods {','.join(methods)}")
        + "".join(f" --most-ranks {r}:{n}" for r, n in (most_ranks or {}).items())
    )
    cells: list[dict[str, Any]] = []
    for mbit in rates:
        for n in worlds:
            if n > (most_ranks or {}).get(mbit, n):
                continue
            with netsim.Network() as net:
                bed = Testbed(net, mbit, n)
                for mib in sizes_mib:
                    for method in methods:
                        got = busy_cores(partial(bed.run, method, mib * MIB, runs))
                        cell = {"mbit": mbit, "ranks": n, "mib": mib, "method": method, **got,
                                "limit_s": got["bytes"] / (mbit * 1e6 / 8)}  # fmt: skip
                        cells.append(cell)
                        print(f"{mbit} Mbit/s, {n} ranks, {mib} MiB, {method}: "
                              f"{got['s'] * 1e3:.0f} ms, limit {cell['limit_s'] * 1e3:.0f} ms "
                              f"({got['link']})", flush=True)  # fmt: skip
    return section_of(cells, command)


def section_of(cells: list[dict[str, Any]], command: str) -> Section:
    """The section of measured `cells` (what `measure` returns; its raw JSON read back)."""
    return Section(
        key="netsim",
        title="Across a simulated network: allreduce with every rank and server on a host of "
        "its own, links shaped",
        command=command,
        header=["link", "ranks", "MiB", "method", "ms", "busiest link", "limit ms",
                "x of the limit", "x gloo's time", "cores busy", "target", ""],
        rows=[_row(c, cells) for c in cells],
        notes=notes(cells),
        raw={"cells": cells},
    )  # fmt: skip


def _csv(values: Sequence[int]) -> str:
    return ",".join(map(str, values))


def _peer(cell: dict[str, Any], cells: list[dict[str, Any]], method: str) -> dict[str, Any] | None:
    for other in cells:
        same = all(other[k] == cell[k] for k in ("mbit", "ranks", "mib"))
        if same and other["method"] == method:
            return other
    return None


def _misses(missed: list[dict[str, Any]], cells: list[dict[str, Any]]) -> list[str]:
    """The missed targets, each kind once per link rate: the cells' range of the figure the
    target is about, and of the cores busy meanwhile."""
    groups: dict[tuple[str, int], list[tuple[float, float, str]]] = {}
    for cell in missed:
        for target, met in zip(*(t.split("; ") for t in targets(cell, cells)), strict=True):
            if "missed" in met:
                figure = _figure(cell, cells, target)
                got = (figure, cell["cores"], NAMES[cell["method"]])
                groups.setdefault((target, cell["mbit"]), []).append(got)
    return [
        f"{target} at {_rate(mbit)}: {len(got)} cell(s) ("
        + " / ".join(dict.fromkeys(name for _, _, name in got))
        + f"), {_span([f for f, _, _ in got])}x, {_span([c for _, c, _ in got], 1)} cores busy"
        for (target, mbit), got in groups.items()
    ]


def _figure(cell: dict[str, Any], cells: list[dict[str, Any]], target: str) -> float:
    """What `target` measures for `cell`: its time over the limit, or over its peer's."""
    peers = {"1 primary": "cluster-1", "flat": "flat-pairs", "gloo": "gloo"}
    for word, method in peers.items():
        peer = _peer(cell, cells, method)
        if target.endswith(f"x {word}") and peer is not None:
            return float(cell["s"] / peer["s"])
    return float(cell["s"] / cell["limit_s"])


def _span(values: list[float], digits: int = 2) -> str:
    low, high = min(values), max(values)
    return f"{low:.{digits}f}" if low == high else f"{low:.{digits}f}-{high:.{digits}f}"


def _phases(cell: dict[str, Any]) -> float:
    """Seconds the flat allreduce's phases allow through one server's link (see notes)."""
    return 2 * cell["ranks"] * cell["mib"] * MIB / (cell["mbit"] * 1e6 / 8)


def _row(cell: dict[str, Any], cells: list[dict[str, Any]]) -> list[str]:
    gloo = _peer(cell, cells, "gloo")
    against = f"{cell['s'] / gloo['s']:.2f}" if gloo else ""
    target, met = targets(cell, cells)
    return [
        _rate(cell["mbit"]), str(cell["ranks"]), str(cell["mib"]), NAMES[cell["method"]],
        f"{cell['s'] * 1e3:,.0f}", cell["link"], f"{cell['limit_s'] * 1e3:,.0f}",
        f"{cell['s'] / cell['limit_s']:.2f}", against, f"{cell['cores']:.1f}", target, met,
    ]  # fmt: skip


def _rate(mbit: int) -> str:
    return f"{mbit // 1000} Gbit/s" if mbit % 1000 == 0 else f"{mbit} Mbit/s"


def targets(cell: dict[str, Any], cells: list[dict[str, Any]]) -> tuple[str, str]:
    """The issue's target for this cell, and whether it was met (what it is measured against
    is a cell of the same rate, ranks and size)."""
    method, big = cell["method"], cell["mib"] >= 64
    wanted: list[tuple[str, str]] = []
    if method == "cluster-3" and big and (one := _peer(cell, cells, "cluster-1")):
        wanted.append(("<= 0.45x 1 primary", verdict(cell["s"] / one["s"], 0.45, False)))
    flat = _peer(cell, cells, "flat-pairs")
    if method == "hierarchical" and flat and "server's link" in flat["link"]:
        # where the Redis link is the bottleneck
        wanted.append(("<= 0.6x flat", verdict(cell["s"] / flat["s"], 0.6, False)))
    if method == "powersgd" and big and (gloo := _peer(cell, cells, "gloo")):
        wanted.append(("<= 1.0x gloo", verdict(cell["s"] / gloo["s"], 1.0, False)))
    if method not in ("gloo", "powersgd"):  # PowerSGD's few bytes leave its compute to bound it
        wanted.append((f"<= {LIMIT_SLACK}x limit",
                       verdict(cell["s"] / cell["limit_s"], LIMIT_SLACK, False)))  # fmt: skip
    return "; ".join(t for t, _ in wanted), "; ".join(m for _, m in wanted)


def notes(cells: list[dict[str, Any]]) -> list[str]:
    missed = [c for c in cells if "missed" in targets(c, cells)[1]]
    lines = [
        "Every rank and every Redis server is a network namespace of its own on this machine, "
        "joined to one bridge by a veth pair shaped with tc's token bucket at the link rate, "
        "each way (bench/netsim.py). The hosts share this machine's 2 cores: where a figure "
        "is far above its limit, the cores, not the links, bound it (see which below).",
        "The limit is the bytes over the busiest link divided by the link rate; 'x of the "
        "limit' is the measured time over it (1.00 would be the link saturated for the whole "
        "call). Bytes are the servers' own counts per call: the barrier and the notices ride "
        "in them.",
    ]
    phased = [c for c in cells if c["method"] == "flat"]
    if phased:
        lines.append(
            "What the phases' order allows through one server: the scatter is staggered owner "
            "by owner, so the server's link out waits only for the first owner's chunks "
            "(S/L) and for the owners' reduced chunks (S/L) besides its 2(N-1)S: 2NS/L, "
            "N/(N-1) of the limit (1.33x at 4 ranks, 1.14x at 8). One server measured "
            "against it: "
            + "; ".join(
                f"{_rate(c['mbit'])} {c['ranks']} ranks {c['mib']} MiB {c['s'] / _phases(c):.2f}x"
                f" ({c['cores']:.1f} cores busy)"
                for c in phased
            )
            + "."
        )
    if missed:
        lines.append("Missed: " + "; ".join(_misses(missed, cells)) + ".")
        lines.append(READING)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="1000,10000", help="link rates, Mbit/s")
    parser.add_argument("--ranks", default="4,8", help="world sizes")
    parser.add_argument("--sizes", default="16,64", help="MiB of float32 per rank")
    parser.add_argument("--runs", type=int, default=3, help="timed runs per cell (median)")
    parser.add_argument("--methods", default=",".join(METHODS), help=", ".join(METHODS))
    parser.add_argument("--most-ranks", action="append", default=[], metavar="MBIT:N",
                        help="no world larger than N at links of MBIT (repeatable)")  # fmt: skip
    args = parser.parse_args()
    try:
        pairs = [v.split(":") for v in args.most_ranks]
        most = {int(rate): int(n) for rate, n in pairs}
    except ValueError:
        parser.error(f"--most-ranks {args.most_ranks}: give MBIT:N, e.g. 10000:4")
    try:
        rates, worlds, sizes = (tuple(map(int, v.split(","))) for v in
                                (args.rates, args.ranks, args.sizes))  # fmt: skip
    except ValueError:
        parser.error("--rates, --ranks and --sizes take integers separated by commas")
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        parser.error(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    if any(n % 2 for n in worlds):
        parser.error(f"--ranks {args.ranks}: even world sizes (the hierarchy puts 2 on a host)")
    try:
        print(measure(rates, worlds, sizes, args.runs, methods, most).markdown())
    except netsim.NetsimError as exc:
        parser.exit(1, f"{exc}\n")


if __name__ == "__main__":
    main()
