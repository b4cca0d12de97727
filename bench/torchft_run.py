"""Running TorchFT as a user would, for bench/torchft_peer.py: its lighthouse, and each replica
group (bench/torchft_trainer.py) restarted by a loop when it dies; what the groups' step logs
say about each fault.

Everything here starts in a session of its own (cohort.processes.Proc) and is ended by
`TorchFT.close`, the lighthouse included.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.goodput import BATCH, WARMUP_STEPS, _until
from bench.launched import _env
from bench.scratch import discard
from cohort.localredis import free_port
from cohort.processes import Proc, stop_all

HEARTBEAT_MS = 5000
"""The lighthouse's default heartbeat timeout (`torchft_lighthouse --help`)."""
DUPLICATE_S = 2.0
"""Lines for the same step within this long are one step logged by each group."""


class TorchFTMissing(RuntimeError):
    """torchft is not installed: the bench says how to install it."""


def lighthouse_command() -> str:
    """The `torchft_lighthouse` beside this Python (a venv's bin), else on PATH."""
    beside = Path(sys.executable).parent / "torchft_lighthouse"
    found = str(beside) if beside.exists() else shutil.which("torchft_lighthouse")
    if found is None:
        raise TorchFTMissing(
            "torchft is not installed (no torchft_lighthouse beside "
            f"{sys.executable} nor on PATH): pip install -e '.[bench]' (or torchft==0.2.0)"
        )
    return found


@dataclass(frozen=True)
class Line:
    """One step a group logged."""

    t: float
    step: int
    committed: bool
    groups: int
    group: int
    pid: int


@dataclass
class TorchFT:
    """A lighthouse and `groups` replica groups, each restarted when it dies (not when it
    leaves: exit code 0), until `close`."""

    groups: int
    heartbeat_ms: int = HEARTBEAT_MS
    ddp: str = "fixed"
    tmp: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="cohort-torchft-")))
    port: int = field(default_factory=free_port)
    lighthouse: Proc | None = None
    procs: dict[int, Proc] = field(default_factory=dict)
    left: set[int] = field(default_factory=set)
    """Groups that left cleanly: the loop does not start them again."""
    restarts: int = 0
    lines: list[Line] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    """Times of the steps committed, once per step (what bench.goodput's `_periods` watches)."""
    killed: list[float] = field(default_factory=list)
    """When the bench killed a group."""

    @property
    def url(self) -> str:
        return f"http://localhost:{self.port}"

    def start(self) -> TorchFT:
        self.start_lighthouse()
        for group in range(self.groups):
            self._start(group)
        _until(self._training, 240, f"TorchFT: {self.groups} groups training", self.poll)
        return self

    def start_lighthouse(self) -> None:
        self.lighthouse = Proc(
            "lighthouse",
            [lighthouse_command(), "--min_replicas", "1", "--bind", f"[::]:{self.port}",
             "--heartbeat_timeout_ms", str(self.heartbeat_ms)],
            self.tmp / "lighthouse.log", env=_env(),
        )  # fmt: skip
        self.lighthouse.start()

    def _start(self, group: int) -> None:
        proc = Proc(f"group{group}", self._command(group), self.tmp / f"group{group}.log",
                    env={**_env(), **self._env(group)})  # fmt: skip
        proc.start()
        self.procs[group] = proc

    def _command(self, group: int) -> list[str]:
        return [sys.executable, "-m", "bench.torchft_trainer", "--group", str(group),
                "--groups", str(self.groups), "--lighthouse", self.url,
                "--log", str(self.tmp / f"group{group}.jsonl"), "--ddp", self.ddp]  # fmt: skip

    def _env(self, group: int) -> dict[str, str]:
        return {}

    def _training(self) -> bool:
        full = [line for line in self.lines if line.committed and line.groups == self.groups]
        return len(full) >= self.groups * WARMUP_STEPS

    def poll(self) -> None:
        """The restart loop's turn (a group that died starts again at once), then the logs."""
        for group, proc in self.procs.items():
            if proc.alive() or group in self.left:
                continue
            assert proc.popen is not None
            if proc.popen.returncode == 0:
                self.left.add(group)
                continue
            self.restarts += 1
            self._start(group)
        self.lines[:] = read(self.tmp, self.groups)
        self.times[:] = [t for t, _, _ in commits(self.lines, fresh=True)]
        time.sleep(0.1)  # the groups write files: nothing to block on

    def pid(self, group: int) -> int:
        proc = self.procs[group]
        assert proc.popen is not None
        return proc.popen.pid

    def signal(self, group: int, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.procs[group].signal(sig)

    def wait(self, seconds: float) -> None:
        """`seconds` of the loop's turns."""
        end = time.monotonic() + seconds
        _until(lambda: time.monotonic() >= end, seconds + 5, "the wait's end", self.poll)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.alive():
                proc.signal(signal.SIGCONT)  # a stopped group would not see its SIGTERM
        stop_all([*self.procs.values(), *([self.lighthouse] if self.lighthouse else [])], 3)
        discard(self.tmp)

    def counted(self, _: Sequence[float], start: float, end: float) -> int:
        """Group-steps committed in [start, end): each committed step weighs the groups that
        took part (a step without a group trains fewer samples). Over a window with kills,
        steps the model had taken before (every group restarted from nothing) do not count
        again; a window without any is the side's failure-free pace, whatever its step."""
        faulted = any(start <= at < end for at in self.killed)
        return sum(g for t, _, g in commits(self.lines, fresh=faulted) if start <= t < end)

    def outage(self, _: Sequence[float], when: float) -> float:
        return survivors_commit(self.lines, when, 0)


@dataclass
class ShardedTorchFT(TorchFT):
    """TorchFT's fault-tolerant HSDP as torchtitan runs it: each replica group a torchrun of
    `ranks` workers (bench/sharded_ranks.py's `torchft`, FSDP2 over the group), its agent
    restarting the whole group when a worker dies; the group's rank 0 logs its steps. Each
    start of a group's workers makes its own store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, as
    bench.launched's better torchrun): on the agent's shared store a restarted rank read the
    dead rank's gloo address and failed to connect, restart after restart (measured: 20 s
    more per kill)."""

    ranks: int = 2

    def _command(self, group: int) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(self.ranks), "--max-restarts", "1000",
                "--monitor-interval", "0.1", "-m", "bench.sharded_ranks", "torchft"]  # fmt: skip

    def _env(self, group: int) -> dict[str, str]:
        return {"BENCH_GROUP": str(group), "BENCH_GROUPS": str(self.groups),
                "BENCH_LOG": str(self.tmp / f"group{group}.jsonl"),
                "TORCHFT_LIGHTHOUSE": self.url,
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # fmt: skip

    def signal(self, group: int, sig: int) -> None:
        """To the group's rank 0 worker (the one that logs), not to its agent."""
        pids = [line.pid for line in self.lines if line.group == group]
        if pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pids[-1], sig)


def read(tmp: Path, groups: int) -> list[Line]:
    """Every group's step lines, in time order."""
    lines = []
    for group in range(groups):
        with contextlib.suppress(OSError):
            for text in (tmp / f"group{group}.jsonl").read_text().splitlines():
                with contextlib.suppress(json.JSONDecodeError, KeyError, TypeError):
                    lines.append(Line(**json.loads(text)))
    return sorted(lines, key=lambda line: line.t)


def commits(lines: Sequence[Line], fresh: bool = False) -> list[tuple[float, int, int]]:
    """(time, step, groups) of each committed step, once: the first group's line for it. A
    step committed again much later (every group restarted from nothing) is listed again,
    unless `fresh`: then only steps that take the model beyond its count so far."""
    last: dict[int, float] = {}
    top = 0
    found = []
    for line in lines:
        if not line.committed:
            continue
        if line.step in last and line.t - last[line.step] < DUPLICATE_S:
            continue
        last[line.step] = line.t
        if fresh and line.step <= top:
            continue
        top = max(top, line.step)
        found.append((line.t, line.step, line.groups))
    return found


def step_at(lines: Sequence[Line], when: float) -> int:
    """The model's step count at `when`: the last committed step's before it (0: none)."""
    return max((line.step for line in lines if line.committed and line.t <= when), default=0)


def survivors_commit(lines: Sequence[Line], when: float, victim: int) -> float:
    """Seconds from `when` to the first step a group other than `victim` committed without
    the victim's process of then: with fewer groups, or past the step in flight at `when`."""
    at = step_at(lines, when)
    total = max((line.groups for line in lines), default=0)
    later = [
        line.t
        for line in lines
        if line.t > when and line.committed and line.group != victim
        and (line.groups < total or line.step > at + 1)
    ]  # fmt: skip
    return min(later) - when if later else float("inf")


def place_again(lines: Sequence[Line], when: float, victim: int) -> float:
    """Seconds from `when` to the first step committed by a new process of group `victim`."""
    before = {line.pid for line in lines if line.t <= when}
    later = [
        line.t
        for line in lines
        if line.t > when and line.committed and line.group == victim and line.pid not in before
    ]
    return min(later) - when if later else float("inf")


@dataclass(frozen=True)
class Fault:
    """What one fault cost: seconds to the survivors' next committed step and to the lost
    place training again, the survivors' steps discarded, the steps and samples the model
    lost or trained twice, and the survivors that died of it."""

    survivors: float
    place: float
    discarded: int
    redone: int
    skipped: int
    doubled: int
    survivors_died: int


def fault(lines: Sequence[Line], when: float, victim: int, until: float) -> Fault:
    """The fault at `when` to `victim`, read from the lines up to `until` (the next fault)."""
    survivors = survivors_commit(lines, when, victim)
    place = place_again(lines, when, victim)
    healed = when + place if place != float("inf") else until
    window = [line for line in lines if when < line.t <= min(healed, until)]
    before = {line.pid for line in lines if line.t <= when}
    at = step_at(lines, when)
    steps = commits(window)
    first = min((step for _, step, _ in steps), default=at + 1)
    total = max((line.groups for line in lines), default=0)
    return Fault(
        survivors=survivors,
        place=place,
        discarded=sum(1 for line in window if not line.committed and line.group != victim),
        redone=max(0, at - (first - 1)),
        skipped=sum((total - groups) * BATCH for _, _, groups in steps),
        doubled=sum(groups * BATCH for _, step, groups in steps if step <= at),
        survivors_died=len(
            {
                line.group
                for line in lines
                if when < line.t <= until and line.group != victim and line.pid not in before
            }
        ),
    )


def median(values: Sequence[float], digits: int = 2) -> str:
    finite = [v for v in values if v != float("inf")]
    return f"{statistics.median(finite):.{digits}f}" if finite else "never"


def raw(faults: Sequence[Fault]) -> list[dict[str, Any]]:
    return [vars(f) for f in faults]
