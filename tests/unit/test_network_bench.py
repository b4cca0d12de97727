"""How bench.network reads a cell: the busiest link from the servers' byte counts, and
which of issue 35's targets a cell is held to (no network needed)."""

from __future__ import annotations

from typing import Any

from bench.network import Counted, notes, targets

MIB = 2**20


def test_the_flat_allreduce_is_bound_by_the_servers_link_out() -> None:
    """N=4, S=1 MiB: the server takes N*S in and sends 2(N-1)S out; a rank's link carries a
    quarter of each."""
    bytes_, link = Counted(((4 * MIB, 6 * MIB),), hosts=4).busiest()
    assert (bytes_, link) == (6 * MIB, "the server's link, out")


def test_three_primaries_share_the_bytes_and_the_busiest_one_bounds_the_call() -> None:
    bytes_, link = Counted(
        ((1 * MIB, 2 * MIB), (1 * MIB, 3 * MIB), (1 * MIB, 1 * MIB)), 4
    ).busiest()
    assert (bytes_, link) == (3 * MIB, "a primary's link, out")


def test_with_many_servers_and_few_hosts_a_hosts_own_link_is_the_busiest() -> None:
    nodes = tuple((MIB // 2, 1 * MIB) for _ in range(8))
    bytes_, link = Counted(nodes, hosts=2).busiest()
    assert (bytes_, link) == (4 * MIB, "each rank host's link, in")


def cell(method: str, seconds: float, limit: float, link: str = "the server's link, out",
         mib: int = 64) -> dict[str, Any]:  # fmt: skip
    return {"mbit": 1000, "ranks": 4, "mib": mib, "method": method, "s": seconds,
            "limit_s": limit, "link": link, "cores": 1.0}  # fmt: skip


def test_each_cell_is_held_to_its_own_targets_against_cells_of_the_same_run() -> None:
    cells = [
        cell("cluster-1", 3.0, 2.4),
        cell("cluster-3", 1.2, 0.8, "a primary's link, out"),
        cell("flat-pairs", 3.0, 2.4),
        cell("hierarchical", 2.0, 0.8),
        cell("powersgd", 0.5, 0.01),
        cell("gloo", 1.0, 0.9, "each rank host's link, each way"),
    ]
    by = {c["method"]: c for c in cells}
    assert targets(by["cluster-3"], cells) == (
        "<= 0.45x 1 primary; <= 1.3x limit",
        "met; **missed**",
    )
    assert targets(by["hierarchical"], cells)[0] == "<= 0.6x flat; <= 1.3x limit"
    assert targets(by["hierarchical"], cells)[1].startswith("**missed**")  # 0.67x flat
    assert targets(by["powersgd"], cells) == ("<= 1.0x gloo", "met")  # no limit: CPU-bound
    assert targets(by["gloo"], cells) == ("", "")  # the peer
    # the 0.45x and 1.0x-gloo targets are the at 64 MiB only
    small = [dict(c, mib=16) for c in cells]
    assert targets(small[1], small)[0] == "<= 1.3x limit"
    missed = next(line for line in notes(cells) if line.startswith("Missed:"))
    assert "<= 1.3x limit at 1 Gbit/s: 2 cell(s) (Redis Cluster, 3 primaries / Redis hier" in missed


def test_the_hierarchy_is_held_to_the_flat_time_only_where_the_redis_link_bounds_flat() -> None:
    cells = [
        cell("flat-pairs", 3.0, 2.4, "each rank host's link, in"),
        cell("hierarchical", 2.5, 2.0),
    ]
    assert targets(cells[1], cells)[0] == "<= 1.3x limit"
