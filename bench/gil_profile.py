"""Where a rank's Python time goes per step: py-spy on one ElasticJob rank of bench.throughput.

Runs the throughput benchmark's 1M-parameter cell (2 ranks, a coordinator, a Redis) and
samples rank 0 with py-spy while it trains, counting only samples that hold the GIL, so
the figures are the Python work beside torch's kernels (which release it): what cohort
adds to a step, where the model is too small for its step to hide it. Prints the share
of those samples per thread and per function (inclusive), cohort's and torch's glue.

    pip install py-spy
    python -m bench.gil_profile [--route gloo|redis|gloo-exact] [--steps 2500] [--seconds 25]
"""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.fleet import coordinator
from bench.throughput import BATCH, EXACT
from cohort.localredis import LocalRedis
from cohort.processes import end, stop_all

WORLD = 2


def profile(route: str, steps: int, seconds: int) -> Path:
    """py-spy's raw (collapsed) stacks of rank 0, sampled for `seconds` after a warm-up."""
    out = Path(tempfile.mkdtemp(prefix="cohort-profile-")) / f"{route}.txt"
    with LocalRedis(appendonly=False) as server:
        job = f"profile-{route}"
        leader = coordinator(
            server.url, job, "--min-workers", str(WORLD), "--max-steps", str(steps),
            "--dataset-size", str(steps * WORLD * BATCH), "--batch-size", str(BATCH),
            *(("--global-batch", str(WORLD * BATCH), "--placement", "strided")
              if route.endswith(EXACT) else ()),
        )  # fmt: skip
        argv = ["--model", "1m", "--world", str(WORLD), "--steps", str(steps),
                "--route", route, "--job", job, "--redis-url", server.url]  # fmt: skip
        ranks: list[subprocess.Popen[bytes]] = []
        try:
            for r in range(WORLD):
                ranks.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "bench.throughput", "rank", *argv, "--rank", str(r)],
                        stdout=subprocess.DEVNULL,
                    )
                )
            time.sleep(8)  # imports, the world forming, the first steps: not profiled
            subprocess.run(
                ["py-spy", "record", "-p", str(ranks[0].pid), "-r", "200", "-f", "raw",
                 "-o", str(out), "--threads", "--gil", "-d", str(seconds)],
                check=True, capture_output=True,
            )  # fmt: skip
        finally:
            end(ranks, sig=0)
            stop_all([leader])
    return out


def summary(raw: Path, top: int = 40) -> str:
    """Shares of the samples by thread, then by function (each counted once per stack)."""
    total = 0
    threads: collections.Counter[str] = collections.Counter()
    functions: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        total += n
        frames = stack.split(";")
        threads[frames[0].split(":")[-1].strip()] += n
        for name in {frame.rsplit(":", 1)[0] + ")" for frame in frames[1:]}:
            functions[name] += n
    lines = [f"{total} samples holding the GIL", "", "by thread:"]
    lines += [f"{n / total:7.1%}  {name}" for name, n in threads.most_common()]
    lines += ["", "by function (inclusive), cohort's and the loop's:"]
    shown = [(k, n) for k, n in functions.most_common() if "cohort/" in k or "torch/" in k]
    lines += [f"{n / total:7.1%}  {name}" for name, n in shown[:top]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--route", choices=("gloo", "redis", "gloo-exact"), default="gloo")
    parser.add_argument("--steps", type=int, default=2500)
    parser.add_argument("--seconds", type=int, default=25)
    args = parser.parse_args()
    if shutil.which("py-spy") is None:
        parser.error("py-spy is not installed: pip install py-spy")
    print(summary(profile(args.route, args.steps, args.seconds)))


if __name__ == "__main__":
    main()
