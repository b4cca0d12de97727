"""TorchFT beside cohort, measured in the same runs: healing, throughput and what each survives.

TorchFT (meta-pytorch/torchft) heals per step: a Rust lighthouse forms a quorum of replica
groups each step, the groups allreduce through a fault-tolerant process group, and a group
that restarts fetches the weights from a live peer. Each TorchFT side here runs one process
per replica group (bench/torchft_trainer.py: bench.goodput's 1M-parameter MLP and data, 64
samples per group per step, plain SGD, gloo), its lighthouse started by the bench at its
defaults (heartbeat timeout 5 s) or at a 1 s heartbeat, each group restarted at once by a
loop when it dies, as a user's supervisor would (bench/torchft_run.py). cohort's sides are
`cohort run -n N` on the gloo route as bench.healing runs them (bench.goodput's five-line
ElasticJob loop, a constant global batch).

- healing: a group (a rank) SIGKILLed at the start of each period; seconds to the survivors'
  next committed step, to the lost place committing again, the steps and samples lost or
  trained twice, goodput against the side's own failure-free rate.
- throughput: failure-free samples/s of TorchFT's groups, plain DDP over gloo and
  ElasticJob's gloo route, the same model and steps, in rounds that rotate their order.
- survives: a peer SIGSTOPped, a peer leaving cleanly (SIGTERM), the coordinator (cohort's
  leader, TorchFT's lighthouse) SIGKILLed and started again: seconds to training again and
  what was lost, each side in a fresh run.

    python -m bench.torchft_peer healing [--ranks 2] [--failure-free 60] [--every 60] [--kills 10]
    python -m bench.torchft_peer throughput [--ranks 2] [--steps 200] [--runs 3]
    python -m bench.torchft_peer survives [--ranks 2] [--hold 90] [--down 15] [--cases ...]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench import throughput
from bench.goodput import BATCH, DATASET, WARMUP_STEPS, Run, _periods, _until
from bench.launched import _env, _healed, _recommitted, _stop
from bench.results import Section
from bench.scratch import discard
from bench.torchft_run import (
    Fault,
    TorchFT,
    fault,
    lighthouse_command,
    median,
    place_again,
    raw,
    step_at,
)
from cohort.coordinator.replay import JournalWatch
from cohort.events.connection import RedisSettings, connect
from cohort.events.models import StepCommitted
from cohort.processes import children, end

JOB = "torchft-peer"
VICTIM = 0
"""The group TorchFT loses (cohort loses the world's rank 0)."""


def versions() -> str:
    """torch's and torchft's versions, for the notes."""
    found = []
    for name in ("torch", "torchft"):
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} not installed")
    return ", ".join(found)


# ---------------------------------------------------------------- cohort run, watched
@dataclass
class Cohort:
    """`cohort run -n ranks` with `flags`, its journal followed: every commit with the
    world's number and size."""

    ranks: int
    flags: tuple[str, ...] = ()
    tmp: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="cohort-tftpeer-")))
    launcher: subprocess.Popen[bytes] | None = None
    watch: JournalWatch | None = None
    commits: list[tuple[float, int, int, int]] = field(default_factory=list)
    """(time, step, world number, ranks in it) of each StepCommitted."""
    times: list[float] = field(default_factory=list)
    killed: list[float] = field(default_factory=list)

    def start(self) -> Cohort:
        self.launcher = subprocess.Popen(
            [sys.executable, "-m", "cohort", "run", "-n", str(self.ranks), "--job", JOB,
             "--run-dir", str(self.tmp / "run"), *self.flags, "--min-workers", "1",
             "--dataset-size", str(DATASET), "--batch-size", str(BATCH),
             "--global-batch", str(BATCH * self.ranks), "--max-restarts", "100",
             "--", sys.executable, "-m", "bench.goodput", "cohort-rank"],
            env=_env(), stdout=(self.tmp / "launcher.out").open("wb"),
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        run_json = self.tmp / "run" / "run.json"
        _until(run_json.exists, 60, "cohort run: its run.json", lambda: time.sleep(0.1))
        url = json.loads(run_json.read_text())["redis_url"]
        self.watch = JournalWatch.of(connect(RedisSettings.resolve(url)), JOB)
        _until(self._training, 240, f"cohort run: {self.ranks} ranks training", self.poll)
        return self

    def _training(self) -> bool:
        """WARMUP_STEPS committed by a world of every rank (a fault sent earlier may find a
        newcomer still taking the weights)."""
        full = [c for c in self.commits if c[3] == self.ranks]
        return len(full) >= WARMUP_STEPS

    def _ranks(self) -> int:
        assert self.watch is not None
        return len(self.watch.state.ranks)

    def poll(self) -> None:
        assert self.watch is not None
        for fact in self.watch.pull(block_ms=100):
            if isinstance(fact, StepCommitted):
                self.commits.append((fact.at, fact.step, fact.world, self._ranks()))
                self.times.append(fact.at)

    def rank_pid(self) -> int | None:
        """The process of the world's first rank (never a spare)."""
        assert self.watch is not None
        state = self.watch.state
        member = state.members.get(state.ranks[0]) if state.ranks else None
        return member.pid if member is not None and member.pid else None

    def coordinator_pid(self) -> int | None:
        assert self.launcher is not None
        for child in children(self.launcher.pid):
            with contextlib.suppress(OSError):
                if b"coordinator" in Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0"):
                    return child
        return None

    def signal_rank(self, sig: int) -> int | None:
        pid = self.rank_pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        return pid

    def wait(self, seconds: float) -> None:
        end_at = time.monotonic() + seconds
        _until(lambda: time.monotonic() >= end_at, seconds + 5, "the wait's end", self.poll)

    def close(self) -> None:
        if self.launcher is not None:
            _stop(self.launcher)
        discard(self.tmp)

    def counted(self, times: Sequence[float], start: float, end_at: float) -> int:
        """Rank-steps committed in [start, end_at): a constant global batch, every step all
        of the ranks' samples."""
        return self.ranks * sum(1 for at in times if start <= at < end_at)

    def outage(self, _: Sequence[float], when: float) -> float:
        return self.healed(when)

    def healed(self, when: float) -> float:
        return _healed([(at, step, world) for at, step, world, _ in self.commits], when)

    def place(self, when: float) -> float:
        """Seconds from `when` to the first step committed by a later world of every rank."""
        world = max((w for at, _, w, _ in self.commits if at <= when), default=-1)
        later = [at for at, _, w, n in self.commits if at > when and w > world and n == self.ranks]
        return min(later) - when if later else float("inf")

    def fault(self, when: float, died: int) -> Fault:
        """The kill at `when`, of which `died` survivors ended before the next one."""
        redone = _recommitted([(at, step, world) for at, step, world, _ in self.commits], when)
        return Fault(
            survivors=self.healed(when),
            place=self.place(when),
            discarded=0,
            redone=redone,
            skipped=0,  # a constant global batch: the survivors take the lost micro-batches
            doubled=redone * self.ranks * BATCH,
            survivors_died=died,
        )

    def survivor_pids(self, victim: int | None) -> list[int]:
        assert self.watch is not None
        state = self.watch.state
        pids = [state.members[r].pid for r in state.ranks if r in state.members]
        return [pid for pid in pids if pid and pid != victim]


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return not stat.rsplit(b")", 1)[1].split()[0].startswith((b"Z", b"X"))


# ---------------------------------------------------------------- healing
@dataclass(frozen=True)
class Side:
    name: str
    start: Callable[[], Cohort | TorchFT]


@dataclass
class Healed:
    run: Run
    """Counted in rank-steps (group-steps): a step of N ranks counts N."""
    faults: list[Fault]
    ranks: int
    restarts: int = 0


def cohort_sides(ranks: int) -> dict[str, Side]:
    return {
        "cohort-spare": Side("cohort run --spares 1 (defaults: a warm spare)",
                             lambda: Cohort(ranks, ("--spares", "1")).start()),
        "cohort": Side("cohort run (defaults, no spare)", lambda: Cohort(ranks).start()),
    }  # fmt: skip


def torchft_sides(ranks: int) -> dict[str, Side]:
    return {
        "torchft": Side("TorchFT, lighthouse defaults (heartbeat 5 s), DDP with the hook fix",
                        lambda: TorchFT(ranks).start()),
        "torchft-1s": Side("TorchFT, lighthouse --heartbeat_timeout_ms 1000, DDP with the hook "
                           "fix", lambda: TorchFT(ranks, heartbeat_ms=1000).start()),
        "torchft-stock": Side("TorchFT, lighthouse defaults, torchft.ddp as shipped (0.2.0)",
                              lambda: TorchFT(ranks, ddp="stock").start()),
    }  # fmt: skip


def heal(side: Side, failure_free: float, every: float, kills: int) -> Healed:
    """A kill at the start of each period: cohort's world's rank 0, TorchFT's group 0."""
    run = side.start()
    try:
        killed = run.killed
        survivors: list[list[int]] = []
        died: list[int] = []  # cohort: per kill, its survivors ended by the next kill or the end

        def kill(_: int) -> None:
            if isinstance(run, Cohort):
                if survivors:
                    died.append(sum(1 for pid in survivors[-1] if not _alive(pid)))
                killed.append(time.time())
                survivors.append(run.survivor_pids(run.signal_rank(signal.SIGKILL)))
            else:
                killed.append(time.time())
                run.signal(VICTIM, signal.SIGKILL)

        result = _periods(time.time, failure_free, every, kills, run.times, run.poll, kill,
                          run.counted, run.outage, free_after=True)  # fmt: skip
        if killed:
            _await_place(run, killed[-1])
        ends = [*killed[1:], float("inf")]
        if isinstance(run, Cohort):
            died.append(sum(1 for pid in survivors[-1] if not _alive(pid)))
            faults = [run.fault(at, lost) for at, lost in zip(killed, died, strict=True)]
            return Healed(result, faults, run.ranks)
        faults = [
            fault(run.lines, at, VICTIM, until) for at, until in zip(killed, ends, strict=True)
        ]
        return Healed(result, faults, run.groups, run.restarts)
    finally:
        run.close()


PLACE_WAIT = 60.0
"""Seconds the last kill's lost place is waited for after the periods end."""


def _await_place(run: Cohort | TorchFT, killed: float) -> None:
    """Polls until the place lost at `killed` commits again, or PLACE_WAIT passes: a place
    that heals after the last period (a group restarting on a loaded machine imports torch
    for seconds) is then measured, not cut off. A place that never heals stays `inf`."""

    def lost() -> bool:
        if isinstance(run, Cohort):
            return run.place(killed) == float("inf")
        return place_again(run.lines, killed, VICTIM) == float("inf")

    deadline = time.monotonic() + PLACE_WAIT
    while lost() and time.monotonic() < deadline:
        run.poll()


HEALING_HEADER = [
    "side", "kill to survivors' next committed step, s (median)",
    "kill to the lost place committing again, s (median)", "each kill, s (survivors / place)",
    "steps discarded by survivors / committed steps redone (per kill)",
    "samples skipped / trained twice (per kill)", "kills that took a survivor down", "goodput",
    "failure-free steps/s (before / after)", "x cohort run with a spare",
]  # fmt: skip


def measure_healing(
    ranks: int = 2, failure_free: float = 60, every: float = 60, kills: int = 10,
    sides: Sequence[str] = (),
) -> Section:  # fmt: skip
    """Every side in turn, cohort's first; `sides`: a subset of them by key."""
    every_side = {**cohort_sides(ranks), **torchft_sides(ranks)}
    unknown = [side for side in sides if side not in every_side]
    if ranks < 2 or failure_free <= 0 or every <= 0 or kills < 1 or unknown:
        raise ValueError(
            f"--ranks {ranks} (2 or more), --failure-free {failure_free}, --every {every}, "
            f"--kills {kills}: each must be positive; --sides {','.join(sides)}: of "
            f"{','.join(every_side)}"
        )
    lighthouse_command()  # torchft installed, or say how before anything runs
    chosen = list(sides) or list(every_side)
    healed = {key: heal(every_side[key], failure_free, every, kills) for key in chosen}
    section = Section(
        key="torchft-healing",
        title=f"TorchFT beside cohort, healing: a rank (a replica group) SIGKILLed every "
        f"{every:g} s, {ranks} of them, cohort run vs TorchFT",
        command=f"python -m bench.torchft_peer healing --ranks {ranks} --failure-free "
        f"{failure_free:g} --every {every:g} --kills {kills}"
        + (f" --sides {','.join(chosen)}" if sides else ""),
        header=HEALING_HEADER,
        raw={key: {"run": vars(h.run) | {"goodput": h.run.goodput}, "faults": raw(h.faults),
                   "restarts": h.restarts} for key, h in healed.items()},
    )  # fmt: skip
    best = healed.get("cohort-spare") or healed.get("cohort")
    base = statistics.median(_finite([f.survivors for f in best.faults])) if best else 0.0
    section.rows = [_healing_row(every_side[key].name, h, base) for key, h in healed.items()]
    peer = healed.get("torchft")
    if best is not None and peer is not None:
        section.rows.append(_ratio_row(best, peer))
    section.notes = _healing_notes(ranks, failure_free, every, kills, healed)
    return section


def _finite(values: Sequence[float]) -> list[float]:
    return [v for v in values if v != float("inf")] or [float("inf")]


def _healing_row(name: str, healed: Healed, base: float) -> list[str]:
    faults = healed.faults
    heal_s = statistics.median(_finite([f.survivors for f in faults]))
    ratio = f"{heal_s / base:.1f}" if base not in (0.0, float("inf")) else "-"
    if heal_s == float("inf"):
        ratio = "never"
    each = ", ".join(f"{_s(f.survivors)} / {_s(f.place)}" for f in faults)
    free = " / ".join(f"{rate / healed.ranks:.1f}" for rate in healed.run.free_windows)
    died = sum(1 for f in faults if f.survivors_died)
    return [
        name, median([f.survivors for f in faults]), median([f.place for f in faults]), each,
        f"{statistics.median(f.discarded for f in faults):g} / "
        f"{statistics.median(f.redone for f in faults):g}",
        f"{statistics.median(f.skipped for f in faults):g} / "
        f"{statistics.median(f.doubled for f in faults):g}",
        f"{died} of {len(faults)}", f"{healed.run.goodput:.2f}", free, ratio,
    ]  # fmt: skip


RATIO_ROW = "cohort / TorchFT (lighthouse defaults, the hook fix)"


def _ratio_row(mine: Healed, peer: Healed) -> list[str]:
    """cohort's healing and goodput over TorchFT's, in the same run (seconds: lower is
    better, so TorchFT's over cohort's is the column beside)."""
    heal = statistics.median(_finite([f.survivors for f in mine.faults]))
    theirs = statistics.median(_finite([f.survivors for f in peer.faults]))
    goodput = mine.run.goodput / peer.run.goodput if peer.run.goodput > 0 else float("inf")
    cells = [""] * len(HEALING_HEADER)
    cells[0] = RATIO_ROW
    cells[1] = f"{heal / theirs:.2f}" if theirs not in (0.0, float("inf")) else "-"
    cells[HEALING_HEADER.index("goodput")] = f"{goodput:.2f}"
    return cells


def _s(value: float) -> str:
    return "never" if value == float("inf") else f"{value:.2f}"


def committed_note(counted: Mapping[str, float], seconds: float) -> str:
    """The work each side committed over the periods, in rank-steps (goodput divides it by
    the side's own failure-free rate, which differs between the sides: TorchFT's steps
    cost more, and a side whose failure-free windows ran slower looks better)."""
    said = ", ".join(f"{key} {value:,.0f}" for key, value in counted.items())
    return (
        f"Work committed over the {seconds:g} s of kills, in rank-steps (each TorchFT step "
        f"weighed by its groups' share): {said}. Goodput divides this by the side's own "
        "failure-free rate; TorchFT's steps cost more than cohort's (its quorum and "
        "should_commit each step: the throughput section), so a lower rate of its own lifts "
        "its goodput. Where cohort's goodput falls short of 1 by more than its outages "
        "(tenths of a second a kill) account for, its step rate through the periods was "
        "lower: most likely the killed rank's replacement starting on the same two cores as "
        "the training (a fresh Python, torch imported, the model built: a few CPU-seconds "
        "a kill; not measured apart). TorchFT restarts its group likewise, and its survivor "
        "trains alone meanwhile, skipping the lost group's samples."
    )


def _healing_notes(
    ranks: int, failure_free: float, every: float, kills: int, healed: dict[str, Healed]
) -> list[str]:
    notes = [
        f"Every side trains bench.goodput's 1M-parameter MLP with {ranks} ranks (cohort) or "
        f"{ranks} replica groups of one process (TorchFT), {BATCH} samples each per step, "
        f"plain SGD, gloo, one torch thread per process, on this machine; {versions()}. A "
        f"failure-free window of {failure_free:g} s before the kills and one after give the "
        f"side's own failure-free rate; then cohort's world's rank 0 (TorchFT's group 0) is "
        f"SIGKILLed at the start of each of {kills} periods of {every:g} s. Goodput counts "
        "committed steps, each TorchFT step weighed by the share of the groups that took "
        "part (a step without a group trains fewer samples); over the periods, steps the "
        "model had taken before (every group restarted from nothing) do not count again.",
        "TorchFT's groups are restarted at once by a loop when they die (not when they "
        "leave); the restarted group joins the next quorum and fetches the weights from a "
        "live peer over HTTP. Its data follows the step (group g takes the shard "
        "step * groups + g), so a step committed without a group skips that group's "
        f"samples for good ({BATCH} per missing group), as torchft's own DistributedSampler "
        "does (lossy by design); cohort keeps a constant global batch, the survivors take "
        "the lost rank's micro-batches, so it skips none. 'Steps discarded' are a survivor's "
        "steps that did not commit (the step in flight at the kill, and any after it that "
        "failed); cohort's in-flight step is redone by the new world likewise (its journal "
        "does not record it).",
    ]
    notes.append(committed_note({key: h.run.counted for key, h in healed.items()}, every * kills))
    stock = healed.get("torchft-stock")
    if stock is not None:
        died = sum(1 for f in stock.faults if f.survivors_died)
        notes.append(
            f"torchft 0.2.0's own DistributedDataParallel took a survivor down in {died} of "
            f"{len(stock.faults)} kills here ({stock.restarts} group restarts in all, against "
            f"{len(stock.faults)} kills): its comm hook returns `work.get_future()._fut`, "
            "which is None when a kill fails the bucket's allreduce (AssertionError, the "
            "one seen here: this model's gradients fit one bucket) and missing on the no-op "
            "work the manager returns for the buckets after a failed one (AttributeError, "
            "on models of more buckets), and the exception ends the process. Where every "
            "group dies, "
            "the restarted ones start from step 0: the run is lost. The rows 'with the hook "
            "fix' run bench.torchft_trainer's smallest fix: the same class whose hook "
            "returns a completed future holding the bucket when that future is missing; the "
            "manager has recorded the error, so the step is discarded, not applied."
        )
    return notes


# ---------------------------------------------------------------- throughput
def torchft_throughput(groups: int, steps: int) -> throughput.Run:
    """`groups` groups training `steps` committed steps; samples/s over the timed ones (the
    lighthouse waits for every group before the first quorum)."""
    tmp = Path(tempfile.mkdtemp(prefix="cohort-torchft-tp-"))
    run = TorchFT(groups, ddp="stock", tmp=tmp)
    lighthouse = subprocess.Popen(
        [lighthouse_command(), "--min_replicas", str(groups), "--bind", f"[::]:{run.port}"],
        stdout=(tmp / "lighthouse.log").open("wb"), stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, start_new_session=True, env=_env(),
    )  # fmt: skip
    procs: list[subprocess.Popen[str]] = []
    try:
        for group in range(groups):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "bench.torchft_trainer", "--group", str(group),
                 "--groups", str(groups), "--lighthouse", run.url,
                 "--log", str(tmp / f"group{group}.jsonl"), "--ddp", "stock",
                 "--steps", str(steps)],
                stdout=subprocess.PIPE, stderr=(tmp / f"group{group}.log").open("wb"),
                text=True, env=_env(), start_new_session=True,
            ))  # fmt: skip
        spans = []
        for group, proc in enumerate(procs):
            out, _ = proc.communicate(timeout=600)
            lines = [line for line in out.splitlines() if line.startswith("{")]
            if proc.returncode != 0 or not lines:
                raise RuntimeError(f"TorchFT group {group} failed ({proc.returncode}); see {tmp}")
            spans.append(json.loads(lines[-1]))
    finally:
        end([*procs, lighthouse], sig=0)
        discard(tmp)
    timed = min(span["steps"] for span in spans)
    return throughput.Run(timed * groups * BATCH / max(s["seconds"] for s in spans), 0.0, 0.0)


ROUTES = ("ddp", "gloo", "torchft")
ROUTE_NAMES = {
    "ddp": "plain DDP over gloo (torch.distributed, no fault tolerance)",
    "gloo": "cohort ElasticJob, gloo route",
    "torchft": "TorchFT (Manager, its ProcessGroupGloo, torchft.ddp)",
}


def measure_throughput(ranks: int = 2, steps: int = 200, runs: int = 3) -> Section:
    """`runs` rounds of plain DDP, ElasticJob's gloo route and TorchFT, the order rotating."""
    if ranks < 2 or steps <= throughput.MODELS["1m"].warmup or runs < 1:
        raise ValueError(
            f"--ranks {ranks} (2 or more), --steps {steps} (more than "
            f"{throughput.MODELS['1m'].warmup}), --runs {runs} (1 or more)"
        )
    lighthouse_command()
    rounds: list[dict[str, float]] = []
    for i in range(runs):
        turn = ROUTES[i % len(ROUTES) :] + ROUTES[: i % len(ROUTES)]
        found = {}
        for route in turn:
            if route == "torchft":
                found[route] = torchft_throughput(ranks, steps).samples_s
            else:
                found[route] = throughput.run(route, "1m", ranks, steps).samples_s
        rounds.append(found)
    section = Section(
        key="torchft-throughput",
        title=f"TorchFT beside cohort, throughput: the 1M-parameter model on {ranks} ranks "
        "(replica groups), plain DDP vs ElasticJob's gloo route vs TorchFT",
        command=f"python -m bench.torchft_peer throughput --ranks {ranks} --steps {steps} "
        f"--runs {runs}",
        header=["what", "samples/s (median)", "steps/s (median)", "x plain DDP",
                "x cohort's gloo route", "each round, samples/s"],
        raw={"rounds": rounds},
    )  # fmt: skip
    for route in ROUTES:
        rate = statistics.median(r[route] for r in rounds)
        vs_ddp = statistics.median(r[route] / r["ddp"] for r in rounds)
        vs_gloo = statistics.median(r[route] / r["gloo"] for r in rounds)
        section.rows.append([
            ROUTE_NAMES[route], f"{rate:,.0f}", f"{rate / ranks / BATCH:.1f}",
            f"{vs_ddp:.2f}", f"{vs_gloo:.2f}", ", ".join(f"{r[route]:,.0f}" for r in rounds),
        ])  # fmt: skip
    section.notes = [
        f"bench.throughput's 1M-parameter MLP, synthetic data, {BATCH} samples per rank "
        f"(group) per step, plain SGD, one process per rank with one torch thread, {steps} "
        f"steps of which the first {throughput.MODELS['1m'].warmup} are not timed; {versions()}. "
        "Each round runs the three back to back in an order that rotates; a ratio is "
        "one round's against its own peer, each figure the median over rounds. TorchFT runs "
        "torchft.ddp as shipped, its lighthouse waiting for every group before the first "
        "quorum; every step it asks the lighthouse for a quorum (overlapped with the forward "
        "pass) and its manager for should_commit, beside the allreduce.",
    ]
    return section


# ---------------------------------------------------------------- what each survives
@dataclass(frozen=True)
class Outcome:
    """One fault on one side: seconds to training again (inf: not within the window), the
    committed steps redone, the samples skipped, the processes that died of it."""

    again: float
    redone: int
    skipped: int
    died: int


def _torchft_case(case: str, ranks: int, hold: float, down: float) -> Outcome:
    run = TorchFT(ranks).start()
    try:
        before = {group: run.pid(group) for group in range(ranks)}
        at = time.time()
        if case == "stop":
            run.signal(VICTIM, signal.SIGSTOP)
            run.wait(hold)
        elif case == "leave":
            run.signal(VICTIM, signal.SIGTERM)
            run.wait(hold)
        else:
            assert run.lighthouse is not None
            run.lighthouse.signal(signal.SIGKILL)
            run.wait(down)
            run.start_lighthouse()
            run.wait(hold)
        lines = run.lines
        again = _first_commit(
            [(line.t, line.step, line.groups) for line in lines if line.committed],
            at, step_at(lines, at),
        )  # fmt: skip
        if case == "coordinator":
            window = [line for line in lines if line.t > at and line.committed]
            first = min((line.step for line in window), default=step_at(lines, at) + 1)
            redone = max(0, step_at(lines, at) - (first - 1))
        else:
            redone = 0
        skipped = sum(
            (ranks - line.groups) * BATCH for line in lines
            if line.t > at and line.committed and line.group != VICTIM
        )  # fmt: skip
        died = sum(
            1 for group, pid in before.items()
            if run.pid(group) != pid and (case == "coordinator" or group != VICTIM)
        )  # fmt: skip
        return Outcome(again, redone, skipped, died)
    finally:
        run.close()


def _first_commit(commits: Sequence[tuple[float, int, int]], when: float, at: int) -> float:
    """Seconds from `when` to the first commit past the step in flight at `when`. That step
    itself may commit at once without a group that left as it ran (seen: 0.02 s after a
    SIGTERM), before the survivors' next quorum drops the leaver: it is not training
    again."""
    later = [t for t, step, _ in commits if t > when and step > at + 1]
    return min(later) - when if later else float("inf")


def _step_at(commits: Sequence[tuple[float, int, int, int]], when: float) -> int:
    return max((step for t, step, _, _ in commits if t <= when), default=0)


def _cohort_case(case: str, ranks: int, hold: float, down: float) -> Outcome:
    run = Cohort(ranks).start()
    try:
        at = time.time()
        if case == "stop":
            victim = run.signal_rank(signal.SIGSTOP)
            survivors = run.survivor_pids(victim)
            run.wait(hold)
            if victim is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(victim, signal.SIGKILL)
            again = run.healed(at)
        elif case == "leave":
            victim = run.signal_rank(signal.SIGTERM)
            survivors = run.survivor_pids(victim)
            run.wait(hold)
            again = run.healed(at)
        else:
            survivors = run.survivor_pids(None)
            pid = run.coordinator_pid()
            at = time.time()
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            run.wait(hold)  # the launcher starts it again at once: `down` is TorchFT's
            again = _first_commit(
                [(t, s, n) for t, s, _, n in run.commits], at, _step_at(run.commits, at)
            )
        commits = [(t, s, w) for t, s, w, _ in run.commits]
        died = sum(1 for pid in survivors if not _alive(pid))
        return Outcome(again, _recommitted(commits, at), 0, died)
    finally:
        run.close()


CASES = {
    "stop": "a peer SIGSTOPped (hung), left stopped",
    "leave": "a peer leaves cleanly (SIGTERM: cohort's Leave; TorchFT: manager.shutdown())",
    "coordinator": "the coordinator SIGKILLed (cohort's leader, started again by cohort run; "
    "TorchFT's lighthouse, started again by the bench)",
}


def measure_survives(
    ranks: int = 2, hold: float = 90, down: float = 15, cases: Sequence[str] = ()
) -> Section:
    """Each case (`cases`: a subset by key) on each side, in a fresh run each: the fault,
    then `hold` seconds watched."""
    unknown = [case for case in cases if case not in CASES]
    if ranks < 2 or hold <= 0 or down < 0 or unknown:
        raise ValueError(
            f"--ranks {ranks} (2 or more), --hold {hold} (> 0), --down {down} (>= 0), "
            f"--cases {','.join(cases)} (of {','.join(CASES)})"
        )
    lighthouse_command()
    found = {}
    for case in cases or CASES:
        found[case] = {
            "cohort": _cohort_case(case, ranks, hold, down),
            "torchft": _torchft_case(case, ranks, hold, down),
        }
    section = Section(
        key="torchft-survives",
        title=f"TorchFT beside cohort, what each survives: a hung peer, a clean leave, the "
        f"coordinator SIGKILLed, {ranks} ranks (replica groups)",
        command=f"python -m bench.torchft_peer survives --ranks {ranks} --hold {hold:g} "
        f"--down {down:g}" + (f" --cases {','.join(cases)}" if cases else ""),
        header=["fault", "cohort run: to training again, s", "cohort: steps redone / processes "
                "died", "TorchFT: to training again, s", "TorchFT: steps redone / samples "
                "skipped / processes died", "x cohort"],
        raw={case: {side: vars(o) for side, o in sides.items()} for case, sides in found.items()},
    )  # fmt: skip
    for case, sides in found.items():
        mine, peer = sides["cohort"], sides["torchft"]
        ratio = (
            f"{peer.again / mine.again:.1f}"
            if mine.again not in (0.0, float("inf")) and peer.again != float("inf")
            else "-"
        )
        section.rows.append([
            CASES[case], _within(mine.again, hold), f"{mine.redone} / {mine.died}",
            _within(peer.again, hold), f"{peer.redone} / {peer.skipped:,} / {peer.died}", ratio,
        ])  # fmt: skip
    section.notes = [
        f"Each case runs in a fresh run of each side ({ranks} ranks or groups, bench.goodput's "
        f"model, defaults but for a TorchFT lighthouse with --min_replicas 1), and is watched "
        f"for {hold:g} s after the fault: 'training again' is the first step committed past "
        "the one in flight at the fault. TorchFT's lighthouse is started again "
        f"{down:g} s after its SIGKILL; cohort run starts its coordinator again itself, at "
        f"once. TorchFT's groups run under the restart loop; {versions()}. 'Processes died' "
        "counts processes other than the one the fault was sent to that ended (for the "
        "coordinator: any rank or group).",
    ]
    return section


def _within(seconds: float, hold: float) -> str:
    return f"not within {hold:g}" if seconds == float("inf") else f"{seconds:.2f}"


# ---------------------------------------------------------------- the CLI
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    healing = sub.add_parser("healing")
    healing.add_argument("--ranks", type=int, default=2)
    healing.add_argument("--failure-free", type=float, default=60)
    healing.add_argument("--every", type=float, default=60)
    healing.add_argument("--kills", type=int, default=10)
    healing.add_argument("--sides", default="", help="a subset, comma-separated")
    tp = sub.add_parser("throughput")
    tp.add_argument("--ranks", type=int, default=2)
    tp.add_argument("--steps", type=int, default=200)
    tp.add_argument("--runs", type=int, default=3)
    survives = sub.add_parser("survives")
    survives.add_argument("--ranks", type=int, default=2)
    survives.add_argument("--hold", type=float, default=90)
    survives.add_argument("--down", type=float, default=15)
    survives.add_argument("--cases", default="", help=f"a subset of {','.join(CASES)}")
    args = parser.parse_args()
    try:
        if args.what == "healing":
            sides = [s for s in args.sides.split(",") if s]
            section = measure_healing(args.ranks, args.failure_free, args.every, args.kills, sides)
        elif args.what == "throughput":
            section = measure_throughput(args.ranks, args.steps, args.runs)
        else:
            cases = [c for c in args.cases.split(",") if c]
            section = measure_survives(args.ranks, args.hold, args.down, cases)
    except ValueError as exc:
        parser.error(str(exc))
    print(section.markdown())


if __name__ == "__main__":
    main()
