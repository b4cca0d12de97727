"""Collective call ids: what names one `Collective` call when a step makes several.

A training loop passes its step to `Collective` as it is. The PyTorch helpers make several
calls per step (a bucket of gradients each, a state broadcast), so each gets its own id,
negative so it never collides with a step a loop passes itself; `training_step` and
`call_name` turn an id back into the training step it serves, for messages people read.
"""

from __future__ import annotations

from cohort.worker.errors import CollectiveError

MAX_BUCKETS = 1 << 20
GRADIENTS, WEIGHTS, STATE, FIGURES, BUFFERS = 0, 1, 2, 3, 4
"""Channels of `call_id`: sync_gradients, LocalSGD, broadcast_state, the script's
reductions of its figures (`job.mean`) and a step's buffers (BatchNorm's statistics) never
share a call."""
CHANNELS = ("gradients", "weights", "state", "figures", "buffers")


def call_id(step: int, channel: int, bucket: int = 0) -> int:
    """The collective call id of `bucket` of `channel` at `step` (negative: see module doc)."""
    if not 0 <= bucket < MAX_BUCKETS:
        raise CollectiveError(f"bucket {bucket} is out of range; at most {MAX_BUCKETS} per call")
    return -((step * len(CHANNELS) + channel) * MAX_BUCKETS + bucket) - 1


def _parts(call: int) -> tuple[int, int, int]:
    """(step, channel, bucket) of a negative call id."""
    rest, bucket = divmod(-call - 1, MAX_BUCKETS)
    step, channel = divmod(rest, len(CHANNELS))
    return step, channel, bucket


def training_step(call: int) -> int:
    """The training step a call serves: the call itself if it is a step, else decoded."""
    return call if call >= 0 else _parts(call)[0]


def call_name(call: int) -> str:
    """`step 90`, or `step 90 (gradients, bucket 3)` for a call id."""
    if call >= 0:
        return f"step {call}"
    step, channel, bucket = _parts(call)
    return f"step {step} ({CHANNELS[channel]}, bucket {bucket})"
