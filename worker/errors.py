"""The worker's exceptions: one root, each message says what happened and what to do."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cohort.events.errors import CohortError, RedisUnavailableError
from cohort.events.renames import renamed

if TYPE_CHECKING:
    from cohort.worker.membership.view import Assignment


class WorkerError(CohortError):
    """Root of the worker's errors: what a training script meets from cohort."""


class RedisUnreachableError(WorkerError, RedisUnavailableError):
    """Redis did not answer within the start-up wait (`wait_for_redis`): a wrong URL, or a
    server that is not up. The message names the URL; the cause is redis-py's error."""


class IdentityMismatchError(WorkerError):
    """The worker connects with another worker's own credential (`cohort-J-w-W`): every
    command it sent would be signed as W and dead-lettered, so it refuses to start."""

    def __init__(self, worker: str, owner: str, username: str) -> None:
        super().__init__(
            f"worker id {worker!r} does not match its Redis user {username!r}, which is worker "
            f"{owner!r}'s credential: start it with id {owner!r} (--id {owner}), or connect "
            f"with its own credential (cohort acl --job J --worker {worker} --apply)"
        )
        self.worker = worker
        self.owner = owner


class OutageTooLongError(RedisUnreachableError):
    """Redis stayed unreachable longer than the worker rides out (`ride_out`); the message
    names the URL, what waited, for how long, and the setting."""


class WaitTimeoutError(WorkerError, TimeoutError):
    """A bounded wait ran out before the journal said what was awaited."""


class JoinTimeoutError(WaitTimeoutError):
    """No coordinator answered the join in time (`join(timeout=...)`)."""


class CommitTimeoutError(WaitTimeoutError):
    """A step did not commit in time (`wait_committed`)."""


class ActivationTimeoutError(WaitTimeoutError):
    """This worker was not given a rank in time (`wait_active`)."""


class JoinRefusedError(WorkerError):
    """The coordinator refused the join; `reason` is its explanation."""

    def __init__(self, worker: str, reason: str) -> None:
        super().__init__(f"join of {worker!r} was refused: {reason}")
        self.worker = worker
        self.reason = reason


class RemovedError(WorkerError):
    """This worker is no longer a member (it left or was declared failed); rejoin to come back."""

    def __init__(self, worker: str, reason: str) -> None:
        super().__init__(f"worker {worker!r} is no longer a member: {reason}; join again to return")
        self.worker = worker
        self.reason = reason


class WorldChangedError(WorkerError):
    """The world changed before the step committed: the step was aborted.

    The training loop continues from `assignment.start_step` (None: not a rank of the new world).
    """

    def __init__(self, step: int, assignment: Assignment | None) -> None:
        where = (
            f"world {assignment.world_version} from step {assignment.start_step}"
            if assignment is not None
            else "a world without this worker"
        )
        super().__init__(f"step {step} was aborted by a world change; continue in {where}")
        self.step = step
        self.assignment = assignment


class JobFinishedError(WorldChangedError):
    """A reduction (`job.mean`/`sum`/`max`) could not complete because the job finished:
    a rank of the step's world left (or failed) before it answered. A WorldChangedError
    too, so a script that catches that skips the figure as before; no world follows."""

    def __init__(self, how: str, step: int, job: str, end: str) -> None:
        WorkerError.__init__(
            self,
            f"job.{how}() of step {step}: job {job!r} finished ({end}) and a rank of that "
            "step's world left before it answered; every rank must make the same reductions "
            "(skip this figure, or make it before the job's last step)",
        )
        self.step = step
        self.assignment = None


class Finished(WorkerError):
    """The job finished: no step trains after `step`, its last. Not a failure but control
    flow, hence no `Error` in its name: a loop waiting for a rank or a commit ends here,
    with the final weights."""

    def __init__(self, job: str, step: int, reason: str) -> None:
        super().__init__(f"job {job!r} finished at step {step} ({reason})")
        self.job = job
        self.step = step
        self.reason = reason


class NotAssignedError(WorkerError):
    """This worker holds no rank (in the current world, or in the world of the asked step)."""


class Stopped(WorkerError):
    """The worker was stopped while an operation was still waiting or retrying (a signal,
    `stop()`). Control flow, hence no `Error` in its name: the loop ends cleanly."""


class CollectiveError(WorkerError):
    """A collective could not complete (ranks disagree, a key vanished, Redis failed)."""


class MemoryBudgetError(CollectiveError):
    """A step's gradients do not fit in Redis's maxmemory with room left for the journal
    (`events/budget.py`); nothing of the step is left on the server. The message names
    maxmemory and what to do."""


class CollectiveTimeoutError(CollectiveError, WaitTimeoutError):
    """Some ranks did not do their part in time; the message names them."""


class CorruptDataError(CollectiveError):
    """What a rank wrote for a collective failed verification where it was read (a blob
    that does not unpack, or sizes, dtypes or values other than the call's): the step fails
    at once, naming the rank, its worker and the key, instead of diverging later."""

    def __init__(self, message: str, rank: int, worker: str, key: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.worker = worker
        self.key = key


class WeightsRefusedError(WorkerError):
    """The weights a new world's rank 0 sent do not have the digest the journal recorded
    for them: this rank does not train on them. The message names the sender and both
    digests."""

    def __init__(self, sender: str, step: int, got: str, journaled: str) -> None:
        super().__init__(
            f"the weights of step {step} sent by worker {sender!r} (rank 0) have digest "
            f"{got}, not the journaled {journaled}: refused; this worker left the job rather "
            "than train on them"
        )
        self.sender = sender
        self.step = step
        self.got = got
        self.journaled = journaled


class BlobError(WorkerError):
    """A tensor blob is malformed or hostile (bad header, dtype, shape or byte range)."""


class StateError(WorkerError):
    """Model or optimizer state that cannot be sent, or a blob that does not fit the model
    (`cohort.torch`)."""


class AccumulationError(WorkerError):
    """A gradient was accumulated again after its bucket was averaged (`cohort.torch`)."""


class RendezvousError(WorkerError):
    """The ranks of a world could not meet for torch.distributed (store unreachable, rank 0
    published nothing): `cohort.ElasticProcessGroup`."""


__getattr__ = renamed(
    "cohort.worker.errors",
    {
        "RedisUnreachable": "RedisUnreachableError",
        "IdentityMismatch": "IdentityMismatchError",
        "OutageTooLong": "OutageTooLongError",
        "WaitTimeout": "WaitTimeoutError",
        "JoinTimeout": "JoinTimeoutError",
        "CommitTimeout": "CommitTimeoutError",
        "ActivationTimeout": "ActivationTimeoutError",
        "CollectiveTimeout": "CollectiveTimeoutError",
        "NotAssigned": "NotAssignedError",
        "Removed": "RemovedError",
    },
    globals(),
)
