"""A peer dies (SIGKILL): how long until the survivors are training again. cohort vs torchrun.

cohort: a coordinator and two `cohort example-worker` processes (heartbeat every
0.5 s, failed after 2 s of silence). One worker is SIGKILLed; the time is from
the kill to the first step the survivor commits in the new world (the
StepCommitted fact's server time).

torchrun (torch.distributed.run, c10d rendezvous, 2 agents on this machine,
`--nnodes 1:2`, `--max-restarts 5`, `--monitor-interval 0.1`), each agent running
bench/torch_trainer.py (gloo allreduce every step). Two kills:
- the worker process of agent 2 (its agent notices and restarts every worker of the job);
- agent 2 and its worker together (the machine is gone; agent 1 must re-rendezvous alone);
- agent 1, which hosts the c10d store, and its worker.
The time is from the kill to the first step any worker finishes after it.

    python -m bench.peer_death [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.fleet import coordinator, spawn
from bench.results import Section, verdict
from bench.scratch import discard
from cohort.coordinator.replay import JournalWatch
from cohort.events.models import StepCommitted
from cohort.localredis import LocalRedis
from cohort.processes import end, kill_tree

TIMEOUT_S = 2.0
LIMIT_S = 120.0  # give up on a resume after this long


def _cohort_once(run: int) -> float:
    job = f"death-{run}"
    with LocalRedis(appendonly=False) as server:
        conn = server.client()
        procs = [
            coordinator(server.url, job, "--heartbeat-interval", "0.5", "--heartbeat-timeout",
                        str(TIMEOUT_S), "--min-workers", "1", "--dataset-size", "4096")
        ]  # fmt: skip
        try:
            for name in ("a", "b"):
                procs.append(
                    spawn(server.url, name, "example-worker", "--job", job, "--id", name,
                          "--steps", "100000", "--pace", "0.05", "--gpu-interval", "0")
                )  # fmt: skip
            watch = JournalWatch.of(conn, job)
            world = _together(watch)
            killed_at = time.time()
            procs[2].signal(signal.SIGKILL)
            deadline = time.monotonic() + LIMIT_S
            while True:
                for fact in watch.pull(block_ms=200):
                    if isinstance(fact, StepCommitted) and fact.world > world:
                        return fact.at - killed_at
                if time.monotonic() > deadline:
                    raise TimeoutError("cohort: the survivor never trained again")
        finally:
            for proc in procs:
                proc.stop()


def _together(watch: JournalWatch, steps: int = 20) -> int:
    """Wait for `steps` steps committed by a world of both workers; that world's version.
    (Steps count in that world only: under load one worker may train alone for 20 steps
    before the other joins, and a kill before the newcomer holds the weights loses them.)"""
    deadline = time.monotonic() + 60
    together = 0
    while together < steps:
        if time.monotonic() > deadline:
            raise TimeoutError("cohort: the two workers never trained together")
        for fact in watch.pull(block_ms=200):
            state = watch.state
            if isinstance(fact, StepCommitted) and fact.world == state.world_version:
                together += len(state.ranks) == 2
    return watch.state.world_version


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _lines(path: Path) -> list[dict[str, float]]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError):
        return []


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _torchrun_once(kill: str, backend: str = "c10d") -> float:
    """Seconds from the kill to the first step finished after it; inf if training never
    came back within LIMIT_S, nan if the job died. `kill`: "worker" (agent 2's worker),
    "agent" (agent 2 and its worker) or "host" (agent 1, which hosts the c10d store).
    `backend` "cohort": the same agents on `--rdzv-backend=cohort`, a Redis and a cohort
    coordinator (heartbeat timeout TIMEOUT_S) instead of a store on agent 1."""
    if backend == "cohort":
        with LocalRedis(appendonly=False) as server:
            lead = coordinator(server.url, "bench", "--heartbeat-interval", "0.5",
                               "--heartbeat-timeout", str(TIMEOUT_S))  # fmt: skip
            try:
                return _agents(kill, backend, server.url)
            finally:
                lead.stop()
    return _agents(kill, backend, f"127.0.0.1:{_free_port()}")


def _agents(kill: str, backend: str, endpoint: str) -> float:
    port = int(endpoint.rsplit(":", 1)[1]) if backend == "c10d" else 0
    tmp = Path(tempfile.mkdtemp(prefix="cohort-bench-torchrun-"))
    logs = [tmp / "agent1.jsonl", tmp / "agent2.jsonl"]
    agents: list[subprocess.Popen[bytes]] = []
    try:
        for i, log in enumerate(logs):
            agents.append(_agent(i, log, tmp, backend, endpoint))
            if port and i == 0:  # agent 1 hosts the c10d store
                _until_listening(port, agents[0], tmp)
        _until_training(logs, agents, tmp)
        lost = 0 if kill == "host" else 1
        victim = int(_lines(logs[lost])[-1]["pid"])
        killed_at = time.time()
        if kill == "worker":
            os.kill(victim, signal.SIGKILL)
        else:  # a lost node: the agent and its worker, which has a session of its own
            kill_tree(agents[lost].pid)
        return _back_after(logs, victim, killed_at, agents[1 - lost])
    finally:
        # every agent with every worker it started: torchrun starts each worker in a
        # session of its own, which SIGKILL to the agent's process group does not reach
        end(agents, sig=0)
        discard(tmp)


def _agent(i: int, log: Path, tmp: Path, backend: str, endpoint: str) -> subprocess.Popen[bytes]:
    """torchrun agent number `i` + 1, its worker (bench/torch_trainer.py) logging to `log`."""
    # cohort's agents as its integration test runs them; c10d with torch's defaults (a run
    # with last_call_timeout=2 on c10d timed out waiting for the round's role_info)
    conf = ("--rdzv-conf", "last_call_timeout=2") if backend == "cohort" else ()
    trainer = Path(__file__).with_name("torch_trainer.py")
    env = {**os.environ, "BENCH_LOG": str(log), "BENCH_PACE": "0.05"}
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2",
         "--nproc-per-node", "1", "--rdzv-backend", backend,
         "--rdzv-endpoint", endpoint, "--rdzv-id", "bench", *conf,
         "--max-restarts", "5", "--monitor-interval", "0.1", str(trainer)],
        env=env, stdout=(tmp / f"agent{i + 1}.out").open("wb"),
        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip


def _until_listening(port: int, host: subprocess.Popen[bytes], tmp: Path) -> None:
    """Wait for the c10d store agent `host` starts to listen on `port`."""
    deadline = time.monotonic() + 60
    while not _listening(port):
        if time.monotonic() > deadline or host.poll() is not None:
            raise TimeoutError(f"torchrun's store never listened; see {tmp}")
        time.sleep(0.05)  # another process binds the port: nothing to block on


def _until_training(logs: list[Path], agents: list[subprocess.Popen[bytes]], tmp: Path) -> None:
    """Wait for both agents' workers to log 20 steps."""
    deadline = time.monotonic() + 120
    while not all(len(_lines(log)) >= 20 for log in logs):
        if time.monotonic() > deadline or any(a.poll() is not None for a in agents):
            raise TimeoutError(f"torchrun never trained on two agents; see {tmp}")
        time.sleep(0.05)


def _back_after(
    logs: list[Path], victim: int, killed_at: float, survivor: subprocess.Popen[bytes]
) -> float:
    """Seconds from the kill to the first step a restarted worker finished; inf past
    LIMIT_S, nan if the surviving agent exited."""
    deadline = time.monotonic() + LIMIT_S
    while True:
        after = [x["t"] for log in logs for x in _lines(log)
                 if x["t"] > killed_at and x["pid"] != victim and x["restart"] > 0]  # fmt: skip
        if after:
            return min(after) - killed_at
        if survivor.poll() is not None:
            return float("nan")
        if time.monotonic() > deadline:
            return float("inf")
        time.sleep(0.05)


def _shown(seconds: float) -> str:
    if seconds != seconds:
        return "job died"
    return f"> {LIMIT_S:.0f}" if seconds == float("inf") else f"{seconds:.2f}"


CASES = {
    "c10d:worker": "torchrun: every worker restarted (worker SIGKILLed)",
    "c10d:agent": "torchrun: agent 2 + its worker SIGKILLed (a node lost)",
    "c10d:host": "torchrun: agent 1, the c10d store host, + worker SIGKILLed",
    "cohort:worker": "torchrun on cohort: worker SIGKILLed",
    "cohort:agent": "torchrun on cohort: agent 2 + its worker (a node lost)",
    "cohort:host": "torchrun on cohort: agent 1 + its worker (no store host)",
}
"""The torchrun runs, "backend:kill" (see `_torchrun_once`), each with its row's label."""


def measure(runs: int = 3, cases: tuple[str, ...] = tuple(CASES)) -> Section:
    """`runs` runs of cohort and of each of the torchrun `cases` (keys of CASES)."""
    unknown = set(cases) - set(CASES)
    if unknown:
        raise ValueError(f"unknown case(s) {sorted(unknown)}; choose from {', '.join(CASES)}")
    cohort = [_cohort_once(r) for r in range(runs)]
    rows: list[tuple[str, list[float]]] = [("cohort: survivors resume (worker SIGKILLed)", cohort)]
    try:
        import torch  # noqa: F401
    except ImportError:
        torchrun: dict[str, list[float]] = {}
    else:
        torchrun = {}
        for case in cases:
            backend, kill = case.split(":")
            torchrun[case] = [_torchrun_once(kill, backend) for _ in range(runs)]
            rows.append((CASES[case], torchrun[case]))
    mine = statistics.median(cohort)
    section = Section(
        key="peer_death",
        title="Peer death: SIGKILL to survivors training again, cohort vs torchrun",
        command=f"python -m bench.peer_death --runs {runs}"
        + ("" if set(cases) == set(CASES) else f" --cases {','.join(cases)}"),
        header=["what", "median s", "runs, s", "x cohort", "target (cohort)", ""],
    )
    for i, (what, times) in enumerate(rows):
        med = statistics.median(times)
        section.rows.append(
            [what, _shown(med), ", ".join(_shown(t) for t in times),
             f"{med / mine:.1f}" if med == med and med != float("inf") else "",
             f"<= {TIMEOUT_S + 1:g} (timeout {TIMEOUT_S:g} + 1)" if i == 0 else "",
             verdict(med, TIMEOUT_S + 1, higher_is_better=False) if i == 0 else ""]
        )  # fmt: skip
    section.notes = [
        "cohort's survivor never stops: it finds out from the journal (WorkerFailed, "
        "WorldChanged), loads rank 0's weights and goes on. torchrun tears down and "
        "restarts every worker of the job (new processes, imports, a new rendezvous and "
        "process group) and, with no checkpoint in this script, starts over from step 0. "
        "A lost node that hosted the c10d store takes the job with it: the other agent "
        "exits with RendezvousConnectionError ('job died'); cohort keeps its state in "
        "Redis and any coordinator can lead.",
        "torchrun on cohort: the same agents and script with `--rdzv-backend=cohort "
        "--rdzv-endpoint=redis://...` and a cohort coordinator (heartbeat timeout "
        f"{TIMEOUT_S:g} s) and `--rdzv-conf last_call_timeout=2`; c10d with torch's "
        "defaults. It "
        "still restarts every worker (torchrun's own policy), but no agent hosts the "
        "rendezvous, so losing agent 1 does not end the job, and a lost node is noticed "
        "from the journal's WorkerFailed instead of torchrun's keep-alive expiry.",
    ]
    if not torchrun:
        section.notes.append("torch is not installed here: the torchrun rows were skipped.")
    section.raw = {"cohort": cohort, "torchrun": torchrun}
    return section


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--cases", default=",".join(CASES), help="the torchrun runs, comma-separated"
    )
    args = parser.parse_args()
    print(measure(args.runs, tuple(c for c in args.cases.split(",") if c)).markdown())


if __name__ == "__main__":
    main()
