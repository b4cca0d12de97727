"""How the gloo route's watchdog says that a world is over: a finished job's last world ends
without news (no "world N is over: ... join again to return" on a clean finish), a world a
rank is lost from is said at INFO, and one that cut a collective short is a warning."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("torch")

from cohort.worker.errors import RemovedError  # noqa: E402
from cohort.worker.membership.view import View  # noqa: E402
from cohort.worker.pytorch.dist import DistWorld, Watchdog  # noqa: E402
from tests.helpers import wait_until  # noqa: E402

WORLD = DistWorld(version=1, rank=0, size=2, start_step=0, ranks=("me", "peer"), store=None)  # type: ignore[arg-type]


@dataclass
class Worker:
    """A worker whose journal already said what `view` says; waiting on it raises `raises`."""

    view: View
    raises: Exception | None = None

    def wait_for(self, done: Any, timeout: float) -> View:
        if self.raises is not None:
            raise self.raises
        assert done(self.view)
        return self.view


def said(caplog: pytest.LogCaptureFixture, worker: Worker, waiting: bool = False) -> list[str]:
    """What the watchdog of WORLD logs at INFO and above once `worker`'s view ends it."""
    dog = Watchdog(worker, WORLD)  # type: ignore[arg-type]
    if waiting:  # a collective waits in the world as it ends
        done = threading.Event()
        waiter = threading.Thread(target=dog.wait, args=(done,))
        waiter.start()
        wait_until(lambda: dog._waiters, 5, message="the collective waiting")
    with caplog.at_level(logging.DEBUG, logger="cohort"):
        dog.start()
        dog.tripped.wait(5)
        dog.stop()
    if waiting:
        waiter.join(5)
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]


def test_a_finished_jobs_last_world_ends_without_a_word(caplog: pytest.LogCaptureFixture) -> None:
    view = View(worker="me", members=frozenset({"peer"}), left=True, finished="max_steps 8")
    removed = RemovedError("me", "left (finished)")
    assert said(caplog, Worker(view, removed)) == []
    peers_gone = View(worker="me", members=frozenset({"me"}), finished="max_steps 8")
    assert said(caplog, Worker(peers_gone)) == []


def test_this_worker_leaving_by_itself_ends_its_world_without_a_word(
    caplog: pytest.LogCaptureFixture,
) -> None:
    view = View(worker="me", members=frozenset({"peer"}), left=True)
    assert said(caplog, Worker(view, RemovedError("me", "left (stopped)"))) == []


def test_a_lost_rank_ends_the_world_at_info_and_a_broken_collective_warns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    view = View(worker="me", members=frozenset({"me"}))
    (line,) = said(caplog, Worker(view))
    assert line == "world 1 is over: rank(s) ['peer'] of world 1 left or failed"
    caplog.clear()
    (line,) = said(caplog, Worker(view), waiting=True)
    assert line.endswith("left or failed; breaking its collectives")
