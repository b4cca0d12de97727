"""`cohort.torch`: PyTorch on cohort, for `import cohort.torch` and
`from cohort.torch import ElasticJob` (needs the `torch` extra).

The names and what each is live in cohort/worker/pytorch/api.py; `cohort.torch` as an
attribute of `cohort` is this same module.
"""

from __future__ import annotations

from cohort.worker.pytorch.api import *  # noqa: F403 - this module is that list, re-homed
from cohort.worker.pytorch.api import __all__ as __all__
