"""Whole files through fsspec: a local path, file://, s3://, gs://, or any filesystem fsspec
knows. What cohort keeps outside Redis (checkpoints, the journal's archived segments) is
written here whole or not at all, and read back whole."""

from __future__ import annotations

import hashlib
import logging
import secrets
from collections.abc import Iterable
from typing import Any

from cohort.events.errors import EventsError

log = logging.getLogger("cohort.storage")

CHUNK_BYTES = 8 * 1024 * 1024
"""How much of a file `sha256_of` reads at a time."""
CHECKPOINT_NAME = "step-{step:012d}.ckpt"
"""A checkpoint's file under the job's checkpoint URI."""


class StorageError(EventsError):
    """A file cannot be written, read or removed; the message names its URI and why."""


def filesystem(uri: str) -> tuple[Any, str]:
    """The fsspec filesystem that holds `uri`, and the path of `uri` on it."""
    import fsspec

    try:
        return fsspec.core.url_to_fs(uri)
    except (ImportError, ValueError) as exc:
        raise StorageError(
            f"URI {uri!r} cannot be opened ({exc}); use a path, file://..., or a "
            "filesystem fsspec knows (its extra installed, e.g. s3fs for s3://)"
        ) from exc


def write_whole(uri: str, parts: Iterable[bytes | memoryview], what: str = "file") -> None:
    """`parts` one after the other into `uri`, whole or not at all: written beside it under
    a temporary name, then moved into place (a rename on local and most network
    filesystems; on object stores the object appears whole)."""
    fs, path = filesystem(uri)
    tmp = f"{path}.tmp-{secrets.token_hex(4)}"
    try:
        parent = path.rsplit("/", 1)[0] if "/" in path else ""
        if parent:
            fs.makedirs(parent, exist_ok=True)
        with fs.open(tmp, "wb") as out:
            for part in parts:
                out.write(part)
        fs.mv(tmp, path)
    except OSError as exc:
        _remove(fs, tmp)
        raise StorageError(f"cannot write {what} {uri!r}: {exc}") from exc


def read_whole(uri: str, what: str = "file") -> bytes:
    """The bytes of the file at `uri`; StorageError if it is missing or unreadable."""
    fs, path = filesystem(uri)
    try:
        with fs.open(path, "rb") as handle:
            data: bytes = handle.read()
    except (OSError, FileNotFoundError) as exc:
        raise StorageError(f"cannot read {what} {uri!r}: {exc}") from exc
    return data


def sha256_of(uri: str, what: str = "file") -> str:
    """The sha256 of the file at `uri`, read in chunks; StorageError if it cannot be read."""
    fs, path = filesystem(uri)
    digest = hashlib.sha256()
    try:
        with fs.open(path, "rb") as handle:
            while chunk := handle.read(CHUNK_BYTES):
                digest.update(chunk)
    except (OSError, FileNotFoundError) as exc:
        raise StorageError(f"cannot read {what} {uri!r}: {exc}") from exc
    return digest.hexdigest()


def remove_tree(uri: str) -> bool:
    """Delete the directory at `uri` and all it holds; False if it was not there."""
    fs, path = filesystem(uri)
    if not fs.exists(path):
        return False
    try:
        fs.rm(path, recursive=True)
    except OSError as exc:
        log.warning("could not delete %s: %s", path, exc)
        return False
    return True


def remove(uri: str) -> bool:
    """Delete the file at `uri`; False if it was not there (or could not be deleted)."""
    fs, path = filesystem(uri)
    return _remove(fs, path)


def _remove(fs: Any, path: str) -> bool:
    try:
        fs.rm(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        log.warning("could not delete %s: %s", path, exc)
        return False
    return True


OWNER_FILE = "cohort-job.json"
"""Under a checkpoint location: the job that claimed it, so no other job writes its step
files beside (or over) this one's."""


def owner_uri(base: str) -> str:
    return f"{base.rstrip('/')}/{OWNER_FILE}"


def owner(base: str) -> str | None:
    """The job that claimed the location `base`, or None where none did (or it cannot be
    read: the checkpoint writers then say why)."""
    import json

    try:
        body = json.loads(read_whole(owner_uri(base), "owner file"))
    except (StorageError, ValueError):
        return None
    job = body.get("job") if isinstance(body, dict) else None
    return job if isinstance(job, str) else None


def check_owner(base: str, job: str) -> None:
    """Return if the location `base` is `job`'s or nobody's; else StorageError naming its
    owner and the fix."""
    held = owner(base)
    if held is not None and held != job:
        raise StorageError(
            f"checkpoint location {base!r} belongs to job {held!r}; give this job its own "
            f"--checkpoint-uri, or delete {owner_uri(base)!r} if job {held!r}'s checkpoints "
            "there may be overwritten"
        )


def claim(base: str, job: str) -> None:
    """Mark the location `base` as `job`'s (once: a job that holds it already writes
    nothing); StorageError if another job holds it, or it cannot be written."""
    import json

    check_owner(base, job)
    if owner(base) is None:
        write_whole(owner_uri(base), [json.dumps({"job": job}).encode()], "owner file")


def checkpoint_uri(base: str, step: int) -> str:
    """The object a checkpoint of `step` is written to, under the job's checkpoint URI."""
    return f"{base.rstrip('/')}/{CHECKPOINT_NAME.format(step=step)}"
