"""The root of every exception cohort raises, and the shared kernel's own.

Every exception of the package derives from `CohortError` (exported as `cohort.CohortError`),
so a script catches cohort's errors in one clause; each message quotes the bad value and says
what to do. Names end in `Error` where they are errors; the few that are not are control flow
(`Stopped`, `Finished`, the coordinator's `Fenced` and `Conflict`, and a few private ones),
and their docstrings say so. A renamed error's old name still works, with a warning
(`cohort.events.renames`).
"""

from __future__ import annotations

from pydantic import ValidationError

from cohort.events.renames import renamed


class CohortError(Exception):
    """Root of every exception raised by cohort: the shared kernel, the coordinator, the
    worker and the command line."""


class InvalidValueError(CohortError, ValueError):
    """A value given to cohort is out of its range or of the wrong kind (the message names
    it and what would do); also a ValueError, as Python's own argument errors are."""


def invalid_field(what: str, exc: ValidationError) -> InvalidValueError:
    """pydantic's first complaint about a `what` built from a caller's values, as one line
    naming the field, the value and the rule: `workload memory=-1: Input should be ...`."""
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error["loc"] if part != "[key]")
    return InvalidValueError(f"{what} {where}={error.get('input')!r}: {error['msg']}")


class EventsError(CohortError):
    """Root of the shared kernel's errors: events, their encoding, keys and connections."""


class DecodeError(EventsError):
    """An entry could not be turned into an event; `raw` keeps the bytes as received.

    `event_type` is the type its envelope named (None: it named none, or was not read that
    far): code matches on it, never on `reason`, which is for people. `index` is the entry's
    position when it came in a batch (`decode_facts`).
    """

    def __init__(
        self, reason: str, raw: bytes | None = None, event_type: str | None = None
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.raw = raw
        self.event_type = event_type
        self.index: int | None = None


class ForgedCommandError(DecodeError):
    """An inbox entry whose signature does not prove it speaks for the worker it names
    (events/identity.py): unsigned, badly signed, revoked, or another worker's command."""

    signer: str | None = None
    """The worker whose signature the entry carried, when it verified (it spoke for another):
    the sender its dead letter names as proven."""


class SettingsError(EventsError):
    """A connection setting (URL, environment variable) is unusable."""


class RedisUnavailableError(EventsError):
    """Redis could not be reached; always chained from the redis-py error."""


__getattr__ = renamed(
    "cohort.events.errors",
    {"RedisUnavailable": "RedisUnavailableError", "ForgedCommand": "ForgedCommandError"},
    globals(),
)
