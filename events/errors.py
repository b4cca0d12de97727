"""The shared kernel's exceptions: one root, each message quotes the bad value."""

from __future__ import annotations


class EventsError(Exception):
    """Root of every error raised by the events package."""


class DecodeError(EventsError):
    """An entry could not be turned into an event; `raw` keeps the bytes as received.

    `index` is the entry's position when it came in a batch (`decode_facts`).
    """

    def __init__(self, reason: str, raw: bytes | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.raw = raw
        self.index: int | None = None


class ForgedCommand(DecodeError):
    """An inbox entry whose signature does not prove it speaks for the worker it names
    (events/identity.py): unsigned, badly signed, revoked, or another worker's command."""


class SettingsError(EventsError):
    """A connection setting (URL, environment variable) is unusable."""


class RedisUnavailable(EventsError):
    """Redis could not be reached; always chained from the redis-py error."""
