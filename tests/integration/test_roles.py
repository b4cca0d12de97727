"""Roles with real processes: an evaluator member beside the trainers, and the chief.

The evaluator joins before any trainer, holds no rank, does not make up `min_workers`,
evaluates checkpoints of the committed weights at most every K steps, and its metrics are
journaled; SIGKILLed, it is declared failed without a new world or an aborted step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cohort.events.models import EvalReported, WorkerFailed, WorldChanged
from tests.integration.cluster import Cluster

pytestmark = [pytest.mark.redis_server, pytest.mark.slow]

EVERY = 20


def evaluations(cluster: Cluster) -> list[EvalReported]:
    cluster.pull()
    return [f for _, f in cluster.of_type(EvalReported)]  # type: ignore[misc]


def test_an_evaluator_evaluates_checkpoints_without_a_rank_and_its_death_aborts_nothing(
    cluster: Cluster, tmp_path: Path
) -> None:
    store = tmp_path / "ckpt"
    cluster.trainer_coordinator(
        "c1", "--checkpoint-uri", f"file://{store}", "--checkpoint-every", "10",
        "--max-steps", "400", workers=2, interval=0.5, timeout=2.0,
    )  # fmt: skip
    evaluator = cluster.python(
        "e", "-m", "tests.integration.evaluate", cluster.url, cluster.job, "e", str(EVERY)
    )
    cluster.until(lambda s: "e" in s.members, message="the evaluator joined")
    a = cluster.example_worker("a", None, "--pace", "0.02")
    cluster.until(
        lambda s: s.members.get("a") is not None and s.members["a"].status == "ready",
        message="a ready",
    )
    state = cluster.state
    assert state.paused and state.ranks == ()  # a and the evaluator are not min_workers=2
    assert state.members["e"].status == "evaluating" and state.members["e"].role == "evaluator"

    b = cluster.example_worker("b", None, "--pace", "0.02")
    cluster.until(lambda s: len(s.evals) >= 2, timeout=90, message="two evaluations")
    assert "e" not in cluster.state.ranks
    status = subprocess.run(
        [sys.executable, "-m", "cohort", "--redis-url", cluster.url, "status", "--job",
         cluster.job, "--json"], capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    body = json.loads(status.stdout)
    assert body["chief"] == body["ranks"][0] and body["members"]["e"]["rank"] is None
    assert body["evals"][-1]["worker"] == "e" and "accuracy" in body["evals"][-1]["metrics"]
    human = subprocess.run(
        [sys.executable, "-m", "cohort", "--redis-url", cluster.url, "status", "--job",
         cluster.job], capture_output=True, text=True, timeout=60,
    ).stdout  # fmt: skip
    assert "chief" in human and "evaluation by e of step" in human

    worlds_before = len(cluster.of_type(WorldChanged))
    evaluator.kill(signal.SIGKILL)
    cluster.until(
        lambda s: "e" not in s.members and s.last_committed > 0, message="e declared failed"
    )
    assert cluster.finished(a, 120) == 0, a.output()[-3000:]
    assert cluster.finished(b, 120) == 0, b.output()[-3000:]
    cluster.pull()
    assert [f.worker for _, f in cluster.of_type(WorkerFailed)] == ["e"]  # type: ignore[attr-defined]
    assert len(cluster.of_type(WorldChanged)) == worlds_before  # no world changed for e
    assert cluster.state.finished and cluster.state.last_committed == 399

    steps = [f.step for f in evaluations(cluster)]
    saved = {f.step for _, f in cluster.facts if type(f).__name__ == "CheckpointSaved"}
    assert set(steps) <= saved and all(
        b - a >= EVERY for a, b in zip(steps, steps[1:], strict=False)
    )
    lines = [json.loads(line) for line in evaluator.output().splitlines() if line.startswith("{")]
    assert [line["step"] for line in lines][: len(steps)] == steps
    assert all(line["journaled"] in (None, line["digest"]) for line in lines)


def test_a_workers_gpu_workload_and_transfer_queue_show_in_status_and_metrics(
    cluster: Cluster,
) -> None:
    import re
    import urllib.request

    from tests.helpers import wait_until

    leader = cluster.coordinator("c1", "--metrics-port", "0", "--heartbeat-timeout", "600")
    w = cluster.python("w", "-m", "tests.integration.gpu_workload", cluster.url, cluster.job, "w")
    cluster.until(lambda s: "w" in s.members and s.members["w"].workloads, message="w's workload")
    port = wait_until(
        lambda: re.search(r"metrics on http://0\.0\.0\.0:(\d+)/", leader.output()),
        20,
        message="metrics port logged",
    ).group(1)
    expected = [
        'cohort_gpu_workloads{coordinator="c1",job="itest"} 1.0',
        'cohort_gpu_workload_memory_bytes{coordinator="c1",job="itest"} 3.221225472e+09',
        'cohort_transfers_pending{coordinator="c1",job="itest"} 2.0',
    ]

    def missing() -> list[str]:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        lines = body.decode().splitlines()
        return [line for line in expected if line not in lines]

    wait_until(lambda: not missing(), 20, 0.1, message="metrics show the workload")
    body = json.loads(
        subprocess.run(
            [sys.executable, "-m", "cohort", "--redis-url", cluster.url, "status", "--job",
             cluster.job, "--json"], capture_output=True, text=True, timeout=60,
        ).stdout
    )  # fmt: skip
    (workload,) = body["members"]["w"]["workloads"]
    assert workload["devices"] == [0, 1] and workload["priority"] == 5
    assert body["leader_view"]["workers"]["w"]["transfers"]["pending"] == 2
    human = subprocess.run(
        [sys.executable, "-m", "cohort", "--redis-url", cluster.url, "status", "--job",
         cluster.job], capture_output=True, text=True, timeout=60,
    ).stdout  # fmt: skip
    assert "w: train (pid" in human and "transfers: 2 pending, 0 staged" in human
    w.popen.send_signal(signal.SIGTERM)
    assert cluster.finished(w, 30) == 0, w.output()[-3000:]


def test_the_torch_evaluator_example_scores_each_checkpoint_of_the_elastic_example(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/elastic-api.md's evaluator, as shipped: examples/elastic_evaluate.py loads each
    checkpoint examples/elastic_train.py's job saves into the model and reports its scores."""
    if os.environ.get("CI") != "true":
        pytest.importorskip("torch")  # CI installs torch: there a missing torch must fail
    monkeypatch.setenv("COHORT_JOB", cluster.job)
    monkeypatch.setenv("COHORT_REDIS_URL", cluster.url)
    cluster.coordinator(
        "c1", "--min-workers", "2", "--dataset-size", "4096", "--batch-size", "32",
        "--epochs", "2", "--checkpoint-uri", f"file://{tmp_path / 'ckpt'}",
        "--checkpoint-every", "32", "--checkpoint-keep", "8",
    )  # fmt: skip
    evaluator = cluster.python("ev", "examples/elastic_evaluate.py", "--job", cluster.job)
    trainers = [cluster.python(name, "examples/elastic_train.py") for name in ("a", "b")]
    for proc in (*trainers, evaluator):
        assert cluster.finished(proc, 240) == 0, proc.output()[-3000:]
    scored = [json.loads(line) for line in evaluator.output().splitlines() if line[:1] == "{"]
    steps = [score["step"] for score in scored]  # 2 epochs of 64 steps, a checkpoint every 32
    assert steps == sorted(steps) and set(steps) <= {31, 63, 95, 127} and steps[-1] == 127
    assert scored[-1]["accuracy"] > 0.5, scored  # the final weights learned the task
    journaled = [f for _, f in cluster.of_type(EvalReported)]
    assert [(f.step, f.metrics["accuracy"]) for f in journaled] == [
        (s["step"], s["accuracy"]) for s in scored
    ]
