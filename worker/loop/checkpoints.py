"""Checkpoints through fsspec: one self-describing file each, written whole or not at all
(a sharded model's names its shards, written beside it: worker/pytorch/shards.py).

A file is ``MAGIC | u32 header length | msgpack header | payload``. The header says
which job and step the weights are of, their digest (as StepDone reports it) and the
data position after that step, so `cohort resume --from-checkpoint URI` can continue
from any checkpoint file, indexed or not. The payload is whatever the training loop
saves (`worker/collective/tensors.py` blobs for numpy, `cohort.torch.state_blob` for torch).

Writes go to a temporary name beside the target and are then moved onto it (a rename
on local and most network filesystems; on object stores the object appears whole),
and the leader indexes a checkpoint only after its writer reports it with the sha256
of its bytes. So a writer killed mid-write leaves, at worst, a temporary file nothing
refers to, and a reader checks what it loads against the journaled sha256.

`CheckpointWriter` is the background thread a training process uses: the loop hands it
a snapshot and goes on training.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import struct
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgpack

from cohort.events import storage
from cohort.events.models import CheckpointRequested, DataPosition
from cohort.worker.errors import WorkerError

if TYPE_CHECKING:
    from cohort.worker.membership.client import Worker

MAGIC = b"COHORT-CKPT\n"
FORMAT = 1
_LENGTH = struct.Struct("<I")
MAX_HEADER_BYTES = 1024 * 1024
log = logging.getLogger("cohort.checkpoints")


class CheckpointError(WorkerError):
    """A checkpoint cannot be written, read or trusted; the message names its URI."""


@dataclass(frozen=True, slots=True)
class Written:
    uri: str
    sha256: str
    bytes: int


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A checkpoint file as read back: its header fields and its payload."""

    job: str
    step: int
    digest: str | None
    position: DataPosition
    payload: bytes
    sha256: str


def write(
    uri: str,
    job: str,
    step: int,
    digest: str | None,
    position: DataPosition,
    payload: bytes | memoryview,
) -> Written:
    """Write a checkpoint to `uri`, atomically; its sha256 and size."""
    header = msgpack.packb(
        {
            "format": FORMAT,
            "job": job,
            "step": step,
            "digest": digest,
            "position": position.model_dump(mode="json"),
            "payload_bytes": len(memoryview(payload)),
        },
        use_bin_type=True,
    )
    parts = (MAGIC, _LENGTH.pack(len(header)), header, payload)
    sha = hashlib.sha256()
    for part in parts:
        sha.update(part)
    write_whole(uri, parts, "checkpoint")
    return Written(uri=uri, sha256=sha.hexdigest(), bytes=sum(len(memoryview(p)) for p in parts))


def write_whole(uri: str, parts: Iterable[bytes | memoryview], what: str = "file") -> None:
    """`storage.write_whole`, failing with a CheckpointError."""
    try:
        storage.write_whole(uri, parts, what)
    except storage.StorageError as exc:
        raise CheckpointError(str(exc)) from exc


def read(uri: str, sha256: str | None = None) -> Checkpoint:
    """The checkpoint at `uri`; CheckpointError if it is missing, torn, or not `sha256`."""
    try:
        raw = storage.read_whole(uri, "checkpoint")
    except storage.StorageError as exc:
        raise CheckpointError(str(exc)) from exc
    digest = hashlib.sha256(raw).hexdigest()
    if sha256 is not None and digest != sha256:
        raise CheckpointError(
            f"checkpoint {uri!r} has sha256 {digest}, not the journaled {sha256}: it was "
            "changed or cut short since it was written"
        )
    return _parse(uri, raw, digest)


def _parse(uri: str, raw: bytes, digest: str) -> Checkpoint:
    if not raw.startswith(MAGIC) or len(raw) < len(MAGIC) + _LENGTH.size:
        raise CheckpointError(f"{uri!r} is not a cohort checkpoint (no {MAGIC!r} header)")
    at = len(MAGIC)
    (length,) = _LENGTH.unpack_from(raw, at)
    at += _LENGTH.size
    if length > MAX_HEADER_BYTES or at + length > len(raw):
        raise CheckpointError(f"checkpoint {uri!r} is cut short (header of {length} bytes)")
    try:
        header = msgpack.unpackb(raw[at : at + length], raw=False)
        position = DataPosition.model_validate(header["position"])
        step, job, weights = int(header["step"]), str(header["job"]), header.get("digest")
    except Exception as exc:
        raise CheckpointError(f"checkpoint {uri!r} has an unreadable header: {exc}") from exc
    if header.get("format") != FORMAT:
        raise CheckpointError(
            f"checkpoint {uri!r} has format {header.get('format')!r}; this cohort reads {FORMAT}"
        )
    payload = raw[at + length :]
    if len(payload) != header.get("payload_bytes"):
        raise CheckpointError(
            f"checkpoint {uri!r} is cut short: {len(payload)} of "
            f"{header.get('payload_bytes')} payload bytes"
        )
    return Checkpoint(job, step, weights, position, payload, digest)


SHARDS_SUFFIX = ".shards"
"""A sharded model's checkpoint file F keeps its shards under F + SHARDS_SUFFIX
(worker/pytorch/shards.py)."""


def delete(uri: str) -> bool:
    """Remove the checkpoint at `uri`, and its shards if it has any; False if it was not
    there."""
    try:
        storage.remove_tree(f"{uri}{SHARDS_SUFFIX}")
        return storage.remove(uri)
    except storage.StorageError as exc:
        raise CheckpointError(str(exc)) from exc


class CheckpointWriter:
    """Writes the checkpoints a worker is asked for, in the background, one at a time.

    `submit` takes a request and a function producing the payload from a snapshot the
    caller made (the training loop goes on changing its own weights). The thread writes
    the file, reports it to the leader (CheckpointWritten), then deletes the files of
    checkpoints the leader expired and named this worker to delete.
    """

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self._queue: queue.Queue[tuple[CheckpointRequested, Callable[[], bytes], str | None] | None]
        self._queue = queue.Queue()
        self._deleted: set[str] = set()
        self._thread = threading.Thread(
            target=self._run, name=f"cohort-checkpoint-{worker.id}", daemon=True
        )
        self._thread.start()

    def submit(
        self, request: CheckpointRequested, payload: Callable[[], bytes], digest: str | None
    ) -> None:
        self._queue.put((request, payload, digest))

    def close(self, timeout: float = 60.0) -> None:
        """Finish what was submitted (up to `timeout` seconds), then stop."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            request, payload, digest = item
            try:
                written = write(
                    request.uri, request.job, request.step, digest, request.position, payload()
                )
                self.worker.checkpoint_written(
                    request.step, written.uri, written.sha256, written.bytes, digest
                )
                log.info(
                    "checkpoint of step %d written to %s (%d bytes)",
                    request.step,
                    written.uri,
                    written.bytes,
                )
                self._indexed(written.uri)
            except Exception:
                log.exception("checkpoint of step %d to %s failed", request.step, request.uri)
            self._delete_expired()

    def _indexed(self, uri: str) -> None:
        """Wait (a little) until the leader has indexed `uri`: the files it expires in the
        same decision are this writer's to delete, also after the job's last step."""
        try:
            self.worker.wait_for(lambda view: any(c.uri == uri for c in view.checkpoints), 10.0)
        except WorkerError as exc:  # removed, stopped, or no answer: the next write deletes
            log.debug("checkpoint %s not indexed yet (%s)", uri, exc)

    def _delete_expired(self) -> None:
        for expired in self.worker.view.expired:
            if expired.uri not in self._deleted:
                delete(expired.uri)
                self._deleted.add(expired.uri)


def pending(requested: tuple[CheckpointRequested, ...], step: int) -> CheckpointRequested | None:
    """The request to write the weights after `step`, if this worker has one."""
    return next((r for r in requested if r.step == step), None)


def tensors_payload(params: Mapping[str, Any]) -> Callable[[], bytes]:
    """A payload function for a dict of numpy arrays (copied now, packed later)."""
    from cohort.worker.collective import tensors

    snapshot = {name: value.copy() for name, value in params.items()}
    return lambda: tensors.join(tensors.pack(snapshot))
