"""The coordinator's exceptions: one root, each message quotes the bad value."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from cohort.events.errors import CohortError
from cohort.events.renames import renamed

if TYPE_CHECKING:
    from cohort.events.models import JobConfig


class CoordinatorError(CohortError):
    """Root of every error raised by the coordinator package."""


class Fenced(CoordinatorError):
    """Our token is no longer the leader's: stop deciding. `holder` is who leads now, if anyone.
    Control flow: the coordinator goes back to following; no caller sees it."""

    def __init__(self, token: str, holder: str | None) -> None:
        now = f"the lease is held by {holder!r}" if holder else "no one holds the lease"
        super().__init__(f"token {token!r} is no longer current; {now}")
        self.token = token
        self.holder = holder


class Conflict(CoordinatorError):
    """The journal moved past the ID we expected (another writer, or our own retried append).
    Control flow: the leader folds what moved and decides again; no caller sees it."""

    def __init__(self, expected_last: str, actual_last: str) -> None:
        super().__init__(
            f"journal's last entry is {actual_last!r}, not the expected {expected_last!r}"
        )
        self.expected_last = expected_last
        self.actual_last = actual_last


STARTUP = frozenset({"start_workers", "start_wait"})
"""Settings of the first world's wait only: a later coordinator's value conflicts with none."""


class ConfigConflictError(CoordinatorError):
    """The job's journaled config differs from the settings this coordinator was given."""

    def __init__(self, job: str, differ: list[tuple[str, Any, Any]]) -> None:
        given = ", ".join(_flag(name, mine, theirs) for name, mine, theirs in differ)
        super().__init__(
            f"job {job!r} was started with other settings: {given}. Start this coordinator "
            f"with the journaled settings (or without these flags, to keep them), or run "
            f"`cohort reset --job {job}` to clear the job and start it afresh"
        )
        self.job = job
        self.differ = differ

    @classmethod
    def between(
        cls, job: str, journaled: JobConfig | None, config: JobConfig, given: Iterable[str]
    ) -> ConfigConflictError | None:
        """The conflict of the settings `given` in `config` with the journaled ones (None:
        nothing journaled yet, or they agree). The first world's wait (`start_workers`,
        `start_wait`) is no conflict: it is over once the job is journaled and has begun,
        and a launcher sets it from its own number of ranks."""
        if journaled is None:
            return None
        differ = [
            (name, getattr(config, name), getattr(journaled, name))
            for name in sorted(given)
            if name not in STARTUP and getattr(config, name) != getattr(journaled, name)
        ]
        return cls(job, differ) if differ else None


def _flag(name: str, mine: Any, theirs: Any) -> str:
    """A differing setting as the operator would have written it: `--batch-size 64
    (journaled: 32)`, or for a switch `--no-shuffle (journaled: --shuffle)`."""
    flag = name.replace("_", "-")
    if isinstance(mine, bool):
        return f"--{'' if mine else 'no-'}{flag} (journaled: --{'' if theirs else 'no-'}{flag})"
    return f"--{flag} {mine!r} (journaled: {theirs!r})"


__getattr__ = renamed(
    "cohort.coordinator.errors", {"ConfigConflict": "ConfigConflictError"}, globals()
)
