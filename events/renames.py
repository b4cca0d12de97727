"""Old names that still work: a module answers to a name it renamed, with a
DeprecationWarning that names the new one, so a script written against the old name runs on
and is told what to change."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any


def warn_renamed(old: str, new: str, why: str = "") -> None:
    """Warn, at the caller's caller, that `old` is now `new` (and `why`, if said)."""
    warnings.warn(f"{old} is now named {new}{why}", DeprecationWarning, stacklevel=3)


def renamed(
    module: str, names: Mapping[str, str], current: Mapping[str, Any]
) -> Callable[[str], Any]:
    """A module `__getattr__` for `module` that maps each old name in `names` to its new
    one, looked up in `current` (the module's globals), with a DeprecationWarning."""

    def __getattr__(name: str) -> Any:
        new = names.get(name)
        if new is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warn_renamed(f"{module}.{name}", f"{module}.{new}")
        return current[new]

    return __getattr__
