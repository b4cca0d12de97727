"""PyTorch on cohort: gradient averaging, state broadcast and blobs, local SGD / DiLoCo.

Use it as `cohort.torch` (needs the `torch` extra: `pip install cohort-elastic[torch]`);
no other worker module imports it, so cohort itself never needs torch.

Tensors travel through `Collective` (Redis) as numpy arrays:

- float16/float32/float64 CPU tensors are zero-copy numpy views (`Tensor.numpy()`); CUDA
  tensors go bucket by bucket through pinned host buffers, copied non-blocking on a side
  stream and back on the caller's (`staging.py`, docs/gpu.md "Running on GPUs").
- bfloat16 has no numpy dtype. Averaging needs arithmetic, so bfloat16 gradients and
  weights are converted to float32 by torch, averaged (the collective sums in float64) and
  rounded back to bfloat16 once at the end. Where no arithmetic is needed (state blobs,
  broadcasts) bfloat16 and every other dtype numpy lacks travel as their raw bytes, exactly.
- the non-tensor part of an optimizer's state (step counts, param_groups with lr, betas,
  ...) travels as msgpack inside the same blob: no pickle, no `torch.save`, so a blob from
  another process cannot run code. A value msgpack cannot carry raises `StateError`.

Every collective call here has its own call id (`worker/collective/calls.py`), negative so it never
collides with the non-negative steps a training loop passes to `Collective` itself.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

import msgpack
import numpy as np
import torch

from cohort.events.errors import InvalidValueError
from cohort.worker.collective import tensors as blobs
from cohort.worker.collective.calls import BUFFERS, GRADIENTS, STATE, WEIGHTS, call_id
from cohort.worker.collective.compressors import (
    CALLS,
    DEFAULT_RANK,
    Compression,
    Compressor,
    compressor,
)
from cohort.worker.collective.redis_collective import Collective
from cohort.worker.errors import StateError, WorldChangedError
from cohort.worker.pytorch.staging import AVERAGED, HostCopies, Staging, staging_for

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
"""As DDP's default bucket_cap_mb: bounds the extra memory one allreduce call needs."""
META = "__meta__"
BLOB_VERSION = 1

_NUMPY = {
    torch.float16: np.float16,
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.int32: np.int32,
    torch.int64: np.int64,
    torch.uint8: np.uint8,
}
"""torch dtypes a blob carries natively; any other travels as its bytes (|u1)."""
_DTYPES = {str(d): d for d in (*_NUMPY, torch.bfloat16, torch.int8, torch.int16, torch.bool)}


# ------------------------------------------------------------------ tensors <-> numpy
Host = Callable[[torch.Tensor], torch.Tensor]
"""How a tensor reaches the host to be sent or written: a contiguous CPU tensor."""


def _on_host(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().cpu().contiguous()


def _wire(tensor: torch.Tensor, host: Host = _on_host) -> tuple[np.ndarray, list[Any]]:
    """The array that carries `tensor` exactly, and its [dtype, shape] for the meta; `host`
    brings it to the host (contiguous)."""
    t = host(tensor)
    meta = [str(t.dtype), list(t.shape)]
    if t.dtype in _NUMPY:
        return t.numpy(), meta
    if str(t.dtype) not in _DTYPES:
        raise StateError(f"tensor of dtype {t.dtype} cannot be sent; supported: {sorted(_DTYPES)}")
    return t.reshape(-1).view(torch.uint8).numpy(), meta


def dtype_named(name: str) -> torch.dtype:
    """The dtype a state meta names; StateError for one a state cannot carry."""
    if name not in _DTYPES:
        raise StateError(f"a state tensor of dtype {name!r}; supported: {sorted(_DTYPES)}")
    return _DTYPES[name]


def _unwire(array: np.ndarray, meta: Any, name: str) -> torch.Tensor:
    if not (isinstance(meta, list) and len(meta) == 2 and meta[0] in _DTYPES):
        raise StateError(f"tensor {name!r} has meta {meta!r}; want [dtype, shape]")
    dtype, shape = _DTYPES[meta[0]], meta[1]
    out = torch.from_numpy(np.array(array))  # a writable copy owned by torch
    if dtype not in _NUMPY:
        out = out.view(dtype)
    try:
        return out.reshape(shape)
    except RuntimeError as exc:
        raise StateError(f"tensor {name!r}: {exc}") from exc


# ------------------------------------------------------------------ gradients
def buckets(
    named: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of `named` of at most `bucket_bytes` each as averaged (a bigger
    tensor gets a bucket of its own). bfloat16 counts 4 bytes: it travels as float32."""
    bucket: list[tuple[str, torch.Tensor]] = []
    used = 0
    for name, tensor in named:
        size = tensor.numel() * (4 if tensor.dtype not in AVERAGED else tensor.element_size())
        if bucket and used + size > bucket_bytes:
            yield bucket
            bucket, used = [], 0
        bucket.append((name, tensor))
        used += size
    if bucket:
        yield bucket


Averaged = list[tuple[tuple[int, int], list[torch.Tensor], list[np.ndarray]]]
"""Per bucket: its staging slot, its tensors, and their means (host arrays)."""


def _average(
    named: Sequence[tuple[str, torch.Tensor]],
    collective: Collective,
    step: int,
    channel: int,
    bucket_bytes: int,
    world: int | None = None,
    compressor: Compressor | None = None,
    staging: Staging | None = None,
) -> Averaged:
    """Each bucket's tensors with their means over the world; nothing is written yet (`_land`
    does). With a `compressor`, the means are its (lossy, error-fed-back, the same on every
    rank). `staging`: how the tensors reach the host (by their device if not given)."""
    out: Averaged = []
    if staging is None:
        staging = staging_for(named[0][1].device) if named else Staging()
    try:
        for i, bucket in enumerate(buckets(named, bucket_bytes)):
            tensors = [t for _, t in bucket]
            arrays = dict(
                zip([n for n, _ in bucket], staging.to_host((channel, i), tensors), strict=True)
            )
            if compressor is None:
                mean = collective.allreduce(arrays, call_id(step, channel, i), world=world)
            else:
                ids = [call_id(step, channel, CALLS * i + k) for k in range(CALLS)]
                # float32 results may land in the arrays (the gradients' own memory, or the
                # pinned buffers); other widths get new arrays, cast back by write_back
                into = {n: a for n, a in arrays.items() if a.dtype == np.float32}
                mean = compressor.allreduce(collective, arrays, ids, world=world, out=into)
            out.append(((channel, i), tensors, [mean[name] for name, _ in bucket]))
    except WorldChangedError as exc:  # say which training step was aborted, not the call id
        raise WorldChangedError(step, exc.assignment) from exc
    return out


def _land(staging: Staging | None, averaged: Averaged) -> None:
    """Write each bucket's means into its tensors."""
    for slot, tensors, means in averaged:
        (staging or Staging()).from_host(slot, tensors, means)


def weigh_(tensors: Sequence[torch.Tensor], factor: float) -> None:
    """Multiply `tensors` in place by a rank's weight in the world's mean; a weight of 0 (a
    rank standing in, without samples) writes zeros, so an inf or NaN of its stand-in batch
    adds nothing (inf times 0 would be NaN in every rank's mean)."""
    if factor == 1.0 or not tensors:
        return
    with torch.no_grad():
        if factor == 0.0:
            torch._foreach_zero_(list(tensors))
        else:
            torch._foreach_mul_(list(tensors), factor)  # one launch per device and dtype


def sync_gradients(
    model: torch.nn.Module,
    collective: Collective,
    step: int,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    world: int | None = None,
    compressor: Compressor | None = None,
    staging: Staging | None = None,
) -> None:
    """Replace each parameter's `.grad` by its mean over the ranks of the world, as DDP does.

    `world`: the world version the loop synced its state for (WorldChangedError if the
    worker has moved on since). `compressor` (`cohort.torch.compressor("powersgd")` or
    "int8", one per model, `reset(step)` at each world start): send fewer bytes; every rank
    still gets the same gradients (docs/compression.md). `staging`: how the gradients
    reach the host and come back (worker/pytorch/staging.py; by default made for the
    gradients' device at each call: a loop should keep one, whose pinned buffers stay).

    Call it after `backward()` and before `optimizer.step()`. A parameter without a gradient
    on this rank counts as a zero gradient (every rank must send the same tensors). Buckets
    bound the memory: each allreduce flattens one bucket, not the whole model. Raises
    WorldChangedError if the world changes; the gradients are then partly averaged and the
    step must be dropped (zero_grad and redo it in the new world).
    """
    named = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        named.append((name, param.grad))
    if staging is None and named:
        staging = staging_for(named[0][1].device)
    _land(
        staging,
        _average(named, collective, step, GRADIENTS, bucket_bytes, world, compressor, staging),
    )


def exact_sum(
    collective: Collective, payload: torch.Tensor, step: int, world: int | None = None
) -> torch.Tensor:
    """The sum over the world of the int64 `payload` (worker/pytorch/exact.py's), exact,
    through Redis (integers are summed there, not averaged), on `payload`'s device; one
    call per step, in place of `sync_gradients`. WorldChangedError if the world changes."""
    try:
        got = collective.allreduce(
            {"exact": payload.cpu().numpy()}, call_id(step, GRADIENTS), world=world
        )
    except WorldChangedError as exc:
        raise WorldChangedError(step, exc.assignment) from exc
    return torch.from_numpy(np.array(got["exact"])).to(payload.device)


def allreduce(
    collective: Collective,
    tensors: Mapping[str, torch.Tensor],
    step: int,
    world: int | None = None,
    staging: Staging | None = None,
) -> dict[str, torch.Tensor]:
    """The mean of floating-point `tensors` over the world, as new tensors of their dtypes
    on their devices: `Collective.allreduce` for tensors, CUDA ones too (through pinned
    memory, worker/pytorch/staging.py). `step` as `Collective.allreduce`'s: non-negative,
    the same on every rank, one call per step and name set."""
    names = sorted(tensors)
    given = [tensors[n].detach() for n in names]
    if staging is None:
        staging = staging_for(given[0].device) if given else Staging()
    arrays = staging.to_host("allreduce", given)
    mean = collective.allreduce(dict(zip(names, arrays, strict=True)), step, world=world)
    out = [torch.empty_like(t) for t in given]
    staging.from_host("allreduce", out, [mean[n] for n in names])
    return dict(zip(names, out, strict=True))


# ------------------------------------------------------------------ buffers
def state_buffers(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers `model.state_dict()` holds (BatchNorm's running statistics and count; not
    those registered `persistent=False`), in its order: what the weights digest covers, so
    what every rank must hold alike at each step's end."""
    found, seen = [], set()
    for prefix, module in model.named_modules():
        for name, buffer in module._buffers.items():  # as Module._save_to_state_dict picks
            if buffer is None or name in module._non_persistent_buffers_set:
                continue
            if id(buffer) not in seen and not buffer.is_complex():
                seen.add(id(buffer))
                found.append((f"{prefix}.{name}" if prefix else name, buffer))
    return found


def buffer_sums(
    buffers: Sequence[tuple[str, torch.Tensor]], samples: int, chief: bool
) -> torch.Tensor:
    """This rank's part of a step's buffer sync, one float64 vector on the buffers' device:
    each floating-point buffer times the rank's `samples` this step, each other buffer (an
    integer count, a mask) times 1 on rank 0 (`chief`) and 0 elsewhere, then those two
    weights. Their sum (or mean) over the world, handed to `take_buffer_sums`, gives every
    rank the samples-weighted mean of the floating-point buffers and rank 0's others."""
    device = buffers[0][1].device
    weight, first = float(samples), 1.0 if chief else 0.0
    parts = []
    for _, buffer in buffers:
        flat = buffer.detach().reshape(-1).to(torch.float64)
        scale = weight if buffer.is_floating_point() else first
        # times 0 would keep an inf as a nan: a rank that does not count sends zeros
        parts.append(flat * scale if scale else torch.zeros_like(flat))
    parts.append(torch.tensor([weight, first], dtype=torch.float64, device=device))
    return torch.cat(parts)


def take_buffer_sums(buffers: Sequence[tuple[str, torch.Tensor]], sums: torch.Tensor) -> None:
    """Write into `buffers` what `buffer_sums`' sum (or mean) over the world says: a weighted
    mean of each floating-point buffer, rank 0's value of each other one. Ranks that agreed
    keep their bits: the float64 sums of equal values are exact."""
    samples, first = sums[-2], sums[-1]
    at = 0
    with torch.no_grad():
        for _, buffer in buffers:
            part = sums[at : at + buffer.numel()]
            at += buffer.numel()
            value = part / samples if buffer.is_floating_point() else (part / first).round()
            buffer.copy_(value.reshape(buffer.shape).to(buffer.device))


def sync_buffers(
    model: torch.nn.Module,
    collective: Collective,
    step: int,
    samples: int,
    world: int | None = None,
) -> None:
    """Give every rank of the world the same buffers at `step`'s end, through Redis: the
    floating-point ones (BatchNorm's running mean and variance) become their mean over the
    ranks, each weighted by the rank's `samples` this step; the others (BatchNorm's
    `num_batches_tracked`) rank 0's. Nothing is written if the world changes meanwhile
    (WorldChangedError). A model without buffers makes no call."""
    buffers = state_buffers(model)
    if not buffers:
        return
    sums = buffer_sums(buffers, samples, chief=collective.world().rank == 0)
    try:
        mean = collective.allreduce(
            {"buffers": sums.cpu().numpy()}, call_id(step, BUFFERS), world=world
        )
    except WorldChangedError as exc:
        raise WorldChangedError(step, exc.assignment) from exc
    take_buffer_sums(buffers, torch.from_numpy(np.array(mean["buffers"])))


# ------------------------------------------------------------------ state
Wire = Callable[[torch.Tensor], tuple[Any, list[Any]]]
"""What a tensor travels as, and its entry in the meta ([dtype, shape, ...])."""


def _encode(
    value: Any, path: str, tensors: dict[str, Any], metas: dict[str, Any], wire: Wire
) -> Any:
    """`value` as msgpack-able data; each tensor is moved to `tensors` (as `wire` makes it)
    and left as a reference."""
    if isinstance(value, torch.Tensor):
        array, meta = wire(value)
        tensors[path] = array
        metas[path] = meta
        return {"__tensor__": path}
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str | int):
                raise StateError(f"state key {key!r} at {path!r} is not a str or int")
            out[key] = _encode(item, f"{path}/{key}", tensors, metas, wire)
        return out
    if isinstance(value, tuple):
        return {
            "__tuple__": [
                _encode(v, f"{path}/{i}", tensors, metas, wire) for i, v in enumerate(value)
            ]
        }
    if isinstance(value, list):
        return [_encode(v, f"{path}/{i}", tensors, metas, wire) for i, v in enumerate(value)]
    if value is None or isinstance(value, bool | int | float | str | bytes):
        return value
    raise StateError(
        f"state value at {path!r} is a {type(value).__name__}, which msgpack cannot carry"
    )


def _decode(value: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__tensor__"}:
            try:
                return tensors[value["__tensor__"]]
            except KeyError as exc:
                raise StateError(
                    f"state refers to a missing tensor {value['__tensor__']!r}"
                ) from exc
        if set(value) == {"__tuple__"}:
            return tuple(_decode(v, tensors) for v in value["__tuple__"])
        return {k: _decode(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    return value


def state_tensors(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    extra: Mapping[str, Any] | None = None,
    host: Host = _on_host,
) -> dict[str, np.ndarray]:
    """Model and optimizer state as named arrays plus a `__meta__` uint8 array (msgpack).

    `extra` is any other state that travels with them (an LR scheduler's `state_dict()`,
    `torch.get_rng_state()`, epoch counters): tensors, numbers, strings and containers.
    `host` brings each tensor to the host (by default: a view where it is there already).
    """
    arrays, meta = _state(model, optimizer, extra, functools.partial(_wire, host=host))
    arrays[META] = np.frombuffer(meta, dtype=np.uint8)
    return arrays


def state_parts(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    extra: Mapping[str, Any] | None = None,
) -> tuple[dict[str, torch.Tensor], bytes]:
    """The state's tensors as they are (on their devices, not copied), by path, and the
    meta (msgpack) that holds the rest and names each tensor's [dtype, shape, device type]:
    what a world's process group carries (worker/pytorch/handover.py)."""
    return _state(model, optimizer, extra, _as_it_is)


def _as_it_is(tensor: torch.Tensor) -> tuple[torch.Tensor, list[Any]]:
    if str(tensor.dtype) not in _DTYPES:
        raise StateError(
            f"tensor of dtype {tensor.dtype} cannot be sent; supported: {sorted(_DTYPES)}"
        )
    return tensor.detach(), [str(tensor.dtype), list(tensor.shape), tensor.device.type]


def _state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    extra: Mapping[str, Any] | None,
    wire: Wire,
) -> tuple[dict[str, Any], bytes]:
    tensors: dict[str, Any] = {}
    metas: dict[str, Any] = {}
    model_state = _encode(dict(model.state_dict()), "model", tensors, metas, wire)
    optim_state = (
        _encode(optimizer.state_dict(), "optim", tensors, metas, wire)
        if optimizer is not None
        else None
    )
    extra_state = _encode(dict(extra), "extra", tensors, metas, wire) if extra is not None else None
    meta = msgpack.packb(
        {
            "v": BLOB_VERSION,
            "model": model_state,
            "optim": optim_state,
            "extra": extra_state,
            "tensors": metas,
        },
        use_bin_type=True,
    )
    return tensors, meta


def read_meta(raw: bytes) -> dict[str, Any]:
    """The state meta `state_tensors` or `state_parts` made; StateError if it is not one."""
    try:
        meta = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types for bad bytes
        raise StateError(f"state meta is not msgpack: {type(exc).__name__}: {exc}") from exc
    version = meta.get("v") if isinstance(meta, dict) else meta
    if version != BLOB_VERSION:
        raise StateError(f"state meta version {version!r}; this reader knows {BLOB_VERSION}")
    return meta  # type: ignore[no-any-return]


def load_state_tensors(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    arrays: Mapping[str, np.ndarray],
) -> dict[str, Any]:
    """Load what `state_tensors` made (on another rank) into `model` and `optimizer`;
    returns its `extra` state ({} if it had none)."""
    if META not in arrays:
        raise StateError(f"state has no {META!r} entry; it was not made by state_tensors")
    meta = read_meta(bytes(arrays[META]))
    kinds = meta.get("tensors", {})
    tensors = {}
    for name, array in arrays.items():
        if name == META:
            continue
        if name not in kinds:
            raise StateError(f"tensor {name!r} has no entry in the state meta")
        tensors[name] = _unwire(array, kinds[name], name)
    return load_state_parts(model, optimizer, meta, tensors)


def load_state_parts(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    meta: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
) -> dict[str, Any]:
    """Load a state's `meta` (`read_meta`) with its `tensors` by path into `model` and
    `optimizer`; returns its `extra` state ({} if it had none)."""
    model.load_state_dict(_decode(meta["model"], tensors))
    if optimizer is not None:
        if meta.get("optim") is None:
            raise StateError("the state carries no optimizer state but an optimizer was given")
        optimizer.load_state_dict(_decode(meta["optim"], tensors))
    extra = meta.get("extra")
    return dict(_decode(extra, tensors)) if extra is not None else {}


def state_blob(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: Mapping[str, Any] | None = None,
) -> bytes:
    """Model, optimizer and `extra` state as one tensor blob (collective/tensors.py's format), for
    a joiner or a checkpoint: no pickle, so loading one never runs code."""
    return blobs.join(blobs.pack(state_tensors(model, optimizer, extra)))


def state_capture(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Callable[[], bytes]:
    """The `state_blob` of the state as it is now, made when called (on a checkpoint
    writer's thread): the tensors are copied now, a GPU's into pinned memory without the
    host waiting (`HostCopies`); the call waits for those copies, then packs. A value
    msgpack cannot carry raises here, on the caller's thread."""
    copies = HostCopies()
    arrays = state_tensors(model, optimizer, extra, host=copies.take)
    copies.recorded()

    def blob() -> bytes:
        copies.wait()
        return blobs.join(blobs.pack(arrays))

    return blob


def load_state_blob(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, blob: bytes
) -> dict[str, Any]:
    """Load a `state_blob` into `model` (and `optimizer`); returns its extra state. Raises
    BlobError/StateError if the blob is bad."""
    return load_state_tensors(model, optimizer, blobs.unpack(blob))


def broadcast_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    collective: Collective,
    step: int,
    root: int = 0,
    world: int | None = None,
) -> None:
    """Give every rank `root`'s model and optimizer state (call it at the start of a world).

    All tensors and the msgpack meta go in one `Collective.broadcast`; receivers load them,
    the root keeps its own. Raises WorldChangedError if the world changes meanwhile.
    """
    mine = collective.world().rank == root
    try:
        got = collective.broadcast(
            state_tensors(model, optimizer) if mine else None,
            root=root,
            step=call_id(step, STATE),
            world=world,
        )
    except WorldChangedError as exc:
        raise WorldChangedError(step, exc.assignment) from exc
    if not mine:
        load_state_tensors(model, optimizer, got)


# ------------------------------------------------------------------ local SGD / DiLoCo
class LocalSGD:
    """Train locally, average every `sync_every` steps: cohort's Redis carries H times less.

    mode="weights": every rank takes the mean of the ranks' weights (local SGD / model
    averaging). mode="pseudo_gradient" (DiLoCo): every rank keeps the global weights of the
    last sync; the pseudo-gradient is global - local, averaged over ranks, and an outer SGD
    step (optionally with momentum / Nesterov) moves the global weights, which every rank
    then takes. With outer_lr=1 and no momentum both modes give the same weights.

    Call `step(step)` after each inner `optimizer.step()`; call `reset()` after each world
    start's `broadcast_state`, so every rank holds the same global weights and momentum.

    `compression` ("powersgd" with `rank`, or "int8"; pseudo_gradient mode only) sends the
    pseudo-gradients compressed with error feedback (docs/compression.md); every rank
    still applies the same outer update. `reset(step)` with the world's first step also
    restarts the compressor's state there.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        collective: Collective,
        sync_every: int,
        mode: Literal["weights", "pseudo_gradient"] = "weights",
        outer_lr: float = 1.0,
        outer_momentum: float = 0.0,
        nesterov: bool = False,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        compression: Compression | None = None,
        rank: int = DEFAULT_RANK,
    ) -> None:
        if sync_every < 1:
            raise InvalidValueError(f"sync_every must be >= 1, not {sync_every!r}")
        if mode not in ("weights", "pseudo_gradient"):
            raise InvalidValueError(f"mode must be 'weights' or 'pseudo_gradient', not {mode!r}")
        if not (outer_lr > 0 and math.isfinite(outer_lr)):
            raise InvalidValueError(f"outer_lr must be a positive number, not {outer_lr!r}")
        if not 0.0 <= outer_momentum < 1.0:
            raise InvalidValueError(f"outer_momentum must be in [0, 1), not {outer_momentum!r}")
        self.compressor = compressor(compression, rank)
        if self.compressor is not None and mode != "pseudo_gradient":
            raise InvalidValueError(
                f"compression {compression!r} needs mode='pseudo_gradient' (weights are not "
                "compressed), not mode={mode!r}"
            )
        self.model = model
        self.collective = collective
        self.sync_every = sync_every
        self.mode = mode
        self.outer_lr = outer_lr
        self.outer_momentum = outer_momentum
        self.nesterov = nesterov
        self.bucket_bytes = bucket_bytes
        self.syncs = 0
        self.global_params: dict[str, torch.Tensor] = {}
        self.momentum: dict[str, torch.Tensor] = {}
        self._staging: Staging | None = None
        self._staging_device: torch.device | None = None
        self.reset()

    def _params(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    def _staging_of(self, params: list[tuple[str, torch.nn.Parameter]]) -> Staging:
        """The staging for the parameters' device, kept (its pinned buffers with it)."""
        device = params[0][1].device if params else torch.device("cpu")
        if self._staging is None or self._staging_device != device:
            self._staging, self._staging_device = staging_for(device), device
        return self._staging

    def reset(self, step: int = 0) -> None:
        """Take the model's current weights as the global weights; zero the outer momentum;
        restart the compressor (error, Q) from `step` (the world's first step, the same on
        every rank)."""
        with torch.no_grad():
            self.global_params = {n: p.detach().float().clone() for n, p in self._params()}
        self.momentum = {}
        if self.compressor is not None:
            self.compressor.reset(step)

    def due(self, step: int) -> bool:
        return (step + 1) % self.sync_every == 0

    def step(self, step: int) -> bool:
        """Average if `step` ends a period of `sync_every` steps; True if it did.

        Raises WorldChangedError if the world changes during the averaging; the model's
        weights are then untouched (all buckets are averaged before any is written).
        """
        if not self.due(step):
            return False
        params = self._params()
        staging = self._staging_of(params)
        if self.mode == "weights":
            averaged = _average(
                params, self.collective, step, WEIGHTS, self.bucket_bytes, staging=staging
            )
            _land(staging, averaged)
            self.reset_global_from_model()
        else:
            with torch.no_grad():
                deltas = [
                    (name, self.global_params[name] - param.detach().float())
                    for name, param in params
                ]
            means = _average(
                deltas, self.collective, step, WEIGHTS, self.bucket_bytes, None, self.compressor,
                staging,
            )  # fmt: skip
            _land(staging, means)  # each delta now holds its mean, on the weights' device
            with torch.no_grad():
                for (name, param), (_, update) in zip(params, deltas, strict=True):
                    if self.outer_momentum:
                        buf = self.momentum.get(name)
                        buf = (
                            update.clone()
                            if buf is None
                            else buf.mul_(self.outer_momentum).add_(update)
                        )
                        self.momentum[name] = buf
                        update = update + self.outer_momentum * buf if self.nesterov else buf
                    self.global_params[name].sub_(update, alpha=self.outer_lr)
                    param.copy_(self.global_params[name])
        self.syncs += 1
        return True

    def reset_global_from_model(self) -> None:
        with torch.no_grad():
            for name, param in self._params():
                self.global_params[name].copy_(param.detach().float())


class Held:
    """A state dict held as data, with a module's `state_dict`/`load_state_dict`: what lets
    `state_blob` and `state_parts` carry a gathered (FQN-keyed) state, or a rank's shards of
    one, in the format a module's takes."""

    def __init__(self, state: Any = None) -> None:
        self.state = state

    def state_dict(self) -> Any:
        return self.state

    def load_state_dict(self, state: Any) -> None:
        self.state = state
