"""A folder named `cohort` where a rank's Python looks first shadows the installed package.

A clone of cohort's repository takes git's default name, `cohort`; beside a training
script, `import cohort` then finds that folder instead of the package, and the script fails
the same way at every restart ("module 'cohort' has no attribute 'torch'"). `cohort run`
looks before it starts a rank (`shadow`), and names the cause when a rank it gives up on
failed that way (`hint`).
"""

from __future__ import annotations

import importlib.machinery
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

VALUED = {"-W", "-X", "--check-hash-based-pycs"}
"""Python's options that take the next argument as their value."""

FAILED_IMPORT = re.compile(r"module 'cohort' has no attribute|No module named 'cohort\.")
"""What a script prints when the `cohort` it imported is not the package."""


def first_on_path(argv: Sequence[str], cwd: Path) -> Path | None:
    """The folder a rank's Python puts first on sys.path: its script's (`python train.py`,
    or a .py run directly), the working directory (`python -m`, `-c`); None for a command
    whose Python cannot be read from its arguments (a shell script)."""
    if not argv:
        return None
    if argv[0].endswith(".py"):
        return (cwd / argv[0]).parent
    if not Path(argv[0]).name.startswith("python"):
        return None
    args = iter(argv[1:])
    for arg in args:
        if arg in ("-m", "-c"):
            return cwd
        if arg in VALUED:
            next(args, None)
        elif not arg.startswith("-"):
            return (cwd / arg).parent
    return None


def shadow(
    argv: Sequence[str], cwd: Path, package: Path, search: Sequence[str] | None = None
) -> Path | None:
    """The folder that `import cohort` would find in a rank running `argv` from `cwd`
    instead of the installed package in `package`; None when there is none. A folder with
    an `__init__.py` always comes first; one without (a clone's top) only where no regular
    package is on the rest of `search` (sys.path): under an editable install, say."""
    first = first_on_path(argv, cwd)
    if first is None:
        return None
    folder = first / "cohort"
    if not folder.is_dir() or folder.resolve() == package.resolve():
        return None
    if (folder / "__init__.py").is_file():
        return folder
    rest = [p for p in (sys.path if search is None else search) if _other(p, first)]
    found = importlib.machinery.PathFinder.find_spec("cohort", rest)
    regular = found is not None and found.origin is not None
    return None if regular else folder


def shadowing_said(folder: Path, package: Path, argv: Sequence[str]) -> str:
    """Why no rank is started: what shadows what, and the fix."""
    return (
        f"the folder {folder} shadows the installed cohort package ({package}): "
        f"`{' '.join(argv)}` would import that folder as `cohort` and fail at every start "
        "(\"module 'cohort' has no attribute ...\"). Rename the folder (a clone of cohort's "
        "repository: `mv cohort cohort-src`) or run the script from another folder"
    )


def hint(log_tail: str) -> str:
    """A line for a rank given up on after failing at `import cohort`: what may cause it."""
    if not FAILED_IMPORT.search(log_tail):
        return ""
    return (
        "\nIf a folder named `cohort` is where its Python looks first (beside the script, "
        "or the working directory: a clone of cohort's repository?), it shadows the installed "
        "package: rename that folder or run from elsewhere"
    )


def _other(entry: str, first: Path) -> bool:
    """Whether sys.path entry `entry` is another folder than `first`."""
    try:
        return Path(entry or os.curdir).resolve() != first.resolve()
    except OSError:
        return True
