"""`cohort run` under SLURM: what a job step's environment already says, as the launcher's
settings, so that the batch script gives no flag SLURM knows (docs/slurm.md).

The decisions are pure functions of the environment (`SlurmJob.of`, `job_name`, `ranks`,
`run_dir`, `published_url`); the I/O at the edges is the job's Redis URL, written by the node
that hosts the Redis (`publish`) and awaited by the others (`await_url`), in a file of the
job's run directory on the submit directory, which every node of a cluster shares.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cohort.errors import CohortError

RUNS = "cohort-runs"
"""The folder of the submit directory the jobs' run directories go in (as `cohort run`'s
./cohort-runs)."""
URL_FILE = "redis.json"
"""In the job's run directory: the Redis URL its first node published, for this allocation."""
URL_WAIT = 300.0
"""How long a node waits for the first node to publish the job's Redis."""


class SlurmError(CohortError):
    """The SLURM job's environment cannot be used as it is; the message says what to give."""


@dataclass(frozen=True)
class SlurmJob:
    """What `cohort run` reads of the SLURM job step it runs in."""

    job_id: str
    """$SLURM_JOB_ID: the same after a requeue (and for each task of an array its own)."""
    name: str
    """$SLURM_JOB_NAME (the batch script's name unless --job-name)."""
    node: str
    """$SLURMD_NODENAME: the node this step's task runs on."""
    node_id: int
    """$SLURM_NODEID: the node's index in the allocation (0: the first of its node list)."""
    nodes: int
    """$SLURM_JOB_NUM_NODES."""
    submit_dir: Path
    """$SLURM_SUBMIT_DIR: where sbatch ran, shared by the nodes."""
    restarts: int = 0
    """$SLURM_RESTART_COUNT: how many times the job was requeued (absent: 0)."""
    gpus_on_node: int | None = None
    """$SLURM_GPUS_ON_NODE (set where the job was given GPUs)."""

    @classmethod
    def of(cls, env: Mapping[str, str]) -> SlurmJob | None:
        """The job `env` is a SLURM job step's task of; None outside one (no $SLURM_JOB_ID
        or no $SLURMD_NODENAME: a login node's shell inside `salloc` is not a node)."""
        job_id, node = env.get("SLURM_JOB_ID"), env.get("SLURMD_NODENAME")
        if not job_id or not node:
            return None
        return cls(
            job_id=job_id,
            name=env.get("SLURM_JOB_NAME", ""),
            node=node,
            node_id=_count(env, "SLURM_NODEID") or 0,
            nodes=_count(env, "SLURM_JOB_NUM_NODES") or _count(env, "SLURM_NNODES") or 1,
            submit_dir=Path(env.get("SLURM_SUBMIT_DIR") or os.getcwd()),
            restarts=_count(env, "SLURM_RESTART_COUNT") or 0,
            gpus_on_node=_count(env, "SLURM_GPUS_ON_NODE"),
        )

    @property
    def hosts_redis(self) -> bool:
        """Whether this node runs the job's Redis where none is given: the first node."""
        return self.node_id == 0

    @property
    def root(self) -> Path:
        """The job's run directory, the same for each allocation of the job (a requeue keeps
        its id): the first node's run (run.json, the Redis's AOF), the URL file, and a folder
        per other node."""
        return self.submit_dir / RUNS / f"slurm-{self.job_id}"


def _count(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name, "")
    return int(value) if value.isdigit() else None


def job_name(job: SlurmJob) -> str:
    """The cohort job of a SLURM job: its name and id (`train-4242`), so that a requeue (same
    id) continues it and another submission of the script is another job."""
    stem = re.sub(r"[^A-Za-z0-9._-]", "-", job.name).strip(".-_")[:40] or "slurm"
    return f"{stem}-{job.job_id}"


def node_name(job: SlurmJob) -> str:
    """The node's name in worker ids and logs: SLURM's, as cohort's names allow it."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", job.node).strip(".-_")[:48] or f"node{job.node_id}"


def ranks(job: SlurmJob, tasks_per_node: int | None) -> tuple[str, str]:
    """The node's ranks where -n is not given, and what said so: one per GPU SLURM gave the
    node (`gpu`: the CUDA_VISIBLE_DEVICES SLURM sets names them); else the job's tasks per
    node as sbatch was given them (`--ntasks-per-node=4`: 4; `tasks_per_node`, read from the
    job's record: the step that runs `cohort run` has one task per node, and its environment
    says so); else 1."""
    if job.gpus_on_node:
        return "gpu", f"SLURM_GPUS_ON_NODE={job.gpus_on_node}"
    if tasks_per_node:
        return str(tasks_per_node), f"the job's tasks per node ({tasks_per_node})"
    return "1", "SLURM gives no GPU nor tasks per node"


def tasks_per_node(record: str) -> int | None:
    """The job's tasks per node from its record (`scontrol show job -o ID`: NumTasks over
    NumNodes, rounded up); None where the record does not say."""
    fields = dict(word.partition("=")[::2] for word in record.split() if "=" in word)
    tasks, nodes = fields.get("NumTasks", ""), fields.get("NumNodes", "").split("-")[0]
    if not tasks.isdigit() or not nodes.isdigit() or int(nodes) < 1:
        return None
    return -(-int(tasks) // int(nodes))


def run_dir(job: SlurmJob, own_redis: bool) -> Path:
    """The node's run directory: the job's (`root`) for the node whose Redis keeps the
    journal (the first, or the only one), so a requeue finds its AOF there and resumes;
    `root/nodes/NODE` for each other node's logs (its journal is the first node's)."""
    if own_redis:
        return job.root
    return job.root / "nodes" / node_name(job)


def start_workers(job: SlurmJob, node_ranks: int) -> int:
    """The ranks the job's first world waits for: this node's, on each of its nodes."""
    return node_ranks * job.nodes


def published_url(body: Mapping[str, Any] | None, job: SlurmJob) -> str | None:
    """The URL in the URL file's `body` if the first node published it in this allocation
    (one left by an earlier one, before a requeue, names a Redis that is gone)."""
    if not body or body.get("job_id") != job.job_id or body.get("restarts") != job.restarts:
        return None
    url = body.get("url")
    return url if isinstance(url, str) and url else None


# ---------------------------------------------------------------- the edges: the URL file


def publish(job: SlurmJob, url: str) -> Path:
    """Write the job's Redis URL (with its password) for the other nodes: readable by the
    job's user only, replaced whole."""
    path = job.root / URL_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"url": url, "job_id": job.job_id, "restarts": job.restarts, "node": job.node}
    partial = path.with_name(f".{URL_FILE}.partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(json.dumps(body) + "\n")
    os.replace(partial, path)
    return path


def read_url_file(job: SlurmJob) -> dict[str, Any] | None:
    try:
        body = json.loads((job.root / URL_FILE).read_text())
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) else None


def await_url(
    job: SlurmJob,
    timeout: float = URL_WAIT,
    clock: Callable[[], float] = time.monotonic,
    pause: Callable[[float], object] | None = None,
) -> str:
    """The URL the first node publishes in this allocation, once it has; SlurmError after
    `timeout` s naming the file and the first node's log."""
    pause = pause or threading.Event().wait
    deadline = clock() + timeout
    while (url := published_url(read_url_file(job), job)) is None:
        if clock() >= deadline:
            raise SlurmError(
                f"SLURM job {job.job_id}: the first node did not publish the job's Redis in "
                f"{job.root / URL_FILE} within {timeout:g} s (its `cohort run` log says why); "
                "or give every node --redis-url"
            )
        pause(0.2)
    return url


def job_record(job: SlurmJob) -> str:
    """The job's record as `scontrol show job -o` prints it ('' where scontrol cannot)."""
    try:
        done = subprocess.run(
            ["scontrol", "show", "job", "-o", job.job_id],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout if done.returncode == 0 else ""


def redis_host(env: Mapping[str, str]) -> str:
    """The address the first node's Redis listens on and the others reach it at:
    $COHORT_REDIS_HOST, else this host's name's address."""
    given = env.get("COHORT_REDIS_HOST")
    if given:
        return given
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError as exc:
        raise SlurmError(
            f"this node's address is not known ({exc}): set COHORT_REDIS_HOST to the address "
            "the other nodes reach it at"
        ) from exc
