"""A job's life with real processes: it ends at its length with every process exiting 0,
a coordinator given other settings refuses, and `cohort reset` clears a job's name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cohort.errors import Exit
from cohort.events.keys import Keys
from cohort.events.models import CheckpointSaved, JobFinished, WorkerFailed
from tests.integration.cluster import Cluster

pytestmark = [pytest.mark.redis_server, pytest.mark.slow]


def cohort(url: str, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cohort", "--redis-url", url, *args],
        capture_output=True,
        text=True,
        timeout=60,
        input=stdin,
        stdin=None if stdin is not None else subprocess.DEVNULL,
    )


def test_a_job_ends_at_its_length_and_every_process_exits_0(
    cluster: Cluster, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    length = ("--max-steps", "25", "--checkpoint-uri", str(ckpt), "--checkpoint-every", "10")
    coordinators = [cluster.trainer_coordinator(name, *length) for name in ("c1", "c2")]
    workers = [cluster.example_worker(name, None) for name in ("a", "b")]
    for proc in (*workers, *coordinators):
        assert cluster.finished(proc, 120) == 0, proc.output()[-3000:]
    (_, end), *more = cluster.of_type(JobFinished)
    assert not more and isinstance(end, JobFinished)
    assert (end.step, end.reason) == (24, "max_steps=25 reached")
    summaries = [proc.summary() for proc in workers]
    assert {s["finished"] for s in summaries} == {"max_steps=25 reached"}
    assert len({s["weights_digest"] for s in summaries}) == 1  # the same final weights
    saved = [f.step for _, f in cluster.of_type(CheckpointSaved)]
    assert saved[-1] == 24  # the last step is checkpointed before the workers go
    assert cluster.state.members == {} and cluster.of_type(WorkerFailed) == []
    status = cohort(cluster.url, "status", "--job", cluster.job, "--json")
    assert json.loads(status.stdout)["phase"] == "finished"
    human = cohort(cluster.url, "status", "--job", cluster.job)
    assert "finished (max_steps=25 reached)" in human.stdout

    late = cluster.trainer_coordinator("c3")  # a finished job: nothing to lead
    assert cluster.finished(late, 60) == 0
    assert "job 'itest' finished at step 24" in late.output()
    joiner = cluster.example_worker("d", None)
    assert cluster.finished(joiner, 60) == 0  # nothing to do, said in one line
    assert f"nothing to train: job {cluster.job!r} finished at step 24" in joiner.output()
    assert f"cohort reset --job {cluster.job}" in joiner.output()
    assert "Traceback" not in joiner.output()


def test_a_coordinator_given_other_settings_refuses_naming_both_and_the_ways_out(
    cluster: Cluster,
) -> None:
    first = cluster.coordinator("c1", "--max-steps", "1000", "--batch-size", "32")
    cluster.until(lambda s: s.configured, message="the config is journaled")
    other = cohort(
        cluster.url, "coordinator", "--job", cluster.job, "--max-steps", "500",
        "--batch-size", "32",
    )  # fmt: skip
    assert other.returncode == Exit.DATA
    assert "--max-steps 500 (journaled: 1000)" in other.stderr
    assert "batch-size" not in other.stderr  # given, and as journaled
    assert f"cohort reset --job {cluster.job}" in other.stderr
    assert "Traceback" not in other.stderr
    assert first.alive()  # the running leader is untouched


def test_reset_offers_an_export_then_deletes_every_key_of_the_job_and_only_those(
    cluster: Cluster, tmp_path: Path
) -> None:
    coordinator = cluster.coordinator("c1", "--max-steps", "1000")
    cluster.until(lambda s: s.leader == "c1", message="c1 leads")
    keys = Keys(cluster.job)
    cluster.conn.set(f"{keys.spread('n1')}:grad:1:0:0:0", b"x")  # a gradient on another slot
    cluster.conn.set("cohort:{itest2}:journal", b"another job's")
    refused = cohort(cluster.url, "reset", "--job", cluster.job, "--yes")
    assert refused.returncode == Exit.USAGE and "has a running coordinator" in refused.stderr
    coordinator.kill()
    coordinator.wait(10)
    cluster.conn.delete(keys.leader)  # its lease would run out within seconds anyway

    unanswered = cohort(cluster.url, "reset", "--job", cluster.job)  # stdin closed
    assert unanswered.returncode == Exit.USAGE and "nothing was deleted" in unanswered.stderr
    declined = cohort(cluster.url, "reset", "--job", cluster.job, stdin="n\nn\n")
    assert declined.returncode == 0 and "nothing was deleted" in declined.stdout
    assert cluster.conn.exists(keys.journal)

    export = tmp_path / "before-reset.cohort"
    done = cohort(cluster.url, "reset", "--job", cluster.job, stdin=f"y\n{export}\ny\n")
    assert done.returncode == 0, done.stderr
    assert "keys deleted" in done.stdout
    assert [k for p in keys.patterns for k in cluster.conn.scan_iter(match=p)] == []
    assert cluster.conn.get("cohort:{itest2}:journal") == b"another job's"
    replayed = cohort(cluster.url, "replay", "--file", str(export), "--json")
    assert json.loads(replayed.stdout)["state"]["leader"] == "c1"

    again = cluster.coordinator("c2", "--max-steps", "7")  # the name starts a new run
    cluster.state = type(cluster.state)()
    cluster.journal_id = "0-0"
    cluster.until(lambda s: s.leader == "c2", message="c2 leads a new journal")
    assert cluster.state.config is not None and cluster.state.config.max_steps == 7
    assert again.alive()
    nothing = cohort(cluster.url, "reset", "--job", "never-ran", "--yes")
    assert nothing.returncode == 0 and "nothing to reset" in nothing.stdout


def test_simulated_workers_end_with_the_job_too(cluster: Cluster) -> None:
    coordinator = cluster.coordinator("c1", "--min-workers", "2", "--max-steps", "10")
    workers = [cluster.worker(name, "--step-time", "0.01") for name in ("s1", "s2")]
    for proc in (*workers, coordinator):
        assert cluster.finished(proc, 60) == 0, proc.output()[-3000:]
    for proc in workers:
        summary = proc.summary()
        assert summary["finished"] == "max_steps=10 reached"
        assert summary["steps_committed"] == 10
