"""A running worker moves to its new credential when the job key is rotated (docs/identity.md).

`cohort acl --rotate` writes each worker's new secret to `Keys.credential(worker)`, which its
own Redis user alone may read. Every few seconds the heartbeat thread looks; once the secret
found differs from the one the worker signs with, the worker logs in with it (AUTH, and every
connection its client makes later) and signs with it from then on. During the rotation's
grace the leader accepts either secret, so nothing sent on the way is refused.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis

from cohort.events.connection import Client, credentials, reauthenticate
from cohort.events.identity import Signer
from cohort.events.keys import Keys
from cohort.events.streams import Inbox

POLL_EVERY = 2.0
"""Seconds between looks: a rotation's grace (at least 10 s) leaves room for several."""


class CredentialRefresh:
    """Called often (the heartbeat thread's every turn), looks every `every` seconds."""

    def __init__(
        self, conn: Client, job: str, inbox: Inbox, log: logging.Logger, every: float = POLL_EVERY
    ) -> None:
        self.conn = conn
        self.inbox = inbox
        """Whose `signer` is the worker's credential, switched here when the key rotates."""
        self.keys = Keys(job)
        self.log = log
        self.every = every
        self._next = 0.0

    def __call__(self) -> None:
        signer = self.inbox.signer
        now = time.monotonic()
        if signer is None or now < self._next:
            return
        self._next = now + self.every
        secret = self._handed_out(signer.worker)
        if secret is None or secret == signer.secret:
            return
        try:
            reauthenticate(self.conn, credentials(self.conn)[0], secret)
        except redis.RedisError as exc:  # its user does not take it (yet): keep the old one
            self.log.warning("worker %s could not log in with its new credential: %s", signer, exc)
            return
        self.inbox.signer = Signer(signer.worker, secret)
        self.log.info(
            "worker %s: job %r's key was rotated; it logs in and signs with its new credential",
            signer.worker,
            self.keys.job,
        )

    def _handed_out(self, worker: str) -> str | None:
        """The secret `cohort acl --rotate` left for `worker`, if any. A user issued before
        rotations existed may not read it (NOPERM), and Redis may be away: look again later."""
        try:
            found: Any = self.conn.get(self.keys.credential(worker))
        except redis.RedisError:
            return None
        if not found:
            return None
        return found.decode() if isinstance(found, bytes) else str(found)
