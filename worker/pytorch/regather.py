"""A grown sharded world's whole state, put together from the shards its survivors hold.

When a world of a model sharded over every rank (`wrap(shard=...)`) ends with none of its
ranks lost (a rank joined), the whole state still exists: in pieces, each survivor holding
its shard of every parameter and of the optimizer's state. The next world starts from
them, without a rewind. As it begins, each rank in turn gives what it holds through the
world's group (`handover.Handover` from that rank: guarded, in buckets): a survivor its
local pieces, the rank it had and how each piece was cut; a joiner nothing. Every rank
then puts the whole state together (each tensor's pieces joined along the dimension the
old mesh cut it on, in the old ranks' order; what was whole on every rank, taken from the
old rank 0) and keeps its own shards of it, as from rank 0's whole state. The optimizer's
settings, the scheduler, scaler, RNG and `extra` state are the new rank 0's, as in any
world that starts from a survivor's weights; the journal's digest then checks the result
on every rank.

HSDP's shard groups each hold a copy: a world that lost ranks starts this way too while
one holder of each shard is left (a shard's pieces come from the first rank that holds
them; the holders after it give nothing). A world that lost every holder of a shard (FSDP
over every rank: any rank) rewinds to a checkpoint (docs/sharded.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from cohort.worker.errors import WorkerError
from cohort.worker.pytorch import shards
from cohort.worker.pytorch import sync as torch_sync
from cohort.worker.pytorch.handover import Handover
from cohort.worker.pytorch.sync import Held

HELD = "cohort.held"
"""The extra state's key for what a rank held: [its old rank, the old world's size]."""
CUTS = "cohort.cuts"
"""...and how each piece was cut: the dimension, or None where it was whole."""
TAKEN = "cohort.extra"
"""...and, from the new rank 0, the extra state every rank takes."""


class IncompleteShardsError(WorkerError):
    """The pieces a world's ranks hold are not every shard of one world's: its holders gave
    some up (they applied a step the job did not commit) before it began."""


@dataclass(frozen=True)
class Pieces:
    """This process's shards of the world it trained in last: shard `rank` of `size` (of
    each HSDP copy, or of the one FSDP copy)."""

    rank: int
    size: int
    model: dict[str, torch.Tensor]
    optim: dict[str, dict[str, Any]]
    cuts: dict[str, int | None]


def _local(value: Any) -> tuple[Any, int | None]:
    """A DTensor's local piece and the dimension its (one-dimensional) mesh cuts it on;
    anything else as it is, whole."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(value, DTensor):
        return value, None
    if len(value.placements) != 1:
        raise WorkerError(f"a {len(value.placements)}-dimensional mesh: cohort's worlds have one")
    (placement,) = value.placements
    dim = placement.dim if isinstance(placement, Shard) else None
    return value.to_local().detach(), dim


def pieces(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, size: int
) -> Pieces:
    """What this process holds of `module` and `optimizer` as rank `rank` of `size`."""
    state = shards.flat(module, optimizer)  # the parts DCP writes, named alike
    model: dict[str, torch.Tensor] = {}
    cuts: dict[str, int | None] = {}
    for name, value in state["model"].items():
        model[name], cuts[f"model.{name}"] = _local(value)
    optim: dict[str, dict[str, Any]] = {}
    for name, values in state["optim"].items():
        optim[name] = {}
        for key, value in values.items():
            optim[name][key], cuts[f"optim.{name}.{key}"] = _local(value)
    return Pieces(rank, size, model, optim, cuts)


def _joined(parts: list[Any], dim: int | None) -> Any:
    return parts[0] if dim is None else torch.cat(parts, dim=dim)


def regather(
    handover_for: Callable[[int], Handover],
    mine: Pieces | None,
    groups: list[dict[str, Any]],
    extra: Mapping[str, Any],
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The whole model and optimizer state (by name, as `optimizer_by_name` gives it) and
    the extra state every rank takes, from the pieces the world's ranks held (a collective:
    every rank of the world calls it, `mine` None where it held none). `groups` and `extra`:
    what this rank would give as the world's optimizer settings and extra state (rank 0's
    are taken)."""
    me, size = dist.get_rank(), dist.get_world_size()
    found: dict[int, Pieces] = {}
    settings: list[dict[str, Any]] = []
    taken: dict[str, Any] = {}
    for src in range(size):
        handover = handover_for(src)
        if src == me:
            info: dict[str, Any] = {HELD: None}
            model, optim = {}, {}
            if mine is not None and mine.rank not in found:  # a copy's shard given before
                info = {HELD: [mine.rank, mine.size], CUTS: mine.cuts}
                model, optim = mine.model, mine.optim
            if me == 0:
                info[TAKEN] = dict(extra)
            sent = Held(model), Held({"state": optim, "param_groups": groups})
            decoded, tensors = handover.state(*torch_sync.state_parts(*sent, info))  # type: ignore[arg-type]
        else:
            decoded, tensors = handover.state(None, b"")
        got_model, got_optim = Held(), Held()
        info = torch_sync.load_state_parts(got_model, got_optim, decoded, tensors)  # type: ignore[arg-type]
        if info.get(HELD) is not None and info[HELD][0] not in found:  # one copy of each
            rank, held_size = info[HELD]
            found[rank] = Pieces(
                rank, held_size, got_model.state, got_optim.state["state"], info[CUTS]
            )
        if src == 0:
            settings, taken = got_optim.state["param_groups"], info.get(TAKEN, {})
    model, optim = _assembled(found, settings)
    return model, optim, taken


def _assembled(
    found: Mapping[int, Pieces], settings: list[dict[str, Any]]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The whole model and optimizer state from every old rank's pieces."""
    sizes = {p.size for p in found.values()}
    if len(sizes) != 1 or set(found) != set(range(next(iter(sizes)))):
        held = sorted(found)
        raise IncompleteShardsError(
            f"the world's ranks hold shards {held} of {sorted(sizes)} of the last world's "
            "model: not every shard of it"
        )
    order = [found[rank] for rank in sorted(found)]
    first = order[0]
    model = {
        name: _joined([p.model[name] for p in order], first.cuts[f"model.{name}"])
        for name in first.model
    }
    state = {
        name: {
            key: _joined([p.optim[name][key] for p in order], first.cuts[f"optim.{name}.{key}"])
            for key in values
        }
        for name, values in first.optim.items()
    }
    return model, {"state": state, "param_groups": settings}
