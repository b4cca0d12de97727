"""The straggler check looks at each step once for the whole world (one commit looks at
every rank): it must flip exactly the flags the rule, read rank by rank, flips."""

from __future__ import annotations

from dataclasses import replace
from statistics import median

from hypothesis import given, settings
from hypothesis import strategies as st

from cohort.coordinator import stragglers
from cohort.coordinator.liveness import Liveness
from cohort.coordinator.state import JobState, Member
from cohort.events.models import JobConfig, StepDone

RANKS = ("a", "b", "c", "d", "e")


def reference(
    state: JobState, seen: Liveness, step: int, config: JobConfig
) -> list[tuple[str, bool, float, float]]:
    """The rule as written: slow (or fast) in each of the last `straggler_steps` steps, each
    judged against the median of that step's times; a rank or step without times, no flip."""
    flips = []
    for worker in state.ranks:
        verdicts = set()
        for s in range(step - config.straggler_steps + 1, step + 1):
            times = seen.step_times.get(s, {})
            if worker not in times or len(times) < 2:
                verdicts = {None}
                break
            mine, middle = times[worker], median(times.values())
            verdicts.add(mine > config.straggler_factor * middle and mine > 0)
        if len(verdicts) != 1 or None in verdicts:
            continue
        slow = verdicts.pop()
        if slow != state.members[worker].straggler:
            times = seen.step_times[step]
            flips.append((worker, bool(slow), times[worker], median(times.values())))
    return flips


reports = st.dictionaries(  # step -> worker -> time (a rank may not have reported)
    st.integers(0, 5),
    st.dictionaries(st.sampled_from(RANKS), st.sampled_from([0.0, 0.5, 1.0, 1.4, 1.5, 2.0, 9.0])),
)


@settings(max_examples=300, deadline=None)
@given(reports, st.sets(st.sampled_from(RANKS)), st.integers(1, 4), st.integers(0, 6))
def test_the_flags_that_flip_are_those_the_rule_flips_rank_by_rank(
    times: dict[int, dict[str, float]], flagged: set[str], streak: int, step: int
) -> None:
    config = JobConfig(straggler_steps=streak, straggler_factor=1.5)
    members = {w: Member(worker=w, status="active", joined_at=0.0) for w in RANKS}
    members = {w: replace(m, straggler=w in flagged) for w, m in members.items()}
    state = JobState(job="j", config=config, members=members, ranks=RANKS)
    seen = Liveness()
    for s, by_worker in sorted(times.items()):
        for worker, took in by_worker.items():
            seen.observe(StepDone(at=0, job="j", worker=worker, step=s, world=1, step_time=took), 1)
        seen.timed(s)  # a median cached before a later report must not be used after it
    late = StepDone(at=0, job="j", worker="a", step=step, world=1, step_time=1.0)
    seen.observe(late, 2)

    assert list(stragglers.changes(state, seen, step, config)) == reference(
        state, seen, step, config
    )
