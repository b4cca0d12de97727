"""`torchrun --rdzv-backend=cohort` before any rendezvous: the entry point (registered
whichever cohort module a process imports first), bad settings refused in one line naming
the value, agent ids, and the journal's record of gone agents."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from datetime import timedelta
from pathlib import Path

import pytest

from cohort.events import models as m
from cohort.worker.membership import view as views
from tests.helpers import entry_point_path

torch = pytest.importorskip("torch")

from torch.distributed.elastic.rendezvous.api import RendezvousParameters  # noqa: E402
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc  # noqa: E402

from cohort.worker.pytorch.torchrun import handler as torchrun  # noqa: E402
from cohort.worker.pytorch.torchrun import plugin  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
WORKER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$")


def params(endpoint: str = "redis://127.0.0.1:1/0", run_id: str = "job", **conf: str):  # type: ignore[no-untyped-def]
    return RendezvousParameters("cohort", endpoint, run_id, 1, 4, **conf)


def test_pyproject_declares_the_torchrun_entry_point_and_it_gives_the_creator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    target = project["entry-points"]["torchrun.handlers"]["cohort"]
    assert target == "cohort.worker.pytorch.torchrun.plugin:entry_point"
    monkeypatch.setattr(torchrun, "create_handler", lambda p: ("handler for", p.run_id))
    assert plugin.entry_point()(params(run_id="j")) == ("handler for", "j")


# Imports the module named first, then asks torch's registry for the cohort backend: our
# handler, reached, ends the process with exit code 2 for want of a Redis on port 1.
FIRST_IMPORT = """
import importlib, sys
importlib.import_module(sys.argv[1])
from torch.distributed.elastic.rendezvous.api import RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler
get_rendezvous_handler(RendezvousParameters("cohort", "redis://127.0.0.1:1/0", "job", 1, 1))
"""


@pytest.mark.parametrize(
    "first",
    [
        "cohort.worker.pytorch.torchrun.rendezvous_backend",
        "cohort.worker.pytorch.torchrun.handler",
        "cohort.worker.pytorch.torchrun.c10d_store",
        "cohort.torch",
    ],
)
def test_the_backend_is_registered_whichever_cohort_module_is_imported_first(
    first: str, tmp_path: Path
) -> None:
    meta = entry_point_path(tmp_path, ROOT)  # this checkout's entry points, not an install's
    path = os.pathsep.join(p for p in (str(meta), os.environ.get("PYTHONPATH", "")) if p)
    ran = subprocess.run(
        [sys.executable, "-c", FIRST_IMPORT, first],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "registering out of tree plugin" not in ran.stderr, ran.stderr
    assert ran.returncode == 2, ran.stderr
    assert "torchrun --rdzv-backend=cohort: cannot reach Redis" in ran.stderr


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        (params(endpoint="http://redis-host:6379"), "'http://redis-host:6379'"),
        (params(endpoint="redis://host:99999/0"), "bad port"),
        (params(run_id="my job!"), "'my job!'"),
        (params(run_id="none"), "no job id: torchrun's --rdzv-id is 'none'"),
        (params(endpoint="foo://h:1"), "(set --rdzv-endpoint or $COHORT_REDIS_URL)"),
        (params(last_call_timeout="soon"), "last_call_timeout='soon'"),
        (params(keep_alive_interval="0"), "keep_alive_interval='0'"),
        (params(read_timeout="1.5"), "read_timeout='1.5'"),
        (params(), "cannot reach Redis at redis://127.0.0.1:1/0"),
    ],
)
def test_bad_settings_end_torchrun_with_one_line_naming_the_value(
    setting: RendezvousParameters, named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        torchrun.create_handler(setting)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("torchrun --rdzv-backend=cohort: ") and named in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_no_run_id_takes_the_job_from_the_environment() -> None:
    assert torchrun.job_of("mnist", {"COHORT_JOB": "other"}) == "mnist"
    assert torchrun.job_of("none", {"PET_RDZV_ID": "a", "COHORT_JOB": "b"}) == "a"
    assert torchrun.job_of("none", {"PET_RDZV_ID": "none", "COHORT_JOB": "b"}) == "b"
    assert torchrun.job_of("", {"COHORT_JOB": "b"}) == "b"


@pytest.mark.parametrize(
    ("endpoint", "env", "url"),
    [
        ("", {}, None),  # RedisSettings: $COHORT_REDIS_URL, else the local default
        ("redis://h:7/2", {}, "redis://h:7/2"),
        ("10.0.0.5:16391", {}, "redis://10.0.0.5:16391/0"),  # as accelerate launch builds it
        (" 10.0.0.5:16391 ", {}, "redis://10.0.0.5:16391/0"),
        ("10.0.0.5:16391", {"COHORT_REDIS_URL": "rediss://u:p@10.0.0.5:16391/3"},
         "rediss://u:p@10.0.0.5:16391/3"),  # the same server: its credentials come along
        ("10.0.0.5:6379", {"COHORT_REDIS_URL": "redis://10.0.0.5/0"}, "redis://10.0.0.5/0"),
        ("10.0.0.6:16391", {"COHORT_REDIS_URL": "redis://u:p@10.0.0.5:16391/3"},
         "redis://10.0.0.6:16391/0"),  # another server: the command line wins
        ("redis-host", {}, "redis://redis-host/0"),
        ("fd00::5:6379", {}, "redis://[fd00::5]:6379/0"),  # accelerate launch's IPv6 form
        ("[fd00::5]:6379", {}, "redis://[fd00::5]:6379/0"),
        ("fd00::5:6379", {"COHORT_REDIS_URL": "redis://u:p@[fd00::5]/1"},
         "redis://u:p@[fd00::5]/1"),
    ],
)  # fmt: skip
def test_the_endpoint_may_be_a_url_or_host_port(
    endpoint: str, env: dict[str, str], url: str | None
) -> None:
    assert torchrun.endpoint_url(endpoint, env) == url


def test_last_call_defaults_to_two_seconds_other_timeouts_to_torchs() -> None:
    assert torchrun._seconds(params(), "last_call") == timedelta(seconds=2)
    assert torchrun._seconds(params(last_call_timeout="30"), "last_call") == timedelta(seconds=30)
    assert torchrun._seconds(params(), "join") is None


def test_an_old_torch_is_refused_saying_which_version_is_needed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torchrun.torch, "__version__", "2.5.1+cpu")
    with pytest.raises(SystemExit):
        torchrun.create_handler(params())
    err = capsys.readouterr().err
    assert "needs torch >= 2.6" in err and "2.5.1+cpu" in err


@pytest.mark.parametrize(
    ("version", "old"),
    [("2.5.1", True), ("1.13.0", True), ("2.6.0", False), ("2.13.0+cpu", False),
     ("3.0.0a0", False), ("nightly", True)],
)  # fmt: skip
def test_too_old(version: str, old: bool) -> None:
    assert torchrun.too_old(version) is old


@pytest.mark.parametrize(
    "addr", ["localhost", "10.0.0.7", "fe80::1%eth0", "node 7/rack", "x" * 200, ""]
)
def test_agent_ids_are_valid_worker_ids_and_the_same_on_every_agent(addr: str) -> None:
    node = _NodeDesc(addr, 4242, 1)
    assert WORKER_ID.fullmatch(torchrun.agent_id(node))
    assert torchrun.agent_id(_NodeDesc(addr, 4242, 1)) == torchrun.agent_id(node)
    assert torchrun.agent_id(_NodeDesc(addr, 4243, 1)) != torchrun.agent_id(node)


def test_the_view_remembers_who_failed_or_left_until_they_join_again() -> None:
    def fact(cls: type, **body: object) -> m.Fact:
        return cls(at=1.0, job="j", **body)  # type: ignore[no-any-return]

    view = views.fold(
        [
            fact(m.WorkerJoined, worker="a"),
            fact(m.WorkerJoined, worker="b"),
            fact(m.WorkerJoined, worker="c"),
            fact(m.WorkerFailed, worker="a", last_seen=0.5, timeout=2.0),
            fact(m.WorkerLeft, worker="b"),
        ],
        views.View(worker="me"),
    )
    assert view.gone == {"a", "b"} and view.members == {"c"}
    again = views.evolve(view, fact(m.WorkerJoined, worker="a"))
    assert again.gone == {"b"} and again.members == {"a", "c"}


def test_an_agent_leaves_saying_how_its_workers_ended() -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    failed = ChildFailedError.__new__(ChildFailedError)  # its constructor wants real failures
    assert torchrun.leave_reason(failed).endswith("its workers failed past --max-restarts")
    assert torchrun.leave_reason(SystemExit(2)) == "torchrun agent shut down: SystemExit: 2"
    assert torchrun.leave_reason(RuntimeError("a\nb")).endswith("RuntimeError: a")
