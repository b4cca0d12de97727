"""Which weights a world starts from, and where a checkpoint puts the data: pure helpers.

The last committed weights live only in the processes that committed them (the
`holders`). A new world starts from them when one of its ranks is a holder (rank 0
is then one: survivors come first and broadcast); before any commit, from the
initial weights; after a rewind, from the rewind's checkpoint (or the initial
weights, from scratch). Otherwise nobody has them: the leader rewinds to the latest
checkpoint, or the job pauses.
"""

from __future__ import annotations

from cohort.coordinator.state import JobState
from cohort.events import deal
from cohort.events.models import DataPosition, Weights
from cohort.events.shards import Shard


def world_weights(state: JobState, ranks: tuple[str, ...]) -> Weights | None:
    """The weights a world of `ranks` would start from, or None if none of them has them."""
    if ranks and ranks[0] in state.holders:
        return Weights(step=state.last_committed, source="rank", digest=state.last_digest, uri=None)
    if state.restart is not None:
        return state.restart
    if state.last_committed < 0:
        return Weights(step=-1, source="initial")
    return None


def position(state: JobState) -> DataPosition:
    """Where the data stands before `state.next_step`: the epoch and what is left of it."""
    assert state.config is not None
    rest = deal.leftover(
        state.config, state.shards, state.base_step, state.next_step, state.unassigned
    )
    return DataPosition(epoch=state.epoch, rest=Shard(ranges=rest))


def beginning(state: JobState) -> DataPosition:
    """Where the data stands before the first step: epoch 0, every sample."""
    assert state.dataset is not None
    return DataPosition(epoch=0, rest=Shard(ranges=((0, state.dataset.size),)))


def due(state: JobState, step: int) -> bool:
    """Whether committing `step` calls for a checkpoint (one after every N steps)."""
    config = state.config
    return bool(config and config.checkpoint_uri and (step + 1) % config.checkpoint_every == 0)


def lost_reason(state: JobState) -> str:
    step = state.weights_lost
    return (
        f"the weights of step {step} are lost: no member holds them and no checkpoint exists; "
        f"continue with `cohort resume --job {state.job} --from-scratch` or "
        "`--from-checkpoint URI`"
    )
