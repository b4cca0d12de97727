"""cohort's shared kernel: events, their wire format, key names, streams and the clock."""

from __future__ import annotations

from cohort.events.clock import Clock, ManualClock, ServerClock, SystemClock
from cohort.events.codec import decode_command, decode_fact, encode
from cohort.events.connection import RedisSettings, connect
from cohort.events.errors import DecodeError, EventsError, RedisUnavailableError, SettingsError
from cohort.events.keys import Keys, check_job
from cohort.events.models import *  # noqa: F403 - the event vocabulary is the package's API
from cohort.events.shards import Shard
from cohort.events.streams import Entry, Inbox, Journal, Stream

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
    "RedisUnavailableError",
    "SettingsError",
    "Keys",
    "check_job",
    "Shard",
    "Entry",
    "Inbox",
    "Journal",
    "Stream",
]
