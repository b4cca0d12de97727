"""Each rank's own Redis user, where its job signs commands (docs/identity.md).

A job whose workers hold per-worker credentials decides only commands each worker signed
with its own secret. `cohort run` gives every rank process it starts a credential of its
own (its Redis URL names the user `cohort-<job>-w-<worker>`), issued with the launcher's
Redis user, which must be allowed ACL SETUSER, and deletes that user once the process has
ended: a replacement gets a new worker id and a new credential.
"""

from __future__ import annotations

import redis

from cohort import acl
from cohort.events.connection import Client
from cohort.events.identity import Signer, worker_user
from cohort.events.keys import Keys


class Credentials:
    """The credentials one launcher issued, by worker id, while their processes run."""

    def __init__(self, conn: Client, job: str, url: str) -> None:
        self.conn = conn
        self.job = job
        self.url = url
        self.issued: dict[str, str] = {}
        """Worker -> the secret issued to it, while its user exists."""

    @staticmethod
    def needed(conn: Client, job: str, asked: bool) -> bool:
        """Asked for (`--worker-credentials`), or the job signs its commands already. A
        user that may not even look at the job key (the worker role of `cohort acl`) could
        not issue credentials either: its ranks connect as that user, unsigned."""
        if asked:
            return True
        try:
            return bool(conn.exists(Keys(job).identity))
        except redis.exceptions.NoPermissionError:
            return False

    def url_for(self, worker: str) -> str:
        """`worker`'s own Redis URL, its user created on every node (acl.AclError if the
        launcher's user may not)."""
        secret = acl.issue(self.conn, self.job, [worker])[worker]
        self.issued[worker] = secret
        return acl.url_as(self.url, worker_user(self.job, worker), secret)

    def signer(self, worker: str) -> Signer | None:
        """What signs a command about `worker` in its own name (its launcher's word that its
        process exited), while its credential is issued."""
        secret = self.issued.get(worker)
        return None if secret is None else Signer(worker, secret)

    def retire(self, worker: str) -> None:
        """`worker`'s process ended: its user goes (acl.AclError if Redis refuses)."""
        if worker in self.issued:
            acl.retire(self.conn, self.job, worker)
            self.issued.pop(worker, None)

    def retire_all(self) -> list[str]:
        """Every user still issued deleted; returns the problems, one line each."""
        problems = []
        for worker in sorted(self.issued):
            try:
                self.retire(worker)
            except (acl.AclError, redis.RedisError) as exc:
                problems.append(f"{worker_user(self.job, worker)}: {exc}")
        return problems
