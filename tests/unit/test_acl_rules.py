"""The pure part of cohort/acl.py: role rules, the default user's verdict, a rotation's plan.

What Redis makes of these rules is tested on a real server (tests/integration/test_acl.py,
test_acl_hardening.py); here, what cohort asks of it.
"""

from __future__ import annotations

import pytest

from cohort import acl
from cohort.events import identity

JOB = "j"
OLD, NEW = bytes(32), bytes(range(32))


def test_every_role_may_select_only_the_database_it_was_made_for() -> None:
    for role in acl.ROLES:
        assert "+select" not in acl.rules(JOB, role)
        assert "+select|0" in acl.rules(JOB, role)
        assert [r for r in acl.rules(JOB, role, db=3) if "select" in r] == ["+select|3"]
    command = acl.worker_setuser(JOB, "a", "s", db=5)
    assert "+select|5" in command and "+select|0" not in command
    with pytest.raises(acl.AclError, match="database -1"):
        acl.rules(JOB, "worker", db=-1)


def test_the_worker_role_may_only_xadd_to_the_inbox() -> None:
    rules = acl.rules(JOB, "worker")
    inbox = [r for r in rules if "inbox" in r]
    assert inbox == ["(%W~cohort:{j}:inbox +xadd)"]  # a selector: nothing else on that key
    # printed for redis-cli as one argument
    assert acl.quote_arg(inbox[0]) == '"(%W~cohort:{j}:inbox +xadd)"'


def test_a_worker_s_own_user_reads_its_own_handed_out_secret_and_no_other() -> None:
    command = acl.worker_setuser(JOB, "a", "s")
    assert "%R~cohort:{j}:identity:credential:a" in command
    assert not [r for r in command if "credential:b" in r or r.endswith("credential:*")]
    assert not [r for r in acl.rules(JOB, "worker") if "credential" in r]  # the role: none


@pytest.mark.parametrize(
    ("line", "exposure"),
    [
        ("user default on nopass ~* &* +@all", "nopass"),
        ("user default on nopass sanitize-payload ~* &* +@all", "nopass"),
        ("user default on #" + "a" * 64 + " ~* &* +@all", "password"),
        ("user default on nopass resetchannels -@all +get ~*", "nopass"),  # reads every key
        ("user default off nopass ~* &* +@all", None),
        ("user default on nopass resetchannels -@all +ping", None),
        ("user default on ~* &* +@all", None),  # no password at all: nobody logs in as it
    ],
)
def test_the_default_user_is_open_when_on_with_a_way_in_and_broad_rights(
    line: str, exposure: str | None
) -> None:
    assert acl.default_exposure(["user other on nopass ~* +@all", line]) == exposure


def test_the_warning_for_an_open_default_user_names_the_command_that_locks_it() -> None:
    warning = acl.default_warning("nopass", JOB)
    assert warning.count("\n") >= 4 and "protect nothing" in warning
    assert "ACL SETUSER default off" in warning
    assert "cohort acl --job j --apply --lock-default" in warning
    assert "redis://admin:ADMIN_PASSWORD@HOST:PORT" in warning  # the admin URL needs a user
    assert "requirepass" in acl.default_warning("password", JOB)


def test_locking_the_default_user_off_from_a_url_that_logs_in_as_it_is_refused() -> None:
    for user in (None, "default"):
        refusal = acl.lock_refusal(user, None)
        assert refusal is not None and "logs in as `default`" in refusal
        assert acl.DEFAULT_PASSWORD_ENV in refusal
        assert acl.lock_refusal(user, "pw") is None  # a password: the URL can carry it
    assert acl.lock_refusal("admin", None) is None


def test_during_the_grace_a_worker_s_user_takes_both_secrets_and_after_it_the_new_one() -> None:
    during = acl.rotation_setusers(JOB, ["a", "b"], OLD, NEW)
    for worker, command in zip(("a", "b"), during, strict=True):
        assert command[:5] == ["ACL", "SETUSER", identity.worker_user(JOB, worker), "reset", "on"]
        hashes = [r for r in command if r.startswith("#")]
        assert hashes == [
            acl.password_hash(identity.secret_of(NEW, worker)),
            acl.password_hash(identity.secret_of(OLD, worker)),
        ]
        assert f"%R~cohort:{{j}}:identity:credential:{worker}" in command
    after = acl.finish_setusers(JOB, ["a"], NEW)
    assert after == [
        ["ACL", "SETUSER", "cohort-j-w-a", "resetpass",
         acl.password_hash(identity.secret_of(NEW, "a"))],
    ]  # fmt: skip


@pytest.mark.parametrize("grace", [0, 9.9, -5, float("nan")])
def test_a_grace_too_short_for_workers_to_move_is_refused_naming_the_minimum(grace: float) -> None:
    with pytest.raises(acl.AclError, match="at least 10 seconds"):
        acl.check_grace(grace)
    assert acl.check_grace(10) == 10_000
