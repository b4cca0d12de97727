"""What failures change in what a job learns: the LM example (examples/lm_train.py) under
`cohort run`, clean and through SIGKILLs, its final weights against the clean run's.

Three runs per precision, the same job each time (a constant global batch, strided
placement, deterministic algorithms):

- clean: `cohort run -n R`, no failure;
- constant world: `cohort run -n R --spares 1`, the chief SIGKILLed twice; the spare takes
  its place in the decision that fails it, so every step trains in a world of R ranks;
- world change: `cohort run -n R`, the chief SIGKILLed once; the world trains R - 1 ranks
  until the launcher's replacement joins again (R -> R-1 -> R).

The figure is the largest |difference| of any weight from the clean run's: 0 is
bit-identical. docs/guarantees.md's table quotes it.

    python -m bench.drift [--ranks 3] [--steps 60] [--precisions fp32,bf16] [--route redis]

`--route gloo` runs the ranks' collectives on gloo (the exact sums along a tree), `redis`
(the default) through Redis (the exact sums in integers).
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
from pathlib import Path

from bench.results import Section
from cohort.coordinator.replay import JournalWatch
from cohort.events.connection import RedisSettings, connect

EXAMPLE = str(Path(__file__).resolve().parents[1] / "examples" / "lm_train.py")
BATCH, PER_RANK_MICRO = 8, 2


def _until(
    done: Callable[[], bool], timeout: float, what: str, between: Callable[[], None]
) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:.0f} s for {what}")
        between()


def run(
    ranks: int, steps: int, precision: str, spares: int, kills: Sequence[int], route: str
) -> tuple[Path, list[float]]:
    """One `cohort run` of the example; the chief SIGKILLed once the job committed each step
    of `kills`. The first world waits for every rank; later ones train with whoever is there
    (`--min-workers 1`), so without a spare a kill leaves a smaller world until the
    replacement joins. The final weights' path, and each kill's seconds to the next commit."""
    tmp = Path(tempfile.mkdtemp(prefix="cohort-drift-"))
    env = {k: v for k, v in os.environ.items() if k != "COHORT_TORCH_BACKEND"}
    if route == "gloo":
        env["COHORT_TORCH_BACKEND"] = "gloo"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "cohort", "run", "-n", str(ranks), "--spares", str(spares),
         "--min-workers", "1", "--start-workers", str(ranks), "--run-dir", str(tmp / "run"),
         "--dataset-size", "2048", "--batch-size", str(BATCH),
         "--global-batch", str(BATCH * PER_RANK_MICRO * ranks), "--placement", "strided",
         "--max-steps", str(steps), EXAMPLE, "--precision", precision,
         "--save", str(tmp / "final.pt")],
        stdout=(tmp / "launcher.out").open("wb"), stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, start_new_session=True, env=env,
    )  # fmt: skip
    try:
        run_json = tmp / "run" / "run.json"
        _until(run_json.exists, 60, "run.json", lambda: time.sleep(0.1))
        body = json.loads(run_json.read_text())
        watch = JournalWatch.of(connect(RedisSettings.resolve(body["redis_url"])), body["job"])

        def pull() -> None:
            watch.pull(block_ms=20)

        healed: list[float] = []

        for at in kills:
            _until(
                lambda at=at: watch.state.last_committed >= at,  # type: ignore[misc]
                600, f"step {at}", pull,
            )  # fmt: skip
            member = watch.state.members.get(watch.state.ranks[0])
            if member is not None and member.pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(member.pid, signal.SIGKILL)
                killed, before = time.monotonic(), watch.state.last_committed
                _until(
                    lambda before=before: watch.state.last_committed > before,  # type: ignore[misc]
                    600, "a commit after the kill", pull,
                )  # fmt: skip
                healed.append(time.monotonic() - killed)
        if launcher.wait(1800) != 0:
            raise RuntimeError(f"cohort run failed: {(tmp / 'launcher.out').read_text()[-3000:]}")
        smaller = f"of {ranks - 1} (world"
        if not spares and kills and smaller not in (tmp / "launcher.out").read_text():
            raise RuntimeError(f"no world of {ranks - 1} ranks trained: {tmp / 'launcher.out'}")
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    return tmp / "final.pt", healed


def largest_difference(a: Path, b: Path) -> float:
    import torch

    mine, theirs = torch.load(a), torch.load(b)
    return max(float((mine[k].float() - theirs[k].float()).abs().max()) for k in theirs)


def measure(ranks: int, steps: int, precisions: Sequence[str], route: str = "redis") -> Section:
    early, late = steps // 4, steps // 2
    rows, raw = [], {}
    healing: dict[str, dict[str, list[float]]] = {}
    for precision in precisions:
        clean, _ = run(ranks, steps, precision, 0, (), route)
        constant, spared = run(ranks, steps, precision, 1, (early, late), route)
        changed, shrunk = run(ranks, steps, precision, 0, (early,), route)
        figures = {
            "constant world (a spare, 2 kills)": largest_difference(constant, clean),
            f"world change ({ranks} -> {ranks - 1} -> {ranks}, 1 kill)": largest_difference(
                changed, clean
            ),
        }
        healing[precision] = {"spare": spared, "no spare": shrunk}
        for weights in (clean, constant, changed):  # a run that failed keeps its directory
            shutil.rmtree(weights.parent, ignore_errors=True)
        raw[precision] = {**figures, "kill -> next commit (s)": healing[precision]}
        rows += [
            [precision, what, f"{value:.2g}", ", ".join(f"{t:.2f}" for t in times)]
            for (what, value), times in zip(figures.items(), (spared, shrunk), strict=True)
        ]
    return Section(
        key="drift",
        title="What failures change: the LM example's weights against its clean run",
        command=f"python -m bench.drift --ranks {ranks} --steps {steps} "
        f"--precisions {','.join(precisions)} --route {route}",
        header=["precision", "run", "max |weight - clean run's|", "kill -> next commit (s)"],
        rows=rows,
        raw=raw,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--route", choices=("redis", "gloo"), default="redis")
    args = parser.parse_args()
    section = measure(args.ranks, args.steps, args.precisions.split(","), args.route)
    print(section.markdown())


if __name__ == "__main__":
    main()
