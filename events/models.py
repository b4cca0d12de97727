"""Every event of cohort: commands workers send to the inbox, facts the leader journals.

Commands are imperative (`Join`), facts past tense (`WorkerJoined`). Every event
is a frozen pydantic model that forbids unknown fields and carries the envelope:
`type` (the discriminator), `v` (its schema version), `at` (the producer's wall
clock, seconds) and `job`. Field limits here are the first line of defence
against hostile inbox entries: nothing unbounded gets past validation.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, TypeAdapter, model_validator

from cohort.events.order import Order
from cohort.events.shards import Shard

MAX_INT = 2**53  # what a JSON or JavaScript reader still represents exactly
Placement = Literal["contiguous", "strided", "hash", "locality"]

WorkerId = Annotated[
    str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$", max_length=128)
]
JobName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]
Count = Annotated[int, Field(ge=0, le=MAX_INT)]
Seconds = Annotated[float, Field(ge=0, le=1e10, allow_inf_nan=False)]
Text = Annotated[str, StringConstraints(max_length=1024)]
Digest = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{8,128}$")]


class Event(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    v: int = 1
    at: Seconds
    job: JobName


# ---------------------------------------------------------------- commands (inbox)


Range = tuple[Annotated[int, Field(ge=0, le=MAX_INT)], Annotated[int, Field(ge=0, le=MAX_INT)]]
MAX_FILES = 100_000
"""Files a dataset may be made of (their sizes travel in one inbox entry and one fact)."""
Label = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9._:/-]{0,128}$")]


class Node(BaseModel):
    """What a worker's machine is, said in its Join: where it runs, what hardware it has,
    and which of the dataset's files it holds (the locality placement prefers those).

    `files`: ranges of file indices (into the dataset's `files`) on this node's local disk
    or cache; `locality`: a score in [0, 1] for the whole dataset where files are not
    listed (1: all of it is local)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: Annotated[str, StringConstraints(max_length=255)] = ""
    zone: Label = ""
    region: Label = ""
    gpus: Annotated[int, Field(ge=0, le=1024)] = 0
    gpu_memory: Count = 0
    """Bytes of memory over all of its GPUs."""
    bandwidth: Count = 0
    """Bytes per second it can read its data at (0: unknown)."""
    files: tuple[Range, ...] = Field(default=(), max_length=10_000)
    locality: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] = 0.0

    @model_validator(mode="after")
    def _ranges_ordered(self) -> Node:
        for start, stop in self.files:
            if start >= stop:
                raise ValueError(f"file range ({start}, {stop}) must satisfy start < stop")
        return self

    def holds(self, file: int) -> bool:
        return any(start <= file < stop for start, stop in self.files)


class Dataset(BaseModel):
    """The data a job trains on, as a worker declares it: `size` samples, a `fingerprint`
    that names its content (two workers with different data must not share a job), and,
    for a dataset made of files (parquet, tar shards), each file's sample count in order:
    file i holds samples [sum(files[:i]), sum(files[:i + 1]))."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    size: Annotated[int, Field(ge=1, le=MAX_INT)]
    fingerprint: Annotated[str, StringConstraints(max_length=128)] = ""
    files: tuple[Annotated[int, Field(ge=1, le=MAX_INT)], ...] = Field(
        default=(), max_length=MAX_FILES
    )
    adapts: bool = False
    """The worker makes its data to the job's size (synthetic data): a job that knows its
    dataset keeps it, and one that does not takes this one."""

    @model_validator(mode="after")
    def _files_add_up(self) -> Dataset:
        if self.files and sum(self.files) != self.size:
            raise ValueError(
                f"the files hold {sum(self.files)} samples but the dataset's size is {self.size}"
            )
        return self

    def mismatch(self, other: Dataset) -> str | None:
        """How `other` differs from this dataset, in words (None: it is the same data, or
        `other` adapts to it)."""
        if other.adapts:
            return None
        if other.size != self.size:
            return f"{other.size} samples, not {self.size}"
        if other.fingerprint and self.fingerprint and other.fingerprint != self.fingerprint:
            return f"fingerprint {other.fingerprint!r}, not {self.fingerprint!r}"
        if other.files and self.files and other.files != self.files:
            return f"{len(other.files)} files of other sizes than the job's {len(self.files)}"
        return None


Role = Literal["trainer", "agent", "evaluator"]
AGENT_SUCCEEDED = "torchrun agent shut down: its workers succeeded"
"""The `Leave` reason of an agent whose workers all finished: what a launcher job's audit
counts as a run that ended well (any other reason, or WorkerFailed, is an agent that did
not)."""
MetricName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,63}$")]
Metrics = Annotated[
    dict[MetricName, Annotated[float, Field(allow_inf_nan=True)]], Field(max_length=64)
]
"""Named values of one evaluation (loss, accuracy, ...): at most 64, names of 1-64 characters."""


class Join(Event):
    """A worker asks to join the job. v2 renamed v1's `name` to `worker`; v3 added `node`
    (what its machine is) and `dataset` (the data it trains on); v4 `spare`."""

    type: Literal["Join"] = "Join"
    v: Literal[4] = 4
    worker: WorkerId
    host: Annotated[str, StringConstraints(max_length=255)] = ""
    pid: Annotated[int, Field(ge=0, le=2**31)] = 0
    node: Node | None = None
    dataset: Dataset | None = None
    role: Role = "trainer"
    """What the member does. An agent is a launcher's member (a torchrun agent) that trains
    on no data of the job's own dealing, so it declares none and the job need not know its
    dataset. An evaluator trains nothing; it evaluates the committed weights and reports
    `EvalDone`."""
    spare: bool = False
    """A trainer that waits, synced, to take the place of a rank the job loses (`cohort run
    --spares`): it holds no rank and no shard and costs no collective until the leader
    promotes it (`SparePromoted`). Only a trainer can be a spare."""

    @model_validator(mode="after")
    def _only_a_trainer_is_a_spare(self) -> Join:
        if self.spare and self.role != "trainer":
            raise ValueError(f"a spare trains when promoted: role {self.role!r} cannot be one")
        return self


class Heartbeat(Event):
    """A worker is alive. v2 added its progress: last finished step and world version."""

    type: Literal["Heartbeat"] = "Heartbeat"
    v: Literal[2] = 2
    worker: WorkerId
    step: Count | None = None
    world: Count | None = None


class StepDone(Event):
    """A worker finished `step` in world `world` (its collective completed). v2 added
    `metrics`: the script's named figures of the step (`job.record`)."""

    type: Literal["StepDone"] = "StepDone"
    v: Literal[2] = 2
    worker: WorkerId
    step: Count
    world: Count
    step_time: Seconds = 0.0
    samples: Count = 0
    digest: Digest | None = None
    loss: Annotated[float, Field(allow_inf_nan=True)] | None = None
    metrics: Metrics | None = None


class EpochDone(Event):
    """A worker has used up its shard of `epoch`; the coordinator cross-checks it."""

    type: Literal["EpochDone"] = "EpochDone"
    worker: WorkerId
    epoch: Count
    world: Count


class GpuProcess(BaseModel):
    """A process holding a GPU context; `used_memory` is None where NVML cannot tell (WDDM)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    pid: Annotated[int, Field(ge=0, le=2**32)]
    used_memory: Count | None = None


MAX_GPU_PROCESSES = 32  # per device: keeps a whole reading well under the inbox entry limit


class GpuDevice(BaseModel):
    """One device of a reading. None: NVML does not support that value on this device."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    index: Annotated[int, Field(ge=0, le=1024)]
    name: Annotated[str, StringConstraints(max_length=128)] = ""
    memory_total: Count = 0
    memory_used: Count = 0
    utilization_gpu: Annotated[float, Field(ge=0, le=100)] | None = None
    utilization_memory: Annotated[float, Field(ge=0, le=100)] | None = None
    temperature: Annotated[float, Field(ge=-100, le=300)] | None = None
    power_w: Annotated[float, Field(ge=0, le=100_000)] | None = None
    memory_free: Count | None = None
    processes: tuple[GpuProcess, ...] = Field(default=(), max_length=MAX_GPU_PROCESSES)
    memory_cached: Count | None = None
    """Of `memory_used`, what the reporting process's PyTorch caching allocator holds with no
    tensor in it (reserved - allocated); None where that process does not run torch on CUDA."""


class Workload(BaseModel):
    """A GPU workload a worker runs: process `pid` on `devices`, holding `memory` bytes
    (its expected footprint), `priority` higher first (after the seed's GPU workloads)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,63}$")]
    pid: Annotated[int, Field(ge=0, le=2**32)] = 0
    devices: tuple[Annotated[int, Field(ge=0, le=1024)], ...] = Field(default=(), max_length=64)
    memory: Count = 0
    priority: Annotated[int, Field(ge=-1000, le=1000)] = 0


MAX_WORKLOADS = 16
"""Workloads one worker may register (a later one with a new name replaces the oldest)."""


class RegisterWorkload(Event):
    """A worker registers (or, under the same name, updates) a GPU workload."""

    type: Literal["RegisterWorkload"] = "RegisterWorkload"
    worker: WorkerId
    workload: Workload


class TransfersWaiting(Event):
    """A worker's transfer queue now: `pending` transfers (`staged` of them until training
    stops), and `delayed` seconds its started transfers waited in all. Telemetry: the
    leader's view and metrics show it; nothing is journaled."""

    type: Literal["TransfersWaiting"] = "TransfersWaiting"
    worker: WorkerId
    pending: Count
    staged: Count = 0
    delayed: Seconds = 0.0


class GpuReading(Event):
    """The GPUs a worker's process was given, read through NVML (each under its NVML index).
    Still v1 as its devices gained fields (`memory_free`, `processes`, `memory_cached`):
    each may be missing, from older workers (docs/wire-format.md)."""

    type: Literal["GpuReading"] = "GpuReading"
    worker: WorkerId
    devices: tuple[GpuDevice, ...] = Field(default=(), max_length=64)


class WeightsLoaded(Event):
    """A joiner has loaded the weights of `step` and is ready to be activated."""

    type: Literal["WeightsLoaded"] = "WeightsLoaded"
    worker: WorkerId
    step: Count = 0
    digest: Digest | None = None


class Leave(Event):
    """A worker will leave after finishing `after_step` (None: as soon as possible)."""

    type: Literal["Leave"] = "Leave"
    worker: WorkerId
    after_step: Count | None = None
    reason: Text = ""


class ProcessExited(Event):
    """`worker`'s process ended (`how`: "killed by SIGKILL", "exit code 1"), as the launcher
    that started it saw it: a certain death, so the leader fails the member at once instead
    of waiting for its connections' grace or its silence. A launcher of a job that signs its
    commands signs it with the worker's own credential, which it issued."""

    type: Literal["ProcessExited"] = "ProcessExited"
    worker: WorkerId
    how: Text = ""


class DataRefused(Event):
    """What `accused` wrote for a collective of `step` in world `world` failed verification
    where `worker` read it (worker/collective's CorruptDataError: a blob that does not
    unpack, or of other sizes or dtypes than the call's). The leader removes a rank that a
    majority of its world's other ranks refuse (docs/identity.md)."""

    type: Literal["DataRefused"] = "DataRefused"
    worker: WorkerId
    accused: WorkerId
    world: Count
    step: Count
    reason: Text = ""


class EvalDone(Event):
    """An evaluator evaluated the weights after `step` (a checkpoint's): its `metrics`. A
    trainer sends one too, when its loops end, with the figures it recorded after its last
    step `step` (`job.record`: they had no next step's report to ride on)."""

    type: Literal["EvalDone"] = "EvalDone"
    worker: WorkerId
    step: Count
    metrics: Metrics


class RoundStarted(Event):
    """A launcher's agent (torchrun's) started its workers in rendezvous round `round`, with
    the `agents` of that round in rank order. A round after a run's first restarted every
    worker of the job."""

    type: Literal["RoundStarted"] = "RoundStarted"
    worker: WorkerId
    round: Count
    agents: Annotated[tuple[WorkerId, ...], Field(min_length=1, max_length=4096)]


CheckpointUri = Annotated[str, StringConstraints(min_length=1, max_length=1024)]
Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]


class DataPosition(BaseModel):
    """Where the data stands after a step: the epoch, and what is left of it (ranges of
    positions, in order)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    epoch: Count
    rest: Shard


class _CheckpointFile(Event):
    """A checkpoint file whole at `uri`: the weights after `step` (`digest` as StepDone
    reports them), written by `worker`; `sha256` and `bytes` of the file."""

    worker: WorkerId
    step: Count
    uri: CheckpointUri
    digest: Digest | None = None
    sha256: Sha256
    bytes: Count


class CheckpointWritten(_CheckpointFile):
    """The worker the leader asked (`CheckpointRequested`) wrote its checkpoint, whole."""

    type: Literal["CheckpointWritten"] = "CheckpointWritten"


class Resume(Event):
    """An operator continues a job whose weights are lost (`cohort resume`): from the
    initial weights (`uri` None), or from the checkpoint file at `uri`, whose own header
    gave `step`, `digest` and `position` (the CLI read and verified it)."""

    type: Literal["Resume"] = "Resume"
    worker: WorkerId = "operator"
    uri: CheckpointUri | None = None
    step: Annotated[int, Field(ge=-1, le=MAX_INT)] = -1
    digest: Digest | None = None
    sha256: Sha256 | None = None
    position: DataPosition | None = None
    reason: Text = ""

    @model_validator(mode="after")
    def _a_checkpoint_says_where(self) -> Resume:
        if (self.uri is None) != (self.position is None) or (self.uri is None) != (self.step < 0):
            raise ValueError("a resume from a checkpoint names its uri, step and position")
        return self


Command = Annotated[
    Join
    | Heartbeat
    | StepDone
    | EpochDone
    | GpuReading
    | WeightsLoaded
    | Leave
    | CheckpointWritten
    | Resume
    | EvalDone
    | RegisterWorkload
    | TransfersWaiting
    | DataRefused
    | RoundStarted
    | ProcessExited,
    Field(discriminator="type"),
]

# ---------------------------------------------------------------- facts (journal)


class JobConfig(BaseModel):
    """Everything a decision depends on. Journaled, so a replay can explain every decision."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    min_workers: Annotated[int, Field(ge=1, le=100_000)] = 1
    start_workers: Annotated[int, Field(ge=1, le=100_000)] | None = None
    """Ready trainers the job's first world waits for, at most `start_wait` seconds after
    the first was ready; it then starts with those there (None: `min_workers`). `cohort run
    -n N` on its own Redis gives N, so no step is trained by fewer ranks than it started."""
    start_wait: Annotated[float, Field(ge=0, le=86_400, allow_inf_nan=False)] = 30.0
    """How long the first world waits for `start_workers` after the first trainer is ready: a
    rank that cannot start holds the job up no longer."""
    max_workers: Annotated[int, Field(ge=1, le=100_000)] = 64
    heartbeat_interval: Annotated[float, Field(gt=0, le=3600, allow_inf_nan=False)] = 1.0
    heartbeat_timeout: Annotated[float, Field(gt=0, le=86_400, allow_inf_nan=False)] = 5.0
    dataset_size: Annotated[int, Field(ge=1, le=MAX_INT)] | None = None
    """Samples per epoch (None: the first worker that joins declares its dataset)."""
    batch_size: Annotated[int, Field(ge=1, le=2**31)] = 32
    """Samples per rank per step; with `global_batch`, the most a rank computes in one
    forward and backward (a micro-batch)."""
    global_batch: Annotated[int, Field(ge=1, le=2**40)] | None = None
    """Samples per step over the whole world, whatever its size: each rank takes its share
    in micro-batches of at most `batch_size` and the update weighs every sample alike, so
    it equals the one a bigger world would make (None: `batch_size` per rank, and the
    global batch grows and shrinks with the world)."""
    placement: Placement = "contiguous"
    """How each epoch's positions are dealt to ranks (events/deal.py)."""
    reduction: Literal["exact", "float"] | None = None
    """How the ranks' gradients are summed. "exact": each micro-batch of the global batch is
    dealt whole to one rank and the sums are exact integers (worker/pytorch/exact.py), so
    a step's update is the same bits at any world size; "float": floating-point sums, whose
    last bits follow the grouping, and a strided step dealt item by item (balanced to one
    sample); None: "exact" where the job promises a result independent of the world (a
    constant `global_batch` dealt strided), else "float"."""
    shard_group: Annotated[int, Field(ge=1, le=100_000)] | None = None
    """Ranks per copy of a model sharded in groups (HSDP: `wrap(shard=..., shard_group=S)`,
    ranks 0..S-1 the first copy, and so on): each rank's place is its shard, so a new world
    keeps every staying rank in its place and puts a spare promoted for a lost rank in that
    rank's place; every rank's own setting must be this one (None: not sharded in groups,
    and survivors close up in rank order)."""
    straggler_factor: Annotated[float, Field(gt=1, le=1000, allow_inf_nan=False)] = 1.5
    straggler_steps: Annotated[int, Field(ge=1, le=10_000)] = 5
    gpu_rules: tuple[dict[str, Any], ...] | None = Field(default=None, max_length=256)
    """GPU rules as the coordinator validated them (None: cohort's defaults)."""
    checkpoint_uri: CheckpointUri | None = None
    """Where checkpoints go (an fsspec URL or path; None: no checkpoints)."""
    checkpoint_every: Annotated[int, Field(ge=1, le=MAX_INT)] = 100
    """Steps between checkpoints (one after every N committed steps)."""
    checkpoint_keep: Annotated[int, Field(ge=1, le=1000)] = 3
    """Checkpoints kept; older ones are expired (and their files deleted)."""
    max_steps: Annotated[int, Field(ge=1, le=MAX_INT)] | None = None
    """The job finishes once this many steps committed (None: no step limit)."""
    epochs: Annotated[int, Field(ge=1, le=MAX_INT)] | None = None
    """The job finishes once this many epochs finished (None: no epoch limit)."""
    shuffle: bool = True
    """Each epoch visits the samples in its own pseudorandom order, keyed by (seed, epoch)
    (False: in index order, position p is sample p). A config journaled before v2 of
    JobConfigured reads as False: that job never shuffled."""
    seed: Annotated[int, Field(ge=0, le=MAX_INT)] = 0
    """The shuffle's key: the same seed gives the same orders whatever the world did."""
    disconnect_grace: Annotated[float, Field(ge=0, le=3600, allow_inf_nan=False)] = 0.3
    """Seconds a member whose connections to Redis all closed may take to connect again
    before it is failed (a process that died closes them at once; 0: only silence fails a
    member; one as long as `heartbeat_timeout` leaves silence to act first). A config
    journaled before v4 of JobConfigured reads as 0: its workers did not show their
    connections."""

    @property
    def exact(self) -> bool:
        """Whether the job's gradient sums are exact (`reduction`, its default resolved)."""
        if self.reduction is not None:
            return self.reduction == "exact"
        return self.global_batch is not None and self.placement == "strided"

    def order(self, epoch: int, dataset: Dataset | None = None) -> Order:
        """Epoch `epoch`'s order: the sample at each position of the journal's shards.
        `dataset`: the one the job trains on (None: `dataset_size` samples, no files)."""
        if dataset is None:
            if self.dataset_size is None:
                raise ValueError("the job's dataset is not known yet: no size to order")
            dataset = Dataset(size=self.dataset_size)
        return Order.of(dataset.size, dataset.files, self.seed if self.shuffle else None, epoch)

    def end_reason(self, step: int, epoch: int, epoch_done: bool) -> str | None:
        """Why committing `step` ends the job (None: it goes on). `epoch` is the data epoch
        `step` trained in, `epoch_done` whether `step` used the last samples of it."""
        if self.max_steps is not None and step + 1 >= self.max_steps:
            return f"max_steps={self.max_steps} reached"
        if self.epochs is not None and epoch_done and epoch + 1 >= self.epochs:
            return f"epochs={self.epochs} finished"
        return None

    @model_validator(mode="after")
    def _consistent(self) -> JobConfig:
        if self.min_workers > self.max_workers:
            raise ValueError(
                f"min_workers ({self.min_workers}) must not exceed max_workers ({self.max_workers})"
            )
        if self.reduction == "exact" and (self.global_batch is None or self.placement != "strided"):
            raise ValueError(
                "reduction 'exact' needs a constant global batch dealt strided (its units "
                "must be the same at any world size): give global_batch (--global-batch N) "
                "and placement 'strided' (--placement strided), or reduction 'float'"
            )
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ValueError(
                f"heartbeat_timeout ({self.heartbeat_timeout}) must be longer than "
                f"heartbeat_interval ({self.heartbeat_interval})"
            )
        return self


class JobConfigured(Event):
    """The job's settings, journaled by its first leader. v2 added `shuffle` and `seed` to
    the config (a v1 config is upcast with `shuffle` False: its epochs were not shuffled);
    v3 `placement` and `global_batch`, and let `dataset_size` be None (declared by workers);
    v4 `disconnect_grace` (a v3 config is upcast with 0: no connection watch); v5
    `start_workers` and `start_wait` (a v4 job's first world waited for `min_workers`, as
    None says); v6 `reduction` (a v5 job's sums were floating-point: "float"); v7
    `shard_group` (a v6 job's leader placed no shard groups: None)."""

    type: Literal["JobConfigured"] = "JobConfigured"
    v: Literal[7] = 7
    config: JobConfig


class DatasetDeclared(Event):
    """The dataset the job trains on, as `worker` declared it in its Join (the first to
    declare one); later joiners must declare the same data, or none."""

    type: Literal["DatasetDeclared"] = "DatasetDeclared"
    worker: WorkerId
    dataset: Dataset


class LeaderElected(Event):
    type: Literal["LeaderElected"] = "LeaderElected"
    coordinator: Annotated[str, StringConstraints(max_length=128)]
    epoch: Count


class WorkerJoined(Event):
    """v2 added `node`, the machine the worker described in its Join; v3 its `role` (every
    member before v3 was a trainer or an agent, and the journal never told them apart); v4
    `spare` (a member that waits, synced, for a rank the job loses)."""

    type: Literal["WorkerJoined"] = "WorkerJoined"
    v: Literal[4] = 4
    worker: WorkerId
    host: Annotated[str, StringConstraints(max_length=255)] = ""
    pid: int = 0
    node: Node | None = None
    role: Role = "trainer"
    spare: bool = False


class JoinRefused(Event):
    """The join was refused (the worker reads the reason here; WorkerJoined is not written)."""

    type: Literal["JoinRefused"] = "JoinRefused"
    worker: WorkerId
    reason: Text


class WorkerSynced(Event):
    """A joiner loaded the weights of `step`; it is activated at the next step boundary."""

    type: Literal["WorkerSynced"] = "WorkerSynced"
    worker: WorkerId
    step: Count


class WorkerActivated(Event):
    type: Literal["WorkerActivated"] = "WorkerActivated"
    worker: WorkerId


class SparePromoted(Event):
    """A ready spare takes the place of `replaces`, a rank the world lost (failed, left or
    removed) in the same decision: it is active from now on and the new world ranks it
    after the survivors. `replaces` is None where it makes up `min_workers` for a job
    paused after losing ranks."""

    type: Literal["SparePromoted"] = "SparePromoted"
    worker: WorkerId
    replaces: WorkerId | None = None


class WorkerLeaving(Event):
    """An active worker drains: it leaves once `after_step` commits."""

    type: Literal["WorkerLeaving"] = "WorkerLeaving"
    worker: WorkerId
    after_step: Count


class WorkerLeft(Event):
    type: Literal["WorkerLeft"] = "WorkerLeft"
    worker: WorkerId
    reason: Text = ""


FailureCause = Literal["silent", "disconnected", "exited"]


class WorkerFailed(Event):
    """A member is taken for dead; carries the evidence. `cause` says which sign it gave:
    "silent", nothing heard for `timeout` s (a host gone, a process stopped or hung);
    "disconnected", its connections to Redis all closed at server time `closed_at` and none
    came back within `grace` s (a process that died: the kernel closes its sockets at once);
    or "exited", its launcher saw its process end (`how`, from ProcessExited). `last_seen` is
    the server time of its last command in every case. v2 added `cause`, `closed_at`,
    `grace` and `how`: every failure before it was a silence."""

    type: Literal["WorkerFailed"] = "WorkerFailed"
    v: Literal[2] = 2
    worker: WorkerId
    last_seen: Seconds
    timeout: Seconds
    cause: FailureCause = "silent"
    closed_at: Seconds | None = None
    grace: Seconds | None = None
    how: Text | None = None

    @property
    def reason(self) -> str:
        """Why, for people: "connections closed (none back within 0.3 s)" or "silent 5 s
        (no heartbeat)"."""
        if self.cause == "disconnected":
            return f"connections closed (none back within {self.grace or 0:g} s)"
        if self.cause == "exited":
            return f"process exited ({self.how or 'as its launcher saw'})"
        return f"silent {self.timeout:g} s (no heartbeat)"


class Weights(BaseModel):
    """The weights a world starts from: after `step` (-1: the initial weights), with `digest`
    as StepDone reports them, held by a surviving rank (rank 0 broadcasts them) or read
    from the journaled checkpoint at `uri`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    step: Annotated[int, Field(ge=-1, le=MAX_INT)]
    source: Literal["initial", "rank", "checkpoint"]
    digest: Digest | None = None
    uri: CheckpointUri | None = None
    sha256: Sha256 | None = None
    """Of the checkpoint file's bytes: a reader checks what it loads against it."""


class WorldChanged(Event):
    """A new world: rank r is `ranks[r]`, its shard of the rest of `epoch` is `shards[r]`.

    v2 added `weights` (v1 worlds say nothing of their weights: None).
    """

    type: Literal["WorldChanged"] = "WorldChanged"
    version: Count
    start_step: Count
    epoch: Count
    ranks: tuple[WorkerId, ...]
    shards: tuple[Shard, ...]
    reason: Text = ""
    unassigned: Shard = Shard()
    """What is left of the epoch that no rank holds (non-empty only when no rank is left)."""
    v: Literal[2] = 2
    weights: Weights | None = None

    @model_validator(mode="after")
    def _one_shard_per_rank(self) -> WorldChanged:
        if len(self.ranks) != len(self.shards):
            raise ValueError(f"{len(self.ranks)} ranks but {len(self.shards)} shards")
        if len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"a worker holds two ranks in {self.ranks}")
        return self


class StepCommitted(Event):
    """Every rank of `world` finished `step`; `digest`: the weights after it, when every
    rank reported the same one."""

    type: Literal["StepCommitted"] = "StepCommitted"
    step: Count
    world: Count
    digest: Digest | None = None


class WeightsDiverged(Event):
    """After committing `step`, active workers reported different weight digests.

    `groups` maps each digest to the workers that reported it (invariant 7 of docs/design.md
    broken).
    """

    type: Literal["WeightsDiverged"] = "WeightsDiverged"
    step: Count
    world: Count
    groups: dict[Digest, tuple[WorkerId, ...]] = Field(max_length=100_000)


class EpochFinished(Event):
    type: Literal["EpochFinished"] = "EpochFinished"
    epoch: Count
    step: Count


class EpochStarted(Event):
    """A new epoch over the same world: the whole index space split afresh."""

    type: Literal["EpochStarted"] = "EpochStarted"
    epoch: Count
    start_step: Count
    shards: tuple[Shard, ...]


class StragglerDetected(Event):
    type: Literal["StragglerDetected"] = "StragglerDetected"
    worker: WorkerId
    step_time: Seconds
    median: Seconds
    steps: Count


class StragglerCleared(Event):
    type: Literal["StragglerCleared"] = "StragglerCleared"
    worker: WorkerId
    step_time: Seconds
    median: Seconds


class TrainingPaused(Event):
    type: Literal["TrainingPaused"] = "TrainingPaused"
    reason: Text
    active: Count
    min_workers: Count


class TrainingResumed(Event):
    type: Literal["TrainingResumed"] = "TrainingResumed"
    active: Count


class CheckpointRequested(Event):
    """After committing `step`, `worker` (a holder of its weights) is asked to write them to
    `uri`; `position` is where the data stands after `step`, for a rewind to it."""

    type: Literal["CheckpointRequested"] = "CheckpointRequested"
    worker: WorkerId
    step: Count
    uri: CheckpointUri
    position: DataPosition


KEEP_REQUESTS = 8
"""Checkpoint requests a fold keeps until saved (the coordinator's state and each worker's
view): a writer answers within a few; older ones are dropped, so a job whose workers never
write checkpoints does not grow its state."""


class CheckpointSaved(_CheckpointFile):
    """The checkpoint of `step` is indexed: the journal is the index of checkpoints;
    `position` is where the data stood after `step`."""

    type: Literal["CheckpointSaved"] = "CheckpointSaved"
    position: DataPosition


class CheckpointExpired(Event):
    """More than `checkpoint_keep` are saved (or a rewind left this one off the lineage): it
    is dropped from the index, and `worker` (the newest checkpoint's writer) deletes its file."""

    type: Literal["CheckpointExpired"] = "CheckpointExpired"
    step: Count
    uri: CheckpointUri
    worker: WorkerId | None = None


class WeightsLost(Event):
    """No member holds the weights of `step` and no checkpoint exists: training pauses until
    an operator resumes (from scratch, or from a checkpoint)."""

    type: Literal["WeightsLost"] = "WeightsLost"
    step: Count
    digest: Digest | None = None


class Rewound(Event):
    """The job goes back to the weights after `to_step` (-1: the initial weights), from
    `from_step`: steps `to_step + 1 .. from_step` are discarded from the lineage, and the
    data stands at `position` again, so their samples return to their epochs."""

    type: Literal["Rewound"] = "Rewound"
    from_step: Annotated[int, Field(ge=-1, le=MAX_INT)]
    to_step: Annotated[int, Field(ge=-1, le=MAX_INT)]
    source: Literal["checkpoint", "scratch"]
    uri: CheckpointUri | None = None
    digest: Digest | None = None
    sha256: Sha256 | None = None
    position: DataPosition
    reason: Text = ""


class WorkloadRegistered(Event):
    """`worker` runs `workload` (a new one, or one it registered before under its name,
    changed); its workloads go when it does."""

    type: Literal["WorkloadRegistered"] = "WorkloadRegistered"
    worker: WorkerId
    workload: Workload


class EvalReported(Event):
    """Evaluator `worker` evaluated the weights after `step`: its `metrics`, journaled as it
    sent them (the report plots them); or trainer `worker`'s figures recorded after its last
    step `step` (the report draws them with its other figures)."""

    type: Literal["EvalReported"] = "EvalReported"
    worker: WorkerId
    step: Count
    metrics: Metrics


class RendezvousRound(Event):
    """The launcher's agents started rendezvous round `round`: `agents` in rank order, as
    `worker` (the first of them to say so) reported it. Journaled once per round."""

    type: Literal["RendezvousRound"] = "RendezvousRound"
    worker: WorkerId
    round: Count
    agents: tuple[WorkerId, ...]


class JobFinished(Event):
    """The job reached its length (`reason`): `step` is its last, `digest` the final weights.
    Nothing trains after it; workers end with the final weights and leave."""

    type: Literal["JobFinished"] = "JobFinished"
    step: Annotated[int, Field(ge=-1, le=MAX_INT)]
    epoch: Count
    digest: Digest | None = None
    reason: Text = ""


EntryId = Annotated[str, StringConstraints(pattern=r"^[0-9]{1,20}-[0-9]{1,20}$")]
RefusalKind = Literal["forged", "malformed", "foreign", "oversized", "undecidable"]
"""Why inbox entries were dead-lettered, in kind: `forged` (a signature that does not
prove the entry's worker: unsigned, bad, revoked, or speaking for another), `malformed`
(no command could be read), `foreign` (another job's command), `oversized` (over the
leader's entry size limit, never decoded), `undecidable` (a command the leader could
not decide)."""
MAX_REFUSAL_ROWS = 256
"""Rows one CommandsRefused carries at most: senders beyond it are counted as `other`."""


class Refusal(BaseModel):
    """How many entries of one sender the leader refused for one kind of reason."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    sender: Annotated[str, StringConstraints(max_length=128)]
    """The worker whose signature proved it (`verified`), else the name the entry claimed
    (its signer field, or its command's worker), else `unknown`; `other` sums the rows
    beyond MAX_REFUSAL_ROWS."""
    verified: bool = False
    kind: RefusalKind
    count: Count
    bytes: Count = 0
    """The entries' size in all (their fields' bytes)."""


class CommandsRefused(Event):
    """Inbox entries the leader dead-lettered since the last such fact, by sender and kind:
    the evidence that outlives the capped dead-letter stream, its log lines (rate-limited)
    and a leader change. Journaled at most every few seconds, while there are any."""

    type: Literal["CommandsRefused"] = "CommandsRefused"
    refusals: tuple[Refusal, ...] = Field(max_length=MAX_REFUSAL_ROWS + 1)
    first: EntryId
    last: EntryId


class InboxRepaired(Event):
    """The leader put the inbox back in order. `ahead`: entries carried IDs ahead of the
    server's clock (an XADD with an explicit ID, or the server's clock stepped back),
    which would have moved the leader's clock and could exhaust the stream; they are
    moved behind the server's time (the first was `entry`, `ahead_s` ahead, by `sender`
    as its fields claim) and decided as of it. `lost`: unread entries after `entry` were
    deleted by someone else (the inbox deleted, or trimmed by an XADD with MAXLEN);
    their commands are gone, and workers that miss an answer send again. `more`: the
    troubles found and repaired after this one and before it was journaled (one fact
    per few seconds at most), counted here."""

    type: Literal["InboxRepaired"] = "InboxRepaired"
    trouble: Literal["ahead", "lost"]
    entry: EntryId
    ahead_s: Seconds = 0.0
    sender: Annotated[str, StringConstraints(max_length=128)] | None = None
    reason: Text = ""
    more: Count = 0


class JournalArchived(Event):
    """The journal's entries `first`..`last` (`facts` of them, counted from the previous
    segment's end) are in the segment file at `uri`, whose bytes have `sha256`; the file also
    holds the state as of `last`. Journaled after the file is whole and before Redis drops
    those entries (XTRIM MINID `last`): docs/design.md, "The journal's cold part"."""

    type: Literal["JournalArchived"] = "JournalArchived"
    first: EntryId
    last: EntryId
    facts: Annotated[int, Field(ge=1, le=MAX_INT)]
    uri: Annotated[str, StringConstraints(min_length=1, max_length=4096)]
    sha256: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
    bytes: Count


def finished_refusal(job: str, step: int, reason: str) -> str:
    """Why a finished job takes no joiner, and what to do (the leader's JoinRefused, and a
    worker's own refusal when no coordinator is left to say it)."""
    return (
        f"job {job!r} finished at step {step} ({reason}); "
        f"`cohort reset --job {job}` clears it to run again"
    )


GpuMetric = Literal["memory_pct", "temperature", "power_w", "utilization_gpu", "utilization_memory"]
GpuAction = Literal["reduce_prefetch", "delay_transfers", "prioritise_model_files"]
RuleName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]
DeviceIndex = Annotated[int, Field(ge=0, le=1024)]
MetricValue = Annotated[float, Field(allow_inf_nan=False, ge=-1e9, le=1e9)]


class GpuAdviceIssued(Event):
    """Rule `rule` fired for `worker`'s `device` (None: a rule over any device of the worker).

    Carries the advice (`action` with its `factor` or `seconds`) and its evidence: the
    `metric`'s `value` in the reading that crossed `threshold`.
    """

    type: Literal["GpuAdviceIssued"] = "GpuAdviceIssued"
    worker: WorkerId
    device: DeviceIndex | None
    rule: RuleName
    action: GpuAction
    factor: Annotated[float, Field(gt=0, le=1)] | None = None
    seconds: Annotated[float, Field(gt=0, le=86_400, allow_inf_nan=False)] | None = None
    metric: GpuMetric
    value: MetricValue
    threshold: MetricValue


class GpuAdviceCleared(Event):
    """Advice of `rule` for `worker`'s `device` ended: `metric` fell to `value`.

    `value` is None when there was nothing to measure: the device (or worker's readings)
    disappeared, or the rule is no longer configured.
    """

    type: Literal["GpuAdviceCleared"] = "GpuAdviceCleared"
    worker: WorkerId
    device: DeviceIndex | None
    rule: RuleName
    metric: GpuMetric | None
    value: MetricValue | None = None


Fact = Annotated[
    JobConfigured
    | DatasetDeclared
    | LeaderElected
    | WorkerJoined
    | JoinRefused
    | WorkerSynced
    | WorkerActivated
    | SparePromoted
    | WorkerLeaving
    | WorkerLeft
    | WorkerFailed
    | WorldChanged
    | StepCommitted
    | WeightsDiverged
    | EpochFinished
    | EpochStarted
    | StragglerDetected
    | StragglerCleared
    | TrainingPaused
    | TrainingResumed
    | GpuAdviceIssued
    | GpuAdviceCleared
    | CheckpointRequested
    | CheckpointSaved
    | CheckpointExpired
    | WeightsLost
    | Rewound
    | EvalReported
    | RendezvousRound
    | WorkloadRegistered
    | JobFinished
    | CommandsRefused
    | InboxRepaired
    | JournalArchived,
    Field(discriminator="type"),
]

COMMANDS: TypeAdapter[Command] = TypeAdapter(Command)
FACTS: TypeAdapter[Fact] = TypeAdapter(Fact)
