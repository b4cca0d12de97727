"""Goodput under failures: a worker SIGKILLed every K seconds and replaced, cohort vs torchrun.

Both sides train the same model (bench.throughput's 1M-parameter MLP) on the same
synthetic data, 2 ranks, 64 samples per rank per step (128 per step), plain SGD, one
torch thread per rank, on this machine:

- cohort: a coordinator (heartbeat every 0.5 s, a worker failed after 2 s of silence)
  and two `cohort.torch.ElasticJob` processes on the torch.distributed (gloo) route, with
  a constant global batch of 128: a lone survivor takes both micro-batches, so every
  committed step is the same 128 samples whatever the world. A killed rank is replaced at
  once by a new process, which joins the running job.
- torchrun: two agents (`--nnodes 2`, c10d rendezvous, `--max-restarts 100`,
  `--monitor-interval 0.1`), one DDP worker each, written as a careful user would: rank 0
  saves model, optimizer and step every `--checkpoint-every` steps (atomically), and every
  (re)started worker resumes from the last checkpoint. The killed worker is agent 2's; the
  agent replaces it, which (torchrun's policy) restarts every worker of the job.

A run first trains failure-free for F seconds (the failure-free rate), then kills a rank
at the start of each of `kills` periods of K seconds. Goodput = steps that count toward
the final model per second over those periods, divided by the failure-free rate. For
cohort the steps that count are the committed ones (StepCommitted facts, by their server
time); for torchrun it is how far the model's step count advanced (after a restart it
falls back to the checkpoint, so redone steps count once).

    python -m bench.goodput [--failure-free 60] [--every 60] [--kills 5] [--checkpoint-every 100]
                            [--runs 1]
    python -m bench.goodput cohort-rank ...   # one cohort rank (internal)
    python -m bench.goodput torchrun-rank     # one torchrun worker (internal; env BENCH_*)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench import scratch
from bench.fleet import coordinator
from bench.results import Section, verdict
from bench.scratch import discard
from cohort.coordinator.replay import JournalWatch
from cohort.events.models import StepCommitted
from cohort.localredis import LocalRedis
from cohort.processes import Proc, children, end, stop_all

MODEL = "1m"
BATCH = 64  # per rank and micro-batch
WORLD = 2
GLOBAL = BATCH * WORLD
DATASET = 10_000_000  # never runs out: one epoch is 78,125 steps
BASE = 8192  # distinct synthetic samples, cycled
TIMEOUT_S = 2.0
ROUTE_ENV = "BENCH_ROUTE"
"""The cohort rank's gradient route: "gloo" (unset: this section's) or "" (through Redis,
ElasticJob's default)."""
WARMUP_STEPS = 20
TARGET_GOODPUT = 0.9
TARGET_VS_TORCHRUN = 1.5


# ---------------------------------------------------------------- what both sides train
def _data() -> Any:
    """DATASET samples cycling over BASE synthetic ones (torch imported here, in ranks)."""
    import torch
    from torch.utils.data import Dataset

    from bench.throughput import dataset

    base = dataset(MODEL, BASE)

    class Cyclic(Dataset):  # type: ignore[type-arg]
        fingerprint = f"goodput-{MODEL}-{BASE}"

        def __len__(self) -> int:
            return DATASET

        def __getitem__(self, i: int) -> Any:
            return base[i % BASE]

    torch.set_num_threads(1)
    return Cyclic()


def cohort_rank(args: argparse.Namespace) -> None:
    """One cohort rank: the five-line elastic loop, forever (the benchmark kills it)."""
    import torch

    import cohort
    from bench.throughput import build

    data = _data()
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH)
    model = build(MODEL)
    backend = os.environ.get(ROUTE_ENV, "gloo") or None  # "": through Redis, the default
    job = cohort.torch.ElasticJob(args.job, backend=backend, redis_url=args.redis_url)
    model, sgd = job.wrap(model, torch.optim.SGD(model.parameters(), lr=0.01))
    for _ in job.epochs():
        for x, y in job.batches(loader):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            sgd.zero_grad()
            loss.backward()
            sgd.step()


def torchrun_rank() -> None:
    """One torchrun worker: DDP over gloo, resuming from and saving to a checkpoint file.

    Each finished step appends {"t", "step"} to $BENCH_LOG (step = the model's step
    count after it)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from bench.throughput import build

    data = _data()
    every = int(os.environ["BENCH_CHECKPOINT_EVERY"])
    path = Path(os.environ["BENCH_CHECKPOINT"])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DistributedDataParallel(build(MODEL))
    sgd = torch.optim.SGD(model.parameters(), lr=0.01)
    step = 0
    if path.exists():
        saved = torch.load(path, weights_only=True)
        model.module.load_state_dict(saved["model"])
        sgd.load_state_dict(saved["optimizer"])
        step = int(saved["step"])
    collate = torch.utils.data.default_collate
    with open(os.environ["BENCH_LOG"], "a") as log:
        while True:
            first = (step * world + rank) * BATCH
            x, y = collate([data[i] for i in range(first, first + BATCH)])
            loss = torch.nn.functional.cross_entropy(model(x), y)
            sgd.zero_grad()
            loss.backward()
            sgd.step()
            step += 1
            if rank == 0 and step % every == 0:
                tmp = path.with_suffix(".tmp")
                state = {"model": model.module.state_dict(), "optimizer": sgd.state_dict()}
                torch.save({**state, "step": step}, tmp)
                os.replace(tmp, path)
            log.write(json.dumps({"t": time.time(), "step": step, "pid": os.getpid()}) + "\n")
            log.flush()


# ---------------------------------------------------------------- counting steps that count
def progress_at(points: Sequence[tuple[float, int]], when: float) -> int:
    """The model's step count at `when`, from (time, step count after that step) points in
    time order: that of the last point at or before `when` (0 before the first). After a
    restart the count falls back to the checkpoint's, so redone steps are counted once."""
    count = 0
    for at, step in points:
        if at > when:
            break
        count = step
    return count


def committed_between(times: Sequence[float], start: float, end: float) -> int:
    """Steps committed in [start, end): cohort never takes a committed step back."""
    return sum(1 for at in times if start <= at < end)


@dataclass(frozen=True)
class Run:
    """One side's run: its failure-free steps/s, the steps that counted over the failure
    periods, their length, and the seconds from each kill to the next step that counted."""

    failure_free: float
    counted: int
    seconds: float
    outages: list[float]
    failed_starts: int = 0
    """Worker starts that failed on their own (torchrun: a restarted worker whose process
    group could not form, which costs another restart of every worker)."""
    free_windows: tuple[float, ...] = ()
    """The failure-free rate of each window it was measured in (before, and after, the
    failure periods), `failure_free` their mean."""

    @property
    def rate(self) -> float:
        return self.counted / self.seconds

    @property
    def goodput(self) -> float:
        return self.rate / self.failure_free


def _until(done: Callable[[], bool], timeout: float, what: str, poll: Callable[[], None]) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout:.0f} s")
        poll()


def _first_after(times: Sequence[float], when: float) -> float:
    later = [t for t in times if t > when]
    return min(later) - when if later else float("inf")


# ---------------------------------------------------------------- cohort
def _cohort(failure_free: float, every: float, kills: int) -> Run:
    job = "goodput"
    with LocalRedis(appendonly=False) as server:
        conn = server.client()
        lead = coordinator(
            server.url, job, "--heartbeat-interval", "0.5", "--heartbeat-timeout",
            str(TIMEOUT_S), "--min-workers", "1", "--dataset-size", str(DATASET),
            "--batch-size", str(BATCH), "--global-batch", str(GLOBAL),
        )  # fmt: skip
        procs: list[Proc] = []
        started = 0

        def rank() -> Proc:
            nonlocal started
            started += 1
            log = scratch.log_file(f"cohort-goodput-{started}")
            proc = Proc(
                f"rank{started}",
                [sys.executable, "-m", "bench.goodput", "cohort-rank", "--job", job,
                 "--redis-url", server.url],
                log,
            )  # fmt: skip
            proc.start()
            return proc

        watch = JournalWatch.of(conn, job)
        commits: list[float] = []

        def pull() -> None:
            for fact in watch.pull(block_ms=100):
                if isinstance(fact, StepCommitted):
                    commits.append(fact.at)

        try:
            for _ in range(WORLD):
                procs.append(rank())  # one by one: those started are stopped if one fails
            _until(
                lambda: len(watch.state.ranks) == WORLD and len(commits) >= WARMUP_STEPS,
                180, "cohort: two ranks training", pull,
            )  # fmt: skip
            return _periods(time.time, failure_free, every, kills, commits, pull,
                            lambda i: _replace(procs, i, rank), counted=committed_between,
                            outage=_first_after)  # fmt: skip
        finally:
            stop_all([*procs, lead])


def _replace(procs: list[Proc], i: int, start: Callable[[], Proc]) -> None:
    """SIGKILL one live rank (alternately the older and the newer) and start its
    replacement at once."""
    victim = procs.pop(i % len(procs))
    victim.signal(signal.SIGKILL)
    procs.append(start())


def _periods(
    now: Callable[[], float],
    failure_free: float,
    every: float,
    kills: int,
    times: list[float],
    poll: Callable[[], None],
    kill: Callable[[int], None],
    counted: Callable[[Sequence[float], float, float], int],
    outage: Callable[[Sequence[float], float], float],
    free_after: bool = False,
) -> Run:
    """The failure-free window, then `kills` periods each starting with a kill; `times`
    fills as `poll` runs. `counted(times, start, end)` are the steps that count.
    `free_after`: a second failure-free window after the periods, and the failure-free
    rate the mean of both (a shared machine's drift over the run then weighs on both sides
    of the ratio alike)."""

    def window(length: float, what: str) -> tuple[float, float]:
        start = now()
        _until(lambda: now() >= start + length, length + 5, what, poll)
        return start, now()

    free = [window(failure_free, "the failure-free window's end")]
    t0 = free[0][1]
    killed_at = []
    for i in range(kills):
        killed_at.append(now())
        kill(i)
        end = t0 + (i + 1) * every
        _until(lambda: now() >= end, every + 5, f"period {i + 1}'s end", poll)  # noqa: B023
    t_end = now()
    if free_after:
        free.append(window(failure_free, "the second failure-free window's end"))
    last = free[-1][1] if free_after else t_end
    settle = time.monotonic() + 10  # steps stamped before `last` that are still on their way
    while not (times and times[-1] >= last) and time.monotonic() < settle:
        poll()
    rates = tuple(counted(times, a, b) / (b - a) for a, b in free)
    return Run(
        failure_free=sum(rates) / len(rates),
        counted=counted(times, t0, t_end),
        seconds=t_end - t0,
        outages=[outage(times, at) for at in killed_at],
        free_windows=rates,
    )


# ---------------------------------------------------------------- torchrun
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _points(paths: Sequence[Path]) -> list[tuple[float, int]]:
    """Every worker's (time, step count) lines, in time order."""
    points = []
    for path in paths:
        with contextlib.suppress(OSError):
            for line in path.read_text().splitlines():
                with contextlib.suppress(json.JSONDecodeError, KeyError):
                    entry = json.loads(line)
                    points.append((float(entry["t"]), int(entry["step"])))
    return sorted(points)


def _torchrun(failure_free: float, every: float, kills: int, checkpoint_every: int) -> Run:
    tmp = Path(tempfile.mkdtemp(prefix="cohort-goodput-torchrun-"))
    logs = [tmp / "agent1.jsonl", tmp / "agent2.jsonl"]
    endpoint = f"127.0.0.1:{_free_port()}"
    agents: list[subprocess.Popen[bytes]] = []
    progress = _StepLogs(logs)
    try:
        for i, log in enumerate(logs):
            agents.append(_agent(i, log, tmp, endpoint, checkpoint_every))
        _until(
            lambda: len(progress.points) >= 2 * WARMUP_STEPS,
            180,
            "torchrun: two workers training",
            progress.pull,
        )
        for agent in agents:
            if agent.poll() is not None:
                raise RuntimeError(f"a torchrun agent exited ({agent.returncode}); see {tmp}")
        run = _periods(time.time, failure_free, every, kills, progress.times, progress.pull,
                       lambda _: _kill_worker(agents[1].pid), progress.counted,
                       progress.outage)  # fmt: skip
        return replace(run, failed_starts=_failed_starts(tmp))
    finally:
        # each agent with every worker it started (in a session of its own), SIGKILLed
        end(agents, sig=0)
        discard(tmp)


class _StepLogs:
    """The torchrun workers' step logs, read again at each `pull`: the model's (time, step
    count) points, and their times (the list `_periods` watches, filled in place)."""

    def __init__(self, logs: Sequence[Path]) -> None:
        self.logs = logs
        self.points: list[tuple[float, int]] = []
        self.times: list[float] = []

    def pull(self) -> None:
        self.points[:] = _points(self.logs)
        self.times[:] = [t for t, _ in self.points]
        time.sleep(0.1)  # the workers write files: nothing to block on

    # "steps that count": how far the model's step count moved
    def counted(self, _: Sequence[float], start: float, end: float) -> int:
        return progress_at(self.points, end) - progress_at(self.points, start)

    def outage(self, _: Sequence[float], when: float) -> float:
        """Seconds from `when` to the first step beyond the count at `when`."""
        before = progress_at(self.points, when)
        later = [t for t, step in self.points if t > when and step > before]
        return min(later) - when if later else float("inf")


def _agent(
    i: int, log: Path, tmp: Path, endpoint: str, checkpoint_every: int
) -> subprocess.Popen[bytes]:
    """torchrun agent number `i` + 1 of two, its one worker logging its steps to `log`."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "BENCH_LOG": str(log),
        "BENCH_CHECKPOINT": str(tmp / "checkpoint.pt"),
        "BENCH_CHECKPOINT_EVERY": str(checkpoint_every),
        # torchrun at its best: without this a restarted worker may read the previous
        # attempt's gloo addresses from the agent's store and fail (bench/launched.py)
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "PYTHONPATH": _python_path(),
    }
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
         "--nproc-per-node", "1", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", endpoint, "--rdzv-id", "goodput",
         "--max-restarts", "100", "--monitor-interval", "0.1",
         "-m", "bench.goodput", "torchrun-rank"],
        env=env, stdout=(tmp / f"agent{i + 1}.out").open("wb"),
        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip


def _kill_worker(agent: int) -> None:
    """SIGKILL the agent's worker: the newest pid in its log's process tree."""
    pid = _worker_pid(agent)
    if pid is None:
        return  # between restarts: the period goes on, the kill is skipped
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _failed_starts(folder: Path) -> int:
    """Workers the agents saw fail with an exit code of their own (not our SIGKILL)."""
    codes = []
    for out in folder.glob("agent*.out"):
        codes += re.findall(r"failed \(exitcode: (-?\d+)\)", out.read_text(errors="replace"))
    return sum(1 for code in codes if int(code) != -signal.SIGKILL)


def _python_path() -> str:
    """This checkout first, so that torchrun's `-m bench.goodput` finds it from anywhere."""
    here = str(Path(__file__).resolve().parents[1])
    return os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))


def _worker_pid(agent: int) -> int | None:
    """The agent's training worker: its child process running torchrun-rank."""
    for child in children(agent):
        with contextlib.suppress(OSError):
            if b"torchrun-rank" in Path(f"/proc/{child}/cmdline").read_bytes():
                return child
    return None


# ---------------------------------------------------------------- the section
def measure(
    failure_free: float = 60,
    every: float = 60,
    kills: int = 5,
    checkpoint_every: int = 100,
    runs: int = 1,
) -> Section:
    """`runs` runs of each side, the sides in turns (which goes first alternates), so that
    other load on the machine falls on both; figures are medians, ratios per run."""
    if failure_free <= 0 or every <= 0 or kills < 1 or checkpoint_every < 1 or runs < 1:
        raise ValueError(
            f"--failure-free {failure_free}, --every {every}, --kills {kills}, "
            f"--checkpoint-every {checkpoint_every}, --runs {runs}: each must be positive"
        )
    mine: list[Run] = []
    peer: list[Run] = []
    for run in range(runs):
        sides = [
            lambda: mine.append(_cohort(failure_free, every, kills)),
            lambda: peer.append(_torchrun(failure_free, every, kills, checkpoint_every)),
        ]
        for side in sides if run % 2 == 0 else sides[::-1]:
            side()
    section = Section(
        key="goodput",
        title="Goodput under failures: a worker SIGKILLed every "
        f"{every:g} s and replaced, cohort vs torchrun",
        command=f"python -m bench.goodput --failure-free {failure_free:g} --every {every:g} "
        f"--kills {kills} --checkpoint-every {checkpoint_every} --runs {runs}",
        header=["what", "failure-free steps/s", "steps/s under failures", "goodput",
                "goodput per run", "kill to next step that counts, s (median)", "target", ""],
        raw={"cohort": [_raw(m) for m in mine], "torchrun": [_raw(p) for p in peer]},
    )  # fmt: skip
    section.rows = _rows(mine, peer, checkpoint_every)
    section.notes = _notes(failure_free, every, kills, runs, peer)
    return section


def _rows(mine: list[Run], peer: list[Run], checkpoint_every: int) -> list[list[Any]]:
    """Each side's medians against its target, then their ratios (median of the runs')."""
    ratios = [
        m.goodput / p.goodput if p.goodput > 0 else float("inf")
        for m, p in zip(mine, peer, strict=True)
    ]
    ratio = statistics.median(ratios)
    goodput = statistics.median(m.goodput for m in mine)
    return [
        _row("cohort (ElasticJob, gloo route, survivors go on)", mine,
             f">= {TARGET_GOODPUT}", verdict(goodput, TARGET_GOODPUT)),
        _row(f"torchrun c10d (restart all, checkpoint every {checkpoint_every} steps)", peer,
             "", ""),
        ["cohort / torchrun", _ratio(mine, peer, lambda r: r.failure_free),
         _ratio(mine, peer, lambda r: r.rate), f"{ratio:.2f}",
         ", ".join(f"{r:.2f}" for r in ratios), "", f">= {TARGET_VS_TORCHRUN}x",
         verdict(ratio, TARGET_VS_TORCHRUN)],
    ]  # fmt: skip


def _notes(failure_free: float, every: float, kills: int, runs: int, peer: list[Run]) -> list[str]:
    """How both sides ran and what counts; torchrun workers that failed on their own."""
    notes = [
        f"Both sides: bench.throughput's 1M-parameter MLP, {WORLD} ranks of {BATCH} "
        f"samples per step each ({GLOBAL} per step), plain SGD, one torch thread per rank, "
        "all on this machine (cohort's coordinator and Redis too). A failure-free window "
        f"of {failure_free:g} s gives each side's own failure-free rate; then a rank is "
        f"SIGKILLed at the start of each of {kills} periods of {every:g} s and replaced at "
        "once. Goodput is the steps that count toward the final model per second over the "
        f"periods, over the failure-free rate. {runs} run(s) of each side, in turns; each "
        "figure is the median, each ratio the median of the runs' own.",
        "cohort: the survivor is told by the journal (a worker failed after "
        f"{TIMEOUT_S:g} s of silence) and trains on alone with both micro-batches (a "
        f"constant global batch of {GLOBAL}); the replacement joins the running job and "
        "takes rank 0's weights. Every committed step counts. torchrun: agent 2 replaces "
        "its worker, which restarts every worker of the job (new processes, imports, "
        "rendezvous, process group); they resume from the last checkpoint, so the steps "
        "since it are redone and count once. A kill the side never recovered from within "
        "its run shows as 'never' in the outages (raw).",
    ]
    failed = [p.failed_starts for p in peer]
    if any(failed):
        notes.append(
            f"Restarted torchrun workers that failed on their own, per run: "
            f"{', '.join(map(str, failed))} (gloo could not connect to a peer that was itself "
            "being restarted), each costing another restart of every worker."
        )
    return notes


def _raw(run: Run) -> dict[str, Any]:
    return {**asdict(run), "rate": run.rate, "goodput": run.goodput}


def _ratio(mine: list[Run], peer: list[Run], figure: Callable[[Run], float]) -> str:
    """The median of the runs' ratios; inf for a run whose torchrun figure is not above 0
    (no step counted while its workers restarted: it raised ZeroDivisionError)."""
    ratios = [
        figure(m) / figure(p) if figure(p) > 0 else float("inf")
        for m, p in zip(mine, peer, strict=True)
    ]
    return f"{statistics.median(ratios):.2f}"


def _row(what: str, runs: list[Run], target: str, met: str) -> list[Any]:
    finite = sorted(o for run in runs for o in run.outages if o != float("inf"))
    outage = f"{statistics.median(finite):.1f}" if finite else "never"
    return [what, f"{statistics.median(r.failure_free for r in runs):.1f}",
            f"{statistics.median(r.rate for r in runs):.1f}",
            f"{statistics.median(r.goodput for r in runs):.2f}",
            ", ".join(f"{r.goodput:.2f}" for r in runs), outage, target, met]  # fmt: skip


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "cohort-rank":
        parser = argparse.ArgumentParser(prog="python -m bench.goodput cohort-rank")
        parser.add_argument("--job", help="default $COHORT_JOB (as cohort run sets it)")
        parser.add_argument("--redis-url", help="default $COHORT_REDIS_URL")
        cohort_rank(parser.parse_args(sys.argv[2:]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "torchrun-rank":
        torchrun_rank()
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--failure-free", type=float, default=60)
    parser.add_argument("--every", type=float, default=60)
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()
    try:
        section = measure(
            args.failure_free, args.every, args.kills, args.checkpoint_every, args.runs
        )
    except ValueError as exc:
        parser.error(str(exc))
    print(section.markdown())


if __name__ == "__main__":
    main()
