"""The cohort command's exit codes, and the root of every cohort exception.

`CohortError` is defined in the shared kernel (`cohort.events.errors`), below every other part
of the package, so that the events, coordinator, worker and command-line errors all derive
from it; it is re-exported here and as `cohort.CohortError`.
"""

from __future__ import annotations

from enum import IntEnum

from cohort.events.errors import CohortError

__all__ = ["TORCH_EXTRA", "CohortError", "Exit", "torch_missing"]

TORCH_EXTRA = "pip install 'cohort-elastic[torch]'"
"""What installs PyTorch beside cohort: its `torch` extra."""


class Exit(IntEnum):
    """What a `cohort` process's exit status means; scripts and tests read these."""

    OK = 0
    FAILED = 1
    """The demo did not end as it should: a process it needs died, the deadline, the audit."""
    USAGE = 2
    """A bad flag, setting or file named on the command line."""
    REDIS = 3
    """Redis cannot be reached, refused the credentials or the TLS handshake."""
    DATA = 4
    """The job says no: an unreadable journal or export, a failed audit, a coordinator or
    worker error (Redis without an AOF, a refused join)."""
    UNFINISHED = 5
    """`cohort run`: every rank's script ended by itself before the job reached its length
    (`--epochs`/`--max-steps`; a job given neither never does): the model is not final."""
    REQUEUE = 75
    """`cohort run`: its drain signal (SIGUSR1, SLURM's warning before a time limit) made every
    rank finish its step and leave, the journal kept: run the job again (requeue it) to resume
    it (75: EX_TEMPFAIL, "try again later")."""
    INTERRUPTED = 130
    """A second SIGINT/SIGTERM: exit now (128 + SIGINT, as shells report it)."""


def torch_missing(what: str, exc: ModuleNotFoundError) -> ModuleNotFoundError:
    """`exc` (torch could not be imported) as a script should read it: what needs torch,
    and how to install it. Any other missing module is `exc` itself."""
    if exc.name != "torch" or TORCH_EXTRA in str(exc):  # another module, or said already
        return exc
    return ModuleNotFoundError(
        f"{what} needs PyTorch, which this Python cannot import ({exc}): {TORCH_EXTRA}",
        name="torch",
    )
