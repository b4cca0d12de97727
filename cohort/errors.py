"""The cohort command's exceptions and exit codes: one root, each message quotes the bad value."""

from __future__ import annotations

from enum import IntEnum


class CohortError(Exception):
    """Root of every error raised by the cohort package (CLI, demo, local servers)."""


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
    INTERRUPTED = 130
    """A second SIGINT/SIGTERM: exit now (128 + SIGINT, as shells report it)."""
