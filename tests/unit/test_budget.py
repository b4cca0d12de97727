"""The gradient budget: a step fits if two steps' worth leaves a quarter of maxmemory free."""

from __future__ import annotations

from cohort.events.budget import HEADROOM, Memory, refusal

MIB = 2**20


def test_no_budget_without_a_limit_or_without_figures() -> None:
    assert refusal(None, 10**12) is None
    assert refusal(Memory(maxmemory=0, used=5 * MIB), 10**12) is None


def test_a_step_fits_while_two_of_it_leave_the_headroom() -> None:
    memory = Memory(maxmemory=64 * MIB, used=8 * MIB)  # 48 MiB for gradients, 8 used: 40
    assert memory.free == int(64 * MIB * (1 - HEADROOM)) - 8 * MIB == 40 * MIB
    assert refusal(memory, 20 * MIB) is None
    why = refusal(memory, 20 * MIB + 1)
    assert why is not None
    assert "maxmemory is 64.0 MiB" in why and "8.0 MiB used" in why and "CONFIG SET" in why


def test_published_figures_round_trip_and_garbage_reads_as_none() -> None:
    memory = Memory(maxmemory=64 * MIB, used=3)
    assert Memory.decode(memory.encode()) == memory
    for raw in (None, b"", b"\xc1", b"\x92\x01\x02"):
        assert Memory.decode(raw) is None
