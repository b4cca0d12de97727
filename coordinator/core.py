"""The leader's inner step without I/O: observe a command, decide, fold the facts.

`service.py` wraps it in Redis; tests and benchmarks drive it directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cohort.events.models import Command, Fact, WorkerFailed, WorkerLeft

from .decide import decide, tick
from .fold import fold
from .liveness import Liveness
from .state import JobState


@dataclass
class Core:
    state: JobState = field(default_factory=JobState)
    seen: Liveness = field(default_factory=Liveness)

    def apply(self, facts: tuple[Fact, ...] | list[Fact]) -> None:
        self.state = fold(facts, self.state)
        for fact in facts:
            if isinstance(fact, WorkerLeft | WorkerFailed):
                self.seen.forget(fact.worker)

    def handle(self, command: Command, received_at: float, now: float) -> tuple[Fact, ...]:
        """Facts following from one command; the state already includes them."""
        self.seen.observe(command, received_at)
        facts = decide(self.state, self.seen, command, now)
        self.apply(facts)
        return facts

    def tick(self, now: float) -> tuple[Fact, ...]:
        facts = tick(self.state, self.seen, now)
        self.apply(facts)
        self.seen.prune(self.state.last_committed)
        return facts
