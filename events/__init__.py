"""cohort's shared kernel: events, their wire format, key names, streams and the clock."""

from __future__ import annotations

from .clock import Clock, ManualClock, ServerClock, SystemClock
from .codec import decode_command, decode_fact, encode
from .connection import RedisSettings, connect
from .errors import DecodeError, EventsError, RedisUnavailable, SettingsError
from .keys import Keys, check_job
from .models import *  # noqa: F403 - the event vocabulary is the package's API
from .shards import Shard
from .streams import Entry, Inbox, Journal, Stream

__all__ = [
    "Clock",
    "ManualClock",
    "ServerClock",
    "SystemClock",
    "decode_command",
    "decode_fact",
    "encode",
    "RedisSettings",
    "connect",
    "DecodeError",
    "EventsError",
    "RedisUnavailable",
    "SettingsError",
    "Keys",
    "check_job",
    "Shard",
    "Entry",
    "Inbox",
    "Journal",
    "Stream",
]
