"""`cohort.torch`: PyTorch on cohort, for `import cohort.torch` and
`from cohort.torch import ElasticJob` (needs the `torch` extra: without torch, importing it
raises ModuleNotFoundError naming `pip install 'cohort-elastic[torch]'`).

The names and what each is live in cohort/worker/pytorch/api.py; `cohort.torch` as an
attribute of `cohort` is this same module.
"""

from __future__ import annotations

from cohort.errors import torch_missing

try:
    from cohort.worker.pytorch.api import *  # noqa: F403 - this module is that list, re-homed
    from cohort.worker.pytorch.api import __all__ as __all__
except ModuleNotFoundError as exc:  # no torch: say which extra brings it
    raise torch_missing("cohort.torch", exc) from exc
