"""A one-shot reader freezes what it read, so no cyclic collection ever walks a whole journal."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from cohort.coordinator.replay import read_once
from cohort.events.codec import gc_paused


@pytest.fixture(autouse=True)
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_objects_read_inside_are_frozen_out_of_later_collections() -> None:
    with read_once():
        assert not gc.isenabled()
        read = [[i] for i in range(10_000)]  # tracked objects, as decoded facts are
    assert gc.isenabled()
    assert gc.get_freeze_count() >= len(read)
    collectable = {id(o) for o in gc.get_objects()}  # what any collection would walk
    assert id(read) not in collectable and id(read[0]) not in collectable


def test_a_collector_that_was_off_stays_off() -> None:
    with gc_paused():
        with read_once():
            pass
        assert not gc.isenabled()
    assert gc.isenabled()


def test_the_collector_comes_back_when_reading_fails() -> None:
    with pytest.raises(RuntimeError), read_once():
        raise RuntimeError("journal entry cannot be read")
    assert gc.isenabled()
