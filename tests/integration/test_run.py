"""`cohort run` as a user runs it: real launchers, real ranks, real signals.

A rank SIGKILLed mid-epoch is replaced while the others keep their processes; two
launchers sharing one Redis are two nodes, and losing one (its whole process group) leaves
the other to finish the job with its coordinator leading; Ctrl-C stops everything with
130; a script that cannot start ends the launcher after its restarts, naming the log; bad
input is refused by name before anything starts. Whatever ends the launcher, no process
it started is left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis

from cohort.coordinator.replay import from_redis
from cohort.coordinator.series import series
from cohort.errors import Exit
from cohort.events.keys import Keys
from cohort.events.models import LeaderElected, WorkerFailed, WorkerJoined
from cohort.localredis import LocalRedis
from tests.helpers import wait_until
from tests.integration.cluster import Cluster
from tests.integration.launch import Launch, running, training, worker_of

pytestmark = pytest.mark.slow

SCRIPT = str(Path(__file__).with_name("run_script.py"))
FAST = ("--heartbeat-timeout", "2", "--heartbeat-interval", "0.5", "--batch-size", "16")


# ---------------------------------------------------------------- one node


def test_a_killed_rank_is_replaced_the_others_keep_their_processes_and_the_job_ends_well(
    tmp_path: Path,
) -> None:
    run = Launch(
        "-n", "3", *FAST, "--epochs", "4", "--export", str(tmp_path / "run.export"),
        SCRIPT, "0.03", cwd=tmp_path,
    )  # fmt: skip
    assert run.run_json()["private_redis"] is True  # no Redis configured: its own
    watch = run.journal()
    wait_until(lambda: training(watch, 3), 60, message="three ranks training")
    before = run.ranks(SCRIPT)
    run.children()  # the coordinator, the Redis and the reaper too
    assert len(before) == 3
    victim = sorted(before)[1]
    os.kill(victim, signal.SIGKILL)
    after = wait_until(
        lambda: (now := run.ranks(SCRIPT)) - before and now, 30, message="a new rank in its place"
    )
    assert before - after == {victim}  # only the killed one was replaced
    assert all(running(pid) for pid in before - {victim})  # the others never restarted
    assert run.wait() == Exit.OK, run.output[-3000:]
    assert "1 rank(s) restarted" in run.output and "finished" in run.output
    assert "audit (every sample exactly once per epoch): passed" in run.output
    summary = next(line for line in run.lines if " steps committed over " in line)
    assert "1 failure(s) survived (" in summary and "silent" not in summary, summary
    replayed = subprocess.run(
        [sys.executable, "-m", "cohort", "replay", "--file", str(tmp_path / "run.export"),
         "--audit", "-q"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    wait_until(lambda: run.left() == [], 10, message="no process of the launcher's left")


def test_ctrl_c_stops_every_rank_the_coordinator_and_redis_and_exits_130(tmp_path: Path) -> None:
    run = Launch("-n", "2", *FAST, "--epochs", "1000", SCRIPT, "0.02", cwd=tmp_path)
    watch = run.journal()
    wait_until(lambda: training(watch, 2), 60, message="two ranks training")
    assert len(run.ranks(SCRIPT)) == 2
    assert len(run.children()) >= 5  # 2 ranks, the coordinator, Redis, the reaper
    run.popen.send_signal(signal.SIGINT)
    assert run.wait(60) == Exit.INTERRUPTED, run.output[-3000:]
    assert "every rank finishes its step and leaves" in run.output
    wait_until(lambda: run.left() == [], 10, message="no process of the launcher's left")


def test_a_script_that_cannot_start_ends_the_launcher_naming_its_log(tmp_path: Path) -> None:
    run = Launch("-n", "2", "--max-restarts", "1", SCRIPT, "0.02", "--fail-at-import", cwd=tmp_path)
    assert run.wait(120) == Exit.FAILED, run.output[-3000:]
    assert "ModuleNotFoundError: No module named 'no_such_module'" in run.output
    assert "giving up on it. Its log (" in run.output and "rank-0.log" in run.output
    assert "every local rank was given up on" in run.output
    assert run.output.count("replacing it in 1 s") == 2  # one restart each, then given up
    wait_until(lambda: run.left() == [], 10, message="no process of the launcher's left")


def test_a_run_whose_every_rank_crashed_says_its_failures_as_journaled_and_none_survived(
    tmp_path: Path,
) -> None:
    run = Launch(
        "-n", "2", "--max-restarts", "0", *FAST, "--epochs", "100", SCRIPT, "0.01",
        "--crash-at", "3", cwd=tmp_path,
    )  # fmt: skip
    assert run.wait(120) != Exit.OK, run.output[-3000:]
    summary = next(line for line in run.lines if " steps committed over " in line)
    assert "did not finish" in summary and "survived" not in summary, summary
    assert "2 failure(s) (" in summary and summary.count("process exited (exit code 1)") == 2


def test_a_figure_recorded_after_the_last_step_shows_in_status_and_the_reports_series(
    server: LocalRedis, tmp_path: Path
) -> None:
    job = "recorded-last"
    run = Launch(
        "--redis-url", server.url, "--job", job, "-n", "2", "--min-workers", "2", *FAST,
        "--max-steps", "4", SCRIPT, "0.01", "--record-at-end", cwd=tmp_path,
    )  # fmt: skip
    assert run.wait(120) == Exit.OK, run.output[-3000:]
    status = subprocess.run(
        [sys.executable, "-m", "cohort", "status", "--job", job, "--redis-url", server.url,
         "--json"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert status.returncode == 0, status.stdout + status.stderr
    evals = json.loads(status.stdout)["evals"]
    assert len(evals) == 2, evals  # one a rank
    assert all(e["step"] == 3 and e["metrics"] == {"val_loss": 0.125} for e in evals), evals
    data = series(from_redis(redis.Redis.from_url(server.url), job))
    figures = dict(data.figures)
    assert sorted(line.label for line in figures["val_loss"]) == sorted(e["worker"] for e in evals)
    assert all([v for _, v in line.points] == [0.125] for line in figures["val_loss"])


def test_a_clone_named_cohort_beside_the_script_is_refused_naming_it_before_anything_starts(
    tmp_path: Path,
) -> None:
    """git's default name for a clone of cohort's repository shadows the (editable)
    installed package in every rank: each would fail at import, restart after restart."""
    (tmp_path / "cohort" / "cohort").mkdir(parents=True)
    (tmp_path / "cohort" / "cohort" / "__init__.py").write_text("")
    script = tmp_path / "train.py"
    script.write_text(Path(SCRIPT).read_text())
    run = Launch("-n", "2", "train.py", cwd=tmp_path)
    assert run.wait(60) == Exit.USAGE, run.output
    assert f"the folder {tmp_path / 'cohort'} shadows the installed cohort package" in run.output
    assert "mv cohort cohort-src" in run.output and "Traceback" not in run.output
    assert not (tmp_path / "cohort-runs").exists() and run.seen == set()


def test_a_rank_given_up_after_failing_at_import_cohort_is_told_what_may_shadow_it(
    tmp_path: Path,
) -> None:
    script = tmp_path / "train.py"
    script.write_text("import cohort\n\ncohort.NoSuchJob()\n")
    run = Launch("-n", "1", "--max-restarts", "0", "train.py", cwd=tmp_path)
    assert run.wait(120) == Exit.FAILED, run.output[-3000:]
    assert "module 'cohort' has no attribute 'NoSuchJob'" in run.output
    given_up = run.output[run.output.index("giving up on it") :]
    assert "it shadows the installed package: rename that folder" in given_up


# ---------------------------------------------------------------- two nodes


def test_losing_a_node_leaves_the_other_to_finish_with_its_coordinator_leading(
    server: LocalRedis, tmp_path: Path
) -> None:
    common = ("--redis-url", server.url, "--job", "two-nodes", *FAST, "--epochs", "30")
    a = Launch(*common, "--node", "a", "-n", "2", SCRIPT, "0.03", cwd=tmp_path)
    watch = a.journal()
    wait_until(lambda: training(watch, 2) and watch.state.leader, 60, message="node a leads")
    assert watch.state.leader == "a-coordinator-0"
    b = Launch(*common, "--node", "b", "-n", "2", SCRIPT, "0.03", cwd=tmp_path)
    further = watch.state.last_committed + 3

    def all_four_hold_the_weights() -> bool:  # a step committed in the four ranks' world
        return training(watch, 4, further) and watch.state.holders == set(watch.state.ranks)

    wait_until(all_four_hold_the_weights, 60, message="a's and b's ranks training")
    a_processes = a.children()
    assert len(a_processes) >= 4 and len(b.children()) >= 3
    seen = len(watch.facts)
    os.killpg(a.popen.pid, signal.SIGKILL)  # the node's launcher, as a lost host takes it
    wait_until(lambda: not any(running(p) for p in a_processes), 10, message="a's are gone")
    assert b.wait() == Exit.OK, b.output[-3000:]
    watch.pull(0)
    after = [f for _, f in watch.facts[seen:]]
    assert any(isinstance(f, LeaderElected) and f.coordinator == "b-coordinator-0" for f in after)
    assert {f.worker for f in after if isinstance(f, WorkerFailed)} == {"a-0", "a-1"}
    assert watch.state.finished is not None
    assert "audit (every sample exactly once per epoch): passed" in b.output
    wait_until(lambda: b.left() == [], 10, message="no process of b's left")


# ---------------------------------------------------------------- Redis going away


def test_the_ranks_ride_out_a_redis_outage_under_the_launcher_and_none_is_restarted(
    server: LocalRedis, tmp_path: Path
) -> None:
    run = Launch(
        "--redis-url", server.url, "--job", "outage", "-n", "2", *FAST, "--epochs", "6",
        SCRIPT, "0.03", cwd=tmp_path,
    )  # fmt: skip
    watch = run.journal()
    wait_until(lambda: training(watch, 2), 60, message="two ranks training")
    ranks = run.ranks(SCRIPT)
    server.kill()  # as a crash: the AOF (fsync always) keeps every fact
    wait_until(lambda: "Redis does not answer" in run.output, 30, message="the outage noticed")
    assert run.popen.poll() is None and all(running(pid) for pid in ranks)
    server.restart()
    assert run.wait() == Exit.OK, run.output[-3000:]
    assert "Redis answers again" in run.output
    assert "0 rank(s) restarted" in run.output and "audit (every sample" in run.output
    wait_until(lambda: run.left() == [], 10, message="no process of the launcher's left")


def test_a_private_redis_that_dies_is_started_again_from_its_aof(tmp_path: Path) -> None:
    run = Launch("-n", "2", *FAST, "--epochs", "6", SCRIPT, "0.03", cwd=tmp_path)
    watch = run.journal()
    wait_until(lambda: training(watch, 2), 60, message="two ranks training")
    (server,) = run.children("redis-server")
    os.kill(server, signal.SIGKILL)
    wait_until(
        lambda: "the private Redis stopped (killed by SIGKILL)" in run.output, 30,
        message="the launcher saw its Redis die",
    )  # fmt: skip
    assert run.wait() == Exit.OK, run.output[-3000:]
    assert "audit (every sample exactly once per epoch): passed" in run.output
    wait_until(lambda: run.left() == [], 10, message="no process of the launcher's left")


# ---------------------------------------------------------------- per-worker credentials


def _users(conn: Any, job: str) -> set[str]:
    """The job's per-worker Redis users."""
    names = (u.decode() for u in conn.execute_command("ACL", "USERS"))
    return {name for name in names if name.startswith(f"cohort-{job}-w-")}


def test_each_rank_speaks_with_a_credential_of_its_own_deleted_when_its_process_ends(
    server: LocalRedis, tmp_path: Path
) -> None:
    job = "signed"
    run = Launch(
        "--redis-url", server.url, "--job", job, "--node", "s", "-n", "2", *FAST,
        "--epochs", "6", "--worker-credentials", SCRIPT, "0.03", cwd=tmp_path,
    )  # fmt: skip
    watch = run.journal()
    wait_until(lambda: training(watch, 2), 60, message="two signed ranks training")
    conn = server.client()
    assert conn.exists(Keys(job).identity)  # the job signs its commands now
    connected = {c["user"] for c in conn.client_list()}
    assert {"cohort-signed-w-s-0", "cohort-signed-w-s-1"} <= connected  # each as its own user
    victim = next(pid for pid in run.ranks(SCRIPT) if worker_of(pid) == "s-0")
    os.kill(victim, signal.SIGKILL)
    wait_until(lambda: f"cohort-{job}-w-s-0.1" in _users(conn, job), 30, message="s-0.1's user")
    assert f"cohort-{job}-w-s-0" not in _users(conn, job)  # the killed rank's is gone
    assert run.wait() == Exit.OK, run.output[-3000:]
    assert "each rank gets its own credential" in run.output
    assert conn.xlen(Keys(job).dead) == 0  # no command unsigned or badly signed
    assert _users(conn, job) == set()  # every credential it issued, deleted
    wait_until(lambda: run.left() == [], 10, message="no process of the launcher's left")


def test_a_launcher_whose_redis_user_cannot_issue_credentials_is_refused(
    server: LocalRedis, tmp_path: Path
) -> None:
    from cohort import acl

    job = "signed-refused"
    admin = server.client()
    acl.issue(admin, job, ["someone"])  # the job signs its commands
    acl.apply(admin, job, {"coordinator": "pw-c"})
    url = acl.role_url(server.url, job, "coordinator", "pw-c")
    run = Launch("--redis-url", url, "--job", job, "-n", "2", SCRIPT, cwd=tmp_path)
    assert run.wait(60) == Exit.REDIS, run.output
    assert "cannot give each rank a credential of its own" in run.output
    assert "ACL SETUSER" in run.output and "Traceback" not in run.output
    assert not (tmp_path / "cohort-runs").exists() and run.seen == set()


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        (("-n", "0", SCRIPT), Exit.USAGE, "-n 0: give a number of ranks of 1 or more"),
        (("-n", "two", SCRIPT), Exit.USAGE, "-n two"),
        ((), Exit.USAGE, "no command to run"),
        (("missing.py",), Exit.USAGE, "script 'missing.py' does not exist"),
        (("no-such-command-here",), Exit.USAGE, "'no-such-command-here' is not found on PATH"),
        (("--no-such-flag", SCRIPT), Exit.USAGE, "No such option '--no-such-flag'"),
        (("--job", "bad name", SCRIPT), Exit.USAGE, "job name 'bad name' is not valid"),
        (("--node", "a b", SCRIPT), Exit.USAGE, "--node 'a b'"),
        (("--batch-size", "-4", SCRIPT), Exit.USAGE, "batch_size=-4"),
        (("--spares", "-1", SCRIPT), Exit.USAGE, "--spares -1: give a number of spares"),
        (("--spares", "2", "--max-workers", "2", SCRIPT), Exit.USAGE, "max_workers=2"),
        (
            ("--redis-url", "redis://127.0.0.1:1/0", "--wait-for-redis", "0.2", SCRIPT),
            Exit.REDIS,
            "127.0.0.1:1",
        ),
    ],
)
def test_bad_input_is_refused_by_name_and_nothing_is_started(
    tmp_path: Path, args: tuple[str, ...], code: Exit, says: str
) -> None:
    run = Launch(*args, cwd=tmp_path)
    assert run.wait(60) == code, run.output
    assert says in run.output
    assert "Traceback" not in run.output
    assert not (tmp_path / "cohort-runs").exists() and run.seen == set()


def test_settings_that_differ_from_the_journal_are_refused_before_anything_starts(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.coordinator("c1", "--batch-size", "32")
    cluster.until(lambda s: s.config is not None, message="the job's settings journaled")
    run = Launch(
        "--redis-url", cluster.url, "--job", cluster.job, "--batch-size", "64", SCRIPT,
        cwd=tmp_path,
    )  # fmt: skip
    assert run.wait(60) == Exit.USAGE, run.output
    assert "--batch-size 64 (journaled: 32)" in run.output
    assert not (tmp_path / "cohort-runs").exists()


def test_a_second_launcher_under_a_node_name_in_use_is_refused(
    server: LocalRedis, tmp_path: Path
) -> None:
    common = ("--redis-url", server.url, "--job", "same-node", *FAST, "--epochs", "1000")
    first = Launch(*common, "--node", "n", "-n", "1", SCRIPT, cwd=tmp_path)
    watch = first.journal()
    wait_until(lambda: training(watch, 1), 60, message="the first launcher trains")
    second = Launch(*common, "--node", "n", "-n", "1", SCRIPT, cwd=tmp_path)
    assert second.wait(60) == Exit.USAGE, second.output
    assert "node name 'n' is in use" in second.output
    first.popen.send_signal(signal.SIGINT)
    assert first.wait(60) == Exit.INTERRUPTED


def test_a_launcher_started_after_the_job_finished_exits_0_saying_so(
    server: LocalRedis, tmp_path: Path
) -> None:
    """A scheduler may start a node late (a replacement pod): the job is done, which is no
    failure of that node's, so it must not be counted (or retried) as one."""
    common = ("--redis-url", server.url, "--job", "late", *FAST, "--max-steps", "3")
    first = Launch(*common, "--node", "a", "-n", "1", SCRIPT, cwd=tmp_path)
    assert first.wait(120) == 0, first.output
    late = Launch(*common, "--node", "b", "-n", "1", SCRIPT, cwd=tmp_path)
    assert late.wait(60) == 0, late.output
    assert "job 'late' finished at step 2" in late.output and "nothing to run on node 'b'" in (
        late.output
    )
    watch = first.journal()
    watch.pull(0)
    joined = [f.worker for _, f in watch.facts if isinstance(f, WorkerJoined)]
    assert joined and not [w for w in joined if w.startswith("b-")], joined  # b started nothing
