"""Compressed allreduce (int8 blocks, PowerSGD) among 3 ranks on fakeredis and a real
redis-server: every rank gets the same bits, fewer bytes cross Redis, and error feedback
keeps the applied updates on the exact means' track."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import redis

from cohort.worker.collective.compressors import Int8Feedback, PowerSGD, compressor
from cohort.worker.collective.redis_collective import Collective
from cohort.worker.collective.tensors import unpack as unpack_blob
from cohort.worker.errors import CollectiveError
from tests.contract.test_collective import KEYS, StandIn, _members, _ok, run_ranks

N = 3
STEPS = 6


def _gradient(rank: int, step: int) -> dict[str, np.ndarray]:
    """Layer-like gradients: a shared low-rank signal plus each rank's noise, a bias and a
    matrix too small to compress."""
    signal = np.random.default_rng(1000 + step)
    u = signal.standard_normal((96, 2))
    v = signal.standard_normal((2, 160))
    noise = np.random.default_rng(rank * 100 + step)
    return {
        "fc.weight": (u @ v + 0.3 * noise.standard_normal((96, 160))).astype("<f4"),
        "fc.bias": noise.standard_normal(96).astype("<f4"),
        "tiny": noise.standard_normal((3, 4)).astype("<f4"),
    }


def _exact_mean(step: int) -> dict[str, np.ndarray]:
    grads = [_gradient(r, step) for r in range(N)]
    return {n: np.mean([g[n] for g in grads], axis=0, dtype=np.float64) for n in grads[0]}


def _bytes_stored(conn: redis.Redis) -> int:
    """The bytes of the gradient blobs the ranks wrote (kept until the op after next)."""
    keys = list(conn.scan_iter(match="cohort:{" + KEYS.job + "}:grad*", _type="STRING"))
    return sum(int(conn.strlen(k)) for k in keys)


def _train(
    connect_more: Callable[[], redis.Redis], name: str | None, steps: int = STEPS
) -> list[Any]:
    """Each rank's results of `steps` compressed allreduces (None: exact), per rank."""

    def body(c: Collective, m: StandIn) -> list[dict[str, np.ndarray]]:
        comp = compressor(name, rank=4)
        if comp is not None:
            comp.reset(0)
        out = []
        for step in range(steps):
            g = _gradient(m.rank, step)
            if comp is None:
                out.append(c.allreduce(g, 2 * step))
            else:
                out.append(comp.allreduce(c, g, (2 * step, 2 * step + 1)))
        return out

    return _ok(run_ranks(connect_more, _members(N), body, timeout=60))


@pytest.mark.parametrize("name", ["int8", "powersgd"])
def test_every_rank_applies_the_same_bits_and_feedback_tracks_the_exact_sum(
    connect_more: Callable[[], redis.Redis], name: str
) -> None:
    per_rank = _train(connect_more, name)
    for step in range(STEPS):
        for tensor in per_rank[0][step]:
            for r in range(1, N):
                assert np.array_equal(per_rank[0][step][tensor], per_rank[r][step][tensor])
    # vectors and small matrices go exactly under PowerSGD (up to the float64 sum's rounding)
    if name == "powersgd":
        for step in range(STEPS):
            exact = _exact_mean(step)
            for tensor in ("fc.bias", "tiny"):
                np.testing.assert_allclose(per_rank[0][step][tensor], exact[tensor], rtol=1e-6)
    # error feedback: the sum of applied updates tracks the sum of exact means, better than
    # any one step's error would accumulate
    applied = sum(per_rank[0][s]["fc.weight"].astype(np.float64) for s in range(STEPS))
    true = sum(_exact_mean(s)["fc.weight"] for s in range(STEPS))
    one_step = np.linalg.norm(per_rank[0][0]["fc.weight"] - _exact_mean(0)["fc.weight"])
    drift = np.linalg.norm(applied - true)
    scale = np.linalg.norm(true)
    assert drift / scale < (0.02 if name == "int8" else 0.25)
    assert drift < STEPS * one_step
    first = np.linalg.norm(per_rank[0][0]["fc.weight"] - _exact_mean(0)["fc.weight"])
    assert first / np.linalg.norm(_exact_mean(0)["fc.weight"]) < (0.01 if name == "int8" else 0.6)


@pytest.mark.parametrize(("name", "fewer"), [("int8", 3.5), ("powersgd", 8.0)])
def test_compressed_allreduce_writes_fewer_bytes_through_redis(
    conn: redis.Redis, connect_more: Callable[[], redis.Redis], name: str, fewer: float
) -> None:
    _train(connect_more, None, steps=1)
    exact = _bytes_stored(conn)
    conn.flushall()
    _train(connect_more, name, steps=1)
    compressed = _bytes_stored(conn)
    assert exact / compressed > fewer, (exact, compressed)


def test_int8_transport_sends_int8_levels_and_the_owner_mean_decodes_alike(
    conn: redis.Redis, connect_more: Callable[[], redis.Redis]
) -> None:
    def body(c: Collective, m: StandIn) -> dict[str, np.ndarray]:
        return c.allreduce(_gradient(m.rank, 0), 5, transport="int8")

    results = _ok(run_ranks(connect_more, _members(N), body))
    for r in results[1:]:
        for tensor in r:
            assert np.array_equal(results[0][tensor], r[tensor])
    exact = _exact_mean(0)
    for tensor, mean in results[0].items():
        bound = 2 * np.max(np.abs(exact[tensor])) / 127  # two roundings, half a level each
        assert np.max(np.abs(mean - exact[tensor])) <= bound
    scattered = unpack_blob(conn.get(KEYS.grad(1, 5, 0, 1, "w0")))
    assert scattered["<f4"].dtype == np.uint8 and "<f4/scales" in scattered


def test_a_world_of_one_and_mixed_transports(connect_more: Callable[[], redis.Redis]) -> None:
    alone = Collective(connect_more(), "coll", StandIn("w0", 0, 1))
    g = _gradient(0, 0)
    got = PowerSGD(2).allreduce(alone, g, (0, 1))
    assert got["fc.bias"].tobytes() == g["fc.bias"].tobytes()  # exact
    assert Int8Feedback().allreduce(alone, g, (2, 3))["tiny"].shape == (3, 4)

    def mixed(c: Collective, m: StandIn) -> Any:
        transport = "int8" if m.rank else "float32"
        return c.allreduce({"x": np.ones(300, "<f4")}, 9, timeout=10, transport=transport)

    for error in run_ranks(connect_more, _members(2), mixed):
        assert isinstance(error, CollectiveError) and "transport" in str(error)


def test_int8_transport_refuses_values_that_are_not_finite(
    connect_more: Callable[[], redis.Redis],
) -> None:
    def body(c: Collective, m: StandIn) -> Any:
        return c.allreduce({"x": np.array([1.0, np.inf], "<f4")}, 0, timeout=5, transport="int8")

    error = run_ranks(connect_more, _members(2), body)[0]
    assert isinstance(error, CollectiveError) and "inf or nan" in str(error)


@pytest.mark.parametrize(("transport", "travels"), [("float32", "<f4"), ("float16", "<f2")])
def test_a_reduced_chunk_travels_no_wider_than_the_contributions(
    conn: redis.Redis, connect_more: Callable[[], redis.Redis], transport: str, travels: str
) -> None:
    """The owners sum in float64, but what they store for the others is in the values' own
    width (a float64 mean would double the bytes of the gather phase)."""

    def body(c: Collective, m: StandIn) -> dict[str, np.ndarray]:
        tensors = {"w": np.full(3000, m.rank, "<f4"), "d": np.full(10, m.rank, "<f8")}
        return c.allreduce(tensors, 7, transport=transport)

    results = _ok(run_ranks(connect_more, _members(N), body))
    assert all(np.array_equal(r["w"], np.full(3000, 1.0, "<f4")) for r in results)
    reduced = list(conn.scan_iter(match="cohort:{" + KEYS.job + "}:grad*reduced*"))
    assert reduced, "no reduced chunk was found to look at"
    for key in reduced:
        chunk = unpack_blob(conn.get(key))
        assert chunk["<f4"].dtype == np.dtype(travels), (key, chunk["<f4"].dtype)
        assert chunk["<f8"].dtype == np.float64
