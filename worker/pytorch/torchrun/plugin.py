"""The `torchrun.handlers` entry point `cohort`: what torch loads while its rendezvous
package is still importing.

torch registers out-of-tree backends from inside `torch.distributed.elastic.rendezvous`'s
own import, and a plugin it fails to load there stays unregistered. So this module
imports nothing of cohort's or torch's at load: were it `handler.py`, importing any cohort
module that reaches torch's rendezvous package first (`rendezvous_backend.py`, say) would
make torch load the entry point from a half-initialised module, and `cohort` would be
missing from torch's registry for the life of the process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous.api import RendezvousParameters

    from cohort.worker.pytorch.torchrun.handler import CohortRendezvousHandler


def entry_point() -> Callable[[RendezvousParameters], CohortRendezvousHandler]:
    """What the entry point names: torch calls it, at registration, for the function that
    creates the handler from torchrun's `--rdzv-*` options."""
    return create_handler


def create_handler(params: RendezvousParameters) -> CohortRendezvousHandler:
    """`handler.create_handler`, imported when torchrun first asks for a handler: by then
    torch's rendezvous package has finished importing."""
    from cohort.worker.pytorch.torchrun.handler import create_handler as create

    return create(params)
