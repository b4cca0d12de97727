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


def test_clients_buffers_are_not_counted_as_used_memory() -> None:
    """A worker's 55 MB write that Redis refuses sits in its query buffer for an instant:
    counted, it would refuse every step until the leader's next figure (issue 33)."""
    info = {"maxmemory": 100 << 20, "used_memory": 80 << 20, "mem_clients_normal": 56 << 20}

    memory = Memory.of_info(info)

    assert memory == Memory(100 << 20, 24 << 20)
    assert refusal(memory, 10 << 20) is None
    assert Memory.of_info({"maxmemory": 0, "used_memory": 5, "mem_clients_normal": 9}).used == 0
