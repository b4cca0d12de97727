"""FSDP2 over every rank of a world: the model sharded anew in each world (docs/sharded.md).

`job.wrap(model, optimizer, shard=lambda module, mesh: fully_shard(module, mesh=mesh))`
keeps the script's unsharded `model` as a template. In each world, after its process group
exists, a copy of the template is handed to `shard` with a DeviceMesh over the world's
ranks (torch 2.13 applies `fully_shard` once per module and refuses to copy a sharded
one, so a world of another size needs a fresh module); the optimizer's parameter groups
are pointed at the copy's parameters, in their order (`fully_shard` replaces every
Parameter: an optimizer left on the old ones would train nothing); rank 0's whole state
(the initial one, or a checkpoint's) then reaches every rank through the world's group
(`handover.Handover`: guarded, in buckets), and each keeps its shards of it
(`set_model_state_dict` with the full state dict; the optimizer's through
`shard_optimizer_state`). Each world's DeviceMesh is named for the world (`world_mesh`).

A world's state lives in its shards only: a world that loses a rank cannot pass it on, so
its survivors give up their claim to the weights and the job rewinds to its last
checkpoint (`ElasticJob._start_world`). Where one file is wanted (a checkpoint, `job.save`),
the whole state is gathered on rank 0 (`full_state_dict=True, cpu_offload=True`).

FSDP's own all-gathers and reduce-scatters go through `GuardedComms`: each is issued
asynchronously and waited for under the world's watchdog, so a dead or hung peer ends the
step (nothing is applied, it comes again in the next world) instead of raising in the
script's forward or backward, or hanging it.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from cohort.worker.errors import WorkerError, WorldChangedError
from cohort.worker.pytorch import regather, shards
from cohort.worker.pytorch import sync as torch_sync
from cohort.worker.pytorch.completion import HostCompletion
from cohort.worker.pytorch.digests import weights_digest
from cohort.worker.pytorch.handover import Handover
from cohort.worker.pytorch.sync import Held

log = logging.getLogger("cohort.torch")

Shard = Callable[[torch.nn.Module, Any], Any]
"""What the script gives `wrap(shard=...)`: called as `shard(module, mesh)`, it shards
`module` in place over `mesh` (a DeviceMesh of the world's ranks)."""


class ShardedModel(torch.nn.Module):
    """What `wrap(shard=...)` gives the script: the current world's sharded module, called
    through this one (its parameters are that module's DTensors, for clipping and the
    like). Before the first world, the unsharded template."""

    def __init__(self, template: torch.nn.Module) -> None:
        super().__init__()
        self.module = template

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


def digest_of(state: Mapping[str, Any]) -> str:
    """The weights digest of a model state dict (as `TorchState.digest` makes it): the same
    for a plain model's `state_dict()` and a sharded one's gathered whole."""
    return weights_digest(state)


def optimizer_settings(
    optimizer: torch.optim.Optimizer, names: list[list[str]]
) -> list[dict[str, Any]]:
    """The optimizer's parameter groups' settings (learning rate, betas, ...), each with its
    parameters' names."""
    return [
        {**{k: v for k, v in group.items() if k != "params"}, "params": group_names}
        for group, group_names in zip(optimizer.param_groups, names, strict=True)
    ]


def optimizer_by_name(optimizer: torch.optim.Optimizer, names: list[list[str]]) -> dict[str, Any]:
    """`optimizer.state_dict()` with its parameters named (`names`: each group's parameter
    names, in order), as `get_optimizer_state_dict(full_state_dict=True)` gives it."""
    state = optimizer.state_dict()
    flat = [name for group in names for name in group]
    return {
        "state": {flat[i]: value for i, value in state["state"].items()},
        "param_groups": [
            {**group, "params": list(named)}
            for group, named in zip(state["param_groups"], names, strict=True)
        ],
    }


def group_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """Each of the optimizer's parameter groups as the names of its parameters in `model`
    (KeyError-free: a parameter the model does not have is refused by the caller)."""
    name_of = {id(p): name for name, p in model.named_parameters()}
    return [[name_of[id(p)] for p in group["params"]] for group in optimizer.param_groups]


class GuardedComms:
    """FSDP's all-gather and reduce-scatter in one world, each waited for under its watchdog
    (`ElasticProcessGroup.wait`): once the world is over, or the step may not launch (a stale
    step's), every further one of the step returns zeros and `aborted` is set."""

    def __init__(self, rdzv: Any, may_launch: Callable[[], bool], step: Callable[[], int]):
        self.rdzv = rdzv
        self.may_launch = may_launch
        self.step = step
        self.aborted = False
        self.replicas: Any = None
        """HSDP: the process group of this rank's copies in the other shard groups, which
        `all_reduce` averages each reduce-scatter's output over (None: FSDP, one copy)."""
        self.scale = 1.0
        """This rank's gradient weight in the mean (its share of the step's samples times
        the world size; 0 for a rank without samples), as DDP's comm hook applies it."""
        self._reduced: list[torch.Tensor] = []
        """The sharded parameters FSDP gave a gradient in the backward running now."""
        self._scattered: Any = None
        """The group of the backward's last reduce-scatter (None: it ran none)."""

    def begin(self) -> None:
        """A step begins: nothing of it aborted, no weight until its share is known."""
        self.aborted, self.scale, self._reduced, self._scattered = False, 0.0, [], None

    def reduced(self, param: torch.Tensor) -> None:
        """FSDP wrote `param`'s reduced gradient (its post-accumulate-grad hook); the first
        of a backward queues what its end does."""
        if not self._reduced:
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)
        self._reduced.append(param)

    def _backward_ended(self) -> None:
        """A step whose collectives were cut short leaves the script no gradients: what it
        does with them next (a clip's norm: DTensor's collective over the shard group)
        would fail on the lost peer, and the step applies nothing anyway. The ranks of the
        shard group agree on it first: with HSDP, one of them may have lost its replica
        peer while the others' all-reduces held, and a rank that went on to the clip alone
        would wait there for peers that never come, then raise."""
        params, self._reduced = self._reduced, []
        group, self._scattered = self._scattered, None
        if group is not None:
            self.agree(group)
        if self.aborted:
            for param in params:
                param.grad = None

    def agree(self, group: Any) -> None:
        """Aborted where any rank of `group` aborted the step, or the agreement itself
        breaks (a peer lost), or the world is over. A rank that aborted still says so."""
        if self.rdzv.watchdog.tripped.is_set():
            self.aborted = True
            return
        flag = torch.tensor([1.0 if self.aborted else 0.0])
        try:
            self._wait(dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group, async_op=True))
        except WorldChangedError:
            self.aborted = True
            return
        self.aborted = self.aborted or bool(flag.item())

    def run(self, issue: Callable[[], Any], output: torch.Tensor) -> None:
        if not self.aborted and (self.rdzv.watchdog.tripped.is_set() or not self.may_launch()):
            self.aborted = True
        if not self.aborted:
            try:
                self._wait(issue())
                return
            except WorldChangedError:
                self.aborted = True
        output.zero_()

    def all_reduce(self, output: torch.Tensor) -> None:
        """HSDP: the shard group's reduced gradients averaged over its replicas, guarded as
        FSDP's own collectives are (FSDP's built-in HSDP all-reduce is not: a lost peer
        would raise in the script's backward, or hang it)."""
        group = self.replicas
        self.run(lambda: dist.all_reduce(output, group=group, async_op=True), output)
        output.div_(dist.get_world_size(group))

    def _wait(self, work: Any) -> None:
        """Wait for `work` under the world's watchdog (gloo's reduce-scatter has no future):
        WorldChangedError once the world is over, or if it failed as it ended."""
        self.rdzv.track(work)  # pinned with its group if the world is abandoned
        self.rdzv.fence([work], HostCompletion(), self.step())

    def comms(self) -> tuple[Any, Any]:
        """An AllGather and a ReduceScatter for `FSDPModule.set_custom_*`."""
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
            DefaultAllGather,
            DefaultReduceScatter,
        )

        guard = self

        class GuardedAllGather(DefaultAllGather):  # type: ignore[misc]
            def __call__(self, output_tensor, input_tensor, group, async_op=False):  # type: ignore[no-untyped-def]
                guard.run(
                    lambda: dist.all_gather_single(
                        output_tensor, input_tensor, group=group, async_op=True
                    ),
                    output_tensor,
                )
                return None  # done (or zeros): nothing for FSDP to wait for

        class GuardedReduceScatter(DefaultReduceScatter):  # type: ignore[misc]
            def __call__(self, output_tensor, input_tensor, group, op, async_op=False):  # type: ignore[no-untyped-def]
                torch_sync.weigh_((input_tensor,), guard.scale)  # FSDP's flat copy of them
                guard._scattered = group
                guard.run(
                    lambda: dist.reduce_scatter_single(
                        output=output_tensor,
                        input=input_tensor,
                        op=op,
                        group=group,
                        async_op=True,
                    ),
                    output_tensor,
                )
                return None

        return GuardedAllGather(), GuardedReduceScatter()


def guard(module: torch.nn.Module, comms: GuardedComms) -> None:
    """Route every FSDP module's collectives in `module` through `comms`, which hears of
    every gradient FSDP writes."""
    from torch.distributed.fsdp import FSDPModule

    gather, scatter = comms.comms()
    for part in module.modules():
        if isinstance(part, FSDPModule):
            part.set_custom_all_gather(gather)
            part.set_custom_reduce_scatter(scatter)
            if comms.replicas is not None:
                part.set_all_reduce_hook(comms.all_reduce)
    for param in module.parameters():
        if param.requires_grad:  # FSDP calls it as it writes the parameter's gradient
            param.register_post_accumulate_grad_hook(comms.reduced)


def accumulate(module: torch.nn.Module, carry: float, sync: bool) -> None:
    """Before one of a step's forward and backward passes of FSDP `module`: what the passes
    before it accumulated (FSDP's unsharded gradients, each pass's mean at weight 1 / m)
    is kept in FSDP's own accumulator, out of the module's parameters (a `zero_grad` of the
    script's cannot reach it), times `carry` (m_i / m_(i+1), as `MicroBatches` rescales an
    unsharded model's parked gradients; 0 drops it, as a step begins); the pass reduces
    over the world (`set_requires_gradient_sync`) only if `sync`: the step's last."""
    from torch.distributed.fsdp import FSDPModule

    for part in module.modules():
        if not isinstance(part, FSDPModule):
            continue
        part.set_requires_gradient_sync(sync, recurse=False)
        for group in part._get_fsdp_state()._fsdp_param_groups:
            for param in group.fsdp_params:
                _carry(param, carry)


def _carry(param: Any, carry: float) -> None:
    """One FSDPParam's accumulated gradient moved into `unsharded_accumulated_grad` (which
    its next reducing backward adds its own gradient to, and reduces) and scaled."""
    held = param.unsharded_accumulated_grad
    unsharded: Any = getattr(param, "_unsharded_param", None)  # made by its first all-gather
    grad = unsharded.grad if unsharded is not None else None
    if grad is not None:
        unsharded.grad = None
        if param.reduce_dtype is not None:
            grad = grad.to(param.reduce_dtype)
        held = grad if held is None else held.add_(grad)
    if held is not None and carry == 0.0:
        held = None
    elif held is not None and carry != 1.0:
        held.mul_(carry)
    param.unsharded_accumulated_grad = held


@dataclass(frozen=True)
class WorldMesh:
    """A world's mesh for FSDP: `shards`, the ranks one copy of the model is sharded over
    (a shard group of HSDP, or every rank), `count` of them; `replicas`, the process group
    of this rank's copies in the other groups (None: one copy)."""

    shards: Any
    count: int
    replicas: Any = None


def world_mesh(device_type: str, size: int, version: int, group: int | None = None) -> WorldMesh:
    """World `version`'s mesh: HSDP where its `size` ranks make more than one whole shard
    group of `group` ranks (consecutive ranks shard one copy; copies are replicas), else
    FSDP over every rank. Each dimension is named for the world: torch compares meshes by
    their ranks' layout and names, not by which rank this process is, and reuses an equal
    one met before: a process that was rank 0 of an earlier world then got that world's
    mesh back as rank 1 of this one, and DTensor cut its optimizer state as rank 0's part
    while FSDP, which asks its group, held rank 1's."""
    from torch.distributed.device_mesh import init_device_mesh

    if group is None or size <= group or size % group:
        mesh = init_device_mesh(device_type, (size,), mesh_dim_names=(f"world{version}",))
        return WorldMesh(mesh, size)
    names = (f"replicas{version}", f"world{version}")
    mesh = init_device_mesh(device_type, (size // group, group), mesh_dim_names=names)
    return WorldMesh(mesh[names[1]], group, mesh[names[0]].get_group())


def whole(**options: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **options)


class ShardedState:
    """The parts of `TorchState` that differ for a model sharded in each world: where its
    whole state is (rank 0's `pending`, between a load and the world's start), how a world
    shards and fills its module, and how the whole state is gathered again."""

    def __init__(
        self,
        template: torch.nn.Module,
        wrapper: ShardedModel,
        optimizer: torch.optim.Optimizer,
        shard: Shard,
        group: int | None = None,
    ) -> None:
        self.template = template
        self.wrapper = wrapper
        self.optimizer = optimizer
        self.shard = shard
        self.names = group_names(template, optimizer)
        self.module: torch.nn.Module | None = None
        """The current world's sharded module (None before the first world)."""
        self.pending: tuple[dict[str, Any], dict[str, Any]] | shards.Shards | None = None
        """What rank 0 brings to the next world: the whole model and optimizer state, or a
        sharded checkpoint's shards (which every rank of the world reads its parts of)."""
        self.group: int | None = group
        """Ranks per shard group (HSDP: each group one copy of the model); None: FSDP over
        every rank of each world."""
        self.held: tuple[tuple[str, ...], int, int] | None = None
        """The world whose shards `module` holds: its ranks (worker ids), which shard of how
        many this process holds; None: none, or this process gave them up."""

    def whole_state(self) -> tuple[Held, Held] | None:
        """The whole model and optimizer state as `Held`s: gathered on rank 0 in a world
        (a collective: every rank calls it; the others get None), else the template's."""
        if self.module is None:
            return Held(self.template.state_dict()), Held(
                optimizer_by_name(self.optimizer, self.names)
            )
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = whole(cpu_offload=True)
        model = get_model_state_dict(shards.resharded(self.module), options=options)
        optim = get_optimizer_state_dict(self.module, self.optimizer, options=options)
        return (Held(model), Held(optim)) if dist.get_rank() == 0 else None

    def pending_model(self) -> dict[str, Any] | None:
        """The whole model of the pending state (read whole from a checkpoint's shards)."""
        if isinstance(self.pending, shards.Shards):
            return shards.whole_model(self.template, self.pending.location)
        return self.pending[0] if self.pending is not None else None

    def digest(self) -> str:
        """The whole model's digest: of the pending state, or gathered on every rank."""
        pending = self.pending_model()
        if pending is not None:
            return digest_of(pending)
        if self.module is None:
            return digest_of(self.template.state_dict())
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return digest_of(get_model_state_dict(shards.resharded(self.module), options=whole()))

    def enter(
        self,
        mesh: Any,
        comms: GuardedComms,
        extra: dict[str, Any],
        handover_for: Callable[[int], Handover],
        regathering: bool,
    ) -> dict[str, Any]:
        """This world's module: a copy of the template sharded over `mesh`, the optimizer
        pointed at its parameters, and filled with the world's state: rank 0's (and its
        `extra`) spread over the world by `handover_for(0)` (guarded, in buckets), or,
        `regathering`, from the shards the last world's ranks held, each kept in its place
        or given by a holder (worker/pytorch/regather.py). Returns the extra state every
        rank takes."""
        mine = None
        if regathering and self.module is not None and self.held is not None:
            _, index, count = self.held
            mine = regather.pieces(self.module, self.optimizer, index, count)
        self.held = None  # the module is replaced: whatever the world does, nothing is held
        settings = optimizer_settings(self.optimizer, self.names)
        module = copy.deepcopy(self.template)
        self.shard(module, mesh)
        guard(module, comms)
        params = dict(module.named_parameters())
        for group, names in zip(self.optimizer.param_groups, self.names, strict=True):
            group["params"] = [params[name] for name in names]
        self.optimizer.state.clear()
        self.module = self.wrapper.module = module
        if regathering:
            taken, settings = self._regathered(
                regather.regather(
                    handover_for, mine, mesh.get_local_rank(), mesh.size(), settings, extra
                )
            )
        else:  # rank 0's whole state, or where its shards are
            model_state, optim_state, taken = self._spread(handover_for(0), extra)
            self._fill(model_state, optim_state, taken.pop(SHARDS_AT, None))
            settings = optim_state["param_groups"]
        for group, held in zip(self.optimizer.param_groups, settings, strict=True):
            group.update({k: v for k, v in held.items() if k != "params"})
        return dict(taken)

    def _regathered(self, got: regather.Regathered) -> tuple[dict[str, Any], list[Any]]:
        """The module filled from the shards its world's ranks held: this rank's own in
        place, else the whole state; the extra state and optimizer settings to take."""
        assert self.module is not None
        self.pending = None
        log.info(
            "a sharded world starts from its ranks' shards %s: shards %s moved",
            "in place" if got.pieces is not None else "put together whole",
            list(got.moved),
        )
        if got.pieces is not None:
            regather.load(self.module, self.optimizer, got.pieces)
        else:
            assert got.model is not None and got.optim is not None
            self._fill(got.model, got.optim, None)
        return got.taken, got.settings

    def _fill(
        self, model_state: dict[str, Any], optim_state: dict[str, Any], location: str | None
    ) -> None:
        """The module filled from a whole state every rank holds, or (`location`) from the
        checkpoint shards there, each rank reading its own."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        assert self.module is not None
        if location is None:  # every rank keeps its shards of the whole state
            set_model_state_dict(self.module, model_state, options=whole())
            shard_optimizer_state(self.module, self.optimizer, optim_state)
        else:  # every rank reads its own
            shards.load(self.module, self.optimizer, location)
            self.pending = None

    def _spread(
        self, handover: Handover, extra: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        """rank 0's pending whole state and `extra`, on every rank of the world."""
        if dist.get_rank() == 0:
            if self.pending is None:
                raise WorkerError("rank 0 of a sharded world holds no whole state to start from")
            if isinstance(self.pending, shards.Shards):
                model_state, optim_state, _ = from_blob(self.pending.blob)
                extra = {**extra, SHARDS_AT: self.pending.location}
            else:
                model_state, optim_state = self.pending
            parts = torch_sync.state_parts(Held(model_state), Held(optim_state), extra)  # type: ignore[arg-type]
            handover.state(*parts)
            # kept until it went (a world that fails on the way begins again); shards until
            # they were read
            if not isinstance(self.pending, shards.Shards):
                self.pending = None
            return model_state, optim_state, extra
        self.pending = None
        meta, tensors = handover.state(None, b"")
        model, optim = Held(), Held()
        taken = torch_sync.load_state_parts(model, optim, meta, tensors)  # type: ignore[arg-type]
        return model.state, optim.state, taken


SHARDS_AT = "cohort.shards"
"""The key of the extra state a world's start carries, when its state is a checkpoint's
shards: where they are."""


def shard_optimizer_state(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer, whole_state: Mapping[str, Any]
) -> None:
    """The optimizer's state for `module`'s sharded parameters from a whole (full) one
    keyed by parameter name, which every rank holds: each tensor the shape of its parameter
    is cut as the parameter is (`distribute_tensor` with no source rank: each rank takes its
    own part, no collective); the rest (a step count) as it is."""
    shards.fill_optimizer(module, optimizer, whole_state["state"], _cut)


def _cut(name: str, key: str, value: Any, param: torch.nn.Parameter) -> Any:
    """A whole optimizer state `value` of `param`, as this rank keeps it."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if (
        isinstance(param, DTensor)
        and torch.is_tensor(value)
        and value.dim() > 0
        and value.shape == param.shape
    ):
        return distribute_tensor(
            value.to(param.device), param.device_mesh, param.placements, src_data_rank=None
        )
    return value.clone() if torch.is_tensor(value) else value


def blob_of(model: Held, optim: Held, extra: Mapping[str, Any]) -> bytes:
    return torch_sync.state_blob(model, optim, extra)  # type: ignore[arg-type]


def from_blob(blob: bytes) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    model, optim = Held(), Held()
    extra = torch_sync.load_state_blob(model, optim, blob)  # type: ignore[arg-type]
    return model.state, optim.state, extra
