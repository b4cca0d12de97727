"""Who sent an inbox command: per-worker secrets and HMAC-signed entries (issue 24).

Every worker may XADD to the inbox, so the inbox alone cannot say who wrote an entry.
In identity mode (the job has a key at `Keys.identity`, made by `cohort acl --worker`)
each entry carries, beside the command `e`, the signer `w` and `s` =
HMAC-SHA256(secret of w, e). A worker's secret derives from the job key:
HMAC-SHA256(job key, "cohort-worker:" + w), and is the password of its own Redis user
`cohort-<job>-w-<w>`, so a worker carries one string (its URL). The leader, which alone
reads the job key, re-derives the secret and checks the MAC, then that the command speaks
for its signer: worker A's credential can sign only A's commands.

Pure functions only; the coordinator's service calls them on each entry it loads.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import re
from dataclasses import dataclass, field

from cohort.events.codec import FIELD
from cohort.events.errors import EventsError

SIGNER = b"w"
"""The inbox field naming the worker whose credential signed the entry."""
SIGNATURE = b"s"
"""The inbox field holding HMAC-SHA256(signer's secret, the `e` field), 32 raw bytes."""
OPERATOR = "operator"
"""The signer of operator commands (`cohort resume`): the CLI derives its secret from the
job key, which only coordinator (and admin) credentials can read."""
JOB_KEY_BYTES = 32
_DERIVE = b"cohort-worker:"
WORKER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$")  # events.models.WorkerId


class IdentityError(EventsError):
    """A worker name cannot carry a credential; the message names it and the rule."""


def check_worker(worker: str) -> str:
    """`worker` if a per-worker credential can be issued for it, else IdentityError."""
    if not WORKER_NAME.fullmatch(worker):
        raise IdentityError(
            f"worker name {worker!r} is not valid: use 1-128 characters from the ASCII "
            "letters, digits, '.', '_', ':', '@' and '-', starting with a letter or digit"
        )
    if worker == OPERATOR:
        raise IdentityError(
            f"worker name {worker!r} is reserved for operator commands (cohort resume); "
            "pick another worker id"
        )
    return worker


def worker_user(job: str, worker: str) -> str:
    """The Redis user of `worker`'s own credential: cohort-<job>-w-<worker>."""
    return f"{user_prefix(job)}{worker}"


def user_prefix(job: str) -> str:
    return f"cohort-{job}-w-"


def worker_of_user(job: str, username: str | None) -> str | None:
    """The worker whose own credential `username` is, or None for any other user."""
    prefix = user_prefix(job)
    if not username or not username.startswith(prefix) or len(username) == len(prefix):
        return None
    return username[len(prefix) :]


@functools.lru_cache(maxsize=1 << 16)
def secret_of(job_key: bytes, worker: str) -> str:
    """`worker`'s secret (hex): its Redis password and its signing key. Remembered: the
    leader checks every command of every worker against it."""
    return hmac.new(job_key, _DERIVE + worker.encode(), hashlib.sha256).hexdigest()


def sign(secret: str, raw: bytes) -> bytes:
    """The MAC of one inbox entry's command bytes under `secret`."""
    return hmac.new(secret.encode(), raw, hashlib.sha256).digest()


@dataclass(frozen=True, slots=True)
class Signer:
    """What a sender needs to sign: who it is and its secret."""

    worker: str
    secret: str = field(repr=False)  # never in a log line or traceback

    def fields(self, raw: bytes) -> dict[bytes, bytes]:
        """The inbox entry's fields for the command bytes `raw`."""
        return {FIELD: raw, SIGNER: self.worker.encode(), SIGNATURE: sign(self.secret, raw)}


def operator(job_key: bytes) -> Signer:
    """The signer of operator commands, for whoever can read the job key."""
    return Signer(OPERATOR, secret_of(job_key, OPERATOR))


@dataclass(frozen=True, slots=True)
class Trust:
    """What the leader checks signatures against: the job key, the revoked workers and,
    during a rotation's grace (`cohort acl --rotate`), the key before it."""

    job_key: bytes
    revoked: frozenset[str] = frozenset()
    previous: bytes | None = None

    def verifying_keys(self) -> tuple[bytes, ...]:
        """The keys a signature may verify under: the current first."""
        return (self.job_key,) if self.previous is None else (self.job_key, self.previous)


def verify(trust: Trust, fields: dict[bytes, bytes]) -> str | None:
    """Why the entry's signature does not prove its signer, or None if it does."""
    raw, signer, signature = fields.get(FIELD), fields.get(SIGNER), fields.get(SIGNATURE)
    if signer is None or signature is None:
        return (
            "unsigned command: this job requires per-worker credentials "
            "(cohort acl --job J --worker W --apply; the worker connects with its own URL)"
        )
    try:
        worker = signer.decode()
    except UnicodeDecodeError:
        return f"signer {signer[:64]!r} is not a worker name"
    if raw is None:
        return f"entry signed by worker {worker!r} has no command field"
    if worker in trust.revoked:
        return f"worker {worker!r}'s credential is revoked"
    macs = (sign(secret_of(key, worker), raw) for key in trust.verifying_keys())
    if not any(hmac.compare_digest(mac, signature) for mac in macs):
        return f"signature does not verify for worker {worker!r}"
    return None


def claims(claimed: str, signer: str) -> str | None:
    """Why a verified command may not be decided (it speaks for another), or None."""
    if claimed == signer:
        return None
    return f"command claims worker {claimed!r} but was signed by worker {signer!r}'s credential"
