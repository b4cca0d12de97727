"""The leader's connection reading: what it costs per reading, against reading CLIENT LIST.

Every 0.05 s the leader asks Redis which members still hold their presence subscription
(`PUBSUB SHARDNUMSUB` of each member's channel, plus the server's run_id, in one round trip:
`RedisJobLog.connected`). Peer, same run, same server, same members: what issue 37 first
proposed, each worker naming its connection (`CLIENT SETNAME`) and the leader reading
`CLIENT LIST` (redis-py's `client_list()`) and counting its members' names. Every member
here holds both (a named connection with the subscription on it), and the server holds
`--others` idle connections of other jobs too, as a shared server does: CLIENT LIST lists
them all, SHARDNUMSUB asks only for the job's members.

    python -m bench.presence [--members 10,100,1000] [--others 0,1000] [--readings 200]
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import socket
from collections.abc import Iterator
from typing import Any

import redis

from bench.results import Section, median_seconds
from cohort.coordinator.joblog import Durability, RedisJobLog
from cohort.events.keys import Keys
from cohort.localredis import LocalRedis

JOB = "presence"
EVERY = 0.05
"""The leader's reading interval (coordinator/service.py WATCH_EVERY)."""


@contextlib.contextmanager
def _connections(port: int, names: list[str], channels: list[str | None]) -> Iterator[None]:
    """One open connection per name, named so and subscribed to its channel (if any): plain
    sockets, as light as a worker's presence connection."""
    pack = redis.Connection().pack_command
    opened = []
    try:
        for name, channel in zip(names, channels, strict=True):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            opened.append(sock)
            wire = pack("CLIENT", "SETNAME", name)
            if channel is not None:
                wire += pack("SSUBSCRIBE", channel)
            sock.sendall(b"".join(wire))
            last = b":1\r\n" if channel is not None else b"+OK\r\n"
            got = b""
            while not got.endswith(last):
                chunk = sock.recv(4096)
                if not chunk:
                    raise ConnectionError(f"Redis closed {name}'s connection: {got!r}")
                got += chunk
        yield
    finally:
        for sock in opened:
            sock.close()


def _by_names(conn: redis.Redis, prefix: str, members: list[str]) -> dict[str, int]:
    """The peer's reading: each member's named connections, from CLIENT LIST."""
    counts = dict.fromkeys(members, 0)
    for client in conn.client_list():
        name = client.get("name", "")
        if name.startswith(prefix):
            worker = name[len(prefix) :]
            if worker in counts:
                counts[worker] += 1
    return counts


def _server_usec(conn: redis.Redis, command: str) -> float:
    stats = conn.info("commandstats").get(f"cmdstat_{command}", {})
    return float(stats.get("usec_per_call", 0.0))


def _one(port: int, members: int, others: int, readings: int) -> dict[str, float]:
    keys = Keys(JOB)
    workers = [f"w{i}" for i in range(members)]
    prefix = f"cohort-{JOB}-"
    names = [prefix + w for w in workers] + [f"cohort-other-w{i}" for i in range(others)]
    channels: list[str | None] = [keys.presence(w) for w in workers] + [None] * others
    with redis.Redis(port=port) as conn, _connections(port, names, channels):
        log = RedisJobLog(conn, JOB, Durability())
        assert log.connected(workers)[1] == dict.fromkeys(workers, 1)
        assert _by_names(conn, prefix, workers) == dict.fromkeys(workers, 1)
        conn.config_resetstat()
        cohort = median_seconds(lambda: log.connected(workers), readings)
        peer = median_seconds(lambda: _by_names(conn, prefix, workers), readings)
        return {
            "cohort_s": cohort,
            "peer_s": peer,
            "cohort_server_us": _server_usec(conn, "pubsub|shardnumsub"),
            "peer_server_us": _server_usec(conn, "client|list"),
        }


def measure(
    members: tuple[int, ...] = (10, 100, 1000), others: tuple[int, ...] = (0, 1000),
    readings: int = 200,
) -> Section:  # fmt: skip
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max(members) + max(others) + 256
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, hard), hard))
    section = Section(
        key="presence",
        title="Watching connections: the leader's reading, presence channels vs CLIENT LIST",
        command=(
            f"python -m bench.presence --members {','.join(map(str, members))} "
            f"--others {','.join(map(str, others))} --readings {readings}"
        ),
        header=[
            "members", "other clients", "cohort: SHARDNUMSUB + INFO, ms (server us)",
            "peer: CLIENT LIST, ms (server us)", "ratio",
            "leader's time reading at 20/s (peer)",
        ],
    )  # fmt: skip
    raw: dict[str, Any] = {}
    with LocalRedis(appendonly=False) as server:
        for n in members:
            for m in others:
                got = raw[f"{n}/{m}"] = _one(server.port, n, m, readings)
                section.rows.append(
                    [
                        f"{n:,}",
                        f"{m:,}",
                        f"{got['cohort_s'] * 1e3:.3f} ({got['cohort_server_us']:.0f})",
                        f"{got['peer_s'] * 1e3:.3f} ({got['peer_server_us']:.0f})",
                        f"{got['cohort_s'] / got['peer_s']:.2f}",
                        f"{got['cohort_s'] / EVERY:.1%} ({got['peer_s'] / EVERY:.1%})",
                    ]
                )
    section.raw = raw
    section.notes = [
        "Medians of one reading on the leader's side (the round trip and the parsing), with "
        "the server's own microseconds per call from INFO commandstats in brackets. A ratio "
        "below 1 is cohort's reading costing less. The last column is the share of the "
        "leader's time spent reading at its interval (0.05 s): waiting on Redis included, "
        "so at most that share of a core.",
        "Redis answers SHARDNUMSUB from its channel table, one entry per member asked; CLIENT "
        "LIST formats every client the server holds, other jobs' included, and needs the "
        "right to see them (docs/identity.md).",
    ]
    return section


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", default="10,100,1000")
    parser.add_argument("--others", default="0,1000")
    parser.add_argument("--readings", type=int, default=200)
    args = parser.parse_args()
    print(
        measure(
            tuple(int(x) for x in args.members.split(",")),
            tuple(int(x) for x in args.others.split(",")),
            args.readings,
        ).markdown()
    )


if __name__ == "__main__":
    main()
