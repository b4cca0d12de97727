"""Control-plane throughput: commands the leader ingests per second, facts replay folds per second.

Each figure comes with a peer measured in the same run on the same data: for
ingest, reading the same inbox entries with XRANGE and nothing else (the floor
any leader pays); for replay, unpacking the same journal entries with msgpack
alone. Ratios say how much of the time is cohort's own work.

    python -m bench.control_plane [--commands 200000] [--workers 1000] [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import msgpack

from cohort.localredis import LocalRedis
from coordinator.fold import evolve
from coordinator.service import Coordinator, ServiceSettings
from coordinator.state import JobState
from events.codec import decode_fact, encode
from events.keys import Keys
from events.models import Heartbeat, JobConfig, Join, StepDone, WeightsLoaded
from events.streams import ZERO, Inbox, Journal, Stream


def fill_inbox(conn, job: str, commands: int, workers: int) -> None:  # type: ignore[no-untyped-def]
    """Workers join and load weights, then heartbeat and finish steps like a busy job."""
    inbox = Inbox(conn, Keys(job).inbox)
    names = [f"w{i:05d}" for i in range(workers)]
    pipe = conn.pipeline(transaction=False)
    sent = 0

    def send(command) -> None:  # type: ignore[no-untyped-def]
        nonlocal sent
        pipe.xadd(inbox.key, {b"e": encode(command)})
        sent += 1
        if len(pipe) >= 2000:
            pipe.execute()

    for name in names:
        send(Join(at=0, job=job, worker=name))
        send(WeightsLoaded(at=0, job=job, worker=name))
    step, world = 0, 1  # min_workers = workers: all are activated together in world 1
    while sent < commands:
        for name in names:
            send(Heartbeat(at=0, job=job, worker=name, step=step - 1 if step else None))
            send(StepDone(at=0, job=job, worker=name, step=step, world=world, step_time=0.1))
            if sent >= commands:
                break
        step += 1
    pipe.execute()


def ingest(server: LocalRedis, commands: int, workers: int) -> tuple[float, float, int]:
    conn = server.client()
    conn.flushall()
    job = "bench"
    fill_inbox(conn, job, commands, workers)
    total = conn.xlen(Keys(job).inbox)
    last = Stream(conn, Keys(job).inbox).last_id()

    start = time.perf_counter()
    after, read = ZERO, 0
    stream = Stream(conn, Keys(job).inbox)
    while True:
        rows = stream.range(after, count=1024)
        read += len(rows)
        if len(rows) < 1024:
            break
        after = rows[-1].id
    peer = time.perf_counter() - start

    config = JobConfig(
        min_workers=workers,
        max_workers=workers,
        heartbeat_timeout=3600,
        heartbeat_interval=1,
        dataset_size=10_000_000,
        batch_size=32,
    )
    coord = Coordinator(
        conn,
        ServiceSettings(
            job=job,
            coordinator="bench",
            config=config,
            lease_ms=60_000,
            block_ms=1,
            allow_volatile=True,  # the benchmark server runs without AOF on purpose
        ),
    )
    coord.start()
    start = time.perf_counter()
    while coord.cursor != last:
        coord.step()
    took = time.perf_counter() - start
    assert coord.state.members and coord.state.counters.steps_committed > 0
    return total / took, total / peer, coord.counters.facts


def replay(server: LocalRedis) -> tuple[float, float, float, int]:
    conn = server.client()
    journal = Journal(conn, Keys("bench").journal)
    entries = []
    after = ZERO
    while True:
        rows = journal.range(after, count=10_000)
        entries.extend(rows)
        if len(rows) < 10_000:
            break
        after = rows[-1].id
    raws = [e.raw or b"" for e in entries]

    start = time.perf_counter()
    for raw in raws:
        msgpack.unpackb(raw)
    peer = time.perf_counter() - start

    start = time.perf_counter()
    facts = [decode_fact(raw) for raw in raws]
    decoded = time.perf_counter() - start

    start = time.perf_counter()
    state = JobState()
    for fact in facts:
        state = evolve(state, fact)
    folded = time.perf_counter() - start
    n = len(raws)
    return n / (decoded + folded), n / folded, n / peer, n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commands", type=int, default=200_000)
    parser.add_argument("--workers", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    rows: dict[str, list[float]] = {k: [] for k in ("ingest", "xrange", "replay", "fold", "unpack")}
    facts = n = 0
    with LocalRedis(appendonly=False) as server:
        for _ in range(args.runs):
            rate, peer, facts = ingest(server, args.commands, args.workers)
            rows["ingest"].append(rate)
            rows["xrange"].append(peer)
            full, fold_only, unpack, n = replay(server)
            rows["replay"].append(full)
            rows["fold"].append(fold_only)
            rows["unpack"].append(unpack)
    med = {k: statistics.median(v) for k, v in rows.items()}
    print("| what | median per second | peer (same run) | ratio |")
    print("|---|---|---|---|")
    print(
        f"| leader ingest: {args.commands} commands, {args.workers} workers, {facts} facts "
        f"| {med['ingest']:,.0f} commands/s | XRANGE alone {med['xrange']:,.0f}/s "
        f"| {med['ingest'] / med['xrange']:.2f} |"
    )
    print(
        f"| replay: decode + fold {n} facts | {med['replay']:,.0f} facts/s "
        f"| msgpack unpack alone {med['unpack']:,.0f}/s | {med['replay'] / med['unpack']:.3f} |"
    )
    print(f"| replay: fold only (decoded facts) | {med['fold']:,.0f} facts/s | | |")


if __name__ == "__main__":
    threading.current_thread().name = "bench"
    main()
