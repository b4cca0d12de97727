"""A benchmark run's temporary directory: its processes' logs while it runs, gone once it
has succeeded, kept where it failed."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path


def discard(tmp: Path) -> None:
    """Delete a run's temporary directory, unless an exception is on its way (called from a
    `finally`): then its logs are the failure's only record, and stderr says where."""
    if sys.exc_info()[1] is None:
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        print(f"the failed run's logs are kept in {tmp}", file=sys.stderr)
