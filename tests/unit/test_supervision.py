"""What `cohort run` does when a rank exits (cohort/launcher/supervision.py), rule by rule."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from cohort.launcher.supervision import (
    Exited,
    Policy,
    Slot,
    State,
    due,
    on_exit,
    replacement_role,
    started,
    stopped_waiting,
)

POLICY = Policy(max_restarts=3, stable_after=60.0, backoff=1.0, backoff_cap=30.0)


def failed(ran_for: float = 1.0, code: int = -9) -> Exited:
    return Exited(code=code, how="killed by SIGKILL", ran_for=ran_for, finished=False)


def test_a_rank_that_exits_0_is_done_and_not_replaced() -> None:
    slot = on_exit(Slot(0), Exited(0, "exit code 0", 300.0, finished=True), 10.0, POLICY)
    assert slot.state is State.DONE and slot.ended and not due(slot, 1e9)


def test_a_rank_that_exits_0_before_the_end_is_done_too_its_script_chose_to_end() -> None:
    slot = on_exit(Slot(0), Exited(0, "exit code 0", 5.0, finished=False), 10.0, POLICY)
    assert slot.state is State.DONE


def test_a_rank_that_fails_after_the_job_finished_is_not_replaced() -> None:
    slot = on_exit(Slot(0), Exited(1, "exit code 1", 5.0, finished=True), 10.0, POLICY)
    assert slot.state is State.DONE and slot.last_exit == "exit code 1"


def test_a_rank_killed_after_training_a_while_is_replaced_at_once() -> None:
    slot = on_exit(Slot(0, quick_failures=2), failed(ran_for=600.0), 100.0, POLICY)
    assert slot.state is State.WAITING and slot.restart_at == 100.0
    assert slot.quick_failures == 0  # its count starts afresh
    assert due(slot, 100.0)


def test_quick_failures_wait_longer_each_time_then_the_slot_is_given_up() -> None:
    slot, delays = Slot(0), []
    for now in (10.0, 20.0, 30.0):
        slot = on_exit(slot, failed(), now, POLICY)
        assert slot.state is State.WAITING and slot.restart_at is not None
        delays.append(slot.restart_at - now)
        assert not due(slot, now) and due(slot, slot.restart_at)
        slot = started(slot)
    assert delays == [1.0, 2.0, 4.0]
    slot = on_exit(slot, failed(), 40.0, POLICY)
    assert slot.state is State.GIVEN_UP and slot.ended and slot.generation == 3


def test_no_restarts_allowed_gives_up_at_the_first_quick_failure() -> None:
    slot = on_exit(Slot(0), failed(), 0.0, Policy(max_restarts=0))
    assert slot.state is State.GIVEN_UP


def test_the_backoff_is_capped() -> None:
    policy = Policy(max_restarts=100, backoff=1.0, backoff_cap=30.0)
    slot = Slot(0, quick_failures=20)
    slot = on_exit(slot, failed(), 0.0, policy)
    assert slot.restart_at == 30.0


def test_a_slot_waiting_to_restart_is_done_once_the_launcher_stops_or_the_job_ends() -> None:
    waiting = on_exit(Slot(0), failed(), 0.0, POLICY)
    assert stopped_waiting(waiting).state is State.DONE
    running = Slot(1)
    assert stopped_waiting(running) is running


@given(
    st.lists(
        st.tuples(st.floats(0, 1000), st.integers(-15, 3), st.booleans()), min_size=1, max_size=40
    )
)
def test_a_slot_never_runs_more_than_max_restarts_quick_failures_in_a_row(
    exits: list[tuple[float, int, bool]],
) -> None:
    slot, now, quick_in_a_row = Slot(0), 0.0, 0
    for ran_for, code, finished in exits:
        if slot.ended:
            break
        if slot.state is State.WAITING:
            assert slot.restart_at is not None and slot.restart_at >= now
            now = slot.restart_at
            slot = started(slot)
        now += ran_for
        slot = on_exit(slot, Exited(code, "", ran_for, finished), now, POLICY)
        if code != 0 and not finished:
            quick_in_a_row = 0 if ran_for >= POLICY.stable_after else quick_in_a_row + 1
        assert quick_in_a_row <= POLICY.max_restarts or slot.state is State.GIVEN_UP
        if slot.state is State.GIVEN_UP:
            assert quick_in_a_row == POLICY.max_restarts + 1
        if code == 0 or finished:
            assert slot.state is State.DONE


def test_with_spares_a_replacement_waits_for_the_dead_workers_fate_then_follows_the_journal() -> (
    None
):
    # still a member and not waited out: its fate (and a spare's promotion) is to come
    assert replacement_role(False, False, trainers_alive=2, ranks=3) is None
    # a spare took its place: the node has its three trainers, the replacement is a spare
    assert replacement_role(True, False, trainers_alive=3, ranks=3) == "spare"
    # no spare was ready: the replacement is a trainer
    assert replacement_role(True, False, trainers_alive=2, ranks=3) == "trainer"
    # the journal never said: past the deadline the count alone decides
    assert replacement_role(False, True, trainers_alive=2, ranks=3) == "trainer"
