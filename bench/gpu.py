"""The GPU smoke suite: one command, one table, run the day a machine with GPUs is at hand.

    python -m bench.gpu                 # on 1-8 GPUs, unattended, under 10 minutes
    python -m bench.gpu --cpu [--quick] # the same rows on CPU/gloo, small sizes (no GPU here)
    python -m bench.gpu --rows redis,rewind   # only these rows

Every row is a real `cohort run` (or torchrun) of bench/gpu_train.py on this machine, a
small model on synthetic data, each rank on its own device (`job.device`):

- copies: the Redis route's CUDA copies in one process, values checked (the GPU tests of
  tests/unit/test_staging.py);
- nccl-N: N ranks on the NCCL route (gloo with --cpu) and a warm spare; a rank SIGKILLed
  once the spare is ready: the spare takes its place, the job finishes, the audit passes.
  N = 2 and 4, as the GPUs allow (a spare needs a GPU of its own: N + 1 GPUs);
- redis: 2 ranks on the Redis route (on CUDA: pinned, bucketed copies on a side stream);
- bn, dropout: a BatchNorm model and a dropout model (seeded steps) on the NCCL route;
- n-gpu: `cohort run -n gpu` starts one rank per GPU;
- nvml: each rank reports its own GPU, and only its own (`cohort status --json`);
- rewind: every rank SIGKILLed at once after a checkpoint: the job rewinds to it;
- throughput: samples/s of the NCCL route against plain DDP under torchrun, same GPUs.

A row says what it checked, pass / FAIL (or why it could not run: "needs a GPU"), and its
figure. Without CUDA the suite says so and exits 0 unless --cpu asks for the CPU table;
the exit code is 1 if a row that ran failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cohort.coordinator.replay import JournalWatch
from cohort.events import models as m
from cohort.events.connection import RedisSettings, connect

SCRIPT = str(Path(__file__).resolve().parent / "gpu_train.py")
ROWS = (
    "copies", "nccl-2", "nccl-4", "redis", "bn", "dropout", "compiled", "n-gpu", "nvml",
    "rewind", "throughput",
)  # fmt: skip
ROOT = Path(__file__).resolve().parents[1]
RUN_TIMEOUT = 240.0
PACE = "0.1"


@dataclass(frozen=True)
class Machine:
    """What the suite runs on: CUDA or not, and how many GPUs a process sees."""

    cuda: bool
    gpus: int

    @property
    def backend(self) -> str:
        return "nccl" if self.cuda else "gloo"


@dataclass(frozen=True)
class Sizes:
    """How much each run trains (--quick: less)."""

    steps: int
    batch: int
    width: int
    ddp_steps: int
    depth: int = 0
    """width x width layers (the Redis row trains without them: it carries every byte)."""
    killed_steps: int = 150
    """Steps of a run with a SIGKILL, each at least `PACE` long: time for the spare to get
    ready and the kill to fall mid-run."""


FULL = Sizes(steps=40, batch=32, width=256, ddp_steps=60)
QUICK = Sizes(steps=16, batch=16, width=64, ddp_steps=20, killed_steps=100)
GPU_SIZES = Sizes(steps=200, batch=256, width=2048, ddp_steps=200, depth=2)  # 8.5M parameters


@dataclass(frozen=True)
class Row:
    check: str
    verdict: str
    """"pass", "FAIL", "fails (expected: ...)", or why it did not run ("needs a GPU")."""
    figure: str = ""

    @property
    def failed(self) -> bool:
        return self.verdict == "FAIL"


def blocker(row: str, machine: Machine) -> str | None:
    """Why `row` cannot run on `machine` (None: it can). A rank takes a GPU of its own, and
    so does a spare: NCCL refuses two ranks of one world on one GPU."""
    if row in ("copies", "n-gpu", "nvml"):
        return None if machine.cuda else "needs a GPU"
    if not machine.cuda:
        return None
    spare = row.startswith("nccl-") or row == "compiled"  # a kill with a spare waiting
    ranks = (int(row.split("-")[1]) if row.startswith("nccl-") else 2) + spare
    return None if machine.gpus >= ranks else f"needs {ranks} GPUs"


def plan(machine: Machine, quick: bool, only: Sequence[str] = ()) -> list[tuple[str, str | None]]:
    """The rows to report, in order, each with what stops it (None: it runs). --quick on
    CPU leaves out the 4-rank row (the CPU has two cores here, not four)."""
    rows = [r for r in ROWS if not only or r in only]
    if quick and not machine.cuda:
        rows = [r for r in rows if r != "nccl-4" or r in only]
    return [(row, blocker(row, machine)) for row in rows]


# ---------------------------------------------------------------- one cohort run
@dataclass
class Outcome:
    code: int
    seconds: float
    facts: list[Any] = field(default_factory=list)
    output: str = ""
    seen: dict[str, Any] = field(default_factory=dict)
    """What a probe found during the run."""

    def count(self, kind: type) -> int:
        return sum(isinstance(f, kind) for f in self.facts)


Probe = Callable[[Path, JournalWatch, dict[str, Any]], None]


def cohort_run(
    tmp: Path,
    ranks: str,
    sizes: Sizes,
    script: Sequence[str] = (),
    env: dict[str, str] | None = None,
    flags: Sequence[str] = (),
    spares: int = 0,
    start: int = 0,
    kill: Callable[[JournalWatch], list[int]] | None = None,
    probe: Probe | None = None,
) -> Outcome:
    """`cohort run -n ranks` of the training script for `sizes.steps` steps (a run with a
    `kill`: `sizes.killed_steps`, paced), its first world waiting for `start` ranks (else
    `ranks`); `kill(watch)` names pids to SIGKILL (once, when it first names any); `probe`
    looks at the live run."""
    steps = sizes.killed_steps if kill is not None else sizes.steps
    paced = ["--pace", PACE] if kill is not None else []
    start = start or int(ranks)
    run_dir = tmp / "run"
    out = tmp / "launcher.out"
    samples = str(steps * 8 * sizes.batch)  # the job ends at --max-steps, mid-epoch
    command = [
        sys.executable, "-m", "cohort", "run", "-n", ranks, "--spares", str(spares),
        "--run-dir", str(run_dir), "--max-steps", str(steps), "--start-workers", str(start),
        "--dataset-size", samples, "--batch-size", str(sizes.batch),
        "--min-workers", "1", *flags, SCRIPT, "--width", str(sizes.width),
        "--depth", str(sizes.depth), "--batch", str(sizes.batch), "--samples", samples,
        *paced, *script,
    ]  # fmt: skip
    started = time.monotonic()
    launcher = subprocess.Popen(
        command,
        stdout=out.open("wb"),
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )
    outcome = Outcome(code=-1, seconds=0.0)
    try:
        _follow(launcher, run_dir, started, outcome, kill, probe)
        outcome.code = launcher.wait(RUN_TIMEOUT)
    except TimeoutError as exc:
        outcome.output = str(exc)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    outcome.seconds = time.monotonic() - started
    outcome.output += out.read_text(errors="replace")[-3000:]
    return outcome


def _follow(
    launcher: subprocess.Popen[bytes],
    run_dir: Path,
    started: float,
    outcome: Outcome,
    kill: Callable[[JournalWatch], list[int]] | None,
    probe: Probe | None,
) -> None:
    """Follow the run's journal while the launcher runs: its facts into `outcome`, the
    `kill` once it names pids, the `probe` at each pull; TimeoutError past RUN_TIMEOUT."""
    watch = _watch(run_dir, launcher, started)
    killed = False
    while launcher.poll() is None and watch is not None:
        if time.monotonic() - started > RUN_TIMEOUT:
            raise TimeoutError(f"cohort run took over {RUN_TIMEOUT:.0f} s")
        try:
            outcome.facts += watch.pull(block_ms=200)
        except Exception:  # the private Redis ends with the launcher
            return
        if kill is not None and not killed:
            pids = kill(watch)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            killed = bool(pids)
        if probe is not None:
            probe(run_dir, watch, outcome.seen)


def _watch(run_dir: Path, launcher: subprocess.Popen[bytes], started: float) -> JournalWatch | None:
    """The run's journal, once its run.json says where (None: the launcher ended first)."""
    run_json = run_dir / "run.json"
    while not run_json.exists():
        if launcher.poll() is not None:
            return None
        if time.monotonic() - started > RUN_TIMEOUT:
            raise TimeoutError("no run.json")
        time.sleep(0.1)  # a file appearing: nothing to block on
    body = json.loads(run_json.read_text())
    return JournalWatch.of(connect(RedisSettings.resolve(body["redis_url"])), body["job"])


def _trainers(watch: JournalWatch) -> list[Any]:
    return [watch.state.members[w] for w in watch.state.ranks if w in watch.state.members]


def _kill_one_once_a_spare_waits(at: int) -> Callable[[JournalWatch], list[int]]:
    def kill(watch: JournalWatch) -> list[int]:
        state = watch.state
        spare_ready = any(mem.spare and mem.status == "ready" for mem in state.members.values())
        trainers = _trainers(watch)
        if state.last_committed < at or not spare_ready or not trainers or not trainers[0].pid:
            return []
        return [trainers[0].pid]

    return kill


def _kill_all_after_a_checkpoint(watch: JournalWatch) -> list[int]:
    state = watch.state
    if not state.checkpoints or state.last_committed < state.checkpoints[-1].step + 1:
        return []
    return [mem.pid for mem in _trainers(watch) if mem.pid]


def _said(outcome: Outcome, what: str) -> str:
    tail = outcome.output.strip().splitlines()[-1:] if outcome.output.strip() else []
    return f"{what}; exit {outcome.code}" + (f": {tail[0][:120]}" if tail else "")


# ---------------------------------------------------------------- the rows
class Suite:
    def __init__(self, machine: Machine, sizes: Sizes, tmp: Path) -> None:
        self.machine, self.sizes, self.tmp = machine, sizes, tmp
        self.route_env = {"COHORT_TORCH_BACKEND": machine.backend}

    def dir(self, name: str) -> Path:
        path = self.tmp / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def row(self, key: str) -> Row:
        if key.startswith("nccl-"):
            return self.nccl(int(key.split("-")[1]))
        return {
            "redis": self.redis,
            "bn": lambda: self.model("bn"),
            "dropout": lambda: self.model("dropout"),
            "compiled": self.compiled,
            "copies": self.copies,
            "n-gpu": self.n_gpu,
            "nvml": self.nvml,
            "rewind": self.rewind,
            "throughput": self.throughput,
        }[key]()

    def copies(self) -> Row:
        got = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
             "tests/unit/test_staging.py", "-k", "pinned or lands"],
            cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT,
        )  # fmt: skip
        last = (got.stdout.strip().splitlines() or [""])[-1]
        ok = got.returncode == 0 and "2 passed" in last
        return Row(
            "Redis route's CUDA copies: pinned, side stream, values",
            "pass" if ok else "FAIL",
            last[:120],
        )

    def nccl(self, n: int) -> Row:
        check = f"{self.machine.backend} route, {n} ranks + a spare, one SIGKILLed"
        got = cohort_run(
            self.dir(f"nccl-{n}"), str(n), self.sizes, env=self.route_env, spares=1,
            kill=_kill_one_once_a_spare_waits(self.sizes.killed_steps // 4),
        )  # fmt: skip
        promoted = got.count(m.SparePromoted)
        ok = got.code == 0 and promoted >= 1
        figure = f"{promoted} spare promoted, {got.seconds:.0f} s"
        return Row(check, "pass" if ok else "FAIL", figure if ok else _said(got, figure))

    def redis(self) -> Row:
        copies = "pinned copies on a side stream" if self.machine.cuda else "zero-copy views"
        got = cohort_run(self.dir("redis"), "2", self.sizes, ["--depth", "0"])
        figure = f"{self.sizes.steps} steps in {got.seconds:.0f} s"
        return Row(
            f"Redis route, 2 ranks ({copies})",
            "pass" if got.code == 0 else "FAIL",
            figure if got.code == 0 else _said(got, figure),
        )

    def model(self, kind: str) -> Row:
        name = {"bn": "BatchNorm model", "dropout": "dropout model, seeded steps"}[kind]
        got = cohort_run(self.dir(kind), "2", self.sizes, ["--model", kind], self.route_env)
        figure = f"{got.seconds:.0f} s" if got.code == 0 else _said(got, "")
        verdict = "pass" if got.code == 0 else "FAIL"
        return Row(f"{name}, {self.machine.backend} route, 2 ranks", verdict, figure)

    def compiled(self) -> Row:
        """A compiled model (CUDA graphs on a GPU) and a captured Adam with a tensor learning
        rate, through a SIGKILL and a spare: a world change recompiles nothing and keeps
        every `.grad` tensor the optimizer holds."""
        got = cohort_run(
            self.dir("compiled"), "2", self.sizes, ["--compile"], self.route_env, spares=1,
            kill=_kill_one_once_a_spare_waits(self.sizes.killed_steps // 4),
        )  # fmt: skip
        promoted = got.count(m.SparePromoted)
        ok = got.code == 0 and promoted >= 1
        figure = f"{promoted} spare promoted, {got.seconds:.0f} s"
        return Row(
            f"compiled model, captured Adam, {self.machine.backend} route, one SIGKILLed",
            "pass" if ok else "FAIL",
            figure if ok else _said(got, figure),
        )

    def n_gpu(self) -> Row:
        got = cohort_run(
            self.dir("n-gpu"),
            "gpu",
            self.sizes,
            env=self.route_env,
            start=self.machine.gpus,
            probe=_largest_world,
        )
        ranks = got.seen.get("ranks", 0)
        ok = got.code == 0 and ranks == self.machine.gpus
        figure = f"{ranks} ranks on {self.machine.gpus} GPUs"
        return Row(
            "-n gpu: one rank per GPU",
            "pass" if ok else "FAIL",
            figure if ok else _said(got, figure),
        )

    def nvml(self) -> Row:
        n = min(self.machine.gpus, 4)
        got = cohort_run(
            self.dir("nvml"), str(n), self.sizes, ["--gpu-interval", "1"], self.route_env,
            probe=_gpu_readings,
        )  # fmt: skip
        readings: dict[str, list[Any]] = got.seen.get("gpu", {})
        devices = [tuple(d["index"] for d in r) for r in readings.values()]
        own = len(devices) == n and all(len(d) == 1 for d in devices)
        distinct = len({d for d in devices}) == len(devices)
        ok = got.code == 0 and own and distinct
        figure = f"{len(devices)} ranks reporting devices {sorted(devices)}"
        return Row("NVML: each rank reports its own GPU", "pass" if ok else "FAIL", figure)

    def rewind(self) -> Row:
        uri = (self.dir("rewind") / "checkpoints").as_uri()
        every = max(2, self.sizes.steps // 4)
        got = cohort_run(
            self.dir("rewind"), "2", self.sizes, env=self.route_env,
            flags=("--checkpoint-uri", uri, "--checkpoint-every", str(every)),
            kill=_kill_all_after_a_checkpoint,
        )  # fmt: skip
        rewinds = [f for f in got.facts if isinstance(f, m.Rewound)]
        ok = got.code == 0 and any(f.source == "checkpoint" for f in rewinds)
        figure = (
            f"rewound from step {rewinds[0].from_step} to {rewinds[0].to_step}"
            if rewinds
            else "no rewind"
        )
        return Row(
            "every rank SIGKILLed: rewind to the checkpoint",
            "pass" if ok else "FAIL",
            figure if ok else _said(got, figure),
        )

    def throughput(self) -> Row:
        n = min(self.machine.gpus, 4) if self.machine.cuda else 2
        mine, peer = self.dir("throughput-cohort"), self.dir("throughput-ddp")
        got = cohort_run(mine, str(n), self.sizes, ["--times", str(mine)], self.route_env)
        ddp = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc-per-node", str(n), SCRIPT, "--ddp", "--steps", str(self.sizes.ddp_steps),
             "--width", str(self.sizes.width), "--depth", str(self.sizes.depth),
             "--batch", str(self.sizes.batch), "--times", str(peer)],
            capture_output=True, text=True, timeout=RUN_TIMEOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        ours, theirs = (
            samples_per_second(mine, self.sizes.batch),
            samples_per_second(peer, self.sizes.batch),
        )
        check = f"throughput: {self.machine.backend} route against plain DDP, {n} ranks"
        if got.code != 0 or ddp.returncode != 0 or not ours or not theirs:
            why = ddp.stderr.strip().splitlines()[-1:] if ddp.returncode else []
            return Row(check, "FAIL", _said(got, f"ddp exit {ddp.returncode} {why}"))
        return Row(
            check, "pass", f"{ours / theirs:.2f} of DDP ({ours:,.0f} / {theirs:,.0f} samples/s)"
        )


def samples_per_second(directory: Path, batch: int) -> float:
    """The world's samples per second from its ranks' timings: every rank takes `batch` a
    step, and the world is as fast as its slowest rank (0.0 with no timing)."""
    times = [json.loads(p.read_text()) for p in directory.glob("*.json")]
    timed = [t for t in times if t["seconds"] > 0 and t["steps"] > 0]
    if not timed:
        return 0.0
    steps = min(t["steps"] for t in timed)
    return len(timed) * batch * steps / max(t["seconds"] for t in timed)


def _largest_world(run_dir: Path, watch: JournalWatch, seen: dict[str, Any]) -> None:
    seen["ranks"] = max(seen.get("ranks", 0), len(watch.state.ranks))


def _gpu_readings(run_dir: Path, watch: JournalWatch, seen: dict[str, Any]) -> None:
    """Each worker's latest GPU reading, as `cohort status --json` shows it, once every
    rank has one (read at most every 2 s)."""
    if (seen.get("gpu") and all(seen["gpu"].values())) or time.monotonic() < seen.get("next", 0):
        return
    seen["next"] = time.monotonic() + 2.0
    status = subprocess.run(
        [sys.executable, "-m", "cohort", "status", "--run-dir", str(run_dir), "--json"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    with contextlib.suppress(ValueError, KeyError, TypeError):
        workers = json.loads(status.stdout)["leader_view"]["workers"]
        ranked = set(watch.state.ranks)
        seen["gpu"] = {w: v["gpu"] for w, v in workers.items() if w in ranked}


# ---------------------------------------------------------------- the table
def table(machine: Machine, rows: Sequence[Row]) -> str:
    where = f"{machine.gpus} GPU(s), NCCL" if machine.cuda else "CPU only, gloo (--cpu)"
    lines = [f"GPU smoke suite: {where}", "", "| check | result | figure |", "|---|---|---|"]
    lines += [f"| {r.check} | {r.verdict} | {r.figure} |" for r in rows]
    return "\n".join(lines)


def this_machine() -> Machine:
    import torch

    cuda = torch.cuda.is_available()
    return Machine(cuda, torch.cuda.device_count() if cuda else 0)


def run(
    machine: Machine, quick: bool, only: Sequence[str], say: Callable[[str], None]
) -> list[Row]:
    sizes = (QUICK if quick else FULL) if not machine.cuda else GPU_SIZES
    tmp = Path(tempfile.mkdtemp(prefix="cohort-gpu-"))
    suite = Suite(machine, sizes, tmp)
    rows = []
    try:
        for key, blocked in plan(machine, quick, only):
            if blocked is not None:
                rows.append(Row(key, blocked))
                continue
            say(f"{key} ...")
            try:
                rows.append(suite.row(key))
            except Exception as exc:  # a row that breaks is a failed row; the rest run
                rows.append(Row(key, "FAIL", f"{type(exc).__name__}: {exc}"[:200]))
            say(f"{key}: {rows[-1].verdict} {rows[-1].figure}")
    finally:
        if not any(r.failed for r in rows):
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            say(f"the runs' directories (logs): {tmp}")
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="the table on CPU/gloo, GPUs or not")
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer rows")
    parser.add_argument("--rows", default="", help=f"only these, of {','.join(ROWS)}")
    args = parser.parse_args(argv)
    only = [r for r in args.rows.split(",") if r]
    unknown = [r for r in only if r not in ROWS]
    if unknown:
        parser.error(f"--rows {','.join(unknown)}: not a row; the rows are {','.join(ROWS)}")
    if args.cpu:  # the CPU table, GPUs or not: no rank opens one
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    machine = this_machine()
    if not machine.cuda:
        print("no CUDA device here: the GPU rows need a GPU", flush=True)
        if not args.cpu:
            print("run `python -m bench.gpu --cpu` for the same table on CPU/gloo")
            return 0
    rows = run(machine, args.quick, only, lambda line: print(line, file=sys.stderr, flush=True))
    print(table(machine, rows), flush=True)
    return 1 if any(r.failed for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
