"""A world's state from its rank 0 to every rank, through the world's process group.

On a backend route (gloo, NCCL) each world has a process group, and the state a world
starts from (rank 0's weights, optimizer state, scheduler, RNG and `extra`) goes through it
rather than through Redis: NCCL moves it between GPUs without the host copying it, and gloo
straight from rank 0's process to each peer's. What travels:

1. a header (the meta's length and the payload's), then the meta (msgpack: the state's
   structure and each tensor's dtype, shape and device type, `sync.state_parts`);
2. the tensors' bytes in buckets of at most `BUCKET_BYTES` (a tensor bigger than that goes
   alone, received in place), each bucket one uint8 broadcast.

Every wait is the world's guarded one: the header and meta are fenced before they are
read (on NCCL a host read of a hung kernel would block), each bucket is waited for under
the watchdog, and all of them are fenced before the state is loaded; a peer lost on the
way raises WorldChangedError and the world is begun again, as through Redis.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from cohort.worker.pytorch import sync as torch_sync

BUCKET_BYTES = 64 * 1024 * 1024
"""The most bytes packed into one broadcast (and the extra memory a bucket costs)."""
ALIGN = 16
"""Each tensor's place in a bucket is a multiple of this: any dtype can view it."""


@dataclass(frozen=True)
class Entry:
    path: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    device_type: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def entries(meta: Mapping[str, Any]) -> list[Entry]:
    """The tensors a state meta describes, in its order (the same on every rank)."""
    kinds = meta.get("tensors", {})
    return [
        Entry(path, torch_sync.dtype_named(kind[0]), tuple(kind[1]), kind[2])
        for path, kind in kinds.items()
    ]


def buckets(items: Sequence[Entry], limit: int = BUCKET_BYTES) -> Iterator[list[Entry]]:
    """Consecutive entries packed up to `limit` bytes (aligned); one bigger goes alone."""
    bucket: list[Entry] = []
    used = 0
    for entry in items:
        if not entry.nbytes:
            continue
        size = _aligned(entry.nbytes)
        if bucket and used + size > limit:
            yield bucket
            bucket, used = [], 0
        bucket.append(entry)
        used += size
    if bucket:
        yield bucket


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat uint8 view (writing it writes the tensor)."""
    return tensor.reshape(-1).view(torch.uint8)


class Handover:
    """One world start's transfer: `rdzv` (ElasticProcessGroup) guards every wait, tensors
    travel on `carrier` (NCCL: this rank's GPU; gloo: the CPU), and a receiver's tensors
    land on `device` unless they were on the CPU at rank 0."""

    def __init__(
        self,
        rdzv: Any,
        carrier: torch.device,
        device: torch.device,
        completion: Any,
        step: int,
        src: int = 0,
    ) -> None:
        self.rdzv = rdzv
        self.src = src
        """The rank that gives the state (rank 0, unless a sharded world gathers its
        survivors' shards: worker/pytorch/sharded.py)."""
        self.carrier = carrier
        self.device = device
        self.completion = completion
        self.step = step
        self.limit = BUCKET_BYTES
        self.works: list[Any] = []

    def state(
        self, parts: Mapping[str, torch.Tensor] | None, meta: bytes
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Rank `src` gives its `parts` and `meta` (`sync.state_parts`); every rank gets the
        meta, decoded, and the tensors by path (`src` its own), placed."""
        raw = self._meta(meta)
        decoded = torch_sync.read_meta(raw)
        listed = entries(decoded)
        if parts is not None:
            for bucket in buckets(listed, self.limit):
                self._send(bucket, parts)
            self.rdzv.fence(self.works, self.completion, self.step)
            return decoded, dict(parts)
        got = {e.path: torch.empty(e.shape, dtype=e.dtype, device=self.carrier) for e in listed}
        for bucket in buckets(listed, self.limit):
            self._receive(bucket, got)
        self.rdzv.fence(self.works, self.completion, self.step)
        return decoded, {e.path: self._placed(got[e.path], e) for e in listed}

    def _meta(self, meta: bytes) -> bytes:
        """The meta's bytes from rank `src` (which gives them): its length first, then itself,
        each fenced before the host reads it."""
        header = torch.tensor([len(meta)], dtype=torch.int64, device=self.carrier)
        self._fenced(header)
        body = torch.empty(int(header.cpu()[0]), dtype=torch.uint8, device=self.carrier)
        if meta:
            body.copy_(torch.frombuffer(bytearray(meta), dtype=torch.uint8))
        self._fenced(body)
        return meta if meta else bytes(body.cpu().numpy())

    def _fenced(self, tensor: torch.Tensor) -> None:
        self._broadcast(tensor)
        self.rdzv.fence(self.works, self.completion, self.step)
        self.works = []

    def _send(self, bucket: list[Entry], parts: Mapping[str, torch.Tensor]) -> None:
        if len(bucket) == 1:
            tensor = parts[bucket[0].path].detach().to(self.carrier).contiguous()
            self._broadcast(_bytes_of(tensor))
            return
        packed = torch.empty(sum(_aligned(e.nbytes) for e in bucket), dtype=torch.uint8,
                             device=self.carrier)  # fmt: skip
        at = 0
        for entry in bucket:
            source = parts[entry.path].detach().contiguous()
            packed[at : at + entry.nbytes].copy_(_bytes_of(source))
            at += _aligned(entry.nbytes)
        self._broadcast(packed)

    def _receive(self, bucket: list[Entry], got: Mapping[str, torch.Tensor]) -> None:
        if len(bucket) == 1:
            self._broadcast(_bytes_of(got[bucket[0].path]))  # in place
            return
        packed = torch.empty(sum(_aligned(e.nbytes) for e in bucket), dtype=torch.uint8,
                             device=self.carrier)  # fmt: skip
        self._broadcast(packed)
        at = 0
        for entry in bucket:  # queued behind the broadcast (NCCL), or after its data (gloo)
            _bytes_of(got[entry.path]).copy_(packed[at : at + entry.nbytes])
            at += _aligned(entry.nbytes)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        """rank `src`'s `tensor` into every rank's, waited for under the watchdog (gloo: its
        data arrived; NCCL: queued on this rank's stream)."""
        work = dist.broadcast(tensor, src=self.src, async_op=True)
        assert work is not None
        self.rdzv.wait(work, self.step)
        self.works.append(work)

    def _placed(self, tensor: torch.Tensor, entry: Entry) -> torch.Tensor:
        """On the CPU where rank 0 had it there (RNG states, a scheduler's), else on this
        rank's device."""
        return tensor.to("cpu" if entry.device_type == "cpu" else self.device)
