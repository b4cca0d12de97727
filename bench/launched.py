"""Healing under each side's own launcher: `cohort run -n N` against `torchrun
--nproc-per-node N --standalone`, a rank SIGKILLed at the start of every period.

Both sides train bench.goodput's model and data (the 1M-parameter MLP, 64 samples per rank
per step, plain SGD, one torch thread per rank), started as a user starts them, each by its
own launcher on this machine:

- `cohort run -n N` with no Redis given (a private one), its coordinator (heartbeat every
  0.5 s, a rank failed after 2 s of silence) and N copies of bench.goodput's five-line
  `cohort.torch.ElasticJob` loop on the gloo route, with a constant global batch of 64 N:
  survivors take the lost rank's micro-batches, so every committed step is the same samples
  whatever the world. The launcher replaces the killed rank; the others go on.
- `torchrun --nproc-per-node N --standalone` (one agent, `--max-restarts 100`,
  `--monitor-interval 0.1`) with N DDP workers that save model, optimizer and step every
  `--checkpoint-every` steps and resume from the last save: one agent on one host, as a
  competent user runs it. The agent replaces the killed worker by restarting all of them.
  torchrun runs twice: as shipped, and with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, which
  cures its restart storms (a restarted worker reading the previous attempt's gloo
  addresses from the agent's store, which outlives restarts); the ratio is against the
  better of the two.

The rank killed is the one that has run longest. Measured per kill: seconds from the kill to
training again (the first step completed after it: a committed step for cohort, a step of a
restarted worker for torchrun), the steps redone (cohort: committed steps committed again,
which the journal would show; torchrun: the model's count at the kill minus the checkpoint it
resumed from), and seconds until the model's count passes where it was. Goodput is counted as
bench.goodput counts it.

    python -m bench.launched [--ranks 4] [--failure-free 60] [--every 60] [--kills 5]
                             [--checkpoint-every 100]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.goodput import (
    BATCH,
    DATASET,
    ROUTE_ENV,
    TARGET_GOODPUT,
    TARGET_VS_TORCHRUN,
    TIMEOUT_S,
    WARMUP_STEPS,
    Run,
    _failed_starts,
    _periods,
    _python_path,
    _StepLogs,
    _until,
    committed_between,
    progress_at,
)
from bench.results import Section, verdict
from bench.scratch import discard
from cohort.coordinator.replay import JournalWatch
from cohort.coordinator.state import JobState
from cohort.events.connection import RedisSettings, connect
from cohort.events.models import StepCommitted, WorldChanged
from cohort.processes import children, end

JOB = "launched"


@dataclass
class Healing:
    """One side's run under its launcher: goodput's figures and, per kill, the healing:
    seconds to training again (cohort: the survivors' next committed step) and to a world
    of every rank committing again (`whole_again`; cohort only)."""

    run: Run
    training_again: list[float] = field(default_factory=list)
    redone: list[int] = field(default_factory=list)
    failed_starts: int = 0
    whole_again: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Work:
    """What a side's ranks run: each rank's command (after the Python interpreter), a part
    of it that only rank processes' command lines hold, the job's settings (cohort run's
    flags) and what the environment adds."""

    command: tuple[str, ...]
    marker: str
    job: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()


def goodput_work(ranks: int, route: str = "gloo") -> Work:
    """bench.goodput's ElasticJob loop with a constant global batch, on `route`
    (bench.goodput's ROUTE_ENV: "gloo", or "" through Redis)."""
    return Work(
        ("-m", "bench.goodput", "cohort-rank"),
        "cohort-rank",
        ("--dataset-size", str(DATASET), "--batch-size", str(BATCH),
         "--global-batch", str(BATCH * ranks)),
        ((ROUTE_ENV, route),),
    )  # fmt: skip


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": _python_path()}


def _oldest(parent: int, marker: bytes) -> int | None:
    """The child of `parent` running `marker` that started first (None: none runs now)."""
    found = []
    for child in children(parent):
        with contextlib.suppress(OSError, ValueError, IndexError):
            if marker in Path(f"/proc/{child}/cmdline").read_bytes():
                started = int(Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[19])
                found.append((started, child))
    return min(found)[1] if found else None


def _kill_oldest(parent: int, marker: bytes) -> None:
    pid = _oldest(parent, marker)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _stop(launcher: subprocess.Popen[bytes], tmp: Path | None = None, keep: str = "") -> None:
    """SIGINT, as Ctrl-C; after a minute, SIGKILL to the launcher and all it started. And
    whatever it started that outlived it: torchrun starts each worker in a session of its
    own, which killing the launcher's process group does not reach. Then the run's
    directory `tmp` goes, unless the run is failing (called from a `finally`) or `keep`
    says why it stays."""
    end([launcher], signal.SIGINT, grace=60)
    if tmp is not None:
        discard(tmp, keep)


# ---------------------------------------------------------------- cohort run
LAUNCHED_FLAGS = ("--heartbeat-interval", "0.5", "--heartbeat-timeout", str(TIMEOUT_S))
"""This section's cohort settings: a rank failed after 2 s of silence."""


def _cohort(
    ranks: int,
    failure_free: float,
    every: float,
    kills: int,
    flags: Sequence[str] = LAUNCHED_FLAGS,
    victim: str = "oldest",
    work: Work | None = None,
) -> Healing:
    """`cohort run -n ranks` with `flags` added, its ranks running `work` (default:
    bench.goodput's loop on the gloo route); `victim`: "oldest", the rank process that has
    run longest, or "rank", the process of the world's rank 0 (with spares the oldest
    process may be a spare, which holds no rank)."""
    work = work or goodput_work(ranks)
    tmp = Path(tempfile.mkdtemp(prefix="cohort-launched-"))
    launcher = _cohort_run(ranks, flags, work, tmp)
    unhealed = ""
    try:
        run_json = tmp / "run" / "run.json"
        _until(run_json.exists, 60, "cohort run: its run.json", lambda: time.sleep(0.1))
        url = json.loads(run_json.read_text())["redis_url"]
        watch = JournalWatch.of(connect(RedisSettings.resolve(url)), JOB)
        commits: list[tuple[float, int, int]] = []
        times: list[float] = []
        sizes: dict[int, int] = {}  # world version -> its ranks

        def pull() -> None:
            for fact in watch.pull(block_ms=100):
                if isinstance(fact, WorldChanged):
                    sizes[fact.version] = len(fact.ranks)
                elif isinstance(fact, StepCommitted):
                    commits.append((fact.at, fact.step, fact.world))
                    times.append(fact.at)

        _until(
            lambda: len(watch.state.ranks) == ranks and len(times) >= WARMUP_STEPS,
            240, f"cohort run: {ranks} ranks training", pull,
        )  # fmt: skip
        killed: list[float] = []

        def kill(_: int) -> None:
            killed.append(time.time())
            if victim == "oldest":
                _kill_oldest(launcher.pid, work.marker.encode())
            else:
                _kill_rank(watch.state)

        run = _periods(time.time, failure_free, every, kills, times, pull, kill,
                       committed_between, lambda _, at: _healed(commits, at),
                       free_after=True)  # fmt: skip
        healing = _healing(run, killed, commits, [(at, step, w) for at, step, w in commits
                                                  if sizes.get(w) == ranks])  # fmt: skip
        if float("inf") in healing.whole_again:
            unhealed = f"cohort run {' '.join(flags)}: a kill never healed"
        return healing
    finally:
        _stop(launcher, tmp, unhealed)


def _healing(
    run: Run,
    killed: Sequence[float],
    commits: Sequence[tuple[float, int, int]],
    whole: Sequence[tuple[float, int, int]],
) -> Healing:
    """Per kill, from the steps committed (`whole`: those of a world of every rank)."""
    return Healing(
        run,
        training_again=[_healed(commits, at) for at in killed],
        redone=[_recommitted(commits, at) for at in killed],
        whole_again=[_healed(whole, at, commits) for at in killed],
    )


def _cohort_run(ranks: int, flags: Sequence[str], work: Work, tmp: Path) -> subprocess.Popen[bytes]:
    """`cohort run -n ranks *flags` of `work`, its run directory and output under `tmp`."""
    return subprocess.Popen(
        [sys.executable, "-m", "cohort", "run", "-n", str(ranks), "--job", JOB,
         "--run-dir", str(tmp / "run"), *flags, "--min-workers", "1", *work.job,
         "--max-restarts", "100", "--", sys.executable, *work.command],
        env={**_env(), **dict(work.env)}, stdout=(tmp / "launcher.out").open("wb"),
        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip


def _kill_rank(state: JobState) -> None:
    """SIGKILL the process of the world's first rank: a rank, never a spare."""
    member = state.members.get(state.ranks[0]) if state.ranks else None
    if member is not None and member.pid:
        with contextlib.suppress(ProcessLookupError):
            os.kill(member.pid, signal.SIGKILL)


def _healed(
    commits: Sequence[tuple[float, int, int]],
    when: float,
    all_commits: Sequence[tuple[float, int, int]] | None = None,
) -> float:
    """Seconds from `when` to the first of `commits` by a later world than the one training
    at `when` (read from `all_commits`, default `commits`): a step of the old world still
    in flight at the kill is not healing."""
    world = max((w for at, _, w in (all_commits or commits) if at <= when), default=-1)
    later = [at for at, _, w in commits if at > when and w > world]
    return min(later) - when if later else float("inf")


def _recommitted(commits: Sequence[tuple[float, int, int]], when: float) -> int:
    """Steps committed after `when` that had been committed before it: a rewind's redone
    steps (0 unless the job lost its weights)."""
    before = {step for at, step, _ in commits if at <= when}
    return sum(1 for at, step, _ in commits if at > when and step in before)


# ---------------------------------------------------------------- torchrun --standalone
TORCHRUN_WORK = Work(("-m", "bench.goodput", "torchrun-rank"), "torchrun-rank")
"""bench.goodput's DDP worker, resuming from its checkpoint file."""


def _torchrun(
    ranks: int,
    failure_free: float,
    every: float,
    kills: int,
    every_ckpt: int,
    shared: bool,
    work: Work = TORCHRUN_WORK,
) -> Healing:
    """`shared`: torchrun's default, the workers' process group on the agent's rendezvous
    store; else TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, a store of rank 0's per restart.
    `work`: what each worker runs (it logs each step to $BENCH_LOG, checkpoints at
    $BENCH_CHECKPOINT every $BENCH_CHECKPOINT_EVERY steps and resumes from there)."""
    tmp = Path(tempfile.mkdtemp(prefix="cohort-launched-torchrun-"))
    log = tmp / "steps.jsonl"
    env = {
        **_env(),
        **dict(work.env),
        "BENCH_LOG": str(log),
        "BENCH_CHECKPOINT": str(tmp / "checkpoint.pt"),
        "BENCH_CHECKPOINT_EVERY": str(every_ckpt),
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0" if shared else "1",
    }
    agent = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         "--nproc-per-node", str(ranks), "--max-restarts", "100", "--monitor-interval", "0.1",
         *work.command],
        env=env, stdout=(tmp / "agent.out").open("wb"), stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    progress = _StepLogs([log])
    try:
        _until(lambda: len(progress.points) >= ranks * WARMUP_STEPS, 240,
               f"torchrun: {ranks} workers training", progress.pull)  # fmt: skip
        killed: list[float] = []

        def kill(_: int) -> None:
            killed.append(time.time())
            _kill_oldest(agent.pid, work.marker.encode())

        run = _periods(time.time, failure_free, every, kills, progress.times, progress.pull,
                       kill, progress.counted,
                       lambda _, at: _regained(_entries(log), at), free_after=True)  # fmt: skip
        entries = _entries(log)
        return Healing(
            run,
            training_again=[_restarted_step_after(entries, at) for at in killed],
            redone=[_redone(entries, at) for at in killed],
            failed_starts=_failed_starts(tmp),
        )
    finally:
        _stop(agent, tmp)


def _entries(log: Path) -> list[tuple[float, int, int]]:
    """(time, step count, pid) of every step the workers logged, in time order."""
    found = []
    with contextlib.suppress(OSError):
        for line in log.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError, KeyError):
                entry = json.loads(line)
                found.append((float(entry["t"]), int(entry["step"]), int(entry["pid"])))
    return sorted(found)


def _restarted_step_after(entries: Sequence[tuple[float, int, int]], when: float) -> float:
    """Seconds from `when` to the first step of a worker started after it."""
    before = {pid for at, _, pid in entries if at <= when}
    later = [at for at, _, pid in entries if at > when and pid not in before]
    return min(later) - when if later else float("inf")


def _regained(entries: Sequence[tuple[float, int, int]], when: float) -> float:
    """Seconds from `when` to the first step of a worker started after it that takes the
    model's count beyond the count at `when`."""
    at_kill = progress_at([(at, step) for at, step, _ in entries], when)
    before = {pid for at, _, pid in entries if at <= when}
    later = [at for at, step, pid in entries if at > when and pid not in before and step > at_kill]
    return min(later) - when if later else float("inf")


def _redone(entries: Sequence[tuple[float, int, int]], when: float) -> int:
    """The model's count at `when` minus the checkpoint the restarted workers resumed from."""
    at_kill = progress_at([(at, step) for at, step, _ in entries], when)
    before = {pid for at, _, pid in entries if at <= when}
    first = [step for at, step, pid in entries if at > when and pid not in before]
    return max(0, at_kill - (first[0] - 1)) if first else 0


# ---------------------------------------------------------------- the section
def measure(
    ranks: int = 4,
    failure_free: float = 60,
    every: float = 60,
    kills: int = 5,
    checkpoint_every: int = 100,
) -> Section:
    """cohort, then torchrun as shipped, then torchrun with its restart fix; back to back."""
    if ranks < 2 or failure_free <= 0 or every <= 0 or kills < 1 or checkpoint_every < 1:
        raise ValueError(
            f"--ranks {ranks} (2 or more), --failure-free {failure_free}, --every {every}, "
            f"--kills {kills}, --checkpoint-every {checkpoint_every}: each must be positive"
        )
    mine = _cohort(ranks, failure_free, every, kills)
    shipped = _torchrun(ranks, failure_free, every, kills, checkpoint_every, shared=True)
    best = _torchrun(ranks, failure_free, every, kills, checkpoint_every, shared=False)
    section = Section(
        key="launched",
        title=f"Healing under each side's launcher: cohort run -n {ranks} vs torchrun "
        f"--nproc-per-node {ranks} --standalone, a rank SIGKILLed every {every:g} s",
        command=f"python -m bench.launched --ranks {ranks} --failure-free {failure_free:g} "
        f"--every {every:g} --kills {kills} --checkpoint-every {checkpoint_every}",
        header=["launcher", "failure-free steps/s (before / after)", "steps/s under failures",
                "goodput",
                "kill to training again, s (median)", "steps redone per kill (median)",
                "kill to progress regained, s (median)", "workers failing on their own",
                "target", ""],
        raw={"cohort": _raw(mine), "torchrun": _raw(shipped),
             "torchrun_unshared_store": _raw(best)},
    )  # fmt: skip
    section.rows = _rows(mine, shipped, best, checkpoint_every)
    section.notes = _notes(ranks, failure_free, every, kills, mine, shipped, best)
    return section


def _median(values: Sequence[float]) -> str:
    finite = [v for v in values if v != float("inf")]
    return f"{statistics.median(finite):.1f}" if finite else "never"


def _row(what: str, side: Healing, target: str = "", met: str = "") -> list[str]:
    free = " / ".join(f"{rate:.1f}" for rate in side.run.free_windows)
    return [what, free, f"{side.run.rate:.1f}",
            f"{side.run.goodput:.2f}", _median(side.training_again),
            f"{statistics.median(side.redone):.0f}" if side.redone else "-",
            _median(side.run.outages), str(side.failed_starts), target, met]  # fmt: skip


def _rows(mine: Healing, shipped: Healing, best: Healing, every_ckpt: int) -> list[list[Any]]:
    """The ratio is against the better torchrun: the peer at its best."""
    again = [t for t in mine.training_again if t != float("inf")]
    heal_target = TIMEOUT_S + 1.0
    heal_met = bool(again) and max(again) <= heal_target
    peer = max(shipped.run.goodput, best.run.goodput)
    ratio = mine.run.goodput / peer if peer > 0 else float("inf")
    met = verdict(mine.run.goodput, TARGET_GOODPUT) == "met" and heal_met
    return [
        _row("cohort run (only the killed rank restarts)", mine,
             f"goodput >= {TARGET_GOODPUT}; training again <= {heal_target:g} s",
             "met" if met else "**missed**"),
        _row(f"torchrun --standalone as shipped (restart all, checkpoint every {every_ckpt})",
             shipped),
        _row("torchrun --standalone, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (same)", best),
        ["cohort / the better torchrun", "", "", f"{ratio:.2f}", "", "", "", "",
         f">= {TARGET_VS_TORCHRUN}x", verdict(ratio, TARGET_VS_TORCHRUN)],
    ]  # fmt: skip


def _per_kill(side: Healing) -> str:
    return ", ".join(
        f"{t:.1f} s/{r}" for t, r in zip(side.training_again, side.redone, strict=False)
    )


def _notes(
    ranks: int,
    failure_free: float,
    every: float,
    kills: int,
    mine: Healing,
    shipped: Healing,
    best: Healing,
) -> list[str]:
    return [
        f"Each side: bench.goodput's 1M-parameter MLP, {ranks} ranks of {BATCH} samples each "
        f"per step, plain SGD, one torch thread per rank, started by its own launcher on this "
        f"machine (cohort's coordinator and private Redis too). The rank that has run longest "
        f"is SIGKILLed at the start of each of {kills} periods of {every:g} s; goodput is the "
        f"rate over the periods against the side's own failure-free rate, the mean of "
        f"{failure_free:g} s without failures before the periods and {failure_free:g} s "
        f"after: a shared machine's rate drifts over minutes, failures or not, and a window "
        f"before alone would charge the drift to the failures. cohort's heartbeat timeout is "
        f"{TIMEOUT_S:g} s.",
        "Per kill, seconds to training again / steps redone: cohort "
        f"{_per_kill(mine)} (training again = the next committed step; redone = committed "
        f"steps committed again); torchrun as shipped {_per_kill(shipped)}; torchrun with "
        f"the fix {_per_kill(best)} (training again = the first step of a restarted worker; "
        "redone = the model's count at the kill minus the checkpoint it resumed from).",
        "torchrun's restart storms: since torch 2.5 (pytorch/pytorch#128096) the workers' "
        "default process group lives on the agent's rendezvous TCPStore, which outlives "
        "restarts, under keys that do not name the restart. A restarted worker can read "
        "the previous attempt's gloo address of a peer, connect to a dead port ('Connection "
        "refused' in connectFullMesh), fail, and make the agent restart every worker again "
        "(pytorch/pytorch#135712). TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, the documented "
        "workaround, gives each attempt a fresh store on rank 0; the ratio is against the "
        "better of the two torchrun rows.",
    ]


def _raw(side: Healing) -> dict[str, Any]:
    run = side.run
    return {
        "failure_free": run.failure_free, "free_windows": list(run.free_windows),
        "counted": run.counted, "seconds": run.seconds,
        "rate": run.rate, "goodput": run.goodput, "outages": run.outages,
        "training_again": side.training_again, "redone": side.redone,
        "failed_starts": side.failed_starts, "whole_again": side.whole_again,
    }  # fmt: skip


def period_arguments(parser: argparse.ArgumentParser, kills: int = 5, ranks: bool = True) -> None:
    """The flags of a run that kills a rank each period (this one's, bench.healing's and
    bench.sharded's, which has no --ranks: its world is HSDP 2 x 2)."""
    if ranks:
        parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--failure-free", type=float, default=60)
    parser.add_argument("--every", type=float, default=60)
    parser.add_argument("--kills", type=int, default=kills)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    period_arguments(parser)
    parser.add_argument("--checkpoint-every", type=int, default=100)
    args = parser.parse_args()
    try:
        section = measure(
            args.ranks, args.failure_free, args.every, args.kills, args.checkpoint_every
        )
    except ValueError as exc:
        parser.error(str(exc))
    print(section.markdown())


if __name__ == "__main__":
    main()
