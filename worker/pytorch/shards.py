"""A sharded model's checkpoints: every rank writes its own shards, any world size reads them.

A checkpoint of a model sharded with `wrap(shard=...)` is the usual checkpoint file (its
header says the job, step, weights digest and data position; its sha256 is journaled) whose
payload is a manifest: where the shards are, the sha256 of each of their files, and what
is not sharded (the optimizer's settings, the RNG, scheduler, scaler and script state, as
`sync.state_blob` packs them). The shards are written by torch.distributed.checkpoint (DCP)
through fsspec into a directory beside the file, `step-N.ckpt.shards/worldW/`: each rank
writes the parts of the model and optimizer state it holds, rank 0 the metadata, and no
rank ever holds the whole state. A world of another size reads the same files, each rank
the parts its own shards cover (DCP reshards on load).

Trust follows the file: the journal holds the manifest's sha256, the manifest every shard
file's, and the rank that brings a checkpoint to a world (rank 0) checks them all before
any rank loads. The directory is named for the world that wrote it, so a world that failed
halfway through writing leaves files that no manifest names, never files mixed into a
complete checkpoint's. Every rank must reach the same storage (a shared filesystem or an
object store).
"""

from __future__ import annotations

import posixpath
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from cohort.events import storage
from cohort.worker.loop.checkpoints import SHARDS_SUFFIX, CheckpointError

MAGIC = b"COHORT-SHARDS\n"
"""The first bytes of a sharded checkpoint's payload (a whole one is a state blob)."""
METADATA = ".metadata"
"""The file DCP writes last, naming where every part of the state is."""


def relative_location(step_uri: str, world: int) -> str:
    """Where world `world` writes the shards of the checkpoint file `step_uri`, relative
    to the file's directory."""
    return f"{posixpath.basename(step_uri)}{SHARDS_SUFFIX}/world{world}"


def absolute(step_uri: str, relative: str) -> str:
    return f"{posixpath.dirname(step_uri)}/{relative}"


@dataclass(frozen=True)
class Shards:
    """A sharded checkpoint as its manifest names it: the shards' directory (absolute),
    their files' sha256, and the state blob of what is not sharded."""

    location: str
    files: Mapping[str, str]
    blob: bytes


def resharded(module: torch.nn.Module) -> torch.nn.Module:
    """`module` with its sharded parameters in place, as between training steps: a forward
    outside training (an evaluation under no_grad) leaves FSDP's root module unsharded (it
    keeps its parameters gathered for the backward that usually follows), and gathered
    parameters name no optimizer state. No collective."""
    from torch.distributed.fsdp import FSDPModule

    for part in module.modules():
        if isinstance(part, FSDPModule):
            part.reshard()
    return module


def flat(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What DCP writes and reads: the module's state dict (DTensors: each rank its shards)
    and the optimizer's per-parameter state keyed by parameter name (a tensor the shape of
    its parameter sharded as it is; a step count as it is)."""
    names = {id(p): name for name, p in resharded(module).named_parameters()}
    optim = {names[id(p)]: dict(values) for p, values in optimizer.state.items()}
    return {"model": module.state_dict(), "optim": optim}


def fill_optimizer(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    by_name: Mapping[str, Mapping[str, Any]],
    placed: Callable[[str, str, Any, torch.nn.Parameter], Any],
) -> None:
    """`optimizer`'s state made anew for `module`'s parameters from a state keyed by
    parameter name (as `flat` names it), each value as `placed(name, key, value, param)`
    gives it. No step of zeros is run to make the state first, as torch's
    `set_optimizer_state_dict` does."""
    params = dict(module.named_parameters())
    optimizer.state.clear()
    for name, values in by_name.items():
        param = params[name]
        optimizer.state[param] = {
            key: placed(name, key, value, param) for key, value in values.items()
        }


def save(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    location: str,
    group: Any = None,
) -> list[str]:
    """Every rank's shards of the model and optimizer state written under `location` (a
    collective over `group`, default the world's: every rank of it calls it); the files
    written, metadata last. RuntimeError where a lost peer broke it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    try:
        written = dcp.save(
            flat(module, optimizer), storage_writer=FsspecWriter(location), process_group=group
        )
    except dcp.CheckpointException as exc:  # a BaseException: a peer's failure, gathered
        raise RuntimeError(f"the sharded checkpoint to {location} failed: {exc}") from None
    return sorted({item.relative_path for item in written.storage_data.values()}) + [METADATA]


def manifest(location: str, relative: str, files: list[str], blob: bytes) -> bytes:
    """The payload of a sharded checkpoint: its shards (`relative` to the checkpoint file,
    at `location`), each file's sha256 (read back now: called on the writer's thread), and
    `blob`."""
    hashes = {name: storage.sha256_of(f"{location}/{name}", "checkpoint shard") for name in files}
    body = msgpack.packb({"location": relative, "files": hashes, "blob": blob})
    return MAGIC + body


def is_manifest(payload: bytes) -> bool:
    return payload.startswith(MAGIC)


def read_manifest(step_uri: str, payload: bytes) -> Shards:
    """The shards the payload of checkpoint `step_uri` names, every file checked against
    its sha256; CheckpointError naming the first that is missing or changed."""
    try:
        body = msgpack.unpackb(payload[len(MAGIC) :], raw=False)
        relative, files, blob = str(body["location"]), dict(body["files"]), bytes(body["blob"])
    except Exception as exc:
        raise CheckpointError(f"checkpoint {step_uri!r} has an unreadable manifest: {exc}") from exc
    location = absolute(step_uri, relative)
    for name, want in files.items():
        try:
            got = storage.sha256_of(f"{location}/{name}", "checkpoint shard")
        except storage.StorageError as exc:
            raise CheckpointError(f"checkpoint {step_uri!r}: {exc}") from exc
        if got != want:
            raise CheckpointError(
                f"checkpoint {step_uri!r}: shard file {location}/{name} has sha256 {got}, not "
                f"the manifest's {want}: it was changed or cut short since it was written"
            )
    return Shards(location, files, blob)


def load(module: torch.nn.Module, optimizer: torch.optim.Optimizer, location: str) -> None:
    """Each rank's parts of the model and optimizer state read from `location`, whatever
    world wrote it (a collective). The optimizer's state is made from the metadata (a
    tensor the shape of its parameter sharded as the parameter is), then filled in place:
    no step of zeros is run to make it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    reader = FsspecReader(location)
    params = dict(module.named_parameters())
    optim: dict[str, dict[str, Any]] = {}
    for key, meta in reader.read_metadata().state_dict_metadata.items():
        if not key.startswith("optim."):
            continue
        name, field = key[len("optim.") :].rsplit(".", 1)
        param = params[name]
        if not isinstance(meta, dcp.TensorStorageMetadata):
            optim.setdefault(name, {})[field] = None  # bytes: DCP puts the value itself
        elif tuple(meta.size) == tuple(param.shape):
            optim.setdefault(name, {})[field] = torch.empty_like(param.detach())
        else:
            optim.setdefault(name, {})[field] = torch.empty(
                tuple(meta.size), dtype=meta.properties.dtype, device=param.device
            )
    state = {"model": module.state_dict(), "optim": optim}
    try:
        dcp.load(state, storage_reader=reader)
    except dcp.CheckpointException as exc:
        raise RuntimeError(f"the sharded checkpoint at {location} did not load: {exc}") from None
    optimizer.state.clear()
    for name, values in state["optim"].items():
        optimizer.state[params[name]] = values


def whole_model(template: torch.nn.Module, location: str) -> dict[str, torch.Tensor]:
    """The whole model's state dict read from the shards at `location`, in this process
    alone (no world: a joiner's final weights, `job.save`, a digest before a world)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    state = {"model": {k: v.detach().clone() for k, v in template.state_dict().items()}}
    try:
        with warnings.catch_warnings():  # that it loads in one process: as it is meant to
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.load(state, storage_reader=FsspecReader(location), no_dist=True)
    except dcp.CheckpointException as exc:
        raise CheckpointError(f"the sharded checkpoint at {location} did not load: {exc}") from None
    return state["model"]
