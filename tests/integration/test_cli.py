"""The cohort command as a user runs it: status, export, replay, demo, and bad input."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cohort.errors import Exit
from cohort.events.keys import Keys
from cohort.events.models import Join, StepDone, WeightsLoaded
from cohort.events.streams import Inbox
from cohort.localredis import LocalRedis
from tests.helpers import processes_mentioning, require_redis_server, wait_until
from tests.integration.cluster import Cluster

pytestmark = [pytest.mark.redis_server, pytest.mark.slow]


def cohort(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cohort", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=cwd,
    )


def test_status_export_and_replay_agree_on_the_state(cluster: Cluster, tmp_path: Path) -> None:
    cluster.coordinator("c1", "--min-workers", "1", "--heartbeat-timeout", "600")
    inbox = Inbox(cluster.conn, Keys(cluster.job).inbox)
    for name in ("a", "b"):
        inbox.send(Join(at=time.time(), job=cluster.job, worker=name))
        inbox.send(WeightsLoaded(at=time.time(), job=cluster.job, worker=name))
    cluster.until(lambda s: set(s.members) == {"a", "b"} and s.ranks, message="a and b joined")

    status = cohort("--redis-url", cluster.url, "status", "--job", cluster.job, "--json")
    assert status.returncode == 0, status.stderr
    body = json.loads(status.stdout)
    assert body["version"] == 1 and body["members"]["a"]["rank"] == 0
    assert body["leader_id"] == body["elected_id"] == "c1"
    assert body["lease_token"].startswith("1:c1:")
    human = cohort("status", "--job", cluster.job, "--redis-url", cluster.url)
    assert human.returncode == 0 and "c1" in human.stdout and "active" in human.stdout

    out = tmp_path / "run.cohort"
    exported = cohort("export", "--job", cluster.job, "-o", str(out), "--redis-url", cluster.url)
    assert exported.returncode == 0, exported.stderr
    from_file = json.loads(cohort("replay", "--file", str(out), "--json").stdout)
    from_redis = json.loads(
        cohort("--redis-url", cluster.url, "replay", "--job", cluster.job, "--json").stdout
    )
    assert from_file["state"]["state_hash"] == from_redis["state"]["state_hash"]
    assert from_file["state"]["state_hash"] == body["state_hash"]
    first = from_file["timeline"][1]["id"]
    early = json.loads(cohort("replay", "--file", str(out), "--until", first, "--json").stdout)
    assert [e["type"] for e in early["timeline"]] == ["JobConfigured", "LeaderElected"]


@pytest.mark.parametrize(
    "args, says",
    [
        (["coordinator", "--job", "x y"], "job name 'x y' is not valid"),
        (
            ["worker", "--job", "möbius"],
            "job name 'möbius' is not valid: use 1-64 characters "
            "from the ASCII letters A-Z and a-z, the digits 0-9, '.', '_' and '-'",
        ),
        (
            ["coordinator", "--job", "j", "--min-workers", "3", "--max-workers", "2"],
            "must not exceed max_workers",
        ),
        (
            [
                "coordinator",
                "--job",
                "j",
                "--heartbeat-timeout",
                "0.5",
                "--heartbeat-interval",
                "1",
            ],
            "must be longer than",
        ),
        (["--redis-url", "http://h", "status", "--job", "j"], "scheme 'http'"),
        (["status", "--job", "j", "--redis-url", "redis://127.0.0.1:1/0"], "cannot reach Redis"),
        (["replay"], "exactly one source: --job J"),
        (["replay", "--file", "/no/such/file"], "cannot open export file"),
        (["replay", "--file", "/etc/hostname"], "not a `cohort export` file"),
        (["replay", "--job", "j", "--until", "yesterday"], "'yesterday' is not a stream"),
        (["replay", "--job", "j", "--audit", "-q", "--timeline"], "--quiet and --timeline"),
        (["coordinator", "--job", "j", "--config", "/no/such.toml"], "cannot read config file"),
        (["coordinator", "--job", "j", "--journal-hot", "50"], "50 is not in the range x>=200"),
        (
            ["coordinator", "--job", "j", "--archive-uri", "segs"],
            "--archive-uri 'segs' is a relative",
        ),
        (["coordinator", "--job", "j", "--archive-uri", "nosuch://x"], "knows no filesystem"),
    ],
)
def test_bad_input_gets_a_message_naming_it_and_no_traceback(args: list[str], says: str) -> None:
    result = cohort(*args, timeout=30)
    assert result.returncode != 0
    assert says in result.stderr + result.stdout
    assert "Traceback" not in result.stderr


def _demo_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "COHORT_REDIS_URL"}
    (tmp_path / "tmp").mkdir()
    env["TMPDIR"] = str(tmp_path / "tmp")
    return env


def test_demo_runs_to_its_summary_and_leaves_nothing_behind(tmp_path: Path) -> None:
    env = _demo_env(tmp_path)
    result = cohort("demo", "--steps", "24", env=env, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "summary" in result.stderr and "audit" in result.stderr and "passed" in result.stderr
    port = re.search(r"redis://127\.0\.0\.1:(\d+)", result.stderr).group(1)  # type: ignore[union-attr]
    assert processes_mentioning(f"127.0.0.1:{port}") == []
    assert processes_mentioning(str(tmp_path / "tmp")) == []
    assert list((tmp_path / "tmp").iterdir()) == []
    export = str(tmp_path / "cohort-demo.export")
    replayed = cohort("replay", "--file", export, "--audit", "-q")
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    audited = cohort("replay", "--file", export, "--audit")  # the verdict, not the timeline
    assert audited.returncode == 0 and "passed" in audited.stdout
    assert "StepCommitted" not in audited.stdout
    both = cohort("replay", "--file", export, "--audit", "--timeline")
    assert both.stdout.count("StepCommitted") >= 24 and "passed" in both.stdout
    assert "StepCommitted" in cohort("replay", "--file", export).stdout  # no --audit: as ever


@pytest.mark.parametrize("inherited", ["default", "ignored"])
def test_interrupted_demo_stops_every_process_and_removes_its_files(
    tmp_path: Path, inherited: str
) -> None:
    """Also when started with SIGINT ignored, as a script's background job is."""
    env = _demo_env(tmp_path)
    disposition = signal.SIG_IGN if inherited == "ignored" else signal.SIG_DFL
    demo = subprocess.Popen(
        [sys.executable, "-m", "cohort", "demo", "--steps", "10000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=tmp_path,
        preexec_fn=lambda: signal.signal(signal.SIGINT, disposition),
    )
    # Wait until it is well under way: coordinators and workers are running.
    wait_until(
        lambda: len(processes_mentioning("example-worker --job demo", parent=demo.pid)) >= 3,
        60,
        message="demo workers running",
    )
    children = processes_mentioning(" --job demo", parent=demo.pid)
    assert len(children) >= 5  # two coordinators and the workers
    demo.send_signal(signal.SIGINT)
    _, err = demo.communicate(timeout=60)
    assert demo.returncode == 130, err.decode()[-2000:]
    gone = [line.split(":")[0] for line in children]
    wait_until(
        lambda: not any(Path(f"/proc/{pid}").exists() for pid in gone),
        20,
        message="no demo process left",
    )
    assert processes_mentioning(str(tmp_path / "tmp")) == []
    assert list((tmp_path / "tmp").iterdir()) == []


def test_demo_on_a_redis_without_aof_stops_at_once_naming_the_coordinators(
    tmp_path: Path,
) -> None:
    """Both coordinators refuse a Redis that keeps no append-only file and exit at start-up;
    the demo says so within seconds (not at its 240 s deadline), shows the end of a
    coordinator's log, and leaves no process or temp file behind."""
    env = _demo_env(tmp_path)
    with LocalRedis(appendonly=False, binary=require_redis_server()) as volatile:
        env["COHORT_REDIS_URL"] = url = volatile.url
        started = time.monotonic()
        result = cohort("demo", "--steps", "24", env=env, cwd=tmp_path, timeout=120)
        took = time.monotonic() - started
    assert result.returncode == Exit.FAILED, result.stderr[-3000:]
    assert took < 60, f"the demo took {took:.0f} s to notice"
    error = [line for line in result.stderr.splitlines() if line.startswith("cohort: error:")]
    assert error[0] == (
        "cohort: error: every coordinator has exited before the job's end "
        "(coord-1: exit code 4, coord-2: exit code 4); coord-1's log ends:"
    )
    assert "runs without an append-only file" in result.stderr  # coord-1's own last words
    assert "Traceback" not in result.stderr
    mine = f"--redis-url {url} "  # this demo's processes (others may run demos meanwhile)
    wait_until(lambda: processes_mentioning(mine) == [], 20, message="no demo process left")
    assert processes_mentioning(str(tmp_path / "tmp")) == []
    assert list((tmp_path / "tmp").iterdir()) == []


def test_coordinator_metrics_are_scraped_over_http(cluster: Cluster) -> None:
    import urllib.request

    leader = cluster.coordinator("c1", "--min-workers", "1", "--metrics-port", "0")
    port = wait_until(
        lambda: re.search(r"metrics on http://0\.0\.0\.0:(\d+)/", leader.output()),
        20,
        message="metrics port logged",
    ).group(1)
    inbox = Inbox(cluster.conn, Keys(cluster.job).inbox)
    inbox.send(Join(at=time.time(), job=cluster.job, worker="a"))
    inbox.send(WeightsLoaded(at=time.time(), job=cluster.job, worker="a"))
    inbox.send(
        StepDone(at=time.time(), job=cluster.job, worker="a", step=0, world=1, step_time=0.3)
    )

    expected = [
        'cohort_last_committed_step{coordinator="c1",job="itest"} 0.0',
        'cohort_leading{coordinator="c1",job="itest"} 1.0',
        'cohort_world_size{coordinator="c1",job="itest"} 1.0',
        'cohort_commands_total{coordinator="c1",job="itest"} 3.0',
        'cohort_step_time_seconds_count{coordinator="c1",job="itest"} 1.0',
        'cohort_inbox_lag_seconds{coordinator="c1",job="itest"} 0.0',
        'cohort_dead_letters_total{coordinator="c1",job="itest"} 0.0',
    ]

    def missing() -> list[str]:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        lines = body.decode().splitlines()
        return [line for line in expected if line not in lines]

    wait_until(lambda: not missing(), 20, 0.1, message="metrics show the job")


def test_status_and_metrics_show_the_rate_epoch_progress_and_eta(cluster: Cluster) -> None:
    import urllib.request

    leader = cluster.coordinator(
        "c1", "--min-workers", "2", "--heartbeat-timeout", "600", "--dataset-size", "640",
        "--batch-size", "32", "--max-steps", "50", "--metrics-port", "0",
    )  # fmt: skip
    inbox = Inbox(cluster.conn, Keys(cluster.job).inbox)
    for name in ("a", "b"):
        inbox.send(Join(at=time.time(), job=cluster.job, worker=name))
        inbox.send(WeightsLoaded(at=time.time(), job=cluster.job, worker=name))
    cluster.until(lambda s: len(s.ranks) == 2, message="a and b in the world")
    for step in range(5):
        for name in ("a", "b"):
            inbox.send(StepDone(at=time.time(), job=cluster.job, worker=name, step=step, world=1))
        cluster.until(lambda s, step=step: s.last_committed == step, message=f"step {step}")

    body = json.loads(
        cohort("--redis-url", cluster.url, "status", "--job", cluster.job, "--json").stdout
    )
    ahead = body["progress"]
    assert ahead["steps_left"] == 45 and ahead["epoch_progress"] == pytest.approx(0.5)
    assert ahead["steps_per_second"] > 0 and ahead["eta_seconds"] is not None
    human = cohort("status", "--job", cluster.job, "--redis-url", cluster.url).stdout
    assert "steps/s" in human and "epoch 0 50% done" in human and "steps left 45" in human

    port = wait_until(
        lambda: re.search(r"metrics on http://0\.0\.0\.0:(\d+)/", leader.output()),
        20,
        message="metrics port logged",
    ).group(1)

    def steps_left() -> bool:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        return 'cohort_steps_left{coordinator="c1",job="itest"} 45.0' in body.decode()

    wait_until(steps_left, 20, 0.1, message="metrics show the steps left")


def test_status_of_a_job_waiting_for_its_data_says_its_length_and_what_it_waits_for(
    cluster: Cluster,
) -> None:
    """Configured with --epochs 3 and no dataset size, the job's steps are unknown until a
    worker declares its data: status says the length it has, and why training waits."""
    cluster.spawn("c1", "coordinator", "--job", cluster.job, "--epochs", "3", "--min-workers", "2")
    cluster.until(lambda s: s.configured, message="the job configured")
    human = cohort("--redis-url", cluster.url, "status", "--job", cluster.job).stdout
    assert "end after 3 epochs (steps known once the data is)" in human, human
    assert "no configured length" not in human
    assert "paused: waits for 2 worker(s) to train; 0 member(s) now" in human
