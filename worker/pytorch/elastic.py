"""Elastic PyTorch training in a few changed lines: `cohort.torch.ElasticJob`.

    job = cohort.torch.ElasticJob("mnist")
    model, optimizer = job.wrap(model, optimizer)
    for epoch in job.epochs():  # to the job's length: `cohort run --epochs N`
        for x, y in job.batches(loader):
            loss_fn(model(x), y).backward(); optimizer.step(); optimizer.zero_grad()

`wrap` makes `optimizer.step()` average the gradients over the ranks first (through
Redis, as DDP would), and skip the update if a world change cut that short (the step is
retried in the new world). `batches` gives this rank its samples of every step of the
data epoch (the leader's split, elastic across joins, leaves and failures), built from the
loader's dataset and collate function. Every new world starts from rank 0's model,
optimizer and extra state (a survivor's, the initial ones, or a checkpoint's); checkpoints
the leader asks for are written in the background; the job leaves when the loops end.
"""

from __future__ import annotations

import collections
import copy
import functools
import io
import logging
import math
import os
import threading
import types
import warnings
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from typing import Any

import numpy as np
import torch

from cohort.events import deal, storage
from cohort.events.errors import InvalidValueError
from cohort.events.models import JobConfig
from cohort.worker.collective import compressors as feedback
from cohort.worker.collective.compressors import DEFAULT_RANK, Compression
from cohort.worker.collective.redis_collective import Collective
from cohort.worker.errors import AccumulationError, WorkerError, WorldChangedError
from cohort.worker.loop.checkpoints import CheckpointError
from cohort.worker.loop.elastic import POLL, Elastic, EpochEnd, Step, reducible, refuse_weights
from cohort.worker.pytorch import shards
from cohort.worker.pytorch import sync as torch_sync
from cohort.worker.pytorch.completion import HostCompletion, completion_of
from cohort.worker.pytorch.devices import current, rank_device
from cohort.worker.pytorch.digests import bytes_digest, weights_digest
from cohort.worker.pytorch.exact import ExactSum
from cohort.worker.pytorch.handover import Handover
from cohort.worker.pytorch.loader import Stale, StepLoader
from cohort.worker.pytorch.micro import (
    MicroBatches,
    gate_scaler,
    gate_scheduler,
    learning_rates,
)
from cohort.worker.pytorch.overlap import OverlappedGradients
from cohort.worker.pytorch.regather import IncompleteShardsError
from cohort.worker.pytorch.sharded import (
    GuardedComms,
    Held,
    Shard,
    ShardedModel,
    ShardedState,
    accumulate,
    blob_of,
    from_blob,
    optimizer_settings,
    world_mesh,
)
from cohort.worker.pytorch.staging import Landing, lands_later, staging_for
from cohort.worker.pytorch.tree import TreeSum

log = logging.getLogger("cohort.torch")
BACKEND_ENV = "COHORT_TORCH_BACKEND"
"""Where a script that names no backend finds one (gloo, nccl); unset: through Redis."""
SHARD_GROUP_ENV = "COHORT_SHARD_GROUP"
"""Where a script that names no shard group finds one: ranks per HSDP copy of the model."""
COMPRESSION_ENV = "COHORT_COMPRESSION"
"""Where a script that names no compression finds one: int8, powersgd or powersgd:RANK."""


def compression_setting(
    compression: Compression | None, rank: int
) -> tuple[Compression | None, int]:
    """The compression `wrap` names, else what $COHORT_COMPRESSION says (int8, powersgd or
    powersgd:RANK), with its rank; ValueError names a rank that is not an integer."""
    if compression is not None or not os.environ.get(COMPRESSION_ENV):
        return compression, rank
    setting = os.environ[COMPRESSION_ENV]
    named, _, rank_text = setting.partition(":")
    try:
        rank = int(rank_text) if rank_text else rank
    except ValueError:
        raise InvalidValueError(
            f"${COMPRESSION_ENV}={setting!r}: the rank after ':' must be an integer"
        ) from None
    return named, rank  # type: ignore[return-value]  # compressor() checks the name


def shard_group_setting(
    shard_group: int | None, sharded: bool, config: JobConfig | None = None
) -> int | None:
    """The ranks per HSDP shard group `wrap` names, else what $COHORT_SHARD_GROUP says, else
    the job's (`--shard-group`, journaled in `config`); None: FSDP over every rank.
    InvalidValueError names a value that is not a positive integer, one given without
    `shard=`, one the job's disagrees with, and a rank that does not shard in a job that
    does (every rank of a job trains the same way)."""
    named = f"wrap(shard_group={shard_group!r})"
    if shard_group is None and os.environ.get(SHARD_GROUP_ENV):
        named = f"${SHARD_GROUP_ENV}={os.environ[SHARD_GROUP_ENV]!r}"
        try:
            shard_group = int(os.environ[SHARD_GROUP_ENV])
        except ValueError:
            shard_group = 0
    journaled = config.shard_group if config is not None else None
    if journaled is not None:
        _check_journaled_group(journaled, shard_group, named, sharded)
        return journaled
    if shard_group is None:
        return None
    if isinstance(shard_group, bool) or not isinstance(shard_group, int) or shard_group < 1:
        raise InvalidValueError(
            f"{named}: give the ranks each copy of the model is sharded over, a positive "
            "integer (HSDP, docs/sharded.md)"
        )
    if not sharded:
        raise InvalidValueError(
            f"{named} without shard=...: shard groups are of a sharded model; give wrap a "
            "shard function too (docs/sharded.md)"
        )
    return shard_group


def _check_journaled_group(journaled: int, given: int | None, named: str, sharded: bool) -> None:
    """A rank of a job sharded in groups of `journaled` (`--shard-group`) must shard, in
    groups of that size."""
    if not sharded:
        raise InvalidValueError(
            f"the job shards its model in groups of {journaled} ranks (--shard-group "
            f"{journaled}), but this rank's wrap has no shard=...: every rank of a job trains "
            "the same way; give wrap the shard function (docs/sharded.md), or run the job "
            "without --shard-group"
        )
    if given is not None and given != journaled:
        raise InvalidValueError(
            f"{named}, but the job shards in groups of {journaled} ranks (--shard-group "
            f"{journaled}): leave shard_group unset to take the job's, or start the job with "
            f"--shard-group {given}"
        )


class TorchState:
    """A model, its optimizer, an LR scheduler, a GradScaler and any extra state, as one
    training state."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        extra: MutableMapping[str, Any] | None = None,
        scaler: Any = None,
    ) -> None:
        self.model = plain_module(model)
        """The module itself, also when the script compiled it first: its state_dict keys
        are the plain model's (no `_orig_mod.`), in checkpoints and `job.save` alike."""
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.extra = extra
        """The script's own dict, not a copy: what it changes is what travels, and what a
        world or checkpoint brings is what it reads."""
        self.exact = ExactSum()
        """The scales of exact gradient sums through Redis (worker/pytorch/exact.py): they
        follow the steps' sums, and travel with the weights (gloo and NCCL sum along a tree,
        which has none)."""
        self.initial = self.snapshot()
        self._held: tuple[Any, list[dict[str, Any]], Any] | None = None
        self._held_buffers: list[torch.Tensor] = []

    def _extra(self) -> dict[str, Any]:
        state: dict[str, Any] = rng_states()
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        if self.extra is not None:
            state["user"] = self.extra
        if self.exact.exponents is not None:
            state["exact"] = self.exact.state_dict()
        return state

    def _take(self, extra: Mapping[str, Any]) -> None:
        take_rng_states(extra)
        if self.scheduler is not None and "scheduler" in extra:
            self.scheduler.load_state_dict(extra["scheduler"])
        if self.scaler is not None and "scaler" in extra:
            self.scaler.load_state_dict(extra["scaler"])
        self.exact.load_state_dict(extra.get("exact", {}))  # none: a first step's scales
        if self.extra is not None and "user" in extra:
            placed = {k: in_place(v, self.extra.get(k)) for k, v in extra["user"].items()}
            self.extra.clear()
            self.extra.update(placed)

    def digest(self) -> str:
        """The weights digest, computed on the weights' device (worker/pytorch/digests.py)."""
        return weights_digest(self.model.state_dict())

    def holds(self, digest: str) -> bool:
        """Whether the weights are those of `digest`: this version's digest, or the one a
        checkpoint journaled by an earlier version carries (the bytes' sha256)."""
        return self.digest() == digest or bytes_digest(self.model.state_dict()) == digest

    def broadcast(self, collective: Collective, step: int, world: int) -> None:
        mine = collective.world().rank == 0
        got = collective.broadcast(
            torch_sync.state_tensors(self.model, self.optimizer, self._extra()) if mine else None,
            root=0,
            step=torch_sync.call_id(step, torch_sync.STATE),
            world=world,
        )
        if not mine:
            self._take(torch_sync.load_state_tensors(self.model, self.optimizer, got))

    def snapshot(self) -> bytes:
        return torch_sync.state_blob(self.model, self.optimizer, self._extra())

    def spread(self, handover: Handover, chief: bool) -> None:
        """rank 0's state to every rank of the world, through its process group."""
        if chief:
            handover.state(*torch_sync.state_parts(self.model, self.optimizer, self._extra()))
            return
        meta, tensors = handover.state(None, b"")
        self._take(torch_sync.load_state_parts(self.model, self.optimizer, meta, tensors))

    def capture(self) -> Callable[[], bytes]:
        """`snapshot`'s bytes of the state as it is now, packed when called (by the
        checkpoint writer): the tensors are copied now, a GPU's without waiting."""
        return torch_sync.state_capture(self.model, self.optimizer, self._extra())

    def load(self, blob: bytes) -> None:
        if shards.is_manifest(blob):
            raise CheckpointError(
                "the checkpoint holds a sharded model's state (its shards' manifest): train "
                "it with job.wrap(model, optimizer, shard=...) (docs/sharded.md)"
            )
        self._take(torch_sync.load_state_blob(self.model, self.optimizer, blob))

    def reset(self) -> None:
        self.load(self.initial)

    def hold(self) -> None:
        """As a step begins: remember the model's buffers (its forwards move BatchNorm's
        statistics), where the scheduler is, the optimizer's settings it changes (learning
        rates, momenta), and the GradScaler's scale and growth count, so that `unwind` can
        put them back."""
        self._held_buffers = [b.detach().clone() for _, b in torch_sync.state_buffers(self.model)]
        if self.scheduler is None and self.scaler is None:
            return
        groups = [
            {k: v.clone() if torch.is_tensor(v) else v for k, v in group.items() if k != "params"}
            for group in self.optimizer.param_groups
        ]
        scheduled = copy.deepcopy(self.scheduler.state_dict()) if self.scheduler else None
        self._held = (scheduled, groups, [t.clone() for t in _scaler_tensors(self.scaler)])

    def unwind(self) -> None:
        """The step was cut short by a world change and comes again: a scheduler step the
        script took after its `optimizer.step()` (which applied nothing) is undone, so the
        schedule counts applied steps only, as in a run without the failure; so is the
        scaler's update of a step its world did not finish; so are the buffers its forwards
        moved, which a new world's rank 0 sends and whose digest the journal checks."""
        self.restore_buffers()
        if self._held is None:
            return
        scheduled, groups, scaled = self._held
        if scheduled is not None:
            self.scheduler.load_state_dict(copy.deepcopy(scheduled))
        for group, held in zip(self.optimizer.param_groups, groups, strict=True):
            group.update(held)
        live = _scaler_tensors(self.scaler)
        if len(live) == len(scaled):  # else the scaler began in this step: as it began
            for now, then in zip(live, scaled, strict=True):
                now.copy_(then)

    def restore_buffers(self) -> None:
        """The model's buffers as the step began (`hold`): a forward that must leave no trace
        (a cut-short step's, an empty share's) moved them."""
        buffers = torch_sync.state_buffers(self.model)
        if len(buffers) != len(self._held_buffers):
            return  # the model gained or lost buffers since: nothing to put back
        with torch.no_grad():
            for (_, now), then in zip(buffers, self._held_buffers, strict=True):
                now.copy_(then)


class ShardedTorchState(TorchState):
    """A `TorchState` whose model is sharded anew in each world (`wrap(shard=...)`): the
    whole state is rank 0's between a load and the world's start, spread over the world's
    group as it begins (`enter`), and gathered on rank 0 for a checkpoint; the digest is the
    whole model's (worker/pytorch/sharded.py)."""

    def __init__(self, sharded: ShardedState, scheduler: Any, extra: Any, scaler: Any) -> None:
        self.sharded = sharded
        self._pending_extra: dict[str, Any] | None = None
        super().__init__(sharded.template, sharded.optimizer, scheduler, extra, scaler)

    def digest(self) -> str | None:  # type: ignore[override]
        """The whole model's digest (a gather: every rank of the world calls it); None where
        a lost peer broke the gather: the step reports none, and its world is over."""
        try:
            return self.sharded.digest()
        except RuntimeError as exc:
            log.warning("the sharded weights could not be gathered for a digest: %s", exc)
            return None

    def holds(self, digest: str) -> bool:
        """Whether the whole model is that of `digest` (sharded jobs came after the bytes'
        digest: no earlier one to accept)."""
        return self.digest() == digest

    def snapshot(self) -> bytes:
        """rank 0's whole state (b"" on the others, or where a lost peer broke the gather);
        every rank of a world must call it (it gathers)."""
        try:
            held = self.sharded.whole_state()
        except RuntimeError as exc:
            log.warning("the sharded state could not be gathered: %s", exc)
            return b""
        return b"" if held is None else blob_of(*held, self._extra())

    def load(self, blob: bytes) -> None:
        model, optim, extra = from_blob(blob)
        self.sharded.pending = (model, optim)
        self._pending_extra = extra

    def load_checkpoint(self, uri: str, payload: bytes) -> None:
        """The state of checkpoint `uri`: a whole one's, or a sharded one's manifest with
        every shard file checked (worker/pytorch/shards.py), read by each rank of the
        world it starts."""
        if not shards.is_manifest(payload):
            self.load(payload)
            return
        found = shards.read_manifest(uri, payload)
        self.sharded.pending = found
        self._pending_extra = from_blob(found.blob)[2]

    def save_shards(
        self, step_uri: str, world: int, guarded: Callable[[Callable[[Any], Any]], Any]
    ) -> Callable[[], bytes] | None:
        """Every rank's shards written beside checkpoint file `step_uri` now (a collective:
        every rank of the world calls it; `guarded` runs it on the world's group under the
        watchdog); on rank 0, the checkpoint's payload (the shards' manifest) when called,
        on the writer's thread; None elsewhere. RuntimeError where a lost peer broke the
        writing, WorldChangedError where the world ended first."""
        module = self.sharded.module
        assert module is not None
        relative = shards.relative_location(step_uri, world)
        location = shards.absolute(step_uri, relative)
        files: list[str] = guarded(
            lambda group: shards.save(module, self.optimizer, location, group)
        )
        if torch.distributed.get_rank() != 0:
            return None
        groups = optimizer_settings(self.optimizer, self.sharded.names)
        blob = blob_of(Held({}), Held({"state": {}, "param_groups": groups}), self._extra())
        return lambda: shards.manifest(location, relative, files, blob)

    def pending_model(self) -> dict[str, Any] | None:
        return self.sharded.pending_model()

    def enter(
        self,
        mesh: Any,
        comms: GuardedComms,
        handover_for: Callable[[int], Handover],
        regathering: bool,
    ) -> None:
        extra = self._pending_extra if self._pending_extra is not None else self._extra()
        self._take(self.sharded.enter(mesh, comms, extra, handover_for, regathering))
        self._pending_extra = None
        assert self.sharded.module is not None
        self.model = self.sharded.module


def weights_file(model: torch.nn.Module) -> bytes:
    """`model`'s state_dict as `torch.save` writes it (`torch.load` reads it back), its
    tensors copied to the CPU: a file of the live tensors would name their device (cuda:0),
    which a machine without it cannot load."""
    weights = model.state_dict()
    on_cpu = collections.OrderedDict(
        (k, v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v)
        for k, v in weights.items()
    )
    on_cpu._metadata = getattr(weights, "_metadata", None)  # type: ignore[attr-defined]
    out = io.BytesIO()
    torch.save(on_cpu, out)
    return out.getvalue()


def rng_states(cuda: Any = None) -> dict[str, Any]:
    """torch's generator states that travel with the training state: the CPU's, and the
    current CUDA device's where this process has initialised CUDA (dropout on a GPU draws
    from it; asking an uninitialised process would open a context on every GPU)."""
    cuda = torch.cuda if cuda is None else cuda
    states: dict[str, Any] = {"rng": torch.get_rng_state()}
    if cuda.is_available() and cuda.is_initialized():
        states["cuda_rng"] = cuda.get_rng_state()
    return states


def take_rng_states(states: Mapping[str, Any], cuda: Any = None) -> None:
    """Set the generators `rng_states` sent; a CUDA state only where this process uses
    CUDA (a GPU job's checkpoint loads on a CPU-only machine, without it)."""
    cuda = torch.cuda if cuda is None else cuda
    if "rng" in states:
        torch.set_rng_state(states["rng"])
    if "cuda_rng" in states and cuda.is_available() and cuda.is_initialized():
        cuda.set_rng_state(states["cuda_rng"])


def in_place(value: Any, live: Any) -> Any:
    """`value` (from a world's rank 0 or a checkpoint, on the CPU) where this process keeps
    `live`, the value of the same place in the script's `extra`: a tensor of the same shape
    and dtype is copied into the live one (the script's references to it, e.g. an EMA
    model's own state_dict, see the new values); another lands on the live one's device;
    dicts and lists are placed item by item."""
    if torch.is_tensor(value) and torch.is_tensor(live):
        if value.shape == live.shape and value.dtype == live.dtype:
            with torch.no_grad():
                live.copy_(value)
            return live
        return value.to(live.device)
    if isinstance(value, dict) and isinstance(live, Mapping):
        return {k: in_place(v, live.get(k)) for k, v in value.items()}
    if isinstance(value, list | tuple) and isinstance(live, list | tuple):
        if len(value) != len(live):
            return value
        placed = [in_place(v, w) for v, w in zip(value, live, strict=True)]
        return placed if isinstance(value, list) else tuple(placed)
    return value


def _scaler_tensors(scaler: Any) -> tuple[torch.Tensor, ...]:
    """A GradScaler's scale and growth count, as the tensors it keeps on its device (read
    as numbers, through its state_dict, they would wait for the GPU at every step); none
    before its first scale."""
    tensors = (getattr(scaler, "_scale", None), getattr(scaler, "_growth_tracker", None))
    return tuple(t for t in tensors if t is not None)


def plain_module(model: torch.nn.Module) -> torch.nn.Module:
    """The module a `torch.compile` wrapper (an OptimizedModule) holds, else `model`."""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, torch.nn.Module) else model


class ElasticJob(Elastic):
    """Elastic data-parallel PyTorch training; see the module docstring for the loop.

    `backend=None` (and no $COHORT_TORCH_BACKEND): gradients are averaged through Redis in
    `optimizer.step()`. `backend="gloo"` (or "nccl"): every world gets a torch.distributed
    process group (`ElasticProcessGroup`: a fresh store per world, no store host to lose) and the
    model runs under `DistributedDataParallel`, whose allreduce overlaps backward; a
    watchdog following the journal completes a collective a dead peer would hang, and the
    step is skipped.
    """

    def __init__(self, job: str | None = None, backend: str | None = None, **options: Any):
        super().__init__(job, **options)
        backend = backend or os.environ.get(BACKEND_ENV) or None
        self.device = rank_device(self.local_rank)
        """The device this rank trains on (`model.to(job.device)`): its own GPU, which is
        CUDA's current device from now on, or the CPU (worker/pytorch/devices.py)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self._staging = staging_for(self.device)
        """How gradients reach the host for Redis and come back (pinned buffers on CUDA)."""
        self._steps: Iterator[Step | EpochEnd] = self._walk()
        self._peeked: Step | EpochEnd | None = None
        self.backend = backend
        self.rdzv: Any = None
        self.ddp: Any = None
        self._mean: GuardedMean | None = None
        """The comm hook's state in the current world's DDP."""
        self._inside_ddp = False
        self._called: torch.nn.Module | None = None
        """The module the script calls (`wrap`'s, compiled or not): each world's DDP wraps
        it, so a compiled forward runs under DDP and is compiled once for every world."""
        self.overlapped: OverlappedGradients | None = None
        self._gate: Callable[[threading.Event], bool] = lambda cancelled: True
        self._launch: bool | None = None
        self._rebuilt = False
        """Whether the current world's DDP agreed on its buckets (`_buckets_rebuilt`)."""
        self._seed: int | None = None
        """`seed_steps`'s seed: each step's draws then depend on it, the step and the rank."""
        self.micro: MicroBatches | None = None
        """The current step's micro-batches and the gradients parked between them (`wrap`)."""
        self._averaged: tuple[Step, bool] | None = None
        """The step whose gradients were made the world's mean, and whether that held."""
        self._warned_schedule = False
        self._idle_world = 0
        """The world in which this rank last said it has no micro-batch of a step (exact sums)."""
        self._loaders: dict[int, tuple[Any, StepLoader]] = {}
        self.compressor: feedback.Compressor | None = None
        """Set by `wrap(compression=...)`; its state restarts at every world start."""
        self._bucket_bytes = torch_sync.DEFAULT_BUCKET_BYTES
        self._optimizer_step: Callable[..., Any] = lambda *args, **kwargs: None
        """The optimizer's own step, which `wrap` puts cohort's in front of."""
        self._comms: GuardedComms | None = None
        """A sharded model's FSDP collectives in the current world (`wrap(shard=...)`)."""
        self._final_state: dict[str, Any] | None = None
        """A sharded model's whole state, gathered on rank 0 as the job ended."""
        if backend is not None:
            from cohort.worker.pytorch.dist import ElasticProcessGroup

            self.rdzv = ElasticProcessGroup(self.worker, self.conn, self.worker.job)

    def wrap(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        extra: MutableMapping[str, Any] | None = None,
        bucket_bytes: int = torch_sync.DEFAULT_BUCKET_BYTES,
        overlap: bool = True,
        compression: Compression | None = None,
        rank: int = DEFAULT_RANK,
        scaler: Any = None,
        shard: Shard | None = None,
        shard_group: int | None = None,
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """Train `model` with `optimizer` (and `scheduler`, a `torch.amp.GradScaler`, and
        `extra` state that travels with them, e.g. an EMA or counters: a dict changed in
        place) on every rank alike.

        As with DDP, the gradients are the world's mean once the step's last `backward()`
        returns (`job.sync_gradients` says whether this micro-batch is that one; before it
        the script sees zeros), so `clip_grad_norm_` and NaN checks see the global gradient.
        The scheduler steps once per applied update, the scaler's `unscale_`, `step` and
        `update` act in the last micro-batch only, whatever the number of micro-batches.

        Through Redis, gradients are averaged bucket by bucket while backward runs
        (`overlap=False`: all after backward, as gradient accumulation over several
        backward passes per step needs). `compression="powersgd"` (rank-`rank` factors) or
        "int8" sends fewer bytes, with error feedback, after backward; every rank applies
        the same update (docs/compression.md). Through Redis only: a `backend` refuses it.
        Unset, $COHORT_COMPRESSION says (int8, powersgd or powersgd:RANK).

        `shard` (with a backend): FSDP2 over every rank, e.g. `shard=lambda module, mesh:
        fully_shard(module, mesh=mesh)`; cohort calls it in each world on a fresh copy of
        `model` with a DeviceMesh of the world's ranks, and the returned model calls that
        world's sharded module. `shard_group` (or $COHORT_SHARD_GROUP): HSDP, that many
        consecutive ranks sharding each copy of the model (docs/sharded.md)."""
        refuse_sharded(sharded_parameters(model), self.backend)
        group = shard_group_setting(shard_group, shard is not None, self.worker.view.config)
        self.compressor = self._compressor(*compression_setting(compression, rank))
        if shard is not None:
            return self._wrap_sharded(model, optimizer, shard, group, scheduler, extra, scaler)
        self.attach(state := TorchState(model, optimizer, scheduler, extra, scaler))
        self._bucket_bytes = bucket_bytes
        config = self.worker.view.config
        micro = self.micro = self._micro_for(state, config)
        if scheduler is not None:
            gate_scheduler(scheduler, micro)
        if scaler is not None:
            gate_scaler(scaler, micro)
        accumulating = config is not None and config.global_batch is not None
        if self.backend is None and overlap and not accumulating and self.compressor is None:
            self.overlapped = OverlappedGradients(
                model, self.collective, bucket_bytes, self._staging
            )
        self._optimizer_step = optimizer.step
        take_over(optimizer, self._step_optimizer)
        if self.backend is not None:
            self._called = _under_ddp(model, self)
            return self._called, optimizer
        return model, optimizer

    def _micro_for(self, state: TorchState, config: Any) -> MicroBatches:
        """The micro-batches of `state`'s model, into exact sums where the job's are:
        along a fixed tree on gloo and NCCL, in integers through Redis."""
        exact: ExactSum | TreeSum | None = None
        if config is not None and config.exact:
            exact = TreeSum() if self.backend is not None else state.exact
        refuse_compressed_exact_sums(exact is not None, self.compressor is not None)
        return MicroBatches(state.model, self._last_backward_ended, exact)

    def _wrap_sharded(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        shard: Shard,
        group: int | None,
        scheduler: Any,
        extra: MutableMapping[str, Any] | None,
        scaler: Any,
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """`wrap(shard=...)`: the model is sharded in each world (`_joined_world`); no DDP,
        no micro-batch parking: FSDP reduces its own gradients, once per step, and keeps
        what the micro-batches before the last accumulate (`_weigh`)."""
        config = self.worker.view.config
        refuse_shard_setting(self.backend, self.compressor is not None, config)
        say_float_sums(config)
        template = plain_module(model)
        wrapper = ShardedModel(template)
        sharded = ShardedState(template, wrapper, optimizer, shard, group)
        state = ShardedTorchState(sharded, scheduler, extra, scaler)
        self.attach(state)  # type: ignore[arg-type]  # a digest may be None: `_report` sends none
        self.micro = MicroBatches(torch.nn.Module(), self._last_backward_ended)  # counts only
        if scheduler is not None:
            gate_scheduler(scheduler, self.micro)
        if scaler is not None:
            gate_scaler(scaler, self.micro)
        self._optimizer_step = optimizer.step
        take_over(optimizer, self._step_optimizer)
        return wrapper, optimizer

    def _final_weights(self) -> bytes:
        """What `job.save` writes: the model's `weights_file` (a sharded one's gathered
        whole as the job ended, or the final checkpoint's)."""
        state = self.state
        if isinstance(state, ShardedTorchState):
            whole = self._final_state or state.pending_model()
            return weights_file(Held(whole))  # type: ignore[arg-type]
        assert isinstance(state, TorchState)
        return weights_file(state.model)

    def _ended(self, end: Any) -> None:
        """As the base job's; a sharded model trained to the end is gathered whole on rank
        0 now, while its world's group stands (every rank of it comes here): `job.save`
        writes it."""
        super()._ended(end)
        state = self.state
        trained = self._given is not None and self._given.step == end.step
        if isinstance(state, ShardedTorchState) and trained and state.sharded.module is not None:
            try:
                held = state.sharded.whole_state()
            except RuntimeError as exc:  # a rank of the last world is gone
                log.warning("%s: the final weights could not be gathered: %s", self.worker_id,
                            exc)  # fmt: skip
                self._final = False
                return
            self._final_state = held[0].state if held is not None else None

    def seed_steps(self, seed: int) -> None:
        """From now on, begin every step (and every retry of one) with torch's generators
        seeded from `seed`, the step and this rank (`step_seed`): a step's dropout and other
        draws then depend on where it is, not on the steps before it, so a step redone
        after a rewind, in a world of the same size, draws what it drew the first time
        (docs/guarantees.md, "Randomness"). With exact sums each micro-batch is seeded from
        its unit (its place in the step's global batch) instead of the rank, so it draws the
        same in a world of any size. `torch.manual_seed` seeds every CUDA device's
        generator too."""
        self._seed = seed

    def shard(self, data: Any) -> Any:
        """This rank's part (see the base job's `shard`) of a dataset, as a
        `torch.utils.data.Subset`, or of a DataLoader, as a loader of the same settings
        over that part (batch size, collate function, workers; never shuffled, nothing
        dropped unless the loader drops its last batch). A count gives indices."""
        if not isinstance(data, torch.utils.data.DataLoader):
            if isinstance(data, int) or not hasattr(data, "__getitem__"):
                return super().shard(data)
            return torch.utils.data.Subset(data, super().shard(data).tolist())
        part = torch.utils.data.Subset(data.dataset, super().shard(data.dataset).tolist())
        settings = {
            name: getattr(data, name)
            for name in (
                "batch_size", "num_workers", "collate_fn", "pin_memory", "drop_last", "timeout",
                "worker_init_fn", "multiprocessing_context", "persistent_workers",
            )
        }  # fmt: skip
        if data.num_workers:
            settings["prefetch_factor"] = data.prefetch_factor
        return torch.utils.data.DataLoader(part, shuffle=False, **settings)

    def _numbers(self, value: Any, how: str) -> tuple[list[float], Callable[[list[float]], Any]]:
        """A tensor's numbers for `mean`/`sum`/`max`, given back as a tensor of its shape on
        its device (a mean of integers as float64); anything else as the base job does."""
        if not torch.is_tensor(value):
            return super()._numbers(value, how)
        shape, device = value.shape, value.device
        exact = value.dtype.is_floating_point or how != "mean"
        dtype = value.dtype if exact else torch.float64
        numbers = value.detach().to("cpu", torch.float64).reshape(-1).tolist()
        reducible(numbers, how)

        def rebuild(got: list[float]) -> torch.Tensor:
            # NaN (a reduction cut short) has no integer: it comes back as float64
            finite = dtype.is_floating_point or all(math.isfinite(x) for x in got)
            kind = dtype if finite else torch.float64
            return torch.tensor(got, dtype=kind, device=device).reshape(shape)

        return numbers, rebuild

    def _figure(self, name: str, value: Any) -> Any:
        """A one-number CUDA tensor `job.record` keeps as a copy on its way to the host,
        read at the report; anything else is read now, as the base job does."""
        if torch.is_tensor(value) and lands_later(value.device.type, value.numel()):
            return Landing(value)
        return super()._figure(name, value)

    def _compressor(self, compression: Compression | None, rank: int) -> feedback.Compressor | None:
        """The compressor `wrap` was asked for; ValueError if the gradients do not go
        through Redis."""
        compressor = feedback.compressor(compression, rank)
        if compressor is not None and self.backend is not None:
            raise InvalidValueError(
                f"compression {compression!r} works through Redis; backend {self.backend!r} "
                "averages with torch.distributed (leave backend unset)"
            )
        return compressor

    @property
    def stand_in(self) -> bool:
        """Whether the batch the script trains now is a stand-in: this rank has no sample in
        the step (a constant global batch with fewer micro-batches than the world has ranks,
        or an epoch's last step), so it trains the data set's first sample, twice over, and
        its gradients count for nothing. The script's whole step runs on it as on every rank
        (clipping, scaler, scheduler alike); a script that counts what it trains on skips it
        (`if not job.stand_in`). What `record` is told meanwhile is dropped."""
        micro = self.micro
        return micro is not None and micro.inside and micro.standing_in

    def record(self, loss: Any = None, **figures: Any) -> None:
        if not self.stand_in:  # a stand-in's loss is not this rank's training
            super().record(loss, **figures)

    @property
    def sync_gradients(self) -> bool:
        """Whether this micro-batch is its step's last: after its `backward()` the gradients
        are the world's mean and `optimizer.step()` applies the update (Accelerate's name).
        Before it the script sees zero gradients and its `optimizer.step()` does nothing;
        outside `job.batches()`, True."""
        return self.micro is None or self.micro.syncing

    def _step_optimizer(self, *args: Any, **kwargs: Any) -> Any:
        """The script's `optimizer.step()`: in a step's last micro-batch, the optimizer's own
        step on the gradients' mean over the world (made as the last backward ended, or now);
        nothing before the last micro-batch, nor if the world changed meanwhile (the step is
        retried in the next world)."""
        current = self.current
        if current is None:
            raise WorkerError("optimizer.step() outside a step of job.batches()")
        micro = self.micro
        if micro is not None and not micro.last:
            return None  # the update comes after the step's last micro-batch
        if not self._averaged_for(current):
            return None
        result = self._optimizer_step(*args, **kwargs)
        if micro is not None:
            micro.applied = True
        return result

    def _averaged_for(self, current: Step) -> bool:
        """Whether `current`'s gradients are the world's mean, made so now if the step's
        last backward did not already (a script that ran none, or a route that averages
        later); False, and the step aborted, when its world is over."""
        if self._averaged is None or self._averaged[0] is not current:
            if self.micro is not None:
                self.micro.restore()  # micro-batches' gradients parked with no backward after
            self._averaged = (current, self._gradients_averaged(current))
        return self._averaged[1]

    def _last_backward_ended(self) -> None:
        """The step's last backward ended (an autograd callback, before `backward()`
        returns): through Redis, the gradients become the world's mean now, so the script's
        code after backward sees them, as under DDP (whose reducer ran already)."""
        current = self.current
        exact = self.micro is not None and self.micro.exact is not None
        if current is None or (self.backend is not None and not exact):
            return
        if self._averaged is not None and self._averaged[0] is current:
            raise AccumulationError(
                "a second backward() in a step's last micro-batch, after its gradients were "
                "averaged over the world: add the losses and call backward() once (in the "
                "micro-batches before it, several backward passes accumulate)"
            )
        self._averaged = (current, self._gradients_averaged(current))

    def _gradients_averaged(self, current: Step) -> bool:
        """Make the gradients (and buffers) the world's mean for `current`; False (and the
        step aborted) when its world is over or the job moved on. With exact sums, on gloo
        and NCCL the step's sums along the tree (worker/pytorch/tree.py), in two rounds of
        the step's guarded collectives; through Redis its integer sums (exact.py)."""
        model = self._model()
        if self._comms is not None and self._comms.aborted:
            self.abort()  # FSDP's collectives of this step were cut short: nothing applies
            return False
        if self.micro is not None and self.micro.standing_in:
            state = self.state
            assert isinstance(state, TorchState)
            state.restore_buffers()  # as the step began: a stand-in's forward moved them
        exact = self.micro.exact if self.micro is not None else None
        tree = exact if isinstance(exact, TreeSum) else None
        sums = exact if isinstance(exact, ExactSum) else None
        payload = None if sums is None else sums.payload(self._gradients_device())
        if self.backend is None and exact is None:
            self._scale(model, self._last_factor(current))
        mean = self._mean
        if tree is not None and not self._tree_gathered(tree, current):
            return False
        buffers = self._reduce_buffers(mean, model, current) if mean is not None else None
        if (mean is not None and not mean.settle(current.step)) or not self.before_apply():
            self._cut_short()  # a dead peer's world, or the job moved on: built again
            return False
        if buffers is not None:
            torch_sync.take_buffer_sums(*buffers)
        if self.backend is None:
            try:
                payload = self._average_gradients(model, current, self._bucket_bytes, payload)
                torch_sync.sync_buffers(model, self.collective, current.step,
                                        _samples(current), current.world)  # fmt: skip
            except WorldChangedError:
                self.abort()  # no rank applies a step its world did not finish
                return False
        if tree is not None:
            tree.decode()
        if sums is not None and payload is not None:
            self._take_exact_sums(sums, current, payload)
        return True

    def _tree_gathered(self, tree: TreeSum, current: Step) -> bool:
        """The tree's first round settled (the all-to-alls, those the last backward did not
        start sent now) and its second started (the gathers); False (the step aborted)
        where the world ended first."""
        mean = self._mean
        assert mean is not None
        tree.send_rest()
        if not mean.settle(current.step):
            self._cut_short()
            return False
        tree.gather()
        return True

    def _cut_short(self) -> None:
        if self.overlapped is not None:
            self.overlapped.cancel()
        self.abort()

    def _gradients_device(self) -> torch.device:
        """Where the trained parameters are (their gradients', and the exact sums')."""
        params = self.micro.trained if self.micro is not None else ()
        return params[0].device if params else self.device

    def _take_exact_sums(self, exact: ExactSum, current: Step, summed: torch.Tensor) -> None:
        """The world's exact sums of `current` become every rank's gradients, written into
        the tensors the script (or a captured graph) holds: the same bits whatever the
        world size. The next step's scales follow them."""
        assert self.micro is not None
        grads = []
        for param in self.micro.trained:
            if param.grad is None:
                param.grad = torch.empty_like(param)
            grads.append(param.grad)
        exact.decode(summed, grads)
        exact.commit()
        if exact.saturated:
            log.warning("step %d: %d tensors of its micro-batches' gradients went beyond "
                        "the exact sums' range and were clamped to it; the next step's range "
                        "follows", current.step, exact.saturated)  # fmt: skip

    def abort(self) -> None:
        """The step was cut short (see the base job's). Its exact sums' payload is dropped:
        a collective abandoned with its world may still write into it."""
        super().abort()
        if self.micro is not None and self.micro.exact is not None:
            self.micro.exact.discard()

    @staticmethod
    def _reduce_buffers(
        mean: GuardedMean, model: torch.nn.Module, current: Step
    ) -> tuple[list[tuple[str, torch.Tensor]], torch.Tensor] | None:
        """Under DDP: start the sums that make every rank's buffers the world's at the
        step's end, in the step's collectives, so `settle` fences them with its gradients
        (before the update applies: an aborted sum aborts the step). Floating-point ones
        (BatchNorm's running statistics) become their mean weighted by each rank's samples,
        others (`num_batches_tracked`) rank 0's; a model without buffers makes no call
        (docs/elastic-api.md, "Buffers"). Through Redis, `sync_buffers` does the same."""
        buffers = torch_sync.state_buffers(model)
        if not buffers:
            return None
        sums = torch_sync.buffer_sums(buffers, _samples(current), chief=current.rank == 0)
        mean.reduce_also(sums)
        return buffers, sums

    def _model(self) -> torch.nn.Module:
        state = self.state
        assert isinstance(state, TorchState)
        return state.model

    def _joined_world(self, assignment: Any) -> None:
        """With a backend: the world's process group, and the model under DDP in it. With
        compression: its state restarts from the world's first step, alike on every rank."""
        if self.compressor is not None:
            self.compressor.reset(assignment.start_step)
        if self.backend is None:
            return
        if isinstance(self.state, ShardedTorchState):
            self._join_sharded(assignment)
            return
        from torch.nn.parallel import DistributedDataParallel

        from cohort.worker.pytorch.dist import ddp_devices, group_options

        self.ddp = self._mean = None  # the old world's reducer and hooks go before new ones
        self._rebuilt = False
        self.rdzv.init_process_group(self.backend, **group_options(self.backend, self.device))
        self._hand_over(assignment)
        state = self.state
        assert isinstance(state, TorchState)
        assert self._called is not None
        devices = {p.device for p in state.model.parameters()}
        device = next(iter(devices)) if devices else self.device
        if self.micro is not None and self.micro.exact is not None:
            # exact sums: along the tree, through the guarded collectives, bucket by bucket as
            # the step's last backward makes them (the rest in `_gradients_averaged`); DDP's
            # buckets would not be exact
            assert isinstance(self.micro.exact, TreeSum)
            self._mean = GuardedMean(self.rdzv, self._may_launch, completion_of(device))
            self.micro.exact.world(self._mean.also, assignment.rank, assignment.world_size,
                                   self._bucket_bytes)  # fmt: skip
            return
        # The state was handed over already; buffers travel with it at each world start, and
        # are made the world's at each step's end (`_average_buffers`), not broadcast before
        # each forward: DDP's broadcast is not guarded, and would leave each rank's own
        # statistics of the last forward in the step's digest. The gradients are views into
        # DDP's buckets: the comm hook's division is then the only
        # pass over them besides the allreduce (DDP's own hook fuses it with a copy in, and
        # copies the result back out).
        self.ddp = DistributedDataParallel(
            self._called,
            init_sync=False,
            forward_sync_buffers=False,
            gradient_as_bucket_view=True,
            **ddp_devices(devices),
        )
        self._mean = GuardedMean(self.rdzv, self._may_launch, completion_of(device))
        self.ddp.register_comm_hook(self._mean, _guarded_allreduce)

    def _join_sharded(self, assignment: Any) -> None:
        """The world's process group and DeviceMesh, the model sharded over it and filled
        with rank 0's whole state; then every rank's digest of it against the journal's
        (a collective, so every rank computes it; `_check_weights` waits until here)."""
        from cohort.worker.pytorch.dist import group_options

        state = self.state
        assert isinstance(state, ShardedTorchState) and self.backend is not None
        world = self.rdzv.init_process_group(
            self.backend, **group_options(self.backend, self.device)
        )
        self._comms = GuardedComms(self.rdzv, self._may_launch, self._comms_step)
        weights = assignment.weights
        regathering = weights is not None and weights.source == "rank"
        try:
            mesh = world_mesh(self.device.type, world.size, world.version, state.sharded.group)
            self._comms.replicas = mesh.replicas
            state.enter(
                mesh.shards, self._comms, lambda src: self._handover(assignment, src), regathering
            )
            got = state.sharded.digest()
        except RuntimeError as exc:  # a peer died as the world began
            self.rdzv._world_changed(exc, assignment.start_step)
            raise
        except IncompleteShardsError as exc:  # a holder gave its shards up meanwhile
            log.warning("%s: %s; joining again, so that the job rewinds", self.worker_id, exc)
            self._join_again("a sharded world lost a rank's shards")
            raise WorldChangedError(assignment.start_step, assignment) from exc
        plans = [p for p in self.worker.view.plans if p.world_version == world.version]
        state.sharded.held = (
            (plans[0].ranks, world.rank % mesh.count, mesh.count) if plans else None
        )
        want = assignment.weights.digest if assignment.weights is not None else None
        if assignment.rank != 0 and want is not None and got != want:
            refuse_weights(self.worker, assignment, got)

    def _comms_step(self) -> int:
        current = self.current
        return current.step if current is not None else self.worker.next_step

    def _holds(self, digest: str) -> bool:
        state = self.state
        assert isinstance(state, TorchState)
        return state.holds(digest)

    def _take_state(self, assignment: Any) -> None:
        """As the base job's through Redis; with a backend, the world's process group carries
        the state once `_joined_world` made it (`_hand_over`, or a sharded model's `enter`)."""
        if self.backend is None:
            super()._take_state(assignment)

    def _hand_over(self, assignment: Any) -> None:
        """rank 0's state to every rank through the world's group (worker/pytorch/handover.py:
        on NCCL from GPU to GPU), then checked against the journal's digest."""
        state = self.state
        assert isinstance(state, TorchState)
        try:
            state.spread(self._handover(assignment), chief=assignment.rank == 0)
        except RuntimeError as exc:  # a peer died as the world began (gloo: at the issue)
            self.rdzv._world_changed(exc, assignment.start_step)
            raise
        self._check_weights(assignment)

    def _handover(self, assignment: Any, src: int = 0) -> Handover:
        """How this world's start carries rank `src`'s state: on NCCL between the GPUs."""
        carrier = self.device if self.backend == "nccl" else torch.device("cpu")
        return Handover(
            self.rdzv, carrier, self.device, completion_of(carrier), assignment.start_step, src
        )

    def _start_world(self, assignment: Any) -> bool:
        """As the base job's; a sharded model's state lives in the last world's shards.
        Where the journal says to start from a surviving rank's weights and a holder of each
        of the last world's shards is in this one (a rank joined; with HSDP, a copy of each
        shard is left), they are put together again as the world begins (worker/pytorch/
        regather.py). Where every holder of a shard was lost, this rank gives up its claim to
        the weights (leaves and joins again), and once every survivor did, the job rewinds to
        its last checkpoint (docs/sharded.md)."""
        weights = assignment.weights
        state = self.state
        if (
            isinstance(state, ShardedTorchState)
            and weights is not None
            and weights.source == "rank"
            and not self._regathers(state, assignment)
        ):
            log.warning(
                "%s: world %d would start from sharded weights of which a shard was lost; "
                "joining again, so that the job rewinds to its last checkpoint",
                self.worker_id, assignment.world_version,
            )  # fmt: skip
            self._join_again("a sharded world lost a rank's shards")
            return False
        return super()._start_world(assignment)

    def _join_again(self, reason: str) -> None:
        """As the base job's; a sharded rank's shards are no longer the lineage's."""
        if isinstance(self.state, ShardedTorchState):
            self.state.sharded.held = None
        super()._join_again(reason)

    def _regathers(self, state: ShardedTorchState, assignment: Any) -> bool:
        """Whether world `assignment` can start from the shards its ranks hold: of the world
        this process's shards are of, a rank holding each shard is in it (FSDP over every
        rank: every rank; HSDP: one of each shard's replicas); a process that holds none (a
        joiner) takes part in any."""
        plan = self.worker.view.plan
        if plan is None or plan.world_version != assignment.world_version:
            return True  # moved on: the next world decides
        held = state.sharded.held
        if held is None:
            return True
        ranks, _, count = held
        covered = {i % count for i, worker in enumerate(ranks) if worker in plan.ranks}
        return covered == set(range(count))

    def _copy_state(self) -> Callable[[], bytes] | None:
        """The tensors copied now (a GPU's into pinned memory, the host not waiting), packed
        on the checkpoint writer's thread. A sharded state is gathered now (every rank of
        the world calls it); gathered nowhere (a rank other than 0, or a gather a lost peer
        broke), it leaves no checkpoint to write. A broken gather leaves the group to the
        journal: the step after it starts no collective before the world is known over."""
        state = self.state
        if isinstance(state, ShardedTorchState):
            config = self.worker.view.config
            assert config is not None and config.checkpoint_uri is not None
            assert self._reported is not None  # a checkpoint is of the step reported last
            step_uri = storage.checkpoint_uri(config.checkpoint_uri, self._reported)
            assert self.rdzv is not None
            rdzv, step = self.rdzv, self._reported
            try:
                return state.save_shards(
                    step_uri, self.world, lambda body: rdzv.on_side(body, step)
                )
            except WorldChangedError:  # a peer lost, the world over before the write ended
                log.warning("the sharded checkpoint of step %d was not written: its world "
                            "ended first", step)  # fmt: skip
                return None
            except RuntimeError as exc:  # a peer lost as the shards were written
                log.warning("the sharded checkpoint of step %d was not written: %s",
                            self._reported, exc)  # fmt: skip
                assert self.rdzv is not None
                self.rdzv.ends_after_failure()  # the next step's collectives wait for it
                return None
        assert isinstance(state, TorchState)
        return state.capture()

    def _take_checkpoint(self, uri: str, payload: bytes) -> None:
        """As the base job's; a sharded model's checkpoint names its shards."""
        state = self.state
        if isinstance(state, ShardedTorchState):
            state.load_checkpoint(uri, payload)
            return
        super()._take_checkpoint(uri, payload)

    def close(self) -> None:
        """Leave the job (see the base job's `close`), then destroy the last world's process
        group (an NCCL one with works in flight is aborted first: dist.py)."""
        try:
            super().close()
        finally:
            if self.rdzv is not None:
                self.ddp = self._mean = None
                self.rdzv.close()

    def _buckets_rebuilt(self, ddp: Any) -> bool:
        """Under DDP, before a forward: DDP's one collective outside the comm hook, the
        bucket order its ranks agree on at their second forward, run here first (DDP's own
        call then finds it done). It blocks in gloo, which no abort breaks: it runs on a
        thread of its own, and a world the journal ends meanwhile leaves it behind. A peer
        that died breaks it, or hangs it until the journal says so: the step is then
        aborted (False), runs without DDP, and comes again in the next world."""
        if self._rebuilt or not torch.is_grad_enabled():
            return True
        done, failed = threading.Event(), []

        def rebuild() -> None:
            try:
                with current(self.device):
                    self._rebuilt = ddp.reducer._rebuild_buckets()
            except RuntimeError as error:  # gloo: "Connection closed by peer", "Read error"
                failed.append(error)
            finally:
                done.set()

        threading.Thread(target=rebuild, name="cohort-ddp-buckets", daemon=True).start()
        dog = self.rdzv.watchdog
        if dog.wait(done) and not failed:
            return True
        why = failed[0] if failed else "the journal ended the world first"
        log.warning("world %d broke as DDP agreed on its buckets: %s", self.world, why)
        while not dog.tripped.wait(POLL) and not self.stopping:
            pass  # until the journal ends the world: the step comes again in the next
        # The thread left behind holds the reducer's lock, which its hooks on the model's
        # parameters take in every backward: they go, or this step's backward would hang.
        ddp.reducer._remove_autograd_hooks()
        self.abort()
        if self._mean is not None:
            self._mean.aborted = True
        return False

    def _last_factor(self, current: Step) -> float:
        """What the gradients (W / m_last) are multiplied by before the ranks' mean, so the
        mean weighs every sample of the global batch alike: m_last * n / total, i.e. the
        step's weight (this rank's share times n) over its share, times m_last."""
        sizes = self.micro.sizes if self.micro is not None else ()
        mine = sum(sizes)
        return current.weight * sizes[-1] / mine if mine else 0.0

    @staticmethod
    def _scale(model: torch.nn.Module, factor: float) -> None:
        torch_sync.weigh_([p.grad for p in model.parameters() if p.grad is not None], factor)

    def _average_gradients(
        self,
        model: torch.nn.Module,
        current: Step,
        bucket_bytes: int,
        payload: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Through Redis: replace the gradients by their means over the world; or, with
        exact sums, the world's sum of `payload`, returned (WorldChangedError: aborted)."""
        if payload is not None:
            return torch_sync.exact_sum(self.collective, payload, current.step, current.world)
        if self.overlapped is not None:
            self.overlapped.finish()
        else:
            torch_sync.sync_gradients(
                model,
                self.collective,
                current.step,
                bucket_bytes,
                world=current.world,
                compressor=self.compressor,
                staging=self._staging,
            )
        return None

    def _start_step(self) -> None:
        """A step's work begins: its collective may start once `launchable` says so."""
        self._launch = None
        current = self.current
        assert current is not None
        after = self._unsettled.step if self._unsettled is not None else None
        self._gate = functools.partial(self.launchable, current, after)
        state = self.state
        assert isinstance(state, TorchState)
        state.hold()
        if self._seed is not None:
            torch.manual_seed(step_seed(self._seed, current.step, current.rank))
        if self._mean is not None:
            self._mean.begin()
        if self.micro is not None and self.micro.exact is not None:
            self._begin_exact_sums(self.micro.exact, self.micro.trained, current)
        if self._comms is not None:
            self._comms.begin()  # its weight 0 (a rank without samples) until `_weigh`'s
        if self.overlapped is not None:
            self.overlapped.begin(current.step, current.world, self._gate)

    def _begin_exact_sums(
        self, exact: ExactSum | TreeSum, params: Sequence[torch.Tensor], step: Step
    ) -> None:
        """A step's exact sums begin: over its units, all of one size but at an epoch's end."""
        units = self._units(step)
        if isinstance(exact, TreeSum):
            config = self.worker.view.config
            assert config is not None
            exact.begin(params, units, self._global_samples(step) == units * config.batch_size)
        else:
            exact.begin(params, units)
        self._say_if_idle(step)

    def _say_if_idle(self, step: Step) -> None:
        """Once a world: a rank that gets no micro-batch of a full step (exact sums deal
        whole units, and the world has more ranks than the global batch has units)."""
        config = self.worker.view.config
        if config is None or config.global_batch is None or self._idle_world == step.world:
            return
        units = -(-config.global_batch // config.batch_size)
        if step.rank < units:
            return
        self._idle_world = step.world
        log.warning(
            "%s: rank %d of %d gets no micro-batch: exact sums deal the global batch of %s in "
            "%d whole units of --batch-size %d; give a --batch-size of at most %d to train on "
            "every rank",
            self.worker_id, step.rank, step.world_size, config.global_batch, units,
            config.batch_size, max(1, config.global_batch // step.world_size),
        )  # fmt: skip

    def _units(self, step: Step) -> int:
        """The step's micro-batches over the whole world (its global batch's units)."""
        config, total = self.worker.view.config, self._global_samples(step)
        assert config is not None
        return -(-total // config.batch_size)

    def _unit_block(self, step: Step) -> range:
        """The step's units this rank computes (exact sums deal them whole, in runs)."""
        return deal.units_of(self._units(step), step.world_size, step.rank)

    def _global_samples(self, step: Step) -> int:
        """The samples the whole world trains at `step` (fewer only at an epoch's end)."""
        view = self.worker.view
        assert view.config is not None and view.plan is not None
        plan = view.plan
        return deal.step_total(view.config, plan.shards, plan.base_step, step.step)

    def _may_launch(self) -> bool:
        """Under DDP, asked by the comm hook at each bucket: the gate's answer, once a step."""
        if self._launch is None:
            self._launch = self._gate(threading.Event())
        return self._launch

    def epochs(self, count: int | None = None) -> Iterator[int]:
        """The data epochs this job trains, from the one it is in, to the job's end (its
        coordinators' --epochs or --max-steps); leaves the job when they are done, or on the
        first SIGINT/SIGTERM (`interrupted` then says the epoch did not end). `count`, if
        given, must be the job's --epochs: InvalidValueError names any other."""
        try:
            self.check_epochs(count)
            while not self.stopping:
                upcoming = self._peek()
                if upcoming is None or (count is not None and upcoming.epoch >= count):
                    return
                yield upcoming.epoch
        finally:
            self.close()

    def batches(self, loader: Any) -> Iterator[Any]:
        """This rank's batches of each step of the current data epoch, as `loader` would
        build them (its dataset, collate function and worker processes, which load steps
        ahead: worker/pytorch/loader.py); an empty share still takes part. With a constant
        global batch a step may come as several micro-batches: `optimizer.step()` updates
        after the last of them."""
        twin = self._loader_for(loader)
        collate = getattr(loader, "collate_fn", None) or torch.utils.data.default_collate
        dataset = loader.dataset
        first = self._peek()
        self._epoch_whole = False
        while first is not None:  # stopping: the walk reports the step applied, then ends
            step = self._next()
            if not isinstance(step, Step):
                self._epoch_whole = step is not None  # its end, not the walk's
                return  # the epoch's end (the walk waits for the script's code after it)
            if step.epoch != first.epoch:
                self._peeked = step  # a world that starts in a later epoch (a rewind)
                return
            trained, self._given = self._given, step
            self._start_step()
            micro = self._micro_batches()
            total = self._global_samples(step) if micro.exact is not None else 0
            sizes = tuple(sum(b - a for a, b in part) for part in step.micro)
            micro.begin_step(sizes if step.ranges else (), total)  # none: a stand-in step
            self._make_up(step, micro, dataset, collate)
            for index in range(micro.count):
                micro.begin(index)
                self._weigh(step, micro)
                batch = self._batch_of(twin, step, index, dataset, collate)
                if batch is None:
                    break  # its world is over: the step is retried in the next
                rates = learning_rates(self._optimizer())
                if self._seed is not None and micro.exact is not None and step.ranges:
                    # this unit's draws, after the loader's (a new iteration draws its seed)
                    unit = self._unit_block(step).start + index
                    torch.manual_seed(step_seed(self._seed, step.step, unit))
                yield batch
                micro.end()
                if not (micro.applied or self.aborted or self.current is not step):
                    self._check_schedule(rates)
                    if micro.last:  # no update applied (a GradScaler's inf): still the
                        self._averaged_for(step)  # world's step, every rank alike
                if self.aborted or self.current is not step:
                    break  # the world changed under this step: it is retried whole
            micro.end_step()
            self._put_back(trained)

    def _weigh(self, step: Step, micro: MicroBatches) -> None:
        """This rank's gradient weight in the world's mean, for the collectives that make it:
        DDP's comm hook (the step's last micro-batch), FSDP's reduce-scatters. FSDP keeps
        what the micro-batches before accumulated, rescaled for this one's size as
        `MicroBatches` rescales parked gradients, and reduces in the last only."""
        if micro.last and self._mean is not None:
            self._mean.scale = self._last_factor(step)
        if self._comms is not None:
            self._comms.scale = self._last_factor(step)
            carry = micro.carry(micro.index - 1) if micro.index else 0.0
            accumulate(self._model(), carry, sync=micro.last)

    def _make_up(self, step: Step, micro: MicroBatches, dataset: Any, collate: Any) -> None:
        """A sharded world's ranks run as many forward and backward passes in a step (FSDP's
        all-gathers and reduce-scatters are collectives of them all): a rank with fewer
        micro-batches than the most any rank has (a smaller share, or none) runs the
        difference first, on the data set's first sample, times zero, reducing nothing."""
        missing = self._passes(step) - micro.count
        if self._comms is None or missing <= 0:
            return
        state, model = self.state, self._model()
        assert isinstance(state, TorchState)
        accumulate(model, 0.0, sync=False)
        batch = first_sample_twice(dataset, collate)
        inputs = batch[0] if isinstance(batch, tuple | list) else batch
        for _ in range(missing):
            out = model(to_device(inputs, model_device(model, self.device)))
            outputs = out if isinstance(out, tuple | list) else (out,)
            zero = torch.stack([o.float().sum() for o in outputs if torch.is_tensor(o)]).sum() * 0
            zero.backward()
        state.restore_buffers()  # as held when the step began (`_start_step`)

    def _passes(self, step: Step) -> int:
        """The most micro-batches any rank of `step`'s world has in it (1 if none has any)."""
        view, at = self.worker.view, step.step
        plans = [p for p in view.plans if p.world_version == step.world and p.base_step <= at]
        if view.config is None or not plans:
            return 1
        config, plan = view.config, plans[-1]
        ranks = range(len(plan.shards))
        shares = (deal.batch(config, plan.shards, r, plan.base_step, at) for r in ranks)
        return max(len(deal.micro_batches(config, share)) for share in shares)

    def warm(self, *loaders: Any) -> None:
        """Start each loader's worker processes now, not at the first step. Called before
        `job.epochs()`, a warm spare (`cohort run --spares`) waits with them up, and a
        joiner starts them while it takes the weights. Only a loader that keeps its workers
        (`persistent_workers=True`) can: one without workers has nothing to start."""
        for loader in loaders:
            if self._loader_for(loader).warm() or not getattr(loader, "num_workers", 0):
                continue
            warnings.warn(
                f"job.warm(): the loader's {loader.num_workers} worker processes end with "
                "each iteration (persistent_workers=False), so none can be started ahead; "
                "give the DataLoader persistent_workers=True",
                UserWarning,
                stacklevel=2,
            )

    def _put_back(self, trained: Step | None) -> None:
        """After a step the script ran: if a world change cut it short, nothing was applied
        and the script is where it was (the step it trained last, its scheduler's place)."""
        if not self.aborted:
            return
        self._given = trained
        state = self.state
        assert isinstance(state, TorchState)
        state.unwind()

    def _loader_for(self, loader: Any) -> StepLoader:
        """One twin per script loader, kept: its persistent workers live across epochs."""
        known = self._loaders.get(id(loader))
        if known is None or known[0] is not loader:
            self._say_batch_size(loader)
            known = (loader, StepLoader(loader, self.worker))
            self._loaders[id(loader)] = known
        return known[1]

    def _say_batch_size(self, loader: Any) -> None:
        """Once per loader: its own batch_size, where it is not the job's, is not used."""
        config = self.worker.view.config
        own = getattr(loader, "batch_size", None)
        if config is None or own is None or own == config.batch_size:
            return
        warnings.warn(
            f"the DataLoader's batch_size={own} is not used: the job deals batches of "
            f"{config.batch_size} samples per rank (the coordinators' --batch-size "
            f"{config.batch_size}); give the loader batch_size={config.batch_size}, or the "
            "job the size you meant",
            UserWarning,
            stacklevel=4,
        )

    def _accumulating(self) -> bool:
        """Inside a micro-batch before a step's last (DDP must not reduce its gradients)."""
        return not self.sync_gradients

    def _micro_batches(self) -> MicroBatches:
        if self.micro is None:
            raise WorkerError("job.batches() before job.wrap(model, optimizer)")
        return self.micro

    def _optimizer(self) -> torch.optim.Optimizer:
        state = self.state
        assert isinstance(state, TorchState)
        return state.optimizer

    def _check_schedule(self, rates: tuple[Any, ...]) -> None:
        """After a micro-batch whose `optimizer.step()` applied nothing: a learning rate that
        changed anyway was set by a scheduler cohort does not gate. It would step once per
        micro-batch, whose count follows the world size: said once, with the fix."""
        if self._warned_schedule or learning_rates(self._optimizer()) == rates:
            return
        self._warned_schedule = True
        warnings.warn(
            "the learning rate changed in a micro-batch whose optimizer.step() applied no "
            "update: an LR scheduler stepped there counts micro-batches, whose number follows "
            "the world size. Hand it to job.wrap(model, optimizer, scheduler=scheduler) (it "
            "then steps once per update), or step it only `if job.sync_gradients`",
            UserWarning,
            stacklevel=3,
        )

    def _batch_of(
        self, twin: StepLoader, step: Step, index: int, dataset: Any, collate: Any
    ) -> Any:
        """Micro-batch `index` of `step` as the script's loader builds it; a stand-in where
        the rank has no sample in the step; None (the step aborted) if its world is over."""
        if not step.ranges:
            return self._stand_in(dataset, collate)
        try:
            return twin.fetch((step.world, step.step, index))
        except Stale:
            if self.overlapped is not None:
                self.overlapped.cancel()
            self.abort()
            return None

    def _stand_in(self, dataset: Any, collate: Any) -> Any:
        """What a rank with no sample in a step trains on (`first_sample_twice`).

        The script's whole step runs on it, as on every other rank: forward, backward (under
        DDP or FSDP every rank must: the others' collectives wait for it), its clipping, its
        GradScaler's unscale and update, its scheduler. Its gradients count for nothing
        (the rank's weight in the mean is 0, and exact sums take none of them), and the
        buffers its forward moved are put back before the world's are made
        (`_gradients_averaged`), so the rank adds nothing to the step and applies the same
        update as its peers. What the script records of it is dropped (`record`). The
        gradients the script left from the step before are cleared first: a script that
        zeroes them before its backward left them there."""
        state = self.state
        assert isinstance(state, TorchState)
        state.model.zero_grad(set_to_none=False)  # in place: a captured optimizer holds them
        return first_sample_twice(dataset, collate)

    def _peek(self) -> Step | None:
        """The next step, past an epoch's end: asking for it lets the walk go on."""
        while self._peeked is None or isinstance(self._peeked, EpochEnd):
            self._peeked = next(self._steps, None)
            if self._peeked is None:
                return None
        return self._peeked

    def _next(self) -> Step | EpochEnd | None:
        """What the walk gives next: a step, an epoch's end, or None once it ended."""
        taken = self._peeked if self._peeked is not None else next(self._steps, None)
        self._peeked = None
        return taken


def first_sample_twice(dataset: Any, collate: Any) -> Any:
    """The batch a rank trains where it lacks one (a stand-in step, a pass a sharded rank
    makes up): the data set's first sample twice over, since BatchNorm refuses to train on
    one, collated by the loader's function."""
    return collate([dataset[0]] * 2)


def sharded_parameters(model: torch.nn.Module) -> tuple[str, ...]:
    """The names of `model`'s parameters that are DTensors (`fully_shard`, tensor
    parallelism): none for a model of plain tensors, or where this torch has no
    torch.distributed (nothing can be sharded there)."""
    if not torch.distributed.is_available():
        return ()
    from torch.distributed.tensor import DTensor

    return tuple(name for name, p in model.named_parameters() if isinstance(p, DTensor))


def refuse_sharded(names: tuple[str, ...], backend: str | None) -> None:
    """InvalidValueError for a model whose parameters `names` were sharded before `job.wrap`:
    neither route can train it so (cohort shards in each world: `wrap(shard=...)`), so it is
    refused here, naming the route and the fix, rather than deep inside the first state
    copy."""
    if not names:
        return
    shown = ", ".join(repr(n) for n in names[:3]) + (", ..." if len(names) > 3 else "")
    if backend is None:
        why = (
            "the Redis route (no backend) averages and copies whole tensors and cannot carry "
            "DTensors"
        )
    else:
        why = (
            f"the {backend} route makes a new process group for every world, which a "
            "DeviceMesh built before job.wrap does not follow"
        )
    raise InvalidValueError(
        f"job.wrap: {len(names)} of the model's parameters are sharded (DTensor: {shown}), "
        f"and {why}. Give job.wrap the model before fully_shard, and let cohort shard it in "
        "each world: ElasticJob(backend='gloo') (or 'nccl') and job.wrap(model, optimizer, "
        "shard=lambda module, mesh: fully_shard(module, mesh=mesh)) (docs/sharded.md)"
    )


def refuse_compressed_exact_sums(exact: bool, compressed: bool) -> None:
    """InvalidValueError for compression where the job's gradient sums are exact: a
    compressed sum is rounded, and its bits follow the grouping again."""
    if exact and compressed:
        raise InvalidValueError(
            "job.wrap(compression=...) in a job whose gradient sums are exact (a constant "
            "--global-batch dealt --placement strided): compressed sums are not exact; "
            "leave compression unset, or give the coordinator --reduction float"
        )


def refuse_shard_setting(backend: str | None, compressed: bool, config: Any) -> None:
    """InvalidValueError where `wrap(shard=...)` cannot work: on the Redis route (FSDP's
    collectives need a process group), with compression, or with exact sums asked for by
    name (`--reduction exact`: FSDP's reduce-scatter sums in floating point)."""
    if backend is None:
        raise InvalidValueError(
            "job.wrap(shard=...): the Redis route (no backend) cannot run FSDP's collectives; "
            "give ElasticJob(backend='gloo') (or 'nccl', or $COHORT_TORCH_BACKEND)"
        )
    if compressed:
        raise InvalidValueError(
            "job.wrap(shard=...) with compression: FSDP reduces its own gradients, "
            "uncompressed; leave compression unset"
        )
    if config is not None and config.reduction == "exact":
        raise InvalidValueError(
            "job.wrap(shard=...) with --reduction exact: FSDP sums a sharded model's "
            "gradients in its reduce-scatter, in floating point, so they cannot be exact sums; "
            "give the coordinator --reduction float (docs/sharded.md)"
        )


def say_float_sums(config: Any) -> None:
    """A warning where the job's sums would be exact by default (a constant global batch
    dealt strided, no --reduction given): a sharded model's are floating point."""
    if config is None or config.reduction is not None or not config.exact:
        return
    warnings.warn(
        "job.wrap(shard=...): a sharded model's gradient sums are floating point (FSDP's "
        "reduce-scatter), not the exact sums a job of a constant --global-batch dealt "
        "--placement strided makes by default, so a step's update may differ in its last "
        "bits between world sizes; give the coordinator --reduction float to say so "
        "(docs/sharded.md)",
        UserWarning,
        stacklevel=4,
    )


def model_device(model: torch.nn.Module, default: torch.device) -> torch.device:
    """Where `model` keeps its weights (its first parameter's, else buffer's, device), or
    `default` for a model without tensors."""
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return default


def to_device(value: Any, device: torch.device) -> Any:
    """`value` with its tensors on `device`, through tuples, lists and dicts."""
    if torch.is_tensor(value):
        return value.to(device)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(to_device(v, device) for v in value))
    if isinstance(value, list | tuple):
        return type(value)(to_device(v, device) for v in value)
    return value


def _samples(step: Step) -> int:
    """This rank's samples in `step`."""
    return sum(b - a for a, b in step.ranges)


def step_seed(seed: int, step: int, rank: int) -> int:
    """A 64-bit seed for `step` on `rank`, from the job's `seed`: the same three give the
    same seed in any process, and any two that differ give unrelated ones (numpy's
    SeedSequence mixes them)."""
    return int(np.random.SeedSequence((seed, step, rank)).generate_state(1, np.uint64)[0])


def take_over(optimizer: torch.optim.Optimizer, step: Callable[..., Any]) -> None:
    """`optimizer.step()` calls `step` from now on.

    An LR scheduler made before this wrapped the optimizer's step to see it called; the new
    step keeps that promise (it marks the optimizer called, and is marked as wrapped), so
    torch warns neither "optimizer.step() has been overridden" nor "lr_scheduler.step()
    before optimizer.step()", whichever the script built first."""

    def stepped(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True  # type: ignore[attr-defined]  # what schedulers check
        return step(*args, **kwargs)

    optimizer.step = _method_of(optimizer, stepped)  # type: ignore[method-assign]
    optimizer.step.__func__._wrapped_by_lr_sched = True  # type: ignore[attr-defined]


def _method_of(optimizer: torch.optim.Optimizer, call: Callable[..., Any]) -> Any:
    """`call` as a method of `optimizer`: an LR scheduler made after `wrap` rebinds the
    optimizer's step to the optimizer (`step.__func__.__get__(optimizer)`), so what `wrap`
    installs must be a function of the optimizer, not a method of the job."""

    def method(this: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        return call(*args, **kwargs)

    return types.MethodType(method, optimizer)


def _under_ddp(model: torch.nn.Module, job: ElasticJob) -> torch.nn.Module:
    """`model` itself (its class, parameters and state_dict keys unchanged), whose calls run
    under the current world's DDP. DDP calls the module back; that inner call is the model's
    own."""
    base = type(model)

    def call(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        ddp = job.ddp
        if ddp is None or job._inside_ddp:
            return base.__call__(self, *args, **kwargs)
        job._inside_ddp = True
        try:
            if not job._buckets_rebuilt(ddp):
                return base.__call__(self, *args, **kwargs)  # the step is aborted meanwhile
            if job._accumulating():
                with ddp.no_sync():  # reduced with the step's last micro-batch
                    return ddp(*args, **kwargs)
            return ddp(*args, **kwargs)
        finally:
            job._inside_ddp = False

    model.__class__ = type(
        base.__name__, (base,), {"__call__": call, "__module__": base.__module__}
    )
    return model


class GuardedMean:
    """DDP's bucket allreduce in one world (the mean over its ranks), each completed with
    zeros if the journal says the world ended first: a dead peer never hangs backward, and
    `aborted` says the step's gradients are not the world's (it is skipped).

    Where a result goes to DDP before its data is there (NCCL: `completion` is deferred),
    the step's works are kept, and `settle` waits for them on the device before the step
    applies (docs/gpu.md, "The NCCL route's step protocol")."""

    def __init__(
        self, rdzv: Any, may_launch: Callable[[], bool], completion: HostCompletion
    ) -> None:
        import torch.distributed as dist

        self.rdzv = rdzv
        self.may_launch = may_launch
        """Whether this step's collective may start (a stale step's must not: its retry
        brings this rank's part)."""
        self.completion = completion
        self.dog = rdzv.watchdog
        self.size = dist.get_world_size()
        self.scale = 1.0
        """This rank's gradient weight in the mean (a constant global batch's, else 1)."""
        self.aborted = False
        self._pending: dict[int, tuple[torch.futures.Future[torch.Tensor], torch.Tensor]] = {}
        """The results DDP waits for, by id, with their buckets: what a trip completes."""
        self._works: list[Any] = []
        """The step's works whose data nothing has seen arrive yet: a deferred completion's
        buckets, and the sums of `reduce_also` (the buffers') on any backend."""
        self._lock = threading.Lock()
        self.dog.on_trip(self._trip)  # once per world: a bucket's result leaves no callback

    def reduce(self, tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        import torch.distributed as dist

        result = self.completion.result(tensor)
        if self.dog.tripped.is_set() or not self.may_launch():
            self._zeros(result, tensor)
            return result
        torch_sync.weigh_((tensor,), self.scale / self.size)  # then the sum, as DDP's hook
        work = dist.all_reduce(tensor, async_op=True)
        self.rdzv.track(work)  # pinned with its group if the world is abandoned
        with self._lock:
            self._pending[id(result)] = (result, tensor)
            if self.completion.deferred:
                self._works.append(work)
        if self.dog.tripped.is_set():  # tripped before the result was pending: not drained
            self._trip()
        self.completion.hand_over(work, tensor, lambda done: self._finish(result, done))
        return result

    def reduce_also(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` over the world in place, as one more of the step's collectives."""
        import torch.distributed as dist

        self.also(functools.partial(dist.all_reduce, tensor, async_op=True))

    def also(self, start: Callable[[], Any]) -> None:
        """Start one more of the step's collectives (`start()` returns its work): `settle`
        waits for its data (gloo or NCCL) before the step applies; a world already over, or
        a stale step, aborts the step instead."""
        if self.dog.tripped.is_set() or not self.may_launch():
            self.aborted = True
            return
        work = start()
        self.rdzv.track(work)
        with self._lock:
            self._works.append(work)

    def _finish(self, result: torch.futures.Future[torch.Tensor], done: Any) -> None:
        try:
            value = done.value()[0]
        except Exception:  # e.g. a peer's connection closed: the journal will say why
            return  # left pending: the watchdog completes it when it trips
        with self._lock:
            if self._pending.pop(id(result), None) is None:
                return  # the world ended first: completed with zeros
        result.set_result(value)  # on CUDA: in the callback's streams, after NCCL's kernel

    def _trip(self) -> None:
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        for result, tensor in pending:
            self._zeros(result, tensor)

    def _zeros(self, result: torch.futures.Future[torch.Tensor], tensor: torch.Tensor) -> None:
        self.aborted = True
        result.set_result(torch.zeros_like(tensor))

    def begin(self) -> None:
        """A step begins: nothing of it aborted, no work of it in flight."""
        with self._lock:
            self.aborted = False
            self._works = []

    def settle(self, step: int) -> bool:
        """Before the step applies: whether its collectives completed on their devices in
        a world that stands. A deferred completion's works are fenced on a side thread the
        watchdog guards (a trip aborts the group, which ends the kernels: False). A work
        that failed while the journal says nothing yet waits for it: WorldChangedError
        (False here) if it explains within the grace, else the error stands."""
        with self._lock:
            works, self._works = self._works, []
        if self.aborted or not works:
            return not self.aborted
        try:
            self.rdzv.fence(works, self.completion, step)
        except WorldChangedError:
            self.aborted = True
            return False
        except Exception:
            self.aborted = True
            raise
        return True


def _guarded_allreduce(mean: GuardedMean, bucket):  # type: ignore[no-untyped-def]
    """DDP's comm hook: `mean.reduce` of the bucket.

    `bucket` (a dist.GradBucket) and the returned Future[Tensor] carry no annotations: DDP
    checks them by identity, and this module's annotations are strings."""
    return mean.reduce(bucket.buffer())


def params_of(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {name: p.detach().cpu().numpy().copy() for name, p in model.named_parameters()}
