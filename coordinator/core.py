"""The leader's state without I/O: what the journal holds, and what this leader decided since.

`decide` and `tick` return the state after their facts, so a decision is folded once,
as it is made. `state` runs ahead of `committed` until the facts are in the journal
(`commit`) or refused (`rollback`): one checkpoint/rollback pair instead of two
states swapped by hand. Facts read from the journal move both (`fold`).

`service.py` wraps it in Redis; tests and benchmarks drive it directly.
"""

from __future__ import annotations

from collections.abc import Sequence

from cohort.coordinator import decide
from cohort.coordinator.fold import evolve, fold
from cohort.coordinator.liveness import Liveness
from cohort.coordinator.state import JobState
from cohort.events.models import Command, Fact, JobConfig, WorkerFailed, WorkerLeft


class Core:
    def __init__(self, state: JobState | None = None) -> None:
        self.committed = self.state = JobState() if state is None else state
        """`committed`: as the journal holds it. `state`: with this leader's decisions."""
        self.seen = Liveness()

    @property
    def pending(self) -> bool:
        """True while decisions are neither committed nor rolled back."""
        return self.state is not self.committed

    # ------------------------------------------------------------ deciding
    def handle(self, command: Command, received_at: float, now: float) -> tuple[Fact, ...]:
        """Observe `command`, decide; the facts are already folded into `state`."""
        self.seen.observe(command, received_at)
        return self._adopt(decide.decide(self.state, self.seen, command, now))

    def tick(self, now: float) -> tuple[Fact, ...]:
        """What time passing decides (members silent too long have failed)."""
        facts = self._adopt(decide.tick(self.state, self.seen, now))
        self.seen.prune(self.state.last_committed)
        return facts

    def take_over(
        self, job: str, config: JobConfig, coordinator: str, epoch: int, now: float
    ) -> tuple[Fact, ...]:
        """A new leader's first facts: the job's config if the journal has none, and itself."""
        return self._adopt(decide.take_over(self.state, job, config, coordinator, epoch, now))

    def note(self, fact: Fact) -> None:
        """A fact the leader journals as evidence (refusals, a repaired inbox), not as a
        decision: folded into `state` like one."""
        self.state = evolve(self.state, fact)

    def _adopt(self, decision: decide.Decision) -> tuple[Fact, ...]:
        self.state = decision.state
        if decision.facts:  # (most commands decide nothing)
            self._forget_departed(decision.facts)
        return decision.facts

    # ------------------------------------------------------------ the journal's answer
    def commit(self) -> None:
        """The decisions are in the journal."""
        self.committed = self.state

    def rollback(self) -> None:
        """The decisions were refused, or their fate is unknown: back to the journal's state."""
        self.state = self.committed

    def fold(self, facts: Sequence[Fact]) -> None:
        """Facts read from the journal (nothing of this leader's may be pending)."""
        assert not self.pending, "fold journal facts only after commit or rollback"
        self.committed = self.state = fold(facts, self.committed)
        self._forget_departed(facts)

    def restore(self, state: JobState) -> None:
        """Continue from `state` (a snapshot), keeping what was observed of the workers."""
        self.committed = self.state = state

    def _forget_departed(self, facts: Sequence[Fact]) -> None:
        for fact in facts:
            if isinstance(fact, WorkerLeft | WorkerFailed):
                self.seen.forget(fact.worker)
