"""Failures do not change what a job learns (docs/guarantees.md).

The same job (tests/integration/transparent_script.py: a user's loop with an LR scheduler
and a counter in `extra`) runs twice on real processes against a real coordinator and
redis-server: once clean, once through every kind of failure in turn: a rank joins a world
that is training (2 -> 3 ranks), a rank is SIGKILLed mid-epoch (3 -> 2), every rank is
SIGKILLed and the job rewinds to a checkpoint off an epoch's boundary, then again to one on
it. The global batch is constant and dealt strided, so its gradient sums are exact
(worker/pytorch/tree.py on gloo, exact.py through Redis): the run through failures ends
with the clean one's weights to the bit, whatever the world sizes it went through, and
every step it kept was trained with the clean run's learning rate, scheduler position and
counter.

Each optimizer meets each kind of scheduler and each route (gradients through Redis, or
gloo) in four pairings, rather than all eight, in float32; Adam on each route under bf16
autocast; and Adam on gloo under fp16 autocast with a GradScaler (its scale travels with
the state, an inf skips a step on every rank alike).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("CI") == "true":
    import torch  # CI installs torch's CPU build: a missing torch must fail, not skip
else:
    torch = pytest.importorskip("torch")

from cohort.events.models import Rewound, WorkerFailed, WorldChanged  # noqa: E402
from tests.integration.cluster import Cluster, Process  # noqa: E402

pytestmark = [pytest.mark.redis_server, pytest.mark.slow]

SCRIPT = "tests/integration/transparent_script.py"
# 72 samples, 12 a step in 3 micro-batches of 4 (one or more a rank, at 2 or 3 ranks): 6 steps
# an epoch, 24 in 4 epochs. Checkpoints after steps 8 (inside
# epoch 1) and 17 (epoch 2's last step), and the final one.
JOB = (
    "--min-workers", "2", "--dataset-size", "72", "--batch-size", "4", "--global-batch", "12",
    "--placement", "strided", "--epochs", "4", "--checkpoint-every", "9",
    "--heartbeat-interval", "0.5", "--heartbeat-timeout", "2", "--lease", "1",
)  # fmt: skip
OFF_BOUNDARY, ON_BOUNDARY, STEPS = 8, 17, 24
RUNS = ("clean", "failures")


def start(cluster: Cluster, name: str, setup: tuple[str, ...], *failures: str) -> Process:
    return cluster.python(
        name, SCRIPT, str(cluster.tmp), "--redis-url", cluster.url, "--job", cluster.job,
        "--id", name, *setup, *failures,
    )  # fmt: skip


def run(cluster: Cluster, setup: tuple[str, ...], through_failures: bool) -> Path:
    """One whole job; its traces and final weights are in `cluster.tmp`."""
    cluster.coordinator("c1", *JOB, "--checkpoint-uri", f"file://{cluster.tmp / 'ckpt'}")
    if not through_failures:
        ranks = [start(cluster, name, setup) for name in ("a", "b")]
    else:
        # two ranks train, and hold inside step 3 until a third joins; it dies as it is
        # given its second step (under DDP, the one whose forward agrees on buckets); the
        # two left die at step 10 once step 8 is checkpointed
        first = [
            start(cluster, name, setup, "--hold-at", "3:3", "--die-at", f"10:{OFF_BOUNDARY}")
            for name in ("a", "b")
        ]
        cluster.until(lambda s: s.last_committed >= 1, 120, "two ranks training")
        joiner = start(cluster, "c", setup, "--die-at", "+2")
        for proc in (*first, joiner):
            assert cluster.finished(proc, 240) != 0, proc.output()[-3000:]
        # nobody is left: a second pair rewinds to step 8 and dies at step 19 once 17 is
        # checkpointed; a third pair rewinds to 17 and finishes the job
        second = [
            start(cluster, name, setup, "--die-at", f"19:{ON_BOUNDARY}") for name in ("a2", "b2")
        ]
        for proc in second:
            assert cluster.finished(proc, 240) != 0, proc.output()[-3000:]
        ranks = [start(cluster, name, setup) for name in ("a3", "b3")]
    for proc in ranks:
        assert cluster.finished(proc, 240) == 0, proc.output()[-3000:]
    return cluster.tmp


def trained(out: Path) -> dict[int, dict[str, Any]]:
    """What each step kept was trained with: the last applied attempt at it (a rewind
    trains a step again), one line per rank of that attempt's world, which must agree."""
    lines = [
        json.loads(line)
        for trace in sorted(out.glob("trace-*.jsonl"))
        for line in trace.read_text().splitlines()
    ]
    by_step: dict[int, dict[str, Any]] = {}
    for line in sorted(lines, key=lambda x: x["t"]):
        by_step[line["step"]] = {k: line[k] for k in ("epoch", "lr", "sched", "epochs_done")}
    return by_step


def weights(out: Path) -> dict[str, Any]:
    return torch.load(out / "final.pt")  # type: ignore[no-any-return]


def scenario(cluster: Cluster) -> None:
    """The failures the run met are the ones it was meant to."""
    cluster.pull()
    facts = [fact for _, fact in cluster.facts]
    assert any(isinstance(f, WorldChanged) and len(f.ranks) == 3 for f in facts)
    assert [f.worker for f in facts if isinstance(f, WorkerFailed)][:1] == ["c"]
    rewinds = [(f.to_step, f.source) for f in facts if isinstance(f, Rewound)]
    assert rewinds == [(OFF_BOUNDARY, "checkpoint"), (ON_BOUNDARY, "checkpoint")], rewinds


@pytest.mark.parametrize(
    "route, optimizer, schedule, precision",
    [
        ("redis", "sgd", "epoch", "fp32"),
        ("redis", "adam", "step", "fp32"),
        ("gloo", "sgd", "step", "fp32"),
        ("gloo", "adam", "epoch", "fp32"),
        ("redis", "adam", "epoch", "bf16"),
        ("gloo", "adam", "step", "bf16"),
        ("gloo", "adam", "epoch", "fp16"),
    ],
)
def test_a_job_through_failures_learns_what_it_learns_without_them(
    route: str, optimizer: str, schedule: str, precision: str, tmp_path: Path, cluster: Cluster
) -> None:
    setup = ("--route", route, "--optimizer", optimizer, "--schedule", schedule,
             "--precision", precision)  # fmt: skip
    jobs = {name: Cluster(cluster.url, cluster.conn, name, tmp_path / name) for name in RUNS}
    try:
        for name, job in jobs.items():
            job.tmp.mkdir()
            run(job, setup, through_failures=name == "failures")
    finally:
        for job in jobs.values():
            job.stop()
    clean, failures = (jobs[name].tmp for name in RUNS)
    scenario(jobs["failures"])

    expected, got = trained(clean), trained(failures)
    assert sorted(expected) == list(range(STEPS)) and sorted(got) == list(range(STEPS))
    for step in range(STEPS):
        assert got[step] == expected[step], f"step {step}"
    ours, theirs = weights(failures), weights(clean)
    worst = max(float((ours[k] - theirs[k]).abs().max()) for k in theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs), f"{worst:.2e} away"
