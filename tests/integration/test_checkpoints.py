"""Training progress survives losing every worker (issue 16), with real processes and SIGKILL.

A worker asked to checkpoint writes through fsspec (file:// here) in the background; when
every holder of the last committed weights dies, the next world rewinds to the latest
checkpoint, data position included, and the final weights equal one process trained on
the committed batches of the lineage the model descends from. Without a checkpoint the
job pauses until `cohort resume`.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import numpy as np
import pytest

from cohort import example, mlp
from cohort.coordinator.audit import audit
from cohort.events.models import (
    CheckpointSaved,
    DataPosition,
    Rewound,
    StepCommitted,
    TrainingPaused,
    WeightsLost,
    WorldChanged,
)
from cohort.events.shards import Shard
from cohort.events.storage import OWNER_FILE
from cohort.localredis import LocalRedis
from cohort.worker.loop import checkpoints
from tests.helpers import wait_until
from tests.integration.cluster import Cluster, ms

pytestmark = [pytest.mark.redis_server, pytest.mark.slow]

INTERVAL, TIMEOUT = 0.5, 2.0
PACE = "0.03"


def saved_weights(cluster: Cluster, name: str) -> mlp.Params:
    with np.load(cluster.saved(name)) as saved:
        return {k: saved[k] for k in saved.files}


def close(a: mlp.Params, b: mlp.Params) -> bool:
    return all(np.allclose(a[k], b[k], rtol=1e-9, atol=1e-12) for k in b)


def test_every_worker_killed_a_newcomer_resumes_from_the_checkpoint_on_the_lineage(
    cluster: Cluster, tmp_path: Path
) -> None:
    store = tmp_path / "ckpt"
    cluster.trainer_coordinator(
        "c1", "--checkpoint-uri", f"file://{store}", "--checkpoint-every", "10",
        workers=2, interval=INTERVAL, timeout=TIMEOUT,
    )  # fmt: skip
    steps = 120
    first = [cluster.example_worker(n, steps, "--pace", PACE) for n in ("a", "b")]
    cluster.until(
        lambda s: bool(s.checkpoints) and s.last_committed >= s.checkpoints[-1].step + 5,
        timeout=90,
        message="a checkpoint saved, and steps committed after it",
    )
    killed_at = max(proc.kill(signal.SIGKILL) for proc in first)
    cluster.until(lambda s: not s.holders and s.paused, 30, "both workers failed")
    latest = cluster.state.checkpoints[-1]
    waits = cluster.cli("status", "--job", cluster.job).stdout  # what the pause waits for
    assert f"no member holds the weights of step {cluster.state.last_committed}" in waits
    assert f"rewinds to the checkpoint of step {latest.step}" in waits, waits
    # the newcomer starts at once, as a scheduler would restart the job
    newcomer = cluster.example_worker("c", steps, "--pace", PACE, save=True)
    newcomer_2 = cluster.example_worker("d", steps, "--pace", PACE, save=True)
    assert cluster.finished(newcomer, 180) == 0, newcomer.output()[-3000:]
    assert cluster.finished(newcomer_2, 180) == 0, newcomer_2.output()[-3000:]

    cluster.pull()
    facts = [f for _, f in cluster.facts]
    (rewind_id, rewind), *_ = cluster.of_type(Rewound)
    assert rewind.source == "checkpoint" and rewind.to_step >= latest.step
    assert rewind.from_step > rewind.to_step  # committed steps were discarded, not hidden
    world = next(f for i, f in cluster.facts if isinstance(f, WorldChanged) and i > rewind_id)
    assert world.weights is not None and world.weights.source == "checkpoint"
    assert world.weights.uri == rewind.uri
    first_commit = next(
        i for i, f in cluster.facts if isinstance(f, StepCommitted) and i > rewind_id
    )
    print(
        f"last worker's SIGKILL -> training again from the checkpoint: "
        f"{ms(first_commit) - killed_at:.2f} s (heartbeat_timeout {TIMEOUT} s)"
    )

    expected = example.reference(facts)
    for name in ("c", "d"):
        assert close(saved_weights(cluster, name), expected), name
    report = audit(facts)
    assert report.ok, report.problems
    assert report.rewinds and report.discarded == rewind.from_step - rewind.to_step
    assert len({p.summary()["weights_digest"] for p in (newcomer, newcomer_2)}) == 1
    kept = sorted(p.name for p in store.iterdir() if p.name != OWNER_FILE)
    assert len(kept) <= 3 and not [n for n in kept if ".tmp-" in n]  # --checkpoint-keep 3


def test_without_a_checkpoint_the_job_pauses_until_resume_from_scratch(cluster: Cluster) -> None:
    cluster.trainer_coordinator("c1", workers=1, interval=INTERVAL, timeout=TIMEOUT)
    before = cluster.cli("resume", "--job", cluster.job, "--from-scratch")
    assert before.returncode != 0  # no journal yet, or nothing lost: never a silent resume
    steps = 40
    a = cluster.example_worker("a", steps, "--pace", PACE)
    cluster.until(lambda s: s.last_committed >= 10, timeout=60, message="a trains")
    refused = cluster.cli("resume", "--job", cluster.job, "--from-scratch")
    assert refused.returncode == 4 and "is not waiting for a resume" in refused.stderr
    a.kill(signal.SIGKILL)
    b = cluster.example_worker("b", steps, "--pace", PACE, save=True)
    cluster.until(lambda s: s.weights_lost is not None, timeout=30, message="the loss is noticed")
    lost_step = cluster.state.weights_lost
    (_, pause), *_ = [p for p in cluster.of_type(TrainingPaused) if "lost" in p[1].reason]
    assert f"weights of step {lost_step} are lost" in pause.reason
    wait_until(lambda: "weights of step" in b.output(), 30, message="b says what it waits for")
    status = json.loads(cluster.cli("status", "--job", cluster.job, "--json").stdout)
    assert status["weights_lost"] == lost_step and status["paused"]
    assert cluster.state.last_committed == lost_step  # nobody went on from fresh weights

    resumed = cluster.cli("resume", "--job", cluster.job, "--from-scratch", "--reason", "t")
    assert resumed.returncode == 0, resumed.stderr
    assert "resumes from scratch" in resumed.stdout
    assert cluster.finished(b, 120) == 0, b.output()[-3000:]
    cluster.pull()
    facts = [f for _, f in cluster.facts]
    assert [f.step for f in facts if isinstance(f, WeightsLost)] == [lost_step]
    assert close(saved_weights(cluster, "b"), example.reference(facts))
    report = audit(facts)
    assert report.ok and report.discarded == lost_step + 1


WRITER = """
import sys, threading
import cohort
from cohort.worker.loop import checkpoints
conn = cohort.connect(cohort.RedisSettings.resolve(sys.argv[1]))
worker = cohort.Worker(conn, sys.argv[2], worker_id="writer")
worker.join(); worker.ready()
assignment = worker.wait_active(30)
step = assignment.start_step
while True:
    worker.batch(step)
    worker.step_done(step)
    worker.wait_committed(step, 30)
    request = checkpoints.pending(worker.view.requested, step)
    if request is not None:
        print("writing", request.uri, flush=True)
        payload = bytes(400 * 1024 * 1024)  # big enough to be killed in the middle
        checkpoints.CheckpointWriter(worker).submit(request, lambda: payload, None)
        threading.Event().wait()  # idle while the writer thread writes, until killed
    step += 1
"""


def test_a_writer_killed_mid_write_leaves_nothing_referenced(
    cluster: Cluster, tmp_path: Path
) -> None:
    store = tmp_path / "ckpt"
    cluster.trainer_coordinator(
        "c1", "--checkpoint-uri", str(store), "--checkpoint-every", "3", workers=1,
        interval=INTERVAL, timeout=TIMEOUT,
    )  # fmt: skip
    writer = cluster.python("writer", "-c", WRITER, cluster.url, cluster.job)

    def being_written() -> list[Path]:
        return [p for p in store.glob("*.tmp-*") if p.stat().st_size > 0]

    partial = wait_until(being_written, 60, message="the checkpoint file being written")
    writer.kill(signal.SIGKILL)
    cluster.until(
        lambda s: "writer" not in s.members, timeout=TIMEOUT + 10, message="writer failed"
    )
    assert cluster.of_type(CheckpointSaved) == []
    assert cluster.state.checkpoints == () and cluster.state.requested  # asked, never indexed
    assert not list(store.glob("*.ckpt"))  # no file under a checkpoint's own name
    assert partial[0].stat().st_size < 400 * 1024 * 1024
    listing = cluster.cli("checkpoints", "--job", cluster.job)
    assert listing.returncode == 0 and "has no checkpoints" in listing.stdout


def test_a_redis_restart_keeps_the_checkpoint_index(
    cluster: Cluster, server: LocalRedis, tmp_path: Path
) -> None:
    coordinator = cluster.trainer_coordinator(
        "c1", "--checkpoint-uri", f"file://{tmp_path}/ckpt", "--checkpoint-every", "5",
        workers=1, interval=INTERVAL, timeout=TIMEOUT,
    )  # fmt: skip
    worker = cluster.example_worker("a", 30, "--pace", PACE)
    assert cluster.finished(worker, 120) == 0, worker.output()[-3000:]
    cluster.until(lambda s: s.counters.checkpoints == 6, timeout=30, message="six checkpoints")
    before = json.loads(cluster.cli("checkpoints", "--job", cluster.job, "--json").stdout)
    coordinator.kill(signal.SIGTERM)
    coordinator.wait(30)
    server.restart()
    wait_until(lambda: _answers(server), 30, message="redis-server back")
    after = json.loads(cluster.cli("checkpoints", "--job", cluster.job, "--json").stdout)
    assert after["checkpoints"] == before["checkpoints"]
    assert [c["step"] for c in after["checkpoints"]] == [19, 24, 29]  # the last 3 of 6
    for checkpoint in after["checkpoints"]:
        assert Path(checkpoint["uri"].removeprefix("file://")).is_file()


def _answers(server: LocalRedis) -> bool:
    try:
        return bool(server.client().ping())
    except Exception:
        return False


def test_checkpoint_flags_with_a_bad_uri_are_refused_naming_it(cluster: Cluster) -> None:
    for uri, words in (("relative/dir", "relative path"), ("nosuch://x", "no filesystem")):
        result = cluster.cli("coordinator", "--job", "j", "--checkpoint-uri", uri)
        assert result.returncode == 2 and uri in result.stderr and words in result.stderr
        assert "Traceback" not in result.stderr


def test_resume_from_a_checkpoint_file_continues_at_its_step_and_data_position(
    cluster: Cluster, tmp_path: Path
) -> None:
    """An operator's checkpoint file (here: other weights, made by hand for this job) is read
    and checked by `cohort resume`, and the job goes on from its step and its data."""
    cluster.trainer_coordinator("c1", workers=1, interval=INTERVAL, timeout=TIMEOUT)
    a = cluster.example_worker("a", 40, "--pace", PACE)
    cluster.until(lambda s: s.last_committed >= 12, timeout=60, message="a trains")
    a.kill(signal.SIGKILL)
    b = cluster.example_worker("b", 40, "--pace", PACE, save=True)
    cluster.until(lambda s: s.weights_lost is not None, timeout=30, message="the loss is noticed")

    other = mlp.init(seed=5)
    position = DataPosition(epoch=0, rest=Shard(ranges=((6 * 32, 2048),)))
    mine = str(tmp_path / "mine.ckpt")
    foreign = str(tmp_path / "foreign.ckpt")
    for uri, job in ((mine, cluster.job), (foreign, "another-job")):
        checkpoints.write(uri, job, 5, mlp.digest(other), position,
                          checkpoints.tensors_payload(other)())  # fmt: skip
    wrong = cluster.cli("resume", "--job", cluster.job, "--from-checkpoint", foreign)
    assert wrong.returncode == 4 and "'another-job', not of 'itest'" in wrong.stderr
    torn = tmp_path / "torn.ckpt"
    torn.write_bytes((tmp_path / "mine.ckpt").read_bytes()[:-10])
    cut = cluster.cli("resume", "--job", cluster.job, "--from-checkpoint", str(torn))
    assert cut.returncode == 4 and "cut short" in cut.stderr

    resumed = cluster.cli("resume", "--job", cluster.job, "--from-checkpoint", mine)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumes from step 5 ({mine})" in resumed.stdout
    assert cluster.finished(b, 120) == 0, b.output()[-3000:]
    cluster.pull()
    facts = [f for _, f in cluster.facts]
    world = next(f for f in reversed(facts) if isinstance(f, WorldChanged) and f.weights)
    assert world.weights is not None and world.weights.uri == mine
    first = next(f for f in facts if isinstance(f, WorldChanged) and f.weights
                 and f.weights.source == "checkpoint")  # fmt: skip
    assert first.start_step == 6 and first.shards[0].ranges == ((192, 2048),)
    assert close(saved_weights(cluster, "b"), example.reference(facts))
    assert audit(facts).ok
