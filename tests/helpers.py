"""Small test tools shared by every suite. Waiting polls a condition; it never sleeps blind."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T],
    timeout: float = 5.0,
    interval: float = 0.01,
    message: str = "condition",
) -> T:
    """Poll `predicate` until it returns something truthy (returned), or fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{message}: not true within {timeout}s (last value {value!r})")
        pause.wait(interval)
