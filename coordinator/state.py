"""The job as the journal says it is: a frozen value, folded from facts.

`JobState` holds only what facts established, so replaying the journal gives
the same value bit for bit (invariant 1 of docs/design.md). What the leader merely
observes and never journals (heartbeat times, step reports) lives in `liveness.Liveness`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Literal

import msgpack
from pydantic import TypeAdapter

from cohort.coordinator.gpu_rules import DEFAULT_RULES, Rules, parse_rules
from cohort.events.models import (
    CheckpointRequested,
    CheckpointSaved,
    Dataset,
    EvalReported,
    JobConfig,
    JournalArchived,
    Node,
    RendezvousRound,
    Role,
    Weights,
    Workload,
)
from cohort.events.order import Order
from cohort.events.shards import Shard

Status = Literal["syncing", "ready", "active", "draining", "evaluating"]
"""An evaluator is "evaluating" from its join to its end: it never syncs, holds no rank."""
KEEP_EVALS = 16
"""Evaluations kept in the state for `cohort status` (the journal keeps them all)."""
RATE_WINDOW = 32
"""Commits the job's rate is measured over: long enough to smooth a step's jitter, short
enough to follow a world that grew or shrank."""


@dataclass(frozen=True, slots=True)
class Member:
    worker: str
    status: Status
    joined_at: float
    host: str = ""
    pid: int = 0
    synced_step: int | None = None
    synced_at: float | None = None
    """When it became ready (WorkerSynced): a spare ready longer is promoted first."""
    leave_after: int | None = None
    straggler: bool = False
    node: Node | None = None
    """What the worker said of its machine when it joined."""
    role: Role = "trainer"
    workloads: tuple[Workload, ...] = ()
    """The GPU workloads it registered, oldest first."""
    spare: bool = False
    """A spare (`Join(spare=True)`): synced and ready, it waits for a rank the world loses and
    is never activated at a step boundary; `SparePromoted` makes it active, not a spare."""


@dataclass(frozen=True, slots=True)
class Counters:
    joined: int = 0
    refused: int = 0
    left: int = 0
    failed: int = 0
    disconnected: int = 0
    """Of `failed`, the members failed for connections closed past the grace, and `exited`
    those a launcher saw exit (WorkerFailed's `cause`); the rest fell silent."""
    exited: int = 0
    world_changes: int = 0
    steps_committed: int = 0
    epochs_finished: int = 0
    elections: int = 0
    divergences: int = 0
    checkpoints: int = 0
    rewinds: int = 0
    discarded_steps: int = 0
    """Committed steps a rewind took off the lineage the model descends from."""
    dead_letters: int = 0
    """Inbox entries dead-lettered (CommandsRefused), of which `forged` had a signature
    that does not prove their worker."""
    forged: int = 0
    inbox_repairs: int = 0
    promotions: int = 0
    """Spares promoted to take a lost rank's place (SparePromoted)."""
    rounds: int = 0
    """Rendezvous rounds of a launcher's agents (torchrun's) journaled; `runs` of them began
    a run (none of the last round's agents a member any more), each other one restarted
    every worker."""
    runs: int = 0


@dataclass(frozen=True, slots=True)
class JobState:
    """Everything a decision may depend on. Never mutated: `evolve` returns a new one.

    `members` is a dict for lookup speed; it is copied, never changed in place.
    Steps count from 0; `last_committed == -1` means no step has committed yet.
    """

    job: str = ""
    config: JobConfig | None = None
    dataset: Dataset | None = None
    """What the job trains on: the config's `dataset_size`, or the first declared dataset."""
    leader: str | None = None
    leader_epoch: int = 0
    members: dict[str, Member] = field(default_factory=dict)
    world_version: int = 0
    ranks: tuple[str, ...] = ()
    shards: tuple[Shard, ...] = ()
    unassigned: Shard = Shard()
    base_step: int = 0
    epoch: int = 0
    last_committed: int = -1
    paused: bool = True
    started: bool = False
    counters: Counters = Counters()
    advice: frozenset[tuple[str, int | None, str]] = frozenset()
    """Active GPU advice: (worker, device or None for any device, rule)."""
    last_digest: str | None = None
    """The weights after `last_committed`, as every rank of its world reported them."""
    holders: frozenset[str] = frozenset()
    """Members that hold the weights of `last_committed`: the ranks that committed it."""
    checkpoints: tuple[CheckpointSaved, ...] = ()
    """Saved checkpoints, oldest first, at most `checkpoint_keep`."""
    requested: tuple[CheckpointRequested, ...] = ()
    """Checkpoints asked for and not yet saved (newer than the newest saved)."""
    weights_lost: int | None = None
    """The step whose weights nobody holds and no checkpoint has: paused until resumed."""
    restart: Weights | None = None
    """After a rewind, until a step commits: the weights a world starts from (the
    checkpoint's, or the initial ones)."""
    finished: str | None = None
    """Why the job ended (its JobFinished's reason); None while it has steps to go."""
    rendezvous: RendezvousRound | None = None
    """A torchrun job's latest rendezvous round: its number and agents in rank order."""
    evals: tuple[EvalReported, ...] = ()
    """The last KEEP_EVALS evaluations the evaluators reported, oldest first."""
    commits: tuple[tuple[int, float], ...] = ()
    """(step, at) of the last RATE_WINDOW commits since training last paused or rewound:
    what the job's steps per second are measured over (coordinator/progress.py)."""
    archived: tuple[JournalArchived, ...] = ()
    """The journal's segments in storage, oldest first (events/archive.py): facts up to the
    last one's `last` may be gone from Redis."""
    facts: int = 0

    @property
    def archived_facts(self) -> int:
        """Facts of the journal in its archived segments."""
        return sum(segment.facts for segment in self.archived)

    @property
    def next_step(self) -> int:
        return self.last_committed + 1

    @property
    def configured(self) -> bool:
        return self.config is not None

    def order(self, epoch: int | None = None) -> Order:
        """The order of data epoch `epoch` (None: the current one)."""
        assert self.config is not None and self.dataset is not None
        return self.config.order(self.epoch if epoch is None else epoch, self.dataset)

    @property
    def nodes(self) -> dict[str, Node | None]:
        return {worker: member.node for worker, member in self.members.items()}

    @property
    def chief(self) -> str | None:
        """Rank 0 of the current world: the source of every new world's weights."""
        return self.ranks[0] if self.ranks else None

    def rank_of(self, worker: str) -> int | None:
        try:
            return self.ranks.index(worker)
        except ValueError:
            return None

    @property
    def latest_checkpoint(self) -> CheckpointSaved | None:
        return self.checkpoints[-1] if self.checkpoints else None

    @property
    def gpu_rules(self) -> Rules:
        return rules_of(self.config)

    def with_status(self, status: Status) -> tuple[Member, ...]:
        return tuple(m for m in self.members.values() if m.status == status)

    def joiners(self, status: Status) -> tuple[Member, ...]:
        """Members of `status` that are not spares: the ones a step boundary activates."""
        return tuple(m for m in self.members.values() if m.status == status and not m.spare)

    @property
    def spares(self) -> tuple[Member, ...]:
        """Members waiting as spares (syncing or ready), in the order they joined."""
        return tuple(m for m in self.members.values() if m.spare)


@lru_cache(maxsize=16)
def _parsed(rules: str) -> Rules:
    return parse_rules(json.loads(rules), "the journaled JobConfig")


def rules_of(config: JobConfig | None) -> Rules:
    """The GPU rules a config names (defaults when it names none), parsed once."""
    if config is None or config.gpu_rules is None:
        return DEFAULT_RULES
    return _parsed(json.dumps({"rules": list(config.gpu_rules)}, sort_keys=True))


STATE: TypeAdapter[JobState] = TypeAdapter(JobState)


def dump(state: JobState) -> dict[str, Any]:
    """A plain, canonical form (members sorted) for snapshots, JSON and hashing."""
    body = STATE.dump_python(state, mode="json")
    body["members"] = dict(sorted(body["members"].items()))
    body["holders"] = sorted(body["holders"])
    body["advice"] = sorted(
        body["advice"], key=lambda k: (k[0], -1 if k[1] is None else k[1], k[2])
    )
    return body


def load(body: dict[str, Any]) -> JobState:
    return STATE.validate_python(body)


def state_hash(state: JobState) -> str:
    """A stable digest of the state: equal on every coordinator that folded the same facts."""
    return hashlib.sha256(msgpack.packb(dump(state), use_bin_type=True)).hexdigest()[:16]
