"""A sharded world's state, from the shards its ranks held in the world before.

When a world of a sharded model (`wrap(shard=...)`) ends while one holder of each shard is
left (a rank joined; with HSDP, a rank of one copy lost while another copy holds its
shard), the whole state still exists, in pieces, and the next world starts from them
without a rewind. As it begins:

1. each rank in turn says what it holds (`handover.Handover` from that rank: guarded):
   shard i of S, or nothing (a joiner; a rank that gave its shards up); the new rank 0
   adds the optimizer's settings and the extra state every rank takes;
2. **in place**, where the new world's shards are the old world's (the same S: HSDP's
   places kept from world to world, docs/sharded.md): a rank already holding the shard of
   its place keeps it, and each shard a rank lacks is given once by its first holder (a
   spare promoted into a copy takes its lost rank's shard from the same shard of another
   copy). Only the shards missing from their places move;
3. **whole**, otherwise (the world's size or group changed): the first holder of each
   shard gives it, and every rank puts the whole state together (each tensor's pieces
   joined along the dimension the old mesh cut it on, in the old ranks' order; what was
   whole on every rank, taken from the old shard 0) to keep its own shards of it.

The optimizer's settings, the scheduler, scaler, RNG and `extra` state are the new rank
0's, as in any world that starts from a survivor's weights; the journal's digest then
checks the result on every rank. A world that lost every holder of a shard (FSDP over
every rank: any rank) rewinds to a checkpoint (docs/sharded.md): its ranks find it in the
first step, before any piece moves (IncompleteShardsError).
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


@dataclass(frozen=True)
class Regathered:
    """How this rank starts a world from the shards the ranks held: `pieces`, its own shard
    of its place (in place), else `model` and `optim`, the whole state; `settings` and
    `taken`, the new rank 0's optimizer settings and extra state; `moved`, the shards that
    travelled."""

    settings: list[dict[str, Any]]
    taken: dict[str, Any]
    moved: tuple[int, ...]
    pieces: Pieces | None = None
    model: dict[str, Any] | None = None
    optim: dict[str, Any] | None = None


@dataclass(frozen=True)
class _Told:
    held: list[tuple[int, int] | None]
    """By new rank: which shard of how many it holds (None: none)."""
    settings: list[dict[str, Any]]
    taken: dict[str, Any]


def regather(
    handover_for: Callable[[int], Handover],
    mine: Pieces | None,
    place: int,
    count: int,
    groups: list[dict[str, Any]],
    extra: Mapping[str, Any],
) -> Regathered:
    """The world's start from the pieces its ranks held (a collective: every rank of the
    world calls it, `mine` None where it held none): this rank is shard `place` of `count`
    in the new world. `groups` and `extra`: what this rank would give as the world's
    optimizer settings and extra state (rank 0's are taken)."""
    told = _told(handover_for, mine, groups, extra)
    givers = _givers(told.held)
    if len(givers) == count:  # the same shards: each place keeps or takes its own
        places = [rank % count for rank in range(len(told.held))]
        lacking = sorted(
            {i for i, held in zip(places, told.held, strict=True) if held != (i, count)}
        )
        has = mine is not None and (mine.rank, mine.size) == (place, count)
        taken = _given(
            handover_for, mine, {i: givers[i] for i in lacking}, set() if has else {place}
        )
        pieces = mine if has else taken[place]
        return Regathered(told.settings, told.taken, tuple(lacking), pieces=pieces)
    found = _given(handover_for, mine, givers, set(givers))
    model, optim = _assembled(found, told.settings)
    return Regathered(told.settings, told.taken, tuple(sorted(givers)), model=model, optim=optim)


def _told(
    handover_for: Callable[[int], Handover],
    mine: Pieces | None,
    groups: list[dict[str, Any]],
    extra: Mapping[str, Any],
) -> _Told:
    """What every rank holds, said by each in turn; rank 0's settings and extra state."""
    me, size = dist.get_rank(), dist.get_world_size()
    held: list[tuple[int, int] | None] = []
    settings: list[dict[str, Any]] = []
    taken: dict[str, Any] = {}
    for src in range(size):
        handover = handover_for(src)
        if src == me:
            info: dict[str, Any] = {HELD: None if mine is None else [mine.rank, mine.size]}
            if me == 0:
                info[TAKEN] = dict(extra)
            sent = Held({}), Held({"state": {}, "param_groups": groups if me == 0 else []})
            decoded, tensors = handover.state(*torch_sync.state_parts(*sent, info))  # type: ignore[arg-type]
        else:
            decoded, tensors = handover.state(None, b"")
        got_model, got_optim = Held(), Held()
        info = torch_sync.load_state_parts(got_model, got_optim, decoded, tensors)  # type: ignore[arg-type]
        held.append(None if info.get(HELD) is None else (int(info[HELD][0]), int(info[HELD][1])))
        if src == 0:
            settings, taken = got_optim.state["param_groups"], info.get(TAKEN, {})
    return _Told(held, settings, taken)


def _givers(held: list[tuple[int, int] | None]) -> dict[int, int]:
    """Each shard's first holder (the new rank that gives it); IncompleteShardsError where
    the ranks do not hold every shard of one world."""
    givers: dict[int, int] = {}
    for rank, said in enumerate(held):
        if said is not None and said[0] not in givers:
            givers[said[0]] = rank
    sizes = {said[1] for said in held if said is not None}
    if len(sizes) != 1 or set(givers) != set(range(next(iter(sizes)))):
        raise IncompleteShardsError(
            f"the world's ranks hold shards {sorted(givers)} of {sorted(sizes)} of the last "
            "world's model: not every shard of it"
        )
    return givers


def _given(
    handover_for: Callable[[int], Handover],
    mine: Pieces | None,
    givers: Mapping[int, int],
    wanted: set[int],
) -> dict[int, Pieces]:
    """Each shard of `givers` given by its holder, in shard order (every rank takes part);
    the pieces of the `wanted` ones kept."""
    me = dist.get_rank()
    found: dict[int, Pieces] = {}
    for shard, src in sorted(givers.items()):
        handover = handover_for(src)
        if src == me:
            assert mine is not None and mine.rank == shard
            said: dict[str, Any] = {HELD: [mine.rank, mine.size], CUTS: mine.cuts}
            sent = Held(mine.model), Held({"state": mine.optim, "param_groups": []})
            handover.state(*torch_sync.state_parts(*sent, said))  # type: ignore[arg-type]
            if shard in wanted:
                found[shard] = mine
            continue
        decoded, tensors = handover.state(None, b"")
        if shard in wanted:
            got_model, got_optim = Held(), Held()
            info = torch_sync.load_state_parts(got_model, got_optim, decoded, tensors)  # type: ignore[arg-type]
            rank, size = info[HELD]
            found[shard] = Pieces(rank, size, got_model.state, got_optim.state["state"], info[CUTS])
    return found


def _assembled(
    found: Mapping[int, Pieces], settings: list[dict[str, Any]]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The whole model and optimizer state from every old rank's pieces."""
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


def load(module: torch.nn.Module, optimizer: torch.optim.Optimizer, pieces: Pieces) -> None:
    """`module` (sharded over the same shards as `pieces`) and `optimizer` filled with this
    rank's own pieces: each DTensor made from its local piece on the parameter's mesh, as
    the parameter is placed (no collective); what was whole, as it is."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model = {
        name: _placed(pieces.model[name], value, pieces.cuts[f"model.{name}"])
        for name, value in module.state_dict().items()
    }
    set_model_state_dict(module, model, options=StateDictOptions(strict=True))

    def placed(name: str, key: str, value: Any, param: torch.nn.Parameter) -> Any:
        return _placed(value, param, pieces.cuts[f"optim.{name}.{key}"])

    shards.fill_optimizer(module, optimizer, pieces.optim, placed)


def _placed(piece: Any, like: Any, dim: int | None) -> Any:
    """`piece` as `like` holds it: a DTensor of `like`'s mesh, placements, shape and stride
    where the piece was cut (`dim` not None), else a copy of it."""
    from torch.distributed.tensor import DTensor

    if dim is None or not isinstance(like, DTensor):
        return piece.clone() if torch.is_tensor(piece) else piece
    return DTensor.from_local(
        piece.to(like.device),
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )
