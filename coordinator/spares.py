"""Warm spares: which ready spare takes the place of a rank the world lost. Pure.

A spare (`Join(spare=True)`) syncs like any joiner but waits, ready, outside every world.
When the world loses ranks, `decide` promotes one ready spare per lost rank, chosen here:
a spare on the lost rank's machine first (its data and devices are there), then the one
ready longest, then by name, so any coordinator replaying the journal chooses the same.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from cohort.coordinator.state import JobState, Member


def machine(member: Member) -> str:
    """The machine a member runs on, as its Join described it (its node's host, else the
    host it named)."""
    return (member.node.host if member.node is not None else "") or member.host


def ready(state: JobState) -> list[Member]:
    """Ready spares, those ready longest first (then by name)."""
    waiting = [m for m in state.members.values() if m.spare and m.status == "ready"]
    return sorted(waiting, key=lambda m: (m.synced_at or 0.0, m.worker))


def replacing(state: JobState, lost: Iterable[Member]) -> list[tuple[str, str]]:
    """(spare, lost rank) for each lost rank a ready spare can replace, in the order the
    ranks were lost: each takes a spare of its own machine if there is one, else the one
    ready longest."""
    left = ready(state)
    chosen = []
    for rank in lost:
        if not left:
            break
        here = machine(rank)
        spare = next((s for s in left if here and machine(s) == here), left[0])
        left.remove(spare)
        chosen.append((spare.worker, rank.worker))
    return chosen


def making_up(state: JobState, missing: int) -> Sequence[str]:
    """The ready spares that make up `missing` workers of `min_workers` (those ready
    longest), or none if there are too few to make them up."""
    waiting = ready(state)
    if missing <= 0 or len(waiting) < missing:
        return ()
    return tuple(m.worker for m in waiting[:missing])
