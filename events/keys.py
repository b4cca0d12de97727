"""Redis key names. One hash tag per job, so Redis Cluster keeps a job's keys in one slot."""

from __future__ import annotations

import re
from dataclasses import dataclass

from cohort.events.errors import EventsError, InvalidValueError

ENV_JOB = "COHORT_JOB"
"""The environment variable that names the job where no flag does."""
JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class JobNameError(EventsError, ValueError):
    """A job name that is missing or breaks the naming rule (the message says which)."""


def check_job(job: str) -> str:
    """Return `job` if it is a usable job name, else raise naming it and the rule."""
    if not isinstance(job, str) or not job:
        raise JobNameError(
            f"no job name given ({job!r}): pass the name the job's coordinators were started "
            "with (--job / $COHORT_JOB)"
        )
    if not JOB_NAME.fullmatch(job):
        raise JobNameError(
            f"job name {job!r} is not valid: use 1-64 characters from the ASCII letters "
            "A-Z and a-z, the digits 0-9, '.', '_' and '-', starting with a letter or digit"
        )
    return job


JOURNAL_PATTERN = "cohort:{*}:journal"
"""SCAN pattern matching every job's journal."""


def job_of_journal(key: str) -> str | None:
    """The job whose journal `key` is (`cohort:{J}:journal`), or None for any other key."""
    if not (key.startswith("cohort:{") and key.endswith("}:journal")):
        return None
    job = key[len("cohort:{") : -len("}:journal")]
    return job if JOB_NAME.fullmatch(job) else None


@dataclass(frozen=True, slots=True)
class Keys:
    """Every key of one job, as docs/design.md's table names them."""

    job: str

    def __post_init__(self) -> None:
        check_job(self.job)

    @property
    def prefix(self) -> str:
        return f"cohort:{{{self.job}}}"

    @property
    def inbox(self) -> str:
        return f"{self.prefix}:inbox"

    @property
    def journal(self) -> str:
        return f"{self.prefix}:journal"

    @property
    def leader(self) -> str:
        return f"{self.prefix}:leader"

    @property
    def epoch(self) -> str:
        return f"{self.prefix}:epoch"

    @property
    def cursor(self) -> str:
        return f"{self.prefix}:cursor"

    @property
    def snapshot(self) -> str:
        return f"{self.prefix}:snapshot"

    @property
    def archive(self) -> str:
        """The index of the journal's archived segments (events/archive.py), set by the leader
        together with the trim that drops their entries from the journal."""
        return f"{self.prefix}:archive"

    @property
    def dead(self) -> str:
        return f"{self.prefix}:dead"

    def presence(self, worker: str) -> str:
        """The sharded Pub/Sub channel (no key) `worker` keeps a subscription to while it runs:
        it vanishes the moment the worker's process dies, so the leader asks Redis how many
        subscribers it has (PUBSUB SHARDNUMSUB) to tell a dead process from a silent one.
        The job's hash tag puts it on the server that owns the job's slot."""
        return f"{self.prefix}:presence:{worker}"

    @property
    def identity(self) -> str:
        """The job's identity key (32 random bytes): every worker's secret derives from it
        (events/identity.py). Only coordinators read it; no worker or viewer pattern covers it."""
        return f"{self.prefix}:identity"

    @property
    def identity_previous(self) -> str:
        """The job key before `cohort acl --rotate`, kept (with an expiry) for the rotation's
        grace: the leader accepts signatures under either. Like the job key, its name starts
        with 'i', so only coordinators read it."""
        return f"{self.prefix}:identity:previous"

    def credential(self, worker: str) -> str:
        """`worker`'s new secret during a rotation's grace, readable by its own user alone: a
        running worker moves to it without a restart. Its name starts with 'i' (the viewer's
        patterns skip it)."""
        return f"{self.prefix}:identity:credential:{worker}"

    @property
    def revoked(self) -> str:
        """The set of workers whose credential `cohort acl --revoke` took back."""
        return f"{self.prefix}:revoked"

    @property
    def status(self) -> str:
        """The leader's volatile view (liveness, lag, counters), refreshed every second."""
        return f"{self.prefix}:status"

    @property
    def memory(self) -> str:
        """Redis's memory as the leader last read it (maxmemory, used): the budget a
        collective checks before it writes gradients (`events/budget.py`)."""
        return f"{self.prefix}:memory"

    @property
    def rendezvous(self) -> str:
        """torchrun's rendezvous state (`--rdzv-backend=cohort`): a hash {state, token}."""
        return f"{self.prefix}:rdzv"

    @property
    def c10d_groups(self) -> str:
        """The set of groups (per rendezvous round) the job's c10d store holds keys in."""
        return f"{self.prefix}:c10d"

    def c10d(self, group: str) -> str:
        """A hash of the c10d store's keys of `group` (their part before the first '/')."""
        return f"{self.prefix}:c10d:{group}"

    def c10d_events(self, group: str) -> str:
        """A stream of 'key written' notices of `group`, which blocked getters XREAD."""
        return f"{self.prefix}:c10d-events:{group}"

    def c10d_queue(self, group: str, field: str) -> str:
        """A list: the c10d store's queue `field` of `group` (`queue_push`/`queue_pop`); a
        group holds no '/', so GROUP/FIELD names one queue only."""
        return f"{self.prefix}:c10d-queue:{group}/{field}"

    def c10d_queues(self, group: str) -> str:
        """The set of queue fields `group` has had, so the group's queues are deleted with it."""
        return f"{self.prefix}:c10d-queues:{group}"

    @property
    def patterns(self) -> tuple[str, str]:
        """SCAN patterns that match every key of this job, in its own slot and spread."""
        return f"{self.prefix}:*", f"cohort:{{{self.job}/*}}:*"

    def spread(self, tag: str | None) -> str:
        """The prefix of a gradient key placed by `tag`: `cohort:{J/TAG}` hashes to another
        Redis Cluster slot than the job's own keys (job names have no '/', so no job's tag
        can equal it); None keeps the job's prefix (one server: key names as before)."""
        return self.prefix if tag is None else f"cohort:{{{self.job}/{tag}}}"

    def grad(
        self, world: int, step: int, rank: int, chunk: int, writer: str, tag: str | None = None
    ) -> str:
        """Rank `rank`'s part of chunk `chunk` of a step's allreduce, placed by `tag`, written
        by worker `writer` (the rank's owner: see `by`)."""
        return by(f"{self.spread(tag)}:grad:{world}:{step}:{rank}:{chunk}", writer)

    def weights(self, step: int, writer: str) -> str:
        """The weights of `step` as worker `writer` publishes them."""
        return by(f"{self.prefix}:weights:{step}", writer)

    def grad_reduced(
        self, world: int, step: int, chunk: int, writer: str, tag: str | None = None
    ) -> str:
        """Chunk `chunk` of a step's allreduce, averaged by `writer`, the worker that owns it."""
        return by(f"{self.spread(tag)}:grad:{world}:{step}:reduced:{chunk}", writer)

    def grad_broadcast(
        self, world: int, step: int, piece: int, writer: str, tag: str | None = None
    ) -> str:
        """Piece `piece` of the tensors worker `writer` broadcasts (as root) at `step`."""
        return by(f"{self.spread(tag)}:grad:{world}:{step}:broadcast:{piece}", writer)

    def step_events(self, world: int, step: int, op: str, writer: str) -> str:
        """Worker `writer`'s stream of notices ('my part is written') for one collective
        `op` of one step: each rank of the call writes its own, and reads those of the ranks
        it waits for.

        Always in the job's slot: a waiter XREADs them together with the journal."""
        return by(f"{self.prefix}:grad:{world}:{step}:{op}:events", writer)

    def writable(self, writer: str) -> tuple[str, ...]:
        """Glob patterns of every collective key worker `writer` writes, and no other
        worker's (docs/identity.md): its own user's write patterns (cohort/acl.py)."""
        return tuple(
            by(pattern, writer)
            for pattern in (
                f"{self.prefix}:grad:*",
                f"{self.spread('g*')}:grad:*",
                f"{self.prefix}:weights:*",
            )
        )


WRITER = "/"
"""What separates a collective key from the worker that wrote it: the key's last segment.

No worker name holds a '/' (`events.models.WorkerId`), nor a glob special (`*?[]\\`), so
the pattern `...*/W` matches the keys written by W and by no other worker: a key of worker
V ends in '/V', which ends in '/W' only if V is W. '@' would not do: it is allowed in
worker names, and `*@b` matches the keys of worker 'a@b'."""


def by(key: str, writer: str) -> str:
    """`key` as written by worker `writer` (`WRITER` and its name appended)."""
    if not writer or WRITER in writer or any(c in writer for c in "*?[]\\"):
        raise InvalidValueError(
            f"worker name {writer!r} cannot name a collective key's writer: it must be "
            "non-empty, without '/' or a glob special (*?[]\\)"
        )
    return f"{key}{WRITER}{writer}"
