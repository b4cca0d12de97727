"""What a new user sees of one ordinary run (issue 19): two coordinators (the leader is
killed), three CPU workers (one is killed), to the job's end; then the commands they run on
it: the coordinators' logs, `status --json` and `--watch`, `report`, and a typo in a job name.

The run happens once for the module; each test reads what it left.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cohort.errors import Exit
from cohort.localredis import LocalRedis
from tests.helpers import require_redis_server
from tests.integration.cluster import ROOT, Cluster, Process
from tests.integration.test_cli import cohort

pytestmark = [pytest.mark.redis_server, pytest.mark.slow]

JOB = "newcomer"
STEPS = 120


class Run:
    def __init__(
        self, cluster: Cluster, c1: Process, c2: Process, workers: list[Process], narrow: str
    ) -> None:
        self.cluster = cluster
        self.c1, self.c2 = c1, c2
        self.workers = workers
        self.narrow = narrow
        """`cohort status` in an 80-column terminal while three workers trained."""

    @property
    def url(self) -> str:
        return self.cluster.url


def run_in_terminal(args: list[str], columns: int, rows: int = 60) -> str:
    """`cohort *args` on a pseudo-terminal `columns` wide; its whole output."""
    main, other = pty.openpty()
    fcntl.ioctl(other, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "cohort", *args], stdin=other, stdout=other, stderr=other,
        env={**env, "TERM": "xterm"}, close_fds=True,
    )  # fmt: skip
    os.close(other)
    out = b""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ready, _, _ = select.select([main], [], [], 0.5)
        if not ready:
            if proc.poll() is not None:
                break
            continue
        try:
            chunk = os.read(main, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(main)
    proc.wait(10)
    return out.decode(errors="replace")


def _plain(line: str) -> str:
    """`line` as it shows: without terminal codes."""
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", line).rstrip("\r")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    tmp = tmp_path_factory.mktemp("newcomer")
    server = LocalRedis(appendonly=True, binary=require_redis_server()).start()
    cluster = Cluster(url=server.url, conn=server.client(), job=JOB, tmp=tmp)
    flags = (
        "--min-workers", "2", "--heartbeat-interval", "0.2", "--heartbeat-timeout", "1",
        "--lease", "1", "--max-steps", str(STEPS), "--dataset-size", "100000",
    )  # fmt: skip
    try:
        c1 = cluster.coordinator("c1", *flags)
        cluster.until(lambda s: s.leader == "c1", message="c1 leads")
        c2 = cluster.spawn("c2", "--log-json", "coordinator", "--job", JOB, "--id", "c2", *flags)
        workers = [
            cluster.worker(f"w{i}", "--steps", "1000", "--step-time", "0.05") for i in (1, 2, 3)
        ]
        cluster.until(lambda s: s.last_committed >= 20, 60, message="training")
        c1.kill(signal.SIGKILL)
        cluster.until(lambda s: s.leader == "c2", 30, message="c2 takes over")
        cluster.until(lambda s: s.last_committed >= 50, 60, message="training under c2")
        narrow = run_in_terminal(["--redis-url", cluster.url, "status", "--job", JOB], 80)
        workers[2].kill(signal.SIGKILL)
        cluster.until(lambda s: s.counters.failed == 1, 30, message="w3 failed")
        cluster.until(lambda s: s.finished is not None, 120, message="the job finished")
        for worker in workers[:2]:
            assert cluster.finished(worker, 60) == 0, worker.output()[-2000:]
        assert cluster.finished(c2, 60) == 0, c2.output()[-2000:]
        yield Run(cluster, c1, c2, workers, narrow)
    finally:
        cluster.stop()
        server.stop()


# ---------------------------------------------------------------- item 2: coordinator logs


def test_the_leaders_log_has_one_info_line_per_membership_and_leadership_fact(run: Run) -> None:
    plain = run.c1.output()  # the first leader, plain lines
    for fact in ("JobConfigured", "LeaderElected", "WorkerJoined", "WorldChanged"):
        assert f"INFO    cohort.coordinator: {fact} " in plain, fact
    assert "StepCommitted" not in plain  # one per step: DEBUG

    records = [json.loads(line) for line in run.c2.output().splitlines() if line.startswith("{")]
    facts = {r["fact"]: r for r in records if "fact" in r}
    assert facts["LeaderElected"]["msg"].startswith("LeaderElected coordinator=c2 epoch=2")
    failed = facts["WorkerFailed"]
    assert failed["level"] == "info" and failed["job"] == JOB
    assert failed["msg"].startswith("WorkerFailed worker=w3 ")
    assert failed["journal_id"] in failed["msg"]
    assert "WorldChanged" in facts and "JobFinished" in facts and "StepCommitted" not in facts


# ---------------------------------------------------------------- item 3: a typo in a job name


@pytest.mark.parametrize(
    "command",
    [
        ["export", "-o", "out.cohort"],
        ["replay"],
        ["report", "-o", "out.html"],
    ],
)
def test_an_unknown_job_is_an_error_listing_the_jobs_redis_holds(
    run: Run, command: list[str], tmp_path: Path
) -> None:
    result = cohort(
        "--redis-url", run.url, command[0], "--job", "nonexistent", *command[1:], cwd=tmp_path
    )
    assert result.returncode == Exit.USAGE, result.stdout + result.stderr
    assert result.stderr.strip().splitlines() == [
        f"cohort: error: job 'nonexistent' has no journal or inbox in Redis at {run.url}; "
        f"the jobs there: {JOB}"
    ]
    assert list(tmp_path.iterdir()) == []  # nothing written


# ---------------------------------------------------------------- item 4: status --json


def test_status_json_names_the_leader_id_and_the_lease_token_apart(run: Run) -> None:
    body = json.loads(cohort("--redis-url", run.url, "status", "--job", JOB, "--json").stdout)
    schema = (ROOT / "docs" / "status-json.md").read_text()
    assert f"`version`: {body['version']}" in schema
    documented = {line.split("`")[1] for line in schema.splitlines() if line.startswith("| `")}
    assert set(body) == documented
    # c2 ended the job and let the lease go: nobody leads; c2 was elected last.
    assert body["leader_id"] is None and body["lease_token"] is None
    assert body["elected_id"] == "c2" and body["leader_epoch"] == 2 and body["job"] == JOB


# ---------------------------------------------------------------- items 5 and 6: --watch


def test_watch_into_a_pipe_prints_plain_frames_with_commits_folded(run: Run) -> None:
    watch = subprocess.Popen(
        [sys.executable, "-m", "cohort", "--redis-url", run.url, "status", "--job", JOB,
         "--watch", "--interval", "0.2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert watch.stdout is not None
        frames = 0
        seen: list[str] = []
        deadline = time.monotonic() + 30
        while frames < 2 and time.monotonic() < deadline:
            line = watch.stdout.readline()
            seen.append(line)
            frames += line.startswith("--- ")
        assert frames == 2, "".join(seen)
        watch.send_signal(signal.SIGINT)
        rest, err = watch.communicate(timeout=20)
    finally:
        if watch.poll() is None:
            watch.kill()
    assert watch.returncode == 0, err
    text = "".join(seen)
    assert "recent facts" in text and "JobFinished" in text
    assert "\u2013" in text and " committed (" in text  # "steps 100–119 committed (...)"
    assert "\x1b[" not in text  # plain text, no terminal codes


def test_status_in_an_80_column_terminal_cuts_no_cell(run: Run) -> None:
    out = run.narrow
    assert all(f"w{i}" in out for i in (1, 2, 3)) and "c2" in out, out
    assert "\u2026" not in out, out  # rich's ellipsis: a cell was cut
    assert max(len(_plain(line)) for line in out.splitlines()) <= 80, out
    assert "80 columns:" in out and "not shown (widen to see)" in out


# ---------------------------------------------------------------- items 6 and 7: report


def test_the_report_shows_the_failure_folds_commits_and_says_there_was_no_gpu(
    run: Run, tmp_path: Path
) -> None:
    out = tmp_path / "report.html"
    result = cohort("--redis-url", run.url, "report", "--job", JOB, "-o", str(out))
    assert result.returncode == 0, result.stderr
    page = out.read_text()
    timeline = page[page.index('<table id="timeline">') :]
    assert "<td>WorkerFailed</td><td>worker=w3 " in timeline
    assert timeline.count("<td>StepCommitted</td>") < STEPS // 4
    assert " committed (" in timeline
    assert 'id="no-gpu"' in page and 'id="plot-gpu-memory"' not in page
