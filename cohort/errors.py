"""The cohort command's exceptions: one root, each message quotes the bad value."""

from __future__ import annotations


class CohortError(Exception):
    """Root of every error raised by the cohort package (CLI, demo, local servers)."""
