"""How bench/launched.py counts healing, specified on made-up timelines (the benchmark
itself runs in `python -m bench --only launched`)."""

from __future__ import annotations

import math

from bench.launched import _healed, _recommitted, _redone, _regained, _restarted_step_after

# cohort's journal: (time, step committed, the world that committed it)
COMMITS = [
    (1.0, 1, 4), (2.0, 2, 4),
    (2.6, 3, 4),  # the kill at 2.5: step 3 was in flight and its world still commits it
    (4.5, 4, 5),  # the survivors' world: healed
    (9.0, 5, 6),  # the replacement joined
]  # fmt: skip


def test_cohort_trains_again_at_the_first_step_of_a_later_world() -> None:
    assert _healed(COMMITS, 2.5) == 2.0
    assert math.isinf(_healed(COMMITS[:3], 2.5))  # no new world yet: never


def test_cohort_redoes_no_step_unless_a_committed_step_is_committed_again() -> None:
    assert _recommitted(COMMITS, 2.5) == 0
    rewound = [(1.0, 1, 1), (2.0, 2, 1), (3.0, 3, 1), (6.0, 2, 2), (7.0, 3, 2), (8.0, 4, 2)]
    assert _recommitted(rewound, 3.5) == 2  # steps 2 and 3 again


# torchrun's log: (time, the model's step count after the step, worker pid)
LOG = [
    (1.0, 99, 10), (1.0, 99, 11), (2.0, 100, 10), (2.0, 100, 11),
    (3.0, 101, 10),  # the kill at 3.5 takes 11; the agent restarts both from step 100
    (3.6, 102, 10),  # the survivor's step in flight: not a restarted worker's
    (8.0, 101, 20), (8.2, 101, 21), (9.0, 102, 20), (10.0, 103, 20),
]  # fmt: skip


def test_torchrun_trains_again_at_the_first_step_of_a_restarted_worker() -> None:
    assert _restarted_step_after(LOG, 3.5) == 4.5
    assert math.isinf(_restarted_step_after(LOG[:6], 3.5))  # no restarted worker yet


def test_torchrun_regains_progress_when_a_restarted_worker_passes_the_count() -> None:
    assert _regained(LOG, 3.5) == 5.5  # 102 at 9.0 passes 101, the count at the kill
    assert math.isinf(_regained(LOG[:8], 3.5))  # restarted, not yet past it


def test_torchrun_redoes_the_steps_since_the_checkpoint_it_resumed_from() -> None:
    assert _redone(LOG, 3.5) == 1  # at 101 when killed, resumed from 100
    assert _redone(LOG[:6], 3.5) == 0
