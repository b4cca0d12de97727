"""Resuming and inspecting runs, rule by rule (issue 47, items 7 and 8): which job a
command is, which earlier run it continues, whose a checkpoint location is, and one
convention for the options that say where a run's journal is. No Redis here."""

from __future__ import annotations

import json
import multiprocessing
import re
from pathlib import Path
from typing import Any

import click
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cohort.cli import main
from cohort.events.storage import OWNER_FILE, StorageError, check_owner, claim, owner
from cohort.launcher import rundir
from cohort.launcher.rundir import Previous, job_for, latest, resumable
from cohort.launcher.supervision import unused_generation

SCRIPT = ("train.py", "--lr", "0.1")


# ---------------------------------------------------------------- the job of a command


def test_the_same_command_in_the_same_directory_is_the_same_job() -> None:
    assert job_for(SCRIPT, ("--epochs", "3"), "/w") == job_for(SCRIPT, ("--epochs", "3"), "/w")
    assert job_for(SCRIPT, (), "/w").startswith("train-")


@pytest.mark.parametrize(
    "other",
    [
        (("train.py", "--lr", "0.2"), ("--epochs", "3"), "/w"),  # another argument
        (SCRIPT, ("--epochs", "4"), "/w"),  # other job settings
        (SCRIPT, ("--epochs", "3"), "/elsewhere"),  # another working directory
        (("other.py", "--lr", "0.1"), ("--epochs", "3"), "/w"),  # another script
    ],
)
def test_any_other_command_is_another_job(other: tuple[Any, ...]) -> None:
    assert job_for(*other) != job_for(SCRIPT, ("--epochs", "3"), "/w")


@given(st.lists(st.text(min_size=1), min_size=1, max_size=4), st.text())
def test_a_commands_job_name_is_always_a_valid_job_name(command: list[str], cwd: str) -> None:
    from cohort.events.keys import check_job

    name = job_for(command, (), cwd)
    assert check_job(name) == name


# ---------------------------------------------------------------- which run goes on


def run(name: str, job: str, started: float, **body: Any) -> Previous:
    return Previous(Path(f"/runs/{name}"), {"job": job, "private_redis": True,
                                            "started": started, **body})  # fmt: skip


def test_a_rerun_continues_the_jobs_latest_run_that_did_not_finish() -> None:
    runs = [
        run("a1", "a", 1.0, finished="epochs=3 reached"),
        run("a2", "a", 2.0, exit=130),  # interrupted: not finished
        run("b1", "b", 3.0),
        run("a0", "a", 0.5),
    ]
    assert resumable(runs, "a") == runs[1]
    assert resumable(runs, "c") is None


def test_a_job_whose_latest_run_finished_has_nothing_to_resume() -> None:
    runs = [run("a1", "a", 1.0), run("a2", "a", 2.0, finished="max_steps=5 reached")]
    assert resumable(runs, "a") is None
    assert latest(runs, "a") == runs[1]  # the launcher says it finished


def test_a_run_on_a_shared_redis_is_not_resumed_from_its_directory() -> None:
    """Its journal is in that Redis: a rerun with --redis-url joins it by itself."""
    assert resumable([run("a1", "a", 1.0, private_redis=False)], "a") is None


def test_previous_runs_are_read_from_their_run_json_and_broken_ones_skipped(
    tmp_path: Path,
) -> None:
    (tmp_path / "a-1").mkdir()
    (tmp_path / "a-1" / "run.json").write_text(json.dumps({"job": "a", "private_redis": True}))
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "run.json").write_text("{half")
    (found,) = rundir.previous_runs(tmp_path)
    assert (found.job, found.dir) == ("a", (tmp_path / "a-1").resolve())
    assert rundir.previous_runs(tmp_path / "none") == []


@pytest.mark.parametrize(
    ("used", "generation"),
    [
        (set(), 0),
        ({"vm-0"}, 1),
        ({"vm-0", "vm-0.1", "vm-0.3", "vm-1.7", "vm-00", "vm-0.x"}, 4),
        ({"vm-1", "vm-10"}, 0),
    ],
)
def test_a_slots_first_process_never_takes_a_worker_id_the_journal_has_seen(
    used: set[str], generation: int
) -> None:
    assert unused_generation("vm-0", used) == generation


# ---------------------------------------------------------------- one launcher a directory


def _hold(run_dir: str, ready: Any, done: Any) -> None:
    with rundir.held(Path(run_dir)):
        ready.set()
        done.wait(30)


def test_a_run_directory_another_launcher_holds_is_busy_until_it_ends(tmp_path: Path) -> None:
    assert rundir.busy(tmp_path) is None
    ready, done = multiprocessing.Event(), multiprocessing.Event()
    holder = multiprocessing.Process(target=_hold, args=(str(tmp_path), ready, done))
    holder.start()
    try:
        assert ready.wait(30)
        why = rundir.busy(tmp_path)
        assert why is not None and f"pid {holder.pid}" in why and str(tmp_path) in why
        refused = pytest.raises(rundir.RunDirError, match="in use by another launcher")
        with refused, rundir.held(tmp_path):
            pass
    finally:
        done.set()
        holder.join(30)
    assert rundir.busy(tmp_path) is None  # the kernel let go with its process


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (None, "holds no cohort run (no readable run.json)"),
        ({"job": "j", "private_redis": False, "redis_url": "redis://r:6379/0"},
         "read it there with --redis-url redis://r:6379/0 --job j"),
        ({"job": "j", "private_redis": True}, "has no journal on disk"),
    ],
)  # fmt: skip
def test_a_directory_without_a_readable_journal_is_refused_saying_why(
    tmp_path: Path, body: dict[str, Any] | None, says: str
) -> None:
    if body is not None:
        (tmp_path / "run.json").write_text(json.dumps(body))
    with pytest.raises(rundir.RunDirError, match=re.escape(says)), rundir.open_read_only(tmp_path):
        pass


# ---------------------------------------------------------------- checkpoint locations


def test_a_checkpoint_location_is_its_first_jobs_and_refused_to_another_by_name(
    tmp_path: Path,
) -> None:
    uri = f"file://{tmp_path}/ckpt"
    assert owner(uri) is None
    check_owner(uri, "a")  # nobody's: anyone may
    claim(uri, "a")
    claim(uri, "a")  # its own again: fine
    assert owner(uri) == "a" and (tmp_path / "ckpt" / OWNER_FILE).is_file()
    with pytest.raises(StorageError) as refused:
        check_owner(uri, "b")
    said = str(refused.value)
    assert f"checkpoint location {uri!r} belongs to job 'a'" in said
    assert "give this job its own --checkpoint-uri" in said
    with pytest.raises(StorageError):
        claim(uri, "b")
    assert owner(uri) == "a"


# ---------------------------------------------------------------- one convention


def _options(command: click.Command) -> set[str]:
    return {o for p in command.params for o in getattr(p, "opts", ())}


def _commands() -> list[tuple[str, click.Command]]:
    found: list[tuple[str, click.Command]] = []
    for name, command in main.commands.items():
        subs = getattr(command, "commands", None)
        found += [(f"{name} {n}", c) for n, c in subs.items()] if subs else [(name, command)]
    return found


@pytest.mark.parametrize(("name", "command"), _commands())
def test_every_command_of_a_job_takes_redis_url_after_the_subcommand_too(
    name: str, command: click.Command
) -> None:
    if "--job" in _options(command):
        assert "--redis-url" in _options(command), name


@pytest.mark.parametrize("name", ["status", "replay", "report", "export", "checkpoints"])
def test_every_command_that_reads_a_run_takes_its_run_directory(name: str) -> None:
    assert {"--run-dir", "--redis-url", "--job"} <= _options(main.commands[name])


def test_a_new_run_of_a_job_never_takes_an_earlier_runs_directory(tmp_path: Path) -> None:
    first = rundir.new_run_dir("j", tmp_path)
    first.mkdir(parents=True)
    second = rundir.new_run_dir("j", tmp_path)
    assert second != first and second.name.startswith("j-")
