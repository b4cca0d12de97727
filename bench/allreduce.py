"""allreduce through one Redis server, against what that server can move at all.

Each rank is a process with its own connection to a private redis-server (AOF off). A run is
barrier, then allreduce of one float32 vector; its time is the slowest rank's. In the same run
the server's raw throughput is measured with one client doing SET then GET of the largest
size, both with redis-py's default packer and with the parts path `Collective` uses.

The one-server bound: an allreduce of S bytes over N ranks moves (3N-2)*S bytes through the
server (in: (N-1)S scattered + S reduced; out: (N-1)S to the owners + (N-1)S gathered), so
it cannot take less than (3N-2)*S / (raw in+out bytes per second). `bound/measured` is the
fraction of that ideal reached. The raw rate comes from one client doing one thing at a
time, so it underestimates a server that several clients keep busy at once: ratios above
1.0 mean the ranks overlapped their SETs and GETs, not that the bound was beaten.

    python -m bench.allreduce [--sizes 1,16,64] [--ranks 2,4] [--runs 5]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from cohort.localredis import LocalRedis
from events.connection import RedisSettings, connect
from worker.collective import TTL_MS, Collective, _set_command
from worker.tensors import pack

MIB = 1024 * 1024


@dataclass
class Fixed:
    """A worker stand-in whose world never changes."""

    id: str
    rank: int
    world_size: int
    world_version: int = 1
    assignment: None = None


def _rank(url: str, n: int, rank: int, size: int, runs: int, out: Any) -> None:
    conn = connect(RedisSettings(url=url, socket_timeout=120))
    job = f"bench-{n}-{size}"  # a job per cell: (world, step) names one call within a job
    collective = Collective(conn, job, Fixed(f"w{rank}", rank, n))
    vector = {"g": np.random.default_rng(rank).standard_normal(size // 4).astype("<f4")}
    times = []
    for run in range(runs + 1):  # run 0 warms up
        collective.barrier(step=2 * run, timeout=120)
        start = time.perf_counter()
        collective.allreduce(vector, step=2 * run + 1, timeout=120)
        times.append(time.perf_counter() - start)
    out.put((rank, times[1:]))
    conn.close()


def time_allreduce(url: str, n: int, size: int, runs: int) -> float:
    """Median over runs of the slowest rank's allreduce time, in seconds."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(url, n, r, size, runs, out)) for r in range(n)]
    for p in procs:
        p.start()
    per_rank = dict(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(60)
    slowest = [max(per_rank[r][i] for r in range(n)) for i in range(runs)]
    return statistics.median(slowest)


def raw_throughput(url: str, size: int, runs: int) -> dict[str, float]:
    """Bytes per second for SET (default packer and parts path) and GET of `size` bytes."""
    conn = connect(RedisSettings(url=url, socket_timeout=120))
    value = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    pool = conn.connection_pool
    timings: dict[str, list[float]] = {"set_default": [], "set_parts": [], "get": []}
    for _ in range(runs):
        start = time.perf_counter()
        conn.set("raw", memoryview(value), px=TTL_MS)  # type: ignore[arg-type]  # joined by the packer
        timings["set_default"].append(time.perf_counter() - start)
        start = time.perf_counter()
        connection = pool.get_connection()
        try:
            connection.send_packed_command(_set_command("raw", pack({"v": value}), TTL_MS))
            connection.read_response()
        finally:
            pool.release(connection)
        timings["set_parts"].append(time.perf_counter() - start)
        start = time.perf_counter()
        conn.get("raw")
        timings["get"].append(time.perf_counter() - start)
    conn.delete("raw")
    conn.close()
    return {k: size / statistics.median(v) for k, v in timings.items()}


def _gloo_rank(port: int, n: int, rank: int, size: int, runs: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    tensor = torch.randn(size // 4)
    times = []
    for _ in range(runs + 1):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(tensor)
        times.append(time.perf_counter() - start)
    out.put((rank, times[1:]))
    dist.destroy_process_group()


def time_gloo(n: int, size: int, runs: int) -> float:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_gloo_rank, args=(port, n, r, size, runs, out)) for r in range(n)]
    for p in procs:
        p.start()
    per_rank = dict(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(60)
    return statistics.median(max(per_rank[r][i] for r in range(n)) for i in range(runs))


def torch_available() -> bool:
    try:
        import torch.distributed  # noqa: F401
    except ImportError:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,16,64", help="MiB of float32 per allreduce")
    parser.add_argument("--ranks", default="2,4", help="world sizes")
    parser.add_argument("--runs", type=int, default=5, help="timed runs per cell (median)")
    args = parser.parse_args()
    sizes = [int(s) * MIB for s in args.sizes.split(",")]
    worlds = [int(n) for n in args.ranks.split(",")]
    gloo = torch_available()

    with LocalRedis(appendonly=False) as server:
        print(f"{os.cpu_count()} CPUs; redis-server at {server.url} (AOF off)\n")
        print(f"raw, one client, GB/s (median of {args.runs}):\n")
        print("| MiB | SET default packer | SET parts | GET | in+out (parts SET, GET) |")
        print("|---|---|---|---|---|")
        server_rate: dict[int, float] = {}
        for size in sizes:
            raw = raw_throughput(server.url, size, args.runs)
            server_rate[size] = 2 / (1 / raw["set_parts"] + 1 / raw["get"])
            print(
                f"| {size // MIB} | {raw['set_default'] / 1e9:.2f} | {raw['set_parts'] / 1e9:.2f} "
                f"| {raw['get'] / 1e9:.2f} | {server_rate[size] / 1e9:.2f} |"
            )
        print()

        head = (
            "| ranks | MiB | allreduce ms | payload GB/s | via server MiB | bound ms "
            "| bound/measured |"
        )
        rule = "|---|---|---|---|---|---|---|"
        if gloo:
            head += " gloo ms | redis/gloo |"
            rule += "---|---|"
        print(head)
        print(rule)
        for n in worlds:
            for size in sizes:
                took = time_allreduce(server.url, n, size, args.runs)
                through = (3 * n - 2) * size
                bound = through / server_rate[size]
                row = (
                    f"| {n} | {size // MIB} | {took * 1e3:.1f} | {size / took / 1e9:.2f} | "
                    f"{through // MIB} | {bound * 1e3:.1f} | {bound / took:.2f} |"
                )
                if gloo:
                    g = time_gloo(n, size, args.runs)
                    row += f" {g * 1e3:.1f} | {took / g:.1f} |"
                print(row, flush=True)
    if not gloo:
        print("\ntorch not installed: gloo comparison skipped")


if __name__ == "__main__":
    main()
