"""A real SLURM cluster on this machine for tests: `munged`, `slurmctld` and one `slurmd` per
node name, each started in the foreground from a temporary directory with a config written
here, all run as root (SlurmUser=root), on free ports; `stop()` ends every daemon it started
and the job processes they ran, and the directory goes with the test's tmp_path.

Debian's slurm-wlm (22.05) is built without multiple-slurmd support: one host runs one
slurmd, so the cluster has one node (`NODE`) with `cpus` CPUs. `two_nodes()` says whether the
build allows two node names on one host (`slurmd -N NAME`), found by trying.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cohort.localredis import free_port
from tests.helpers import wait_until

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue")
NODE = "node1"


def missing() -> str | None:
    """Why SLURM cannot run here (a binary missing, not root), else None."""
    absent = [name for name in DAEMONS if shutil.which(name) is None]
    if absent:
        return f"{', '.join(absent)} not found: apt-get install slurm-wlm munge"
    if os.geteuid() != 0:
        return "the test's slurmd runs jobs as root (SlurmUser=root): run the tests as root"
    return None


@dataclass
class Slurm:
    """munged + slurmctld + slurmd in `root`, for the length of a test module."""

    root: Path
    nodes: Sequence[str] = (NODE,)
    cpus: int = 2
    path: str = ""
    """The jobs' PATH (sbatch passes the submitter's environment on), default this one's."""
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """The environment of a client (sbatch, scontrol) of this cluster."""
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "COHORT_"))}
        return {**clean, "SLURM_CONF": str(self.conf), "PATH": self.path or clean.get("PATH", "")}

    # ------------------------------------------------------------ start and stop

    def start(self) -> Slurm:
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o700)  # munged refuses a key a directory others may write reaches
        for sub in ("state", "spool", "log"):
            (self.root / sub).mkdir(exist_ok=True)
        self._munge()
        self._write_conf()
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        for node in self.nodes:
            self._spawn(f"slurmd-{node}", ["slurmd", "-D", "-N", node, "-f", str(self.conf)])
        wait_until(self._nodes_idle, 30, 0.2, message=f"SLURM nodes {list(self.nodes)} idle")
        return self

    def _munge(self) -> None:
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self._spawn(
            "munged",
            [
                "munged", "-F", "--force", f"--key-file={key}", f"--socket={self.socket}",
                f"--pid-file={self.root / 'munged.pid'}",
                f"--seed-file={self.root / 'munged.seed'}",
                f"--log-file={self.root / 'log' / 'munged.log'}",
            ],
        )  # fmt: skip
        wait_until(self.socket.exists, 10, message="munged's socket")

    @property
    def socket(self) -> Path:
        return self.root / "munge.socket"

    def _write_conf(self) -> None:
        ctld = free_port()
        root = self.root
        lines = [
            "ClusterName=cohorttest",
            "SlurmctldHost=localhost",
            f"SlurmctldPort={ctld}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.socket}",
            f"StateSaveLocation={root / 'state'}",
            f"SlurmdSpoolDir={root / 'spool' / '%n'}",
            f"SlurmctldPidFile={root / 'slurmctld.pid'}",
            f"SlurmdPidFile={root / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={root / 'log' / 'slurmd-%n.log'}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            # every process of a job step is found by its ancestry and killed with it, as a
            # cgroup would (cohort's ranks run in sessions of their own)
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SwitchType=switch/none",
            "MpiDefault=none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/builtin",
            # a job eligible again (a requeued one's StartTime) starts within a second, not
            # at the next minute's pass
            "SchedulerParameters=sched_interval=1",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
            "ReturnToService=2",
            "JobRequeue=1",
            "KillWait=30",
            "MinJobAge=600",
            "SlurmdTimeout=30",
            "InactiveLimit=0",
            *(
                f"NodeName={node} NodeHostname=localhost NodeAddr=127.0.0.1 Port={free_port()} "
                f"CPUs={self.cpus} State=UNKNOWN"
                for node in self.nodes
            ),
            "PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = (self.root / "log" / f"{name}.out").open("ab")
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        log.close()
        self.procs.append(proc)

    def stop(self) -> None:
        """Every job cancelled, every daemon stopped (SIGTERM, then SIGKILL), none left."""
        with contextlib.suppress(Exception):
            self.run("scancel", "--full", "--user=root", check=False)
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        self.procs.clear()

    # ------------------------------------------------------------ clients

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=60, env=self.env, cwd=self.root
        )
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(argv)}: exit {done.returncode}: {done.stderr}")
        return done

    def _nodes_idle(self) -> bool:
        done = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
        states = dict(line.split() for line in done.stdout.splitlines() if line.strip())
        return all(states.get(node) == "idle" for node in self.nodes)

    def sbatch(self, script: Path, *args: str, options: Sequence[str] = (), cwd: Path) -> str:
        """Submit `script` with sbatch `options`, `args` its own; its job id."""
        done = subprocess.run(
            ["sbatch", "--parsable", *options, str(script), *args],
            capture_output=True, text=True, timeout=60, env=self.env, cwd=cwd,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, RunTime, Restarts, ...)."""
        out = self.run("scontrol", "-o", "show", "job", job_id).stdout
        fields: dict[str, str] = {}
        for word in out.split():
            key, _, value = word.partition("=")
            fields.setdefault(key, value)
        return fields

    def state(self, job_id: str) -> str:
        return self.job(job_id).get("JobState", "")

    def wait_state(self, job_id: str, states: set[str], timeout: float) -> str:
        return wait_until(
            lambda: (s := self.state(job_id)) in states and s,
            timeout, 0.2, message=f"job {job_id} in {sorted(states)}",
        )  # fmt: skip


@contextlib.contextmanager
def started(
    root: Path, nodes: Sequence[str] = (NODE,), cpus: int = 2, path: str = ""
) -> Iterator[Slurm]:
    cluster = Slurm(root, nodes, cpus, path)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def left(cluster: Slurm) -> list[str]:
    """The daemons and job processes of `cluster` still running: none after `stop`."""
    mark = str(cluster.root)
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            raw = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if raw and (mark.encode() in raw or f"SLURM_CONF={mark}".encode() in environ):
            found.append(f"{pid}: {raw.replace(bytes(1), b' ').decode(errors='replace')}")
    return found
