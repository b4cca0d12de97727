"""Logging for the cohort command: one line per event, plain or JSON."""

from __future__ import annotations

import json
import logging
import sys
import time

FIELDS = ("job", "fact", "journal_id")
"""Fields a log call may add with `extra=`, kept as keys of their own in JSON lines."""


class JsonLines(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        body = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        body.update({k: getattr(record, k) for k in FIELDS if hasattr(record, k)})
        if record.exc_info:
            body["exc"] = self.formatException(record.exc_info)
        return json.dumps(body, default=str)


class Plain(logging.Formatter):
    converter = staticmethod(time.gmtime)  # type: ignore[assignment]

    def __init__(self) -> None:
        super().__init__(
            "%(asctime)s.%(msecs)03dZ %(levelname)-7s %(name)s: %(message)s", "%Y-%m-%dT%H:%M:%S"
        )


def setup(level: str = "info", json_lines: bool = False) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLines() if json_lines else Plain())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
