"""`job.record(**figures)`: the script's named numbers travel in the step's own report.

The test is the leader of a one-rank job (tests/unit/test_capture_point.py's `job`).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from cohort.events import models as m
from cohort.events.errors import InvalidValueError
from tests.unit.test_capture_point import commit, job  # noqa: F401  (job: the fixture)
from tests.unit.test_elastic_gate import ME
from tests.unit.test_worker_client import fact


def test_recorded_figures_travel_in_the_report_of_their_own_step(job) -> None:  # noqa: F811
    leader, elastic, _ = job
    walk = elastic._walk()
    next(walk)  # step 0
    elastic.record(loss=np.float32(0.5), accuracy=np.float64(0.9))
    elastic.record(**{"val/acc": 1, "accuracy": 0.95})  # adds; a name said again: its last
    next(walk)  # step 0 is reported as step 1 is asked for
    done = leader.expect("StepDone")
    assert (done.step, done.loss, done.metrics) == (0, 0.5, {"accuracy": 0.95, "val/acc": 1.0})
    commit(leader, 0)
    next(walk)
    quiet = leader.expect("StepDone")  # step 1 recorded nothing: its report says nothing
    assert (quiet.step, quiet.loss, quiet.metrics) == (1, None, None)
    commit(leader, 1)
    walk.close()


def test_figures_recorded_after_the_last_step_go_as_their_own_report_before_the_leave(
    job,  # noqa: F811
) -> None:
    """The last epoch's validation has no next step to ride on: closing sends it (EvalDone
    of the last step, which the leader journals) before the Leave."""
    leader, elastic, _ = job
    walk = elastic._walk()
    for step in range(4):  # one epoch, the job's only
        assert next(walk).step == step
        elastic.record(loss=0.5)
        commit(leader, step, *([fact(m.JobFinished, step=3, epoch=0)] if step == 3 else []))
    assert [type(x).__name__ for x in walk] == ["EpochEnd"]  # then the loops end
    assert [done.loss for done in leader.commands("StepDone")] == [0.5] * 4
    elastic.record(val_loss=np.float32(0.25), loss=0.75)
    closing = threading.Thread(target=elastic.close)
    closing.start()
    last = leader.expect("EvalDone")
    assert (last.worker, last.step, last.metrics) == (ME, 3, {"val_loss": 0.25, "loss": 0.75})
    leader.expect("Leave")
    leader.say(fact(m.WorkerLeft, worker=ME, reason="finished"))
    closing.join(10)
    assert not closing.is_alive()


@pytest.mark.parametrize(
    "figures, named",
    [
        ({"accuracy": "high"}, "accuracy"),
        ({"accuracy": [0.5, 0.6]}, "accuracy"),
        ({"_private": 1.0}, "_private"),
        ({"x" * 65: 1.0}, "x" * 65),
        ({f"m{i}": 1.0 for i in range(65)}, "at most 64"),
    ],
)
def test_a_figure_that_is_no_number_or_badly_named_is_refused_naming_it(
    job,  # noqa: F811
    figures: dict[str, object],
    named: str,
) -> None:
    _, elastic, _ = job
    with pytest.raises(InvalidValueError, match=named[:20]):
        elastic.record(**figures)


def test_a_loss_that_carries_its_graph_is_recorded_without_a_warning(job) -> None:  # noqa: F811
    """`job.record(loss=loss)` with the tensor backward just ran on, as a loop writes it:
    read as `loss.item()` would, with no "requires_grad" warning on every step."""
    import warnings

    torch = pytest.importorskip("torch")
    _, elastic, _ = job
    loss = (torch.ones(2, requires_grad=True) * 0.25).sum()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        elastic.record(loss=loss, norm=loss * 2)
    assert (elastic._loss, elastic._figures) == (0.5, {"norm": 1.0})


class Later:
    """A recorded number still on its way (a GPU tensor's copy): counts its reads."""

    def __init__(self, value: float) -> None:
        self.value, self.reads = value, 0

    def __float__(self) -> float:
        self.reads += 1
        return self.value


def test_a_figure_on_its_way_is_read_once_at_the_report_as_the_same_number(
    job,  # noqa: F811
) -> None:
    """`job.record(loss=cuda_tensor)` must not wait for the GPU where it is called: the
    torch job keeps the tensor's copy and the report reads it (issue 49)."""
    leader, elastic, _ = job
    elastic._figure = lambda name, value: value  # what the torch job keeps of a GPU tensor
    walk = elastic._walk()
    next(walk)  # step 0
    loss, accuracy = Later(0.5), Later(0.75)
    elastic.record(loss=loss, accuracy=accuracy)
    assert loss.reads == accuracy.reads == 0
    next(walk)  # step 0 is reported as step 1 is asked for
    done = leader.expect("StepDone")
    assert (done.loss, done.metrics) == (0.5, {"accuracy": 0.75})
    assert loss.reads == accuracy.reads == 1
    commit(leader, 0)
    walk.close()
