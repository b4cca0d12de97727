"""The elastic training loop, written once: what a script would otherwise write itself.

`Elastic` owns a job's membership and walks its steps: it joins (and waits for a
coordinator, however late it starts), brings every new world the weights it starts from
(rank 0's own, the initial ones, or a checkpoint rank 0 loads) and broadcasts them,
hands out this rank's samples of each step, reports the step and waits for it to commit,
writes the checkpoints the leader asks for in the background, and leaves at the end.

A framework plugs in through `TrainingState` (its weights: digest, broadcast, snapshot,
load, reset); `cohort.torch.ElasticJob` (PyTorch) and `cohort.NumpyElasticJob` (a dict of
numpy arrays) are the two front doors built on it.

A step whose collective was cut short by a world change applied nothing: it is retried
in the new world. A step applied here but never committed (its world changed before any
rank's report reached the leader, which is rare: the collective completing means every
rank contributed) leaves this rank's weights ahead of the lineage; the rank then leaves
and joins again, so that it takes the committed weights from a holder instead of ever
passing its own on.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
import warnings
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

from pydantic import TypeAdapter, ValidationError

from cohort.events import deal
from cohort.events.connection import Client, RedisSettings, connect
from cohort.events.errors import InvalidValueError
from cohort.events.keys import ENV_JOB, check_job
from cohort.events.models import (
    CheckpointSaved,
    DataRefused,
    Dataset,
    EvalDone,
    JobConfig,
    Metrics,
    Node,
)
from cohort.events.order import Order
from cohort.events.shards import Range
from cohort.worker.collective import calls
from cohort.worker.collective.redis_collective import Collective, World
from cohort.worker.errors import (
    CorruptDataError,
    Finished,
    JobFinishedError,
    JoinRefusedError,
    NotAssignedError,
    Stopped,
    WaitTimeoutError,
    WeightsRefusedError,
    WorkerError,
    WorldChangedError,
)
from cohort.worker.loop import checkpoints
from cohort.worker.membership import view as views
from cohort.worker.membership.client import Worker
from cohort.worker.membership.view import Assignment, View
from cohort.worker.telemetry.node import ranges_of, this_node

if TYPE_CHECKING:
    from cohort.events.order import Indices

log = logging.getLogger("cohort.elastic")
POLL = 0.5
LOCAL_RANK_ENV = "COHORT_LOCAL_RANK"
SPARE_ENV = "COHORT_SPARE"
"""Set to 1 by `cohort run --spares` for a process it starts as a spare: the default of
`Elastic(spare=...)`."""
LOG_LEVEL_ENV = "COHORT_LOG_LEVEL"
LOST_LOG_EVERY = 10.0
FIGURES: TypeAdapter[dict[str, float]] = TypeAdapter(Metrics)


class Later(Protocol):
    """A recorded number not read yet (a GPU tensor's, copying to the host): `float()`
    waits for it."""

    def __float__(self) -> float: ...


Figure = float | Later


class TrainingState(Protocol):
    """What the elastic loop needs of a framework's weights and optimizer state."""

    def digest(self) -> str:
        """A digest of the weights (equal on every rank after every committed step)."""
        ...

    def broadcast(self, collective: Collective, step: int, world: int) -> None:
        """Every rank takes rank 0's state (raises WorldChangedError if the world moves)."""
        ...

    def snapshot(self) -> bytes:
        """A copy of the whole state, for a checkpoint (taken now; written later)."""
        ...

    def load(self, blob: bytes) -> None:
        """Take the state of a `snapshot`."""
        ...

    def reset(self) -> None:
        """Back to the initial state (a job resumed from scratch)."""
        ...


@dataclass(frozen=True, slots=True)
class Step:
    """One step of the job on this rank: which samples, in which world and data epoch.

    `ranges` are positions in the epoch's `order` (what the journal assigns); `samples`
    and `indices` are the sample ids at those positions, the ones to train on."""

    step: int
    world: int
    epoch: int
    rank: int
    world_size: int
    ranges: tuple[Range, ...]
    order: Order
    micro: tuple[tuple[Range, ...], ...] = ((),)
    """`ranges` in micro-batches of at most the job's `batch_size` (several only when a
    constant global batch gives this rank more)."""
    weight: float = 1.0
    """This rank's gradient weight in the world's mean (events/deal.py `weight`): 1 unless
    the job keeps a constant global batch."""

    @property
    def samples(self) -> Indices:
        """The ids of this step's samples, an int64 array (for numpy indexing)."""
        return self.order.samples(self.ranges)

    @property
    def indices(self) -> list[int]:
        """The ids of this step's samples, as ints (for `dataset[i]`)."""
        return self.samples.tolist()  # type: ignore[no-any-return]


@dataclass(frozen=True, slots=True)
class EpochEnd:
    """What the walk gives after a data epoch's last step: the script's code between
    epochs (an epoch scheduler's step, validation) runs before the walk goes on, and so
    before a checkpoint of that step copies the state or a new world takes it."""

    epoch: int


def as_dataset(data: Any) -> Dataset | None:
    """What a worker declares of `data`: a cohort.Dataset as it is; any sized dataset (a
    torch Dataset) by its length and its `fingerprint` attribute if it has one (a version
    tag or content hash: it lets the leader refuse a worker holding other data of the same
    size), else its class's name."""
    if data is None or isinstance(data, Dataset):
        return data
    try:
        size = len(data)
    except TypeError:
        raise WorkerError(
            f"dataset= takes a cohort.Dataset or a dataset with a length, not {type(data).__name__}"
        ) from None
    kind = type(data)
    fingerprint = getattr(data, "fingerprint", None) or f"{kind.__module__}.{kind.__qualname__}"
    return Dataset(size=size, fingerprint=str(fingerprint)[:128])


class _UntilConfigured(logging.StreamHandler):  # type: ignore[type-arg]
    """cohort's lines on stderr for a script that set up no logging of its own; silent
    once the root logger has a handler (the script's setup then shows them)."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


def speak() -> None:
    """A script hears cohort's few important lines (waiting for a coordinator, its rank and
    world and the weights it starts from, the end) without configuring logging; level
    $COHORT_LOG_LEVEL (default INFO; WARNING quiets them)."""
    ours = logging.getLogger("cohort")
    if logging.getLogger().handlers or any(isinstance(h, _UntilConfigured) for h in ours.handlers):
        return  # the script, cohort's CLI or a test harness set logging up: theirs decides
    handler = _UntilConfigured()
    handler.setFormatter(logging.Formatter("cohort: %(message)s"))
    ours.addHandler(handler)
    if ours.level == logging.NOTSET:
        level = os.environ.get(LOG_LEVEL_ENV, "INFO").upper()
        known = level in logging.getLevelNamesMapping()
        ours.setLevel(level if known else "INFO")
        if not known:
            log.warning(
                "$%s=%r is not a logging level (DEBUG, INFO, WARNING, ERROR): using INFO",
                LOG_LEVEL_ENV, os.environ[LOG_LEVEL_ENV],
            )  # fmt: skip


def spare_setting(spare: bool | None) -> bool:
    """`spare` as given, else whether $COHORT_SPARE says 1 (anything but 0, 1 or empty is an
    error naming it)."""
    if spare is not None:
        return spare
    value = os.environ.get(SPARE_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise InvalidValueError(f"${SPARE_ENV}={value!r}: give 1 (join as a spare) or 0")
    return value == "1"


def _job_name(job: str | None) -> str:
    """`job`, else $COHORT_JOB, checked; WorkerError if neither names one."""
    job = job or os.environ.get(ENV_JOB)
    if not job:
        raise WorkerError(
            f"no job name: pass one (ElasticJob('mnist')) or set ${ENV_JOB}, the name "
            "the job's coordinators were started with"
        )
    return check_job(job)


class Elastic:
    """A training process's membership of job `job`, and the walk over its steps.

    `collective_timeout`: how long a collective waits for its peers while Redis answers
    (else $COHORT_COLLECTIVE_TIMEOUT, else 60 s); `ride_out`: how long one Redis outage may
    last before a collective gives up (else $COHORT_RIDE_OUT, else 300 s).

    `dataset`: the data this process trains on (a cohort.Dataset, or any dataset with a
    length), declared when it joins: the job takes the first declaration, and refuses a
    worker with other data. `node` and `local_files` say what its machine is and which of
    the dataset's files it holds (worker/telemetry/node.py describes the rest).

    `spare`: join as a warm spare (default: $COHORT_SPARE is 1, as `cohort run --spares`
    sets it): the script runs up to its first step (imports, model, loader built) and the
    loops then wait there, heartbeating and following the journal, in no world and with no
    data, until the leader promotes it in a lost rank's place; it then trains from the
    world's weights like any joiner."""

    def __init__(
        self,
        job: str | None = None,
        *,
        redis_url: str | None = None,
        conn: Client | None = None,
        worker_id: str | None = None,
        join_timeout: float | None = None,
        digest_every: int = 50,
        signals: bool = True,
        gpu_interval: float | None = None,
        dataset: Any = None,
        node: Node | None = None,
        local_files: Iterable[int] | Iterable[tuple[int, int]] | None = None,
        wait_for_redis: float | None = None,
        collective_timeout: float | None = None,
        ride_out: float | None = None,
        spare: bool | None = None,
    ) -> None:
        speak()
        job = _job_name(job)
        self.conn = conn or connect(RedisSettings.resolve(redis_url, client_name=f"cohort-{job}"))
        if local_files is not None:
            node = (node or this_node()).model_copy(update={"files": ranges_of(local_files)})
        self.worker = Worker(
            self.conn,
            job,
            worker_id=worker_id,
            gpu_interval=gpu_interval,
            dataset=as_dataset(dataset),
            node=node,
            wait_for_redis=wait_for_redis,
            spare=spare_setting(spare),
        )
        self.collective = Collective(
            self.conn, job, self.worker, timeout=collective_timeout, ride_out=ride_out
        )
        self.collective.on_corrupt = self._refused_data
        self.digest_every = digest_every
        self._reset_walk()
        if signals:
            self.worker.install_signal_handlers()
        self.joined = self._join(join_timeout)

    def _reset_walk(self) -> None:
        """Where the walk over the steps starts: no state, world, step or report yet."""
        self.state: TrainingState | None = None
        self.world = 0
        self._world_size = 0
        self._step = 0
        """The next step of the walk."""
        self.current: Step | None = None
        """The step the walk built last (it may run ahead of the script: `_given`)."""
        self._given: Step | None = None
        """The step the script trains, or trained last."""
        self._reduced: Step | None = None
        self._reductions = 0
        """The step `_reduced` the script made reductions in (`mean`), and the last's index."""
        self.aborted = False
        """True once a world change cut the current step short: nothing was applied, and
        the step comes again in the next world."""
        self.steps_done = 0
        self._unsettled: Step | None = None
        """Applied and reported here; its commit not seen yet."""
        self._digest: str | None = None
        self._loss: Figure | None = None
        self._figures: dict[str, Figure] = {}
        """What the script recorded of the current step besides its loss."""
        self._reported: int | None = None
        """The step this rank reported last (None: none yet)."""
        self._due = False
        """Whether the leader will ask for a checkpoint of the step reported last."""
        self._snapshot: Callable[[], bytes] | None = None
        """What a checkpoint of the step just reported holds, as bytes when called."""
        self._writer: checkpoints.CheckpointWriter | None = None
        self._world_callbacks: list[Callable[[int, int], None]] = []
        self._left = False
        self._final = False
        """Whether this process ended the loops holding the job's final weights."""
        self._epoch_whole = False
        """Whether the script's last loop over an epoch's batches ran to the epoch's end."""

    def _join(self, timeout: float | None) -> bool:
        """Become a member of the job, waiting for a coordinator however late one starts
        (`timeout` None: until one answers). False if a signal stopped the wait first: the
        loops then just end."""
        try:
            self.worker.join(timeout=timeout)
        except Stopped:
            log.info("%s was stopped before it joined job %r", self.worker.id, self.worker.job)
            return False
        except JoinRefusedError as refused:
            if self.worker.view.finished is None:
                raise
            log.warning("%s: nothing to train: %s", self.worker.id, refused.reason)
            return False  # the loops end at once; job.finished says why
        return True

    # ------------------------------------------------------------ set up
    def attach(self, state: TrainingState) -> None:
        """Train `state`; this worker is then ready to be given a rank."""
        self.state = state
        if self.joined:
            self.worker.ready(step=max(self.worker.view.last_committed, 0))

    def record(self, loss: Any = None, **figures: Any) -> None:
        """Figures of the current step, sent with its report (no message of their own):
        `loss`, and any other named numbers, e.g. `job.record(loss=l, accuracy=a, lr=r)`.
        `cohort status` shows each worker's latest, `cohort report` plots each name per
        worker. Any number will do (a float, a numpy scalar, a one-element tensor: read
        once, at the step's report: a GPU tensor's copy is started here and waited for
        there); calls within a step add up, a name said again keeps its last value.
        Names: a letter or digit, then letters, digits and `._:/-`, up to 64 characters
        (`job.record(**{"val/acc": a})`); at most 64 names a step. Anything else raises
        InvalidValueError naming it."""
        if loss is not None:
            self._loss = self._figure("loss", loss)
        said = {**self._figures, **{name: self._figure(name, v) for name, v in figures.items()}}
        try:
            FIGURES.validate_python({n: 0.0 if _later(v) else v for n, v in said.items()})
            self._figures = said
        except ValidationError as error:
            problem = error.errors()[0]
            where = ".".join(str(part) for part in problem["loc"])
            raise InvalidValueError(
                f"job.record(): {where or 'the figures'}: {problem['msg']} (names: a letter or "
                "digit, then letters, digits and ._:/-, up to 64 characters; at most 64 a step)"
            ) from None

    def _figure(self, name: str, value: Any) -> Figure:
        """What `record` keeps of `value` until the report reads it: a float here; a
        framework's job may keep a number still on its way from a device."""
        return _number(name, value)

    def on_world_change(self, callback: Callable[[int, int], None]) -> None:
        """`callback(old_size, new_size)` at every new world (to scale a learning rate)."""
        self._world_callbacks.append(callback)

    @property
    def stopping(self) -> bool:
        return self.worker.stopping.is_set()

    @property
    def finished(self) -> bool:
        """The job reached its length (whether this process holds the final weights:
        `has_final_weights`)."""
        return self.worker.finished

    @property
    def has_final_weights(self) -> bool:
        """After the loops of a finished job: whether this process holds its final weights
        (it trained the last step, or took them from the final checkpoint). False in a
        process that joined or waited as a spare until after the last world began, and so
        trained none of it: `save` is then not its to do."""
        return self._final

    @property
    def interrupted(self) -> bool:
        """Whether the first SIGINT/SIGTERM stopped this process before the job finished,
        and before the epoch its `batches()` loop was in ended: the script's code between
        epochs would run on a part of one (`if job.interrupted: break` skips it)."""
        return self.stopping and not self.finished and not self._epoch_whole

    def check_epochs(self, count: int | None) -> None:
        """InvalidValueError if the script bounds the epochs at `count` where the job's
        length (its coordinators' --epochs) says otherwise: the job's length is said once,
        to `cohort run`/`cohort coordinator`, and the script reads it from the job."""
        config = self.worker.view.config
        if count is None or config is None or count == config.epochs:
            return
        job = (
            f"the job's length is --epochs {config.epochs}"
            if config.epochs is not None
            else "the job was given no --epochs"
            + (f" (it ends after --max-steps {config.max_steps})" if config.max_steps else "")
        )
        raise InvalidValueError(
            f"job.epochs({count!r}): {job}; the job's length is set once, where the job is: "
            f"drop the argument (job.epochs() trains to the job's end) or give "
            f"`cohort run --epochs {count}` (`cohort coordinator --epochs {count}`)"
        )

    # ------------------------------------------------------------ who am I
    @property
    def worker_id(self) -> str:
        """This process's member id in the job ($COHORT_WORKER_ID under `cohort run`)."""
        return self.worker.id

    @property
    def local_rank(self) -> int:
        """This process's index among the job's processes on its node, for picking a GPU:
        $COHORT_LOCAL_RANK (`cohort run`) or $LOCAL_RANK (torchrun), else 0. Fixed for the
        process's life, unlike `rank`."""
        for name in (LOCAL_RANK_ENV, "LOCAL_RANK"):
            value = os.environ.get(name, "")
            if value.isdigit():
                return int(value)
        return 0

    @property
    def spare(self) -> bool:
        """True while this process waits as a spare (it joined as one and holds no rank yet):
        `rank` is None, `world_size` 0, `is_chief` False, and the loops wait for its
        promotion."""
        view = self.worker.view
        return view.spare and view.status != "active"

    @property
    def rank(self) -> int | None:
        """This process's rank, 0 to world_size - 1, in the world of the step it trains;
        between steps and after the loops, of the step it trained last; before its first
        step, in the world it is in (None while it is in none). A world change renumbers
        ranks: read it where it is used."""
        if self._given is not None:
            return self._given.rank
        assignment = self.worker.assignment
        return assignment.rank if assignment is not None else None

    @property
    def world_size(self) -> int:
        """How many ranks train the step this process trains (as `rank`: between steps and
        after the loops, the last one's; 0 before it is in a world)."""
        if self._given is not None:
            return self._given.world_size
        assignment = self.worker.assignment
        return assignment.world_size if assignment is not None else 0

    @property
    def is_chief(self) -> bool:
        """Rank 0 of its world (as `rank`): the one rank to log, validate or save for all.
        After the loops of a finished job, exactly one process of the final world is."""
        return self.rank == 0

    @property
    def step(self) -> int | None:
        """The job's number of the step this process trains (from 0), or trained last
        between steps and after the loops; None before its first."""
        return self._given.step if self._given is not None else None

    @property
    def epoch(self) -> int:
        """The data epoch of that step (from 0): after an epoch's loop, the epoch it ended;
        before the first step, the job's current epoch."""
        if self._given is not None:
            return self._given.epoch
        plan = self.worker.view.plan
        return plan.epoch if plan is not None else 0

    # ------------------------------------------------------------ the job's settings
    @property
    def batch_size(self) -> int:
        """Samples a rank computes in one forward and backward (`--batch-size`): the size
        to give the DataLoader, so the script never states it a second time."""
        return self._config().batch_size

    @property
    def global_batch(self) -> int | None:
        """Samples of one update over the whole world (`--global-batch`), None: a
        `batch_size` per rank."""
        return self._config().global_batch

    @property
    def dataset_size(self) -> int | None:
        """Samples of a data epoch, as the job was configured (None: the workers' data set
        says)."""
        return self._config().dataset_size

    @property
    def total_steps(self) -> int | None:
        """The job's length in updates where its settings fix it whatever the world's size
        (`--max-steps`, or `--epochs` of a `--global-batch` with `--placement strided` and
        a known data set size): what an LR schedule spans. None where the length follows
        the world's size."""
        config = self._config()
        lengths = [config.max_steps] if config.max_steps is not None else []
        size, per_step = config.dataset_size, config.global_batch
        known = config.epochs is not None and size is not None and per_step is not None
        if known and config.placement == "strided":
            lengths.append(config.epochs * -(-size // per_step))  # type: ignore[operator]
        return min(lengths) if lengths else None

    def _config(self) -> JobConfig:
        config = self.worker.view.config
        if config is None:
            raise WorkerError(
                f"job {self.worker.job!r}: its settings are not known, since this process "
                "never joined it (stopped first, or the job had finished)"
            )
        return config

    # ------------------------------------------------------------ figures of the world
    def mean(self, value: Any) -> Any:
        """The mean of `value` (a number, or an array or tensor of up to 4096, reduced
        element by element) over the ranks of the world of the step this process trains,
        or trained last: inside a step, or between epochs after `batches`. Every rank of
        that world must make the same reductions in the same order, as with any
        collective. It returns a float for a number, else the kind it was given. A world
        change does not stop it, a rank of its world leaving or failing before it answered
        does: that rank will never answer, so it gives NaN (every element), logs why, and
        the script goes on into the next world (an evaluation cut short, never a crash
        that would take the survivors' weights with it); JobFinishedError (a
        WorldChangedError) once the job finished. A rank that answered and then left (its
        loops ended with the job) still counts. Exact: the numbers travel whole and are
        summed with `math.fsum`."""
        return self._reduce(value, "mean")

    def sum(self, value: Any) -> Any:
        """The sum of `value` over the ranks (as `mean`): e.g. correct answers and samples
        of a sharded validation set, whose quotient is the accuracy over all of it."""
        return self._reduce(value, "sum")

    def max(self, value: Any) -> Any:
        """The largest `value` over the ranks (as `mean`), element by element."""
        return self._reduce(value, "max")

    def shard(self, data: Any) -> Any:
        """This rank's part of `data` (a count, or anything with a length): the positions
        rank, rank + n, ... of its world's n ranks, as a numpy array of indices. The ranks
        of one world together hold every position once, so an evaluation over their parts
        uses every sample once: reduce what they found with `sum`/`mean`. Take the parts
        where you use them, in the world of the step trained last (`job.rank`)."""
        import numpy as np

        rank, size = self.rank, self.world_size
        if rank is None or not size:
            raise WorkerError("job.shard() splits over a world's ranks: this process is in none")
        total = data if isinstance(data, int) else len(data)
        return np.arange(rank, total, size)

    def _reduce(self, value: Any, how: str) -> Any:
        given = self._given
        if given is None or self._left:
            raise WorkerError(
                f"job.{how}() reduces over the ranks of a step's world: call it inside the "
                "loops (in a step, or between epochs after job.batches()), not before the "
                "first step or after the loops, when the ranks have left"
            )
        numbers, rebuild = self._numbers(value, how)
        count = self._reductions + 1 if self._reduced is given else 0
        self._reduced, self._reductions = given, count
        try:
            plan = views.plan_for(self.worker.view, given.step)
            ranks = plan.ranks if plan.world_version == given.world else ()
        except NotAssignedError:  # a plan this old is forgotten: its ranks are not watched
            ranks = ()

        members = next(  # whose notices to read: the workers of the step's world
            (p.ranks for p in self.worker.view.plans if p.world_version == given.world), ranks
        )

        def standing() -> bool:
            now = self.worker.view
            return all(w in now.members and w not in now.gone for w in members)

        world = World(given.world, given.rank, given.world_size, members)
        call = calls.call_id(given.step, calls.FIGURES, count)
        try:
            # ranks unknown (a plan forgotten): a newer world ends the call instead, never
            # a wait of the whole timeout for ranks no check can see are gone
            rows = self.collective.gather(numbers, call, world, standing if members else None)
        except WorldChangedError:
            end = self.worker.view.finished
            if end is not None:
                raise JobFinishedError(how, given.step, self.worker.job, end) from None
            log.warning(
                "%s: job.%s() over world %d (after step %d) gives NaN: a rank of that world "
                "left or failed before it answered; training goes on in the next world",
                self.worker_id, how, given.world, given.step,
            )  # fmt: skip
            return rebuild([math.nan] * len(numbers))
        columns = list(zip(*rows, strict=True))
        if how == "max":
            return rebuild([max(column) for column in columns])
        sums = [math.fsum(column) for column in columns]
        return rebuild(sums if how == "sum" else [total / len(rows) for total in sums])

    def _numbers(self, value: Any, how: str) -> tuple[list[float], Callable[[list[float]], Any]]:
        """`value` as numbers for a reduction, and how to give the result back as its kind
        (a float for a number, a numpy array of its shape for an array)."""
        import numpy as np

        if isinstance(value, np.ndarray):
            shape = value.shape
            numbers = value.astype(np.float64).ravel().tolist()
            reducible(numbers, how)
            return numbers, lambda result: np.asarray(result, dtype=np.float64).reshape(shape)
        try:
            return [float(value)], lambda result: result[0]
        except (TypeError, ValueError):
            raise InvalidValueError(
                f"job.{how}({value!r:.80}): give a number, or an array or tensor of numbers"
            ) from None

    def save(self, uri: str | os.PathLike[str]) -> bool:
        """Write the final weights to `uri` (a path or any fsspec URL, written whole or not
        at all) once for the whole job: after the loops, by the chief of the world that
        trained the job's last step. True where this process wrote them; every other rank,
        and a process stopped before the job finished, writes nothing and gets False."""
        if not self.finished:
            log.warning("%s: job.save(%r) skipped: the job did not finish", self.worker_id, uri)
            return False
        if not self._final:
            log.info(
                "%s: job.save(%r) skipped: this process does not hold the final weights "
                "(it trained no step of the job's last world)",
                self.worker_id,
                uri,
            )
            return False
        if not self.is_chief or self.step != self.worker.view.last_committed:
            return False  # the chief of the world that trained the job's last step writes
        checkpoints.write_whole(os.fspath(uri), [self._final_weights()], "the final weights")
        log.info("%s wrote the final weights to %s", self.worker_id, os.fspath(uri))
        return True

    def _final_weights(self) -> bytes:
        """The weights as `save` writes them, in the framework's own file format."""
        raise NotImplementedError

    # ------------------------------------------------------------ the walk
    def steps(self) -> Iterator[Step]:
        """Every step this rank trains, in order, until the job finishes or it is stopped.

        Between two `next()` the caller computes the step and applies its update through
        the job's collective; `abort()` says a world change cut that short."""
        walk = self._walk()
        try:
            for step in walk:
                if isinstance(step, EpochEnd):
                    continue  # a step's body is this route's only place for the script's code
                trained, self._given = self._given, step
                yield step
                if self.aborted:  # nothing applied: the script is where it was
                    self._given = trained
        finally:
            walk.close()

    def _walk(self) -> Generator[Step | EpochEnd, None, None]:
        """Every step this rank trains, in order, until the job finishes or it is stopped,
        with an `EpochEnd` after each data epoch's last step.

        Between two `next()` the caller computes the step and applies its update through
        the job's collective; `abort()` says a world change cut that short. A finished step
        is reported at once and its commit is awaited only after the next step's work (it
        has nearly always arrived by then): the wait stays off the critical path. What the
        step leaves behind (a checkpoint's copy, a new world's broadcast) is taken only
        when the caller asks past it, so it holds what the script did after the step.
        """
        assert self.state is not None, "attach() the training state first"
        if not self.joined:
            return  # stopped before it joined, or the job had finished
        if self.spare:
            log.info(
                "%s waits as a spare: ready, in no world, until a rank of the job is lost",
                self.worker.id,
            )
        lost_logged = 0.0
        try:
            while not self.stopping:
                try:
                    assignment = self.worker.wait_active(POLL)
                except Finished as end:
                    self._ended(end)
                    return
                except WaitTimeoutError:
                    lost_logged = self._say_if_lost(lost_logged)
                    continue
                if assignment.world_version != self.world:
                    self._settle()
                    if not self._start_world(assignment):
                        continue
                self._step = max(self._step, self.worker.next_step)
                step = self._current(assignment)
                self.aborted = False
                started = time.monotonic()
                yield step
                if self.aborted:  # nothing was applied: the step is retried in the new world
                    self._loss, self._figures = None, {}  # the retry says its own
                    self._settle()
                    continue
                yield from self._after(step, time.monotonic() - started)
        finally:
            self._settle()

    def _ended(self, end: Finished) -> None:
        """The job finished: whether this process holds the final weights, said plainly. A
        process that trained the last step does; one that did not (it joined, or waited as
        a spare, until after the last world began) takes them from the final checkpoint
        where the job writes one, and otherwise ends without them."""
        trained = self._given is not None and self._given.step == end.step
        self._final = trained or self._final_checkpoint(end.step)
        if trained:
            said = "it ends with the final weights"
        elif self._final:
            said = "it took the final weights from the job's last checkpoint"
        else:
            was = "waited as a spare" if self.spare else "trained no step of the last world"
            said = (
                f"it {was} and does not hold the final weights (no checkpoint of step "
                f"{end.step} to take them from): job.save() is not its to do"
            )
        log.info("%s: %s; %s", self.worker.id, end, said)

    def _final_checkpoint(self, step: int) -> bool:
        """Load the checkpoint of the job's last `step`: a job that checkpoints asks a rank
        of its last world for one as it finishes, which writes it before it leaves. Waits
        for it while a rank of that world is still a member, up to the collective's
        timeout; False if the job writes none, or it does not come."""
        assert self.state is not None
        view = self.worker.view
        if view.config is None or view.config.checkpoint_uri is None:
            return False
        writers = view.plan.ranks if view.plan is not None else ()

        def saved(view: View) -> CheckpointSaved | None:
            return next((c for c in view.checkpoints if c.step == step), None)

        def settled(view: View) -> bool:
            writing = any(w in view.members and w not in view.gone for w in writers)
            return saved(view) is not None or not writing

        try:
            self.worker.wait_for(settled, self.collective.timeout)
        except (WaitTimeoutError, Stopped):
            return False
        final = saved(self.worker.view)
        if final is None:
            return False
        try:
            self._load_checkpoint(final.uri, final.sha256, final.digest)
        except checkpoints.CheckpointError as exc:
            log.warning("%s: the final checkpoint does not load: %s", self.worker.id, exc)
            return False
        return True

    def _load_checkpoint(self, uri: str, sha256: str | None, digest: str | None) -> None:
        """Take the state of the checkpoint at `uri`; CheckpointError if it cannot be read
        or holds other weights than the journaled `digest`."""
        assert self.state is not None
        self._take_checkpoint(uri, checkpoints.read(uri, sha256).payload)
        if digest is not None and not self._holds(digest):
            raise checkpoints.CheckpointError(
                f"checkpoint {uri!r} holds weights {self.state.digest()}, not the journaled "
                f"{digest}"
            )

    def _take_checkpoint(self, uri: str, payload: bytes) -> None:
        """Take the state of checkpoint `uri`, whose payload is `payload`."""
        assert self.state is not None
        self.state.load(payload)

    def _holds(self, digest: str) -> bool:
        """Whether the state's weights are those of the journaled `digest`."""
        assert self.state is not None
        return self.state.digest() == digest

    def _after(self, step: Step, took: float) -> Generator[EpochEnd, None, None]:
        """`step` applied: report it, and copy what a checkpoint of it needs as the caller
        asks for more. After an epoch's last step the caller is first given the epoch's end
        (its code between epochs runs there), and the step's commit is awaited: it brings
        the next epoch's plan, or the job's end, which the next step is built on."""
        self._settle()  # the step before (as a rule, settled as this one applied)
        ends_epoch, ends_job = self._report(step, took)
        self._unsettled, self._step = step, step.step + 1
        if ends_epoch:
            try:
                yield EpochEnd(step.epoch)
            finally:
                self._capture(between_epochs=True)
        else:
            self._capture(between_epochs=False)
        if ends_epoch or ends_job:
            self._settle()

    @contextlib.contextmanager
    def attempt(self, step: Step) -> Iterator[Step]:
        """One try at `step`'s work: a world change inside it (WorldChangedError) aborts
        the step, which `steps()` then gives again in the new world. `step` must be the one
        `steps()` gave last."""
        if step is not self.current:
            current = self.current.step if self.current is not None else None
            raise WorkerError(
                f"job.attempt() takes the step job.steps() gave last (step {current}), "
                f"not step {step.step}"
            )
        try:
            yield step
        except WorldChangedError:
            self.abort()  # suppressed: the step is retried in the new world

    def step_of(self, step: Step) -> contextlib.AbstractContextManager[Step]:
        """Deprecated: `attempt(step)`, which this was, under a name that says what it does."""
        warnings.warn(
            "job.step_of(step) is now named job.attempt(step)", DeprecationWarning, stacklevel=2
        )
        return self.attempt(step)

    def before_apply(self) -> bool:
        """Called by the framework's glue before it averages and applies the current step.

        The previous step, reported but perhaps not yet seen committed, is settled first
        (its commit has nearly always arrived during this step's forward and backward).
        Its commit may have moved the job on (a new epoch, a new world, the end): False when
        the current step was built on a plan that is no longer the job's, and it is aborted.
        """
        self._settle()
        current = self.current
        assert current is not None, "before_apply() inside a step"
        if not self.stands(current):
            self.abort()
            return False
        return True

    def stands(self, step: Step) -> bool:
        """Whether `step` is still the job's: not past its end, in the current world, with
        the samples and data epoch the current plan gives it."""
        view = self.worker.view
        if view.finished is not None or view.world_version != step.world:
            return False
        plan = view.plan
        if plan is not None and plan.epoch != step.epoch:
            return False
        try:
            return self.worker.batch(step.step) == step.ranges
        except NotAssignedError:
            return False

    def launchable(self, step: Step, after: int | None, cancelled: threading.Event) -> bool:
        """Whether `step`'s collective may start while backward still runs: once step `after`
        (the one before it, reported but not yet seen to settle; None: none) settled,
        whether `step` is still the job's. Every rank answers alike, since each waits for
        the same journal; a rank that built `step` on a plan the commit of `after` replaced
        (a new epoch, a new world) must not pour that step's gradients into the others'.
        Blocks (off the main thread where it can) until it can tell; False once `cancelled`
        or stopping."""
        if after is not None:

            def settled(view: View) -> bool:
                return (
                    view.last_committed >= after
                    or view.world_version != step.world
                    or view.finished is not None
                )

            while True:
                try:
                    self.worker.wait_for(settled, POLL)
                    break
                except WaitTimeoutError:
                    if cancelled.is_set() or self.stopping:
                        return False
                except WorkerError:  # removed meanwhile
                    return False
        return self.stands(step)

    def abort(self) -> None:
        """The step's collective was cut short by a world change: nothing was applied."""
        self.aborted = True

    def _current(self, assignment: Assignment) -> Step:
        ranges = self.worker.batch(self._step)
        view = self.worker.view
        plan = view.plan
        assert view.config is not None
        self.current = Step(
            step=self._step,
            world=assignment.world_version,
            epoch=plan.epoch if plan is not None else 0,
            rank=assignment.rank,
            world_size=assignment.world_size,
            ranges=ranges,
            order=views.order_for(view, self._step),
            micro=deal.micro_batches(view.config, ranges),
            weight=views.weight(view, self._step),
        )
        return self.current

    def _start_world(self, assignment: Assignment) -> bool:
        """Rank 0 brings the world's weights, then every rank takes them. False: the world
        moved on meanwhile (the caller waits for the next one)."""
        assert self.state is not None
        weights = assignment.weights
        if assignment.rank == 0 and weights is not None and weights.source != "rank":
            if weights.source == "initial":
                self.state.reset()
            else:
                assert weights.uri is not None
                self._load_checkpoint(weights.uri, weights.sha256, weights.digest)
                log.info("rank 0 loaded the state of step %d from %s", weights.step, weights.uri)
        try:
            self._take_state(assignment)
            self._joined_world(assignment)
        except WorldChangedError:
            return False
        old, self._world_size = self._world_size, assignment.world_size
        self.world, self._step = assignment.world_version, assignment.start_step
        self.worker.spare = False  # a trainer now: were it to join again, it joins as one
        log.info(
            "%s trains as rank %d of %d (world %d) from step %d, with %s",
            self.worker.id, assignment.rank, assignment.world_size, assignment.world_version,
            assignment.start_step, _origin(weights),
        )  # fmt: skip
        for callback in self._world_callbacks:
            callback(old, assignment.world_size)
        return True

    def _refused_data(self, exc: CorruptDataError) -> None:
        """A rank's data failed verification where this rank read it: name its writer to the
        leader (DataRefused), which removes a rank a majority of its peers refuse, and wait
        for the next world; the step is then retried in it (WorldChangedError). If no world
        follows within the collective's timeout, the error stands."""
        world = self.worker.world_version
        step = self.current.step if self.current is not None else self.worker.next_step
        log.error("%s: %s; refused, and said so to the leader", self.worker.id, exc)
        why = str(exc)[:1000]
        self.worker.send(DataRefused, accused=exc.worker, world=world, step=step, reason=why)
        if self.worker.wait_for_change(world, self.collective.timeout):
            raise WorldChangedError(step, self.worker.assignment) from exc

    def _take_state(self, assignment: Assignment) -> None:
        """Every rank takes rank 0's state, through the collective (Redis), and checks it."""
        assert self.state is not None
        self.state.broadcast(self.collective, assignment.start_step, assignment.world_version)
        self._check_weights(assignment)

    def _check_weights(self, assignment: Assignment) -> None:
        """A receiver takes rank 0's weights only if they have the digest the journal
        recorded for the world's weights (when it recorded one): else it leaves the job and
        raises WeightsRefusedError naming the sender, rather than train on them."""
        assert self.state is not None
        weights = assignment.weights
        if assignment.rank == 0 or weights is None or weights.digest is None:
            return
        got = self.state.digest()
        if got != weights.digest:
            refuse_weights(self.worker, assignment, got)

    def _joined_world(self, assignment: Assignment) -> None:
        """Every rank holds the world's state: what else a world needs (a process group)."""

    def _report(self, step: Step, took: float) -> tuple[bool, bool]:
        """StepDone for `step`, with a digest of the weights now and then, sent without
        waiting for Redis (the commit it leads to is awaited before the next step applies).
        Whether `step` ends its data epoch, and whether it ends the job: read before the
        send, like whether a checkpoint of it is due, since once it commits the view moves
        on."""
        assert self.state is not None
        ends_epoch = self._ends_epoch(step)
        ends_job = self._ends_job(step, ends_epoch)
        self._due = self._checkpoint_due(step, ends_job)
        sample = self._due or (self.digest_every and step.step % self.digest_every == 0)
        self._digest = self.state.digest() if sample else None
        samples = sum(stop - start for start, stop in step.ranges)
        self.worker.step_done(
            step.step,
            step_time=took,
            samples=samples,
            digest=self._digest,
            loss=None if self._loss is None else float(self._loss),
            wait=False,
            metrics={name: float(value) for name, value in self._figures.items()},
        )
        self._loss, self._figures = None, {}
        self._reported = step.step
        return ends_epoch, ends_job

    def _capture(self, between_epochs: bool) -> None:
        """Copy the state a checkpoint of the step just reported holds, if the leader will
        ask for one (it asks when the step commits). The copy is taken as the script asks
        for the next step: after all it did once the step applied (a per-step scheduler's
        step; after an epoch's last step, its code between epochs too: an epoch scheduler's
        step, an EMA, counters in `extra`), and before the next step changes anything. A
        run resumed from it then starts the next step as the uninterrupted run did.
        Between epochs the script may have changed the weights: they are digested again."""
        assert self.state is not None
        self._snapshot = self._copy_state() if self._due else None
        if self._due and between_epochs:
            self._digest = self.state.digest()

    def _copy_state(self) -> Callable[[], bytes] | None:
        """The state now, made into a checkpoint's bytes when called (on the writer's
        thread); None: this rank holds nothing to write."""
        assert self.state is not None
        blob = self.state.snapshot()
        return lambda: blob

    def _checkpoint_due(self, step: Step, ends_job: bool) -> bool:
        """Whether the leader will ask for a checkpoint of `step` once it commits: after
        every `checkpoint_every` steps, and after the job's last."""
        config = self.worker.view.config
        if config is None or config.checkpoint_uri is None:
            return False
        return ends_job or (step.step + 1) % config.checkpoint_every == 0

    def _ends_job(self, step: Step, ends_epoch: bool) -> bool:
        """Whether `step` is the job's last (its length in steps or epochs)."""
        config = self.worker.view.config
        if config is None or self.worker.view.plan is None:
            return False
        return config.end_reason(step.step, step.epoch, ends_epoch) is not None

    def _ends_epoch(self, step: Step) -> bool:
        """Whether `step` is the last of its data epoch (in the plan it was built on)."""
        view = self.worker.view
        config, plan = view.config, view.plan
        if config is None or plan is None:
            return False
        return deal.exhausted(config, plan.shards, plan.base_step, step.step + 1)

    def _settle(self) -> None:
        """Wait for the reported step to commit (if one waits); write its checkpoint if the
        leader asked this worker; rejoin if it never commits."""
        step, self._unsettled = self._unsettled, None
        if step is None:
            return
        if not self.worker.committed(step.step):
            if self.worker.finished:
                log.warning(
                    "%s applied step %d, after the job's last; its weights are not the final "
                    "ones (step %d's)",
                    self.worker.id,
                    step.step,
                    self.worker.view.last_committed,
                )
            elif not self.stopping:
                self._rejoin(step)
            return
        self.steps_done += 1
        request = checkpoints.pending(self.worker.view.requested, step.step)
        if request is not None and self._snapshot is not None:
            self._writer = self._writer or checkpoints.CheckpointWriter(self.worker)
            self._writer.submit(request, self._snapshot, self._digest)
        self._snapshot = None

    def _rejoin(self, step: Step) -> None:
        """This rank applied a step the job never committed: its weights are ahead of the
        lineage. Leave and join again, to take the committed weights from a holder."""
        log.warning(
            "%s applied step %d, which the job did not commit; joining again to take the "
            "committed weights",
            self.worker.id,
            step.step,
        )
        self._join_again(f"weights ahead of the lineage at step {step.step}")

    def _join_again(self, reason: str) -> None:
        """Give up this rank's claim to the weights: leave (not after a step that never
        commits: no drain) and join again, ready for the next world."""
        self.worker.leave(reason=reason, drain=False)
        self.worker.join()
        self.world = 0
        self.worker.ready(step=max(self.worker.view.last_committed, 0))

    def _say_if_lost(self, logged: float) -> float:
        lost = self.worker.view.weights_lost
        now = time.monotonic()
        if lost is None or now - logged < LOST_LOG_EVERY:
            return logged
        log.warning(
            "%s waits: the weights of step %d are lost; continue with `cohort resume --job %s`",
            self.worker.id,
            lost,
            self.worker.job,
        )
        return now

    # ------------------------------------------------------------ the end
    def close(self) -> None:
        """Send what the script recorded after its last step, finish background checkpoint
        writes, then leave the job (once)."""
        if self._left:
            return
        self._left = True
        self._report_last_figures()
        if self._writer is not None:
            self._writer.close()
        reason = "finished" if self.worker.finished else "stopped" if self.stopping else "done"
        self.worker.leave(reason=reason)

    def _report_last_figures(self) -> None:
        """Figures recorded after the last step (a final validation, the last epoch's
        figures) have no next step to ride on: they go as a report of their own, EvalDone of
        that step, which the leader journals (EvalReported), so `cohort status` and the
        report show them after the job ended. A recorded `loss` goes as the figure "loss"."""
        said = {**self._figures, **({"loss": self._loss} if self._loss is not None else {})}
        figures = {name: float(value) for name, value in said.items()}
        self._loss, self._figures = None, {}
        if self._reported is None or not figures or not self.worker.view.member:
            return
        self.worker.send(EvalDone, step=self._reported, metrics=figures)

    def __enter__(self) -> Elastic:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


MAX_REDUCED = 4096
"""Numbers one reduction (`job.mean`) takes: figures, not tensors (use the collective)."""


def reducible(numbers: list[float], how: str) -> None:
    """InvalidValueError if `numbers` are too many for one reduction (`job.mean`)."""
    if len(numbers) > MAX_REDUCED:
        raise InvalidValueError(
            f"job.{how}() of {len(numbers)} numbers: it reduces figures, at most "
            f"{MAX_REDUCED}; tensors go through the job's collective"
        )


def _later(value: Figure) -> bool:
    """Whether a recorded figure is still on its way (validated as a placeholder)."""
    return not isinstance(value, float)


def _number(name: str, value: Any) -> float:
    """`value` as a float for `record`, or InvalidValueError naming it. A tensor that
    carries a graph (a loss, a clipped norm) is read without it, as `loss.item()` would."""
    detached = getattr(value, "detach", None)
    try:
        return float(detached() if callable(detached) else value)
    except (TypeError, ValueError, RuntimeError):  # RuntimeError: a tensor of many values
        raise InvalidValueError(
            f"job.record({name}=...): {value!r:.80} is not a number; record one number a name"
        ) from None


def _origin(weights: Any) -> str:
    """Where a world's starting weights come from, for people."""
    if weights is None or weights.source == "rank":
        return "the weights the ranks hold"
    if weights.source == "initial":
        return "the initial weights"
    return f"the weights of step {weights.step} from {weights.uri}"


class NumpyState:
    """A dict of numpy arrays as the elastic loop's state, changed in place by the caller."""

    def __init__(self, params: dict[str, Any]) -> None:
        import numpy as np

        self.params = params
        self.initial = {k: np.array(v, copy=True) for k, v in params.items()}

    def digest(self) -> str:
        import hashlib

        import numpy as np

        h = hashlib.sha256()
        for name in sorted(self.params):
            h.update(name.encode())
            h.update(np.ascontiguousarray(self.params[name]).tobytes())
        return h.hexdigest()[:32]

    def broadcast(self, collective: Collective, step: int, world: int) -> None:
        import numpy as np

        mine = self.params if collective.world().rank == 0 else None
        got = collective.broadcast(mine, root=0, step=step, world=world)  # type: ignore[arg-type]
        for name, value in got.items():
            self.params[name] = np.array(value, copy=True)

    def snapshot(self) -> bytes:
        return checkpoints.tensors_payload(self.params)()  # type: ignore[arg-type]

    def load(self, blob: bytes) -> None:
        import numpy as np

        from cohort.worker.collective import tensors

        for name, value in tensors.unpack(blob).items():
            self.params[name] = np.array(value, copy=True)

    def reset(self) -> None:
        import numpy as np

        for name, value in self.initial.items():
            self.params[name] = np.array(value, copy=True)


class NumpyElasticJob(Elastic):
    """Elastic data-parallel training of numpy parameters, changed in place:

    job = cohort.NumpyElasticJob("toy")
    params = job.wrap(params)                     # kept equal on every rank
    for step in job.steps():
        with job.attempt(step):                   # a world change retries the step
            grads = gradients(params, *take(step.samples))
            for name, mean in job.allreduce(grads).items():
                params[name] -= lr * mean
    """

    def wrap(self, params: dict[str, Any]) -> dict[str, Any]:
        self.attach(NumpyState(params))
        return params

    def _final_weights(self) -> bytes:
        """The parameters as an .npz file (`numpy.load` reads it back)."""
        import io

        import numpy as np

        assert isinstance(self.state, NumpyState)
        out = io.BytesIO()
        np.savez(out, **self.state.params)
        return out.getvalue()

    def allreduce(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """The mean of `tensors` (this rank's mean gradients over its batch) over the ranks,
        for the current step; with a constant global batch, weighted by each rank's share
        of the step's samples, so every sample counts alike."""
        current = self.current
        assert current is not None, "allreduce() inside a step"
        if not self.before_apply():
            raise WorldChangedError(current.step, self.worker.assignment)
        if current.weight != 1.0:
            tensors = {name: value * current.weight for name, value in tensors.items()}
        return self.collective.allreduce(  # type: ignore[return-value]
            tensors,  # type: ignore[arg-type]
            current.step,
            world=current.world,
        )


def refuse_weights(worker: Worker, assignment: Assignment, got: str) -> NoReturn:
    """Leave the job and raise WeightsRefusedError naming the sender of weights whose
    digest is `got`, not the journal's."""
    weights = assignment.weights
    assert weights is not None and weights.digest is not None
    view = worker.view
    ranks = next((p.ranks for p in view.plans if p.world_version == assignment.world_version), ())
    refused = WeightsRefusedError(ranks[0] if ranks else "?", weights.step, got, weights.digest)
    log.error("%s: %s", worker.id, refused)
    worker.leave(reason=f"refused the weights of step {weights.step}: digest {got}")
    raise refused
