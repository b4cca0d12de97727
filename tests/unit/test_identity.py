"""Per-worker identity, the pure part (events/identity.py): secrets, signatures, verdicts."""

from __future__ import annotations

import re

import pytest

from cohort.events import identity
from cohort.events.codec import FIELD, encode
from cohort.events.identity import SIGNATURE, SIGNER, Signer, Trust
from cohort.events.models import Leave

JOB_KEY = bytes(range(32))
TRUST = Trust(JOB_KEY)
RAW = encode(Leave(at=0, job="j", worker="a"))


def signed_by(worker: str, raw: bytes = RAW, job_key: bytes = JOB_KEY) -> dict[bytes, bytes]:
    return Signer(worker, identity.secret_of(job_key, worker)).fields(raw)


def test_each_worker_s_secret_derives_from_the_job_key_and_its_name_alone() -> None:
    a = identity.secret_of(JOB_KEY, "a")
    assert a == identity.secret_of(JOB_KEY, "a") and len(a) == 64 and int(a, 16) >= 0
    assert a != identity.secret_of(JOB_KEY, "b")
    assert a != identity.secret_of(bytes(32), "a")  # another job's key: another secret


def test_a_worker_s_own_signed_entry_verifies() -> None:
    fields = signed_by("a")
    assert fields[FIELD] == RAW and fields[SIGNER] == b"a" and len(fields[SIGNATURE]) == 32
    assert identity.verify(TRUST, fields) is None
    assert identity.claims("a", "a") is None


def test_an_unsigned_entry_names_the_fix() -> None:
    reason = identity.verify(TRUST, {FIELD: RAW})
    assert reason is not None and reason.startswith("unsigned command")
    assert "cohort acl" in reason and "--worker" in reason


@pytest.mark.parametrize("where", [0, len(RAW) // 2, len(RAW) - 1])
def test_tampered_command_bytes_do_not_verify(where: int) -> None:
    fields = signed_by("a")
    tampered = bytearray(RAW)
    tampered[where] ^= 1
    fields[FIELD] = bytes(tampered)
    assert identity.verify(TRUST, fields) == "signature does not verify for worker 'a'"


def test_a_signature_relabelled_with_another_signer_does_not_verify() -> None:
    fields = signed_by("a")
    fields[SIGNER] = b"b"  # a's MAC presented as b's
    assert identity.verify(TRUST, fields) == "signature does not verify for worker 'b'"


def test_a_secret_guessed_without_the_job_key_does_not_verify() -> None:
    forged = signed_by("b", job_key=b"\x00" * 32)
    assert identity.verify(TRUST, forged) == "signature does not verify for worker 'b'"


def test_a_revoked_worker_s_valid_signature_is_refused() -> None:
    reason = identity.verify(Trust(JOB_KEY, frozenset({"a"})), signed_by("a"))
    assert reason == "worker 'a''s credential is revoked"
    assert identity.verify(Trust(JOB_KEY, frozenset({"a"})), signed_by("b")) is None


def test_a_valid_signature_on_another_worker_s_command_is_a_claim_refused() -> None:
    assert identity.claims("b", "a") == (
        "command claims worker 'b' but was signed by worker 'a''s credential"
    )


def test_the_operator_signs_with_a_secret_only_the_job_key_gives() -> None:
    operator = identity.operator(JOB_KEY)
    assert operator.worker == "operator"
    assert identity.verify(TRUST, operator.fields(RAW)) is None


def test_a_worker_s_own_user_names_it_and_no_other_user_does() -> None:
    user = identity.worker_user("j", "w-1.x")
    assert user == "cohort-j-w-w-1.x"
    assert identity.worker_of_user("j", user) == "w-1.x"
    assert identity.worker_of_user("j", "cohort-j-worker") is None  # the shared role
    assert identity.worker_of_user("j", "cohort-j-w-") is None
    assert identity.worker_of_user("other", user) is None
    assert identity.worker_of_user("j", None) is None


@pytest.mark.parametrize("bad", ["", "-a", "a b", "a/b", "x" * 129, "operator"])
def test_names_that_cannot_carry_a_credential_are_refused_naming_them(bad: str) -> None:
    with pytest.raises(identity.IdentityError, match=re.escape(repr(bad))):
        identity.check_worker(bad)


# ---------------------------------------------------------------- a rotation's grace

NEW_KEY = bytes(range(1, 33))


def test_during_a_rotation_s_grace_either_key_verifies_and_after_it_only_the_new_one() -> None:
    grace = Trust(NEW_KEY, previous=JOB_KEY)
    after = Trust(NEW_KEY)
    old_signed, new_signed = signed_by("a"), signed_by("a", job_key=NEW_KEY)
    assert identity.verify(grace, old_signed) is None
    assert identity.verify(grace, new_signed) is None
    assert identity.verify(after, new_signed) is None
    assert identity.verify(after, old_signed) == "signature does not verify for worker 'a'"


def test_a_revoked_worker_is_refused_under_either_key_of_a_rotation() -> None:
    grace = Trust(NEW_KEY, revoked=frozenset({"a"}), previous=JOB_KEY)
    for key in (JOB_KEY, NEW_KEY):
        assert identity.verify(grace, signed_by("a", job_key=key)) == (
            "worker 'a''s credential is revoked"
        )
