"""Per-step coordination overhead: what a step costs when the training itself costs nothing.

W simulated workers each report StepDone for the next step; the step is over
when the coordinator process has journaled StepCommitted and the fleet has read
it. That round, with no compute and no gradients, is the price cohort adds to
every step (TorchFT's per-step quorum is the comparable cost there).

Peer, same run: the same W StepDone XADDs in one pipeline, then one XADD to the
journal and one XREAD of it: the Redis round trips alone, with no decisions.

    python -m bench.overhead [--workers 8,64,256] [--steps 100]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from bench.fleet import Fleet, coordinator
from bench.results import Section
from cohort.events.keys import Keys
from cohort.localredis import LocalRedis


def _one(url: str, conn, workers: int, steps: int) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    job = f"overhead-{workers}"
    proc = coordinator(
        url, job, "--min-workers", str(workers), "--max-workers", str(workers),
        "--heartbeat-timeout", "3600", "--lease", "30", "--straggler-steps", "1000",
    )  # fmt: skip
    try:
        fleet = Fleet(conn, job, workers)
        fleet.join_all()
        took = []
        for _ in range(steps + 5):
            step = fleet.watch.state.next_step
            start = time.perf_counter()
            fleet.send(fleet.step_done(fleet.names))
            fleet.until(lambda s, step=step: s.last_committed >= step, 60, f"commit of {step}")
            took.append(time.perf_counter() - start)
        peer = []
        journal = Keys(job).journal + ":peer"
        for _ in range(steps + 5):
            start = time.perf_counter()
            last = fleet.send(fleet.step_done(fleet.names))
            entry = conn.xadd(journal, {b"e": last.encode()})
            conn.xread({journal: b"0-0"}, block=1000)
            conn.xdel(journal, entry)
            peer.append(time.perf_counter() - start)
        return statistics.median(took[5:]), statistics.median(peer[5:])
    except Exception:
        print(proc.tail(40))
        raise
    finally:
        proc.stop()


def measure(worlds: tuple[int, ...] = (8, 64, 256), steps: int = 100) -> Section:
    section = Section(
        key="overhead",
        title="Per-step coordination overhead (no compute, no gradients)",
        command=f"python -m bench.overhead --workers {','.join(map(str, worlds))} "
        f"--steps {steps}",
        header=["workers", "StepDone -> StepCommitted seen, ms", "peer: Redis round trips, ms",
                "ratio", "steps/s the coordinator allows"],
    )  # fmt: skip
    raw: dict[str, Any] = {}
    with LocalRedis(appendonly=False) as server:
        conn = server.client()
        for w in worlds:
            took, peer = _one(server.url, conn, w, steps)
            raw[str(w)] = {"step_s": took, "peer_s": peer}
            section.rows.append(
                [str(w), f"{took * 1e3:.2f}", f"{peer * 1e3:.2f}", f"{took / peer:.1f}",
                 f"{1 / took:,.0f}"]
            )  # fmt: skip
    section.notes = [
        "The fleet sends every rank's StepDone at once, so this is the coordinator's "
        "decision latency plus Redis; with real workers the step ends when the slowest "
        "rank reports. The coordinator runs as its own process, as in production.",
    ]
    section.raw = raw
    return section


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="8,64,256")
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    print(measure(tuple(int(w) for w in args.workers.split(",")), args.steps).markdown())


if __name__ == "__main__":
    main()
