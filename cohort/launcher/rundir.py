"""A run directory of `cohort run`: its `run.json`, the private Redis's files, and the lock
its launcher holds while it runs.

The rules are pure (`job_for`, `resumable`, `Previous.finished`); the rest reads the
directory, holds its lock, or opens a finished run's journal read-only, on a copy.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from cohort.errors import CohortError
from cohort.localredis import LocalRedis, LocalRedisError, find_redis_server

RUNS_ROOT = Path("cohort-runs")
"""Where `cohort run` makes a run directory when none is given (relative: the working
directory's)."""
RUN_JSON = "run.json"
LOCK = "launcher.lock"
REDIS_DIR = "redis"


class RunDirError(CohortError):
    """A run directory cannot be used as asked; the message names it and the fix."""


@dataclass(frozen=True)
class Previous:
    """An earlier run of `cohort run` as its directory tells it."""

    dir: Path
    body: dict[str, Any]
    """Its run.json."""

    @property
    def job(self) -> str:
        return str(self.body.get("job", ""))

    @property
    def finished(self) -> bool:
        """Its job finished (the launcher wrote so at its end); a launcher that was killed
        or interrupted leaves it unset."""
        return self.body.get("finished") is not None

    @property
    def started(self) -> float:
        return float(self.body.get("started", 0.0))

    @property
    def journaled(self) -> bool:
        """Its private Redis kept an AOF (not so an embedded one): there is a run to resume."""
        return has_aof(self.dir / REDIS_DIR)


def has_aof(data: Path) -> bool:
    return any(data.glob("appendonlydir/*")) or any(data.glob("*.aof"))


def job_for(command: Sequence[str], flags: Sequence[str], cwd: str) -> str:
    """The job name of a command run without --job: the script's name and a hash of the
    working directory, the command and the job settings, so the same command again is
    the same job (and resumes it) and any other command is another job."""
    script = next((Path(a).stem for a in command if a.endswith(".py")), Path(command[0]).name)
    stem = re.sub(r"[^A-Za-z0-9._-]", "-", script).strip(".-_")[:40] or "run"
    digest = hashlib.sha256(json.dumps([cwd, list(command), list(flags)]).encode()).hexdigest()
    return f"{stem}-{digest[:8]}"


def resumable(runs: Sequence[Previous], job: str) -> Previous | None:
    """The run `job` continues in: its latest run on a private Redis, unless that finished
    (None: there is none, or the latest finished; `latest` tells which)."""
    mine = latest(runs, job)
    return mine if mine is not None and not mine.finished else None


def latest(runs: Sequence[Previous], job: str) -> Previous | None:
    """`job`'s newest run on a private Redis (a shared Redis's runs resume by themselves:
    the journal is there, not in the directory)."""
    mine = [r for r in runs if r.job == job and r.body.get("private_redis")]
    return max(mine, key=lambda r: (r.started, r.dir.name), default=None)


def previous_runs(root: Path = RUNS_ROOT) -> list[Previous]:
    """The runs under `root` that have a readable run.json."""
    found = []
    for path in sorted(root.glob(f"*/{RUN_JSON}")) if root.is_dir() else ():
        body = read_run_json(path.parent)
        if body is not None:
            found.append(Previous(path.parent.resolve(), body))
    return found


def new_run_dir(job: str, root: Path = RUNS_ROOT) -> Path:
    """A directory for a new run of `job` under `root`, named after it and the time (a
    suffix where a run of the same second has it already)."""
    base = f"{job}-{time.strftime('%Y%m%d-%H%M%S')}"
    chosen, more = root / base, 1
    while chosen.exists():
        more += 1
        chosen = root / f"{base}-{more}"
    return chosen


def read_run_json(run_dir: Path) -> dict[str, Any] | None:
    try:
        body = json.loads((run_dir / RUN_JSON).read_text())
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) else None


# ---------------------------------------------------------------- the launcher's lock


@contextlib.contextmanager
def held(run_dir: Path) -> Iterator[None]:
    """The run directory's lock, held while the block runs: one launcher per directory (the
    kernel lets it go when its process ends, however it ends); else RunDirError."""
    run_dir.mkdir(parents=True, exist_ok=True)
    handle = (run_dir / LOCK).open("a+")
    try:
        if not _try_lock(handle):
            raise RunDirError(_busy(run_dir, handle))
        handle.truncate(0)
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        yield
    finally:
        handle.close()


def busy(run_dir: Path) -> str | None:
    """Why a launcher cannot use `run_dir` now (another one runs in it), else None."""
    if not (run_dir / LOCK).exists():
        return None
    with (run_dir / LOCK).open("a+") as handle:
        if _try_lock(handle):
            return None
        return _busy(run_dir, handle)


def _try_lock(handle: IO[str]) -> bool:
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _busy(run_dir: Path, handle: IO[str]) -> str:
    handle.seek(0)
    pid = handle.read().strip() or "?"
    return (
        f"run directory {run_dir} is in use by another launcher (pid {pid}): stop it, or "
        "give this one another --run-dir"
    )


# ---------------------------------------------------------------- reading a finished run


@dataclass(frozen=True)
class Opened:
    """A run's journal, open for reading: the Redis URL to read it at and the run's job."""

    url: str
    job: str


@contextlib.contextmanager
def open_read_only(run_dir: Path) -> Iterator[Opened]:
    """The journal of the run in `run_dir`, readable for the block's length, never written:
    a running launcher's own Redis; else a redis-server of our own on a copy of the run's
    AOF, removed at the end. RunDirError naming the directory where that cannot be."""
    body = read_run_json(run_dir)
    if body is None:
        raise RunDirError(
            f"{run_dir} holds no cohort run (no readable {RUN_JSON}): give the directory "
            "`cohort run` printed after 'logs in'"
        )
    job, url = str(body.get("job", "")), str(body.get("redis_url", ""))
    if not body.get("private_redis"):
        raise RunDirError(
            f"run {run_dir} of job {job!r} kept its journal in the Redis it was given, not "
            f"in the directory: read it there with --redis-url {url} --job {job}"
        )
    if busy(run_dir) is not None:  # its launcher runs: its Redis answers at run.json's URL
        yield Opened(url, job)
        return
    data = run_dir / REDIS_DIR
    if not has_aof(data):
        raise RunDirError(
            f"run {run_dir} of job {job!r} has no journal on disk (its Redis was an embedded "
            "one, without an AOF, or it never started): nothing to read; `cohort run "
            "--export FILE` keeps a run's journal where no redis-server binary exists"
        )
    if find_redis_server() is None:
        raise RunDirError(
            f"reading run {run_dir} needs a redis-server binary to load its AOF: install "
            "redis-server >= 7.0 (or point $COHORT_REDIS_SERVER at one)"
        )
    with _copy_of(data) as copy:
        server = LocalRedis(appendonly=True, data_dir=copy, own_session=True)
        try:
            server.start()
        except LocalRedisError as exc:
            raise RunDirError(f"cannot load the journal of run {run_dir}: {exc}") from exc
        try:
            yield Opened(server.url, job)
        finally:
            server.stop()


@contextlib.contextmanager
def _copy_of(data: Path) -> Iterator[Path]:
    """A temporary copy of a run's Redis files (the AOF only: never the run's own)."""
    root = Path(tempfile.mkdtemp(prefix="cohort-run-read-"))
    try:
        copy = root / REDIS_DIR
        copy.mkdir()
        if (data / "appendonlydir").is_dir():
            shutil.copytree(data / "appendonlydir", copy / "appendonlydir")
        for aof in data.glob("*.aof"):
            shutil.copy2(aof, copy / aof.name)
        yield copy
    finally:
        shutil.rmtree(root, ignore_errors=True)
