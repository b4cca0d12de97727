"""What the launcher does when one of its ranks exits: the rules, pure, over frozen slots.

A slot is one local rank: the launcher keeps a process in it until the job no longer needs
one. A rank that exits 0 is done (its script ended, normally because the job finished);
one that fails (a non-zero exit, a signal) is replaced by a fresh process that joins the
running job, while the other ranks go on untouched. Failures in a row of processes that
ran less than `Policy.stable_after` seconds count against `Policy.max_restarts`, and wait
longer and longer before the next try, so a script that cannot start (an ImportError)
ends in a clear stop instead of a crash loop; a rank that trained a while and then died
(a preemption, the OOM killer) is replaced at once and starts its count afresh.

With warm spares (`cohort run --spares K`) a replacement's role follows the journal: once
the dead worker's fate is journaled (the leader promoted a spare in its place, if one was
ready), it starts as a spare if the node has its ranks' worth of trainers alive, else as
a trainer (`replacement_role`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from enum import Enum


@dataclass(frozen=True, slots=True)
class Policy:
    """How far the launcher goes in replacing a slot's processes."""

    max_restarts: int = 3
    """Quick failures in a row after which the slot is given up."""
    stable_after: float = 60.0
    """A process that ran this many seconds before it failed is replaced at once, and its
    slot's count of quick failures starts again."""
    backoff: float = 1.0
    """Seconds before replacing the first quick failure; each next one waits twice as long."""
    backoff_cap: float = 30.0


class State(Enum):
    RUNNING = "running"
    WAITING = "waiting"
    """Its process failed; a new one starts at `Slot.restart_at`."""
    DONE = "done"
    """Its process exited 0, or after the job finished: no process is needed any more."""
    GIVEN_UP = "given up"
    """Its processes kept failing: `Policy.max_restarts` quick failures in a row."""


@dataclass(frozen=True, slots=True)
class Slot:
    """One local rank and the processes the launcher ran in it."""

    index: int
    state: State = State.RUNNING
    generation: int = 0
    """How many processes were started in it before the current one."""
    quick_failures: int = 0
    """Failures in a row of processes that ran less than `Policy.stable_after`."""
    restart_at: float | None = None
    last_exit: str = ""
    """How its last process ended, for people: "exit code 1", "killed by SIGKILL"."""

    @property
    def ended(self) -> bool:
        return self.state in (State.DONE, State.GIVEN_UP)


@dataclass(frozen=True, slots=True)
class Exited:
    """A slot's process ended with `code` (negative: killed by that signal), `how` for
    people, after `ran_for` seconds; `finished`: the job had finished by then."""

    code: int
    how: str
    ran_for: float
    finished: bool
    intended: bool = False
    """The launcher killed it on purpose (--chaos): replaced at once, not a failure."""


def on_exit(slot: Slot, exited: Exited, now: float, policy: Policy) -> Slot:
    """The slot after its process ended: done, waiting to start a new one, or given up."""
    if exited.code == 0 or exited.finished:
        return replace(slot, state=State.DONE, restart_at=None, last_exit=exited.how)
    if exited.intended:
        return replace(slot, state=State.WAITING, restart_at=now, last_exit=exited.how)
    if exited.ran_for >= policy.stable_after:  # it trained a while: replace it at once
        return replace(
            slot, state=State.WAITING, quick_failures=0, restart_at=now, last_exit=exited.how
        )
    failures = slot.quick_failures + 1
    if failures > policy.max_restarts:
        return replace(
            slot,
            state=State.GIVEN_UP,
            quick_failures=failures,
            restart_at=None,
            last_exit=exited.how,
        )
    delay = min(policy.backoff_cap, policy.backoff * 2 ** (failures - 1))
    return replace(
        slot,
        state=State.WAITING,
        quick_failures=failures,
        restart_at=now + delay,
        last_exit=exited.how,
    )


def due(slot: Slot, now: float) -> bool:
    """The slot waits for a new process and its time has come."""
    return slot.state is State.WAITING and slot.restart_at is not None and now >= slot.restart_at


def started(slot: Slot) -> Slot:
    """The slot once a new process runs in it."""
    return replace(slot, state=State.RUNNING, generation=slot.generation + 1, restart_at=None)


def unused_generation(base: str, used: Iterable[str]) -> int:
    """The generation a slot whose worker ids are `base`, `base.1`, `base.2`... starts at so
    that none of its ids is one in `used` or older: a launcher that resumes a job (or
    starts again on a shared Redis) is never taken for the lost one's processes, whose
    members the journal still holds until they are failed."""
    taken = [
        0 if worker == base else int(worker[len(base) + 1 :])
        for worker in used
        if worker == base or (worker.startswith(f"{base}.") and worker[len(base) + 1 :].isdigit())
    ]
    return max(taken) + 1 if taken else 0


def stopped_waiting(slot: Slot) -> Slot:
    """A slot that waited to restart, once the job finished or the launcher stops: done."""
    return replace(slot, state=State.DONE, restart_at=None) if slot.state is State.WAITING else slot


def replacement_role(
    fate_journaled: bool, waited_out: bool, trainers_alive: int, ranks: int
) -> str | None:
    """What a slot's replacement process starts as: "spare" when the node already has
    `ranks` trainers alive (a spare took the dead one's place), else "trainer"; None while
    the dead worker is still a member of the journal and its deadline has not passed (its
    fate, and a promotion with it, is yet to come)."""
    if not fate_journaled and not waited_out:
        return None
    return "spare" if trainers_alive >= ranks else "trainer"
