"""Whether `cohort run` gives its ranks credentials of their own: asked for, or where the job
signs its commands; a launcher connected as the worker role (which may not even look at the
job key) runs its ranks as that user instead of stopping."""

from __future__ import annotations

import fakeredis
import redis

from cohort.events.keys import Keys
from cohort.launcher.credentials import Credentials


class WorkerRoleUser(fakeredis.FakeRedis):
    """A client whose user may not touch the job key, as Redis answers `cohort acl`'s worker."""

    def exists(self, *names: object) -> int:
        raise redis.exceptions.NoPermissionError(
            "this user has no permissions to access one of the keys used as arguments"
        )


def test_ranks_get_their_own_credentials_only_where_the_job_signs_or_it_is_asked() -> None:
    conn = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    assert not Credentials.needed(conn, "j", asked=False)
    assert Credentials.needed(conn, "j", asked=True)
    conn.set(Keys("j").identity, b"k" * 32)
    assert Credentials.needed(conn, "j", asked=False)


def test_a_worker_role_launcher_runs_its_ranks_as_itself_without_credentials() -> None:
    conn = WorkerRoleUser(server=fakeredis.FakeServer())
    assert not Credentials.needed(conn, "j", asked=False)
    assert Credentials.needed(conn, "j", asked=True)  # asked: issuing is tried, and refused
