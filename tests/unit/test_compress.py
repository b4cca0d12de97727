"""Gradient compression without Redis: the int8 and low-rank codes (worker/collective/codes.py) and
their error feedback (worker/collective/compressors.py) over a stand-in collective of one rank that
sends values the way the int8 transport would."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from cohort.worker.collective import codes as compress
from cohort.worker.collective.compressors import Int8Feedback, PowerSGD, compressor
from cohort.worker.collective.layout import flatten, received, transported, unflatten
from cohort.worker.collective.redis_collective import Collective
from cohort.worker.errors import WorldChangedError


class Alone:
    """A collective of one rank: the mean is the values, as they would travel."""

    def __init__(self, fail_on: int | None = None) -> None:
        self.calls: list[int] = []
        self.fail_on = fail_on

    def allreduce(
        self,
        tensors: Mapping[str, np.ndarray],
        step: int,
        timeout: float | None = None,
        world: int | None = None,
        transport: str = "float32",
    ) -> dict[str, np.ndarray]:
        self.calls.append(step)
        if step == self.fail_on:
            raise WorldChangedError(step, None)
        layout, flats = flatten(tensors)
        wire = transported(flats, transport, "test")  # type: ignore[arg-type]
        return unflatten(layout, received(wire, transport, "test"))  # type: ignore[arg-type]


def alone(fail_on: int | None = None) -> Any:
    return Alone(fail_on)


finite = st.floats(-(2.0**100), 2.0**100, width=32, allow_subnormal=False)


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.float32, st.integers(0, 2000), elements=finite))
@example(np.array([1.1754944e-38], np.float32))  # a subnormal scale: 127 / it would overflow
def test_int8_round_trip_errs_by_at_most_half_a_level_of_each_block(values: np.ndarray) -> None:
    levels, scales = compress.quantise(values)
    assert levels.dtype == np.int8 and scales.size == compress.blocks_of(values.size)
    back = compress.dequantise(levels, scales)
    for b in range(scales.size):
        block = slice(b * compress.BLOCK, (b + 1) * compress.BLOCK)
        biggest = float(np.max(np.abs(values[block]), initial=0.0))
        err = np.abs(back[block].astype(np.float64) - values[block].astype(np.float64))
        # half a level, plus float32 rounding of the scale and the product
        assert np.all(err <= biggest / compress.LEVELS * (0.5 + 1e-5) + 1e-40)


def test_int8_refuses_values_that_are_not_finite_and_mismatched_scales() -> None:
    with pytest.raises(ValueError, match="inf or nan"):
        compress.quantise(np.array([1.0, np.nan], np.float32))
    levels, scales = compress.quantise(np.ones(300, np.float32))
    with pytest.raises(ValueError, match="need 2 scales, not 1"):
        compress.dequantise(levels, scales[:1])


def test_int8_error_feedback_keeps_the_sum_of_updates_on_the_true_sum() -> None:
    rng = np.random.default_rng(0)
    comp = Int8Feedback()
    collective = alone()
    # a small steady gradient beside a large one in each block: rounding alone would
    # lose the small values every step
    true_sum = np.zeros(1024)
    applied = np.zeros(1024)
    worst = 0.0
    for step in range(200):
        g = np.full(1024, 1e-3, np.float32)
        g[::256] = 1.0
        g += rng.normal(0, 1e-4, 1024).astype(np.float32)
        got = comp.allreduce(collective, {"g": g}, (step, -1))["g"]
        true_sum += g
        applied += got
        worst = max(worst, float(np.max(np.abs(applied - true_sum))))
    assert np.abs(comp.error["g"]).max() <= 1.0 / 127  # the residual stays within a level
    assert worst <= 2.0 / 127  # so the applied sum never strays further than that
    without = compress.int8_round_trip(np.full(256, 1e-3, np.float32) + np.eye(1, 256)[0])
    assert without[1] == 0.0  # what the feedback made up for


def test_powersgd_recovers_an_exactly_low_rank_matrix() -> None:
    rng = np.random.default_rng(1)
    m = (rng.standard_normal((64, 3)) @ rng.standard_normal((3, 48))).astype(np.float32)
    got = PowerSGD(4).allreduce(alone(), {"w": m}, (0, 1))["w"]
    np.testing.assert_allclose(got, m, atol=1e-4 * np.abs(m).max())


def test_powersgd_writes_into_out_the_same_bits_it_would_return_step_after_step() -> None:
    rng = np.random.default_rng(7)
    fresh, into = PowerSGD(2), PowerSGD(2)
    for step in range(4):  # the error's buffers change hands each step
        g = {"w": rng.standard_normal((40, 30)).astype(np.float32), "b": np.ones(30, "<f4")}
        expected = fresh.allreduce(alone(), g, (2 * step, 2 * step + 1))
        target = {"w": g["w"].copy()}
        got = into.allreduce(alone(), g, (2 * step, 2 * step + 1), out=target)
        assert got["w"] is not None and np.shares_memory(got["w"], target["w"])
        for name in g:
            assert np.array_equal(got[name], expected[name])
        assert np.array_equal(into.error["w"], fresh.error["w"])
    with pytest.raises(ValueError, match="out\\['w'\\] must be a C-contiguous float32"):
        into.allreduce(alone(), g, (8, 9), out={"w": np.zeros((40, 30))})


def test_powersgd_feedback_tracks_the_sum_and_warm_start_converges() -> None:
    rng = np.random.default_rng(2)
    signal = (rng.standard_normal((80, 6)) * 0.5 ** np.arange(6)) @ rng.standard_normal((6, 60))
    comp = PowerSGD(2)
    collective = alone()
    applied = np.zeros_like(signal)
    errors = []
    for step in range(60):
        g = (signal + 0.05 * rng.standard_normal(signal.shape)).astype(np.float32)
        applied += comp.allreduce(collective, {"w": g}, (2 * step, 2 * step + 1))["w"]
        errors.append(np.linalg.norm(applied - signal * (step + 1)) / np.linalg.norm(signal))
    # the residual (the error buffer) stays bounded: the sum's error does not grow with steps
    assert max(errors[30:]) < 2 * max(errors[:30])
    assert errors[-1] / 60 < 0.05  # relative to the sum of 60 steps
    assert np.linalg.norm(comp.error["w"]) < 3 * np.linalg.norm(signal)


def test_orthonormalise_makes_orthonormal_columns_and_zeroes_dependent_ones() -> None:
    rng = np.random.default_rng(3)
    p = rng.standard_normal((50, 4))
    q = compress.orthonormalise(p)
    np.testing.assert_allclose(q.T @ q, np.eye(4), atol=1e-6)
    # the span is kept: p's columns are combinations of q's
    np.testing.assert_allclose(q @ (q.T @ p), p, atol=1e-5)
    p[:, 2] = p[:, 0] + p[:, 1]
    p[:, 3] = 0
    q = compress.orthonormalise(p)
    assert not q[:, 2:].any()
    np.testing.assert_allclose(q[:, :2].T @ q[:, :2], np.eye(2), atol=1e-6)


def test_initial_q_is_a_function_of_name_and_seed_only() -> None:
    a = compress.initial_q("fc.weight", 30, 4, seed=17)
    assert np.array_equal(a, compress.initial_q("fc.weight", 30, 4, seed=17))
    assert not np.array_equal(a, compress.initial_q("fc.weight", 30, 4, seed=18))
    assert not np.array_equal(a, compress.initial_q("fc.bias", 30, 4, seed=17))


def test_reset_puts_ranks_with_different_histories_in_the_same_state() -> None:
    rng = np.random.default_rng(4)
    veteran, joiner = PowerSGD(2), PowerSGD(2)
    for _ in range(3):  # only the veteran trained in the old world
        veteran.allreduce(alone(), {"w": rng.standard_normal((20, 30)).astype("<f4")}, (0, 1))
    assert veteran.q and veteran.error
    for comp in (veteran, joiner):
        comp.reset(100)  # the new world's first step
    g = {"w": rng.standard_normal((20, 30)).astype("<f4")}
    a = veteran.allreduce(alone(), g, (0, 1))["w"]
    b = joiner.allreduce(alone(), g, (0, 1))["w"]
    assert np.array_equal(a, b)


def test_vectors_and_small_matrices_go_exactly() -> None:
    rng = np.random.default_rng(5)
    tensors = {
        "bias": rng.standard_normal(100).astype("<f4"),
        "small": rng.standard_normal((4, 6)).astype("<f4"),
        "scalar": np.asarray(rng.standard_normal(), "<f4"),
        "big": rng.standard_normal((40, 40)).astype("<f4"),
    }
    comp = PowerSGD(4)
    assert comp.compressed(tensors) == ["big"]
    got = comp.allreduce(alone(), tensors, (0, 1))
    for name in ("bias", "small", "scalar"):
        assert got[name].tobytes() == tensors[name].tobytes()
    assert compress.compressible((64, 16), 4) and not compress.compressible((4, 64), 4)
    assert not compress.compressible((1000,), 1)


def test_a_failed_call_leaves_the_state_as_it_was() -> None:
    comp = PowerSGD(2)
    comp.reset(0)
    g = {"w": np.random.default_rng(6).standard_normal((30, 30)).astype("<f4")}
    with pytest.raises(WorldChangedError):
        comp.allreduce(alone(fail_on=1), g, (0, 1))  # the Q call fails
    assert comp.q == {} and comp.error == {}
    int8 = Int8Feedback()
    with pytest.raises(WorldChangedError):
        int8.allreduce(alone(fail_on=0), g, (0, 1))
    assert int8.error == {}


@pytest.mark.parametrize("rank", [0, -1, 2.5, True])
def test_a_bad_rank_is_refused_by_value(rank: Any) -> None:
    with pytest.raises(ValueError, match=f"rank must be an integer >= 1, not {rank!r}"):
        compressor("powersgd", rank=rank)


def test_an_unknown_compression_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="compression 'topk' is not one of 'powersgd', 'int8'"):
        compressor("topk")
    assert compressor(None) is None


def test_local_sgd_compresses_pseudo_gradients_only() -> None:
    torch = pytest.importorskip("torch")
    from cohort.worker.pytorch.sync import LocalSGD

    model = torch.nn.Linear(3, 2)
    fake: Collective = alone()
    with pytest.raises(ValueError, match="compression 'int8' needs mode='pseudo_gradient'"):
        LocalSGD(model, fake, 2, mode="weights", compression="int8")
    with pytest.raises(ValueError, match="'zip'"):
        LocalSGD(model, fake, 2, mode="pseudo_gradient", compression="zip")  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_sync_gradients_compresses_a_model_of_any_float_width(dtype: str) -> None:
    """float32 gradients take PowerSGD's result in place; other widths get it cast back."""
    torch = pytest.importorskip("torch")
    from cohort.worker.pytorch.sync import sync_gradients

    model = torch.nn.Linear(64, 48).to(getattr(torch, dtype))
    model(torch.randn(4, 64, dtype=getattr(torch, dtype))).sum().backward()
    grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters()}
    expected = PowerSGD(2).allreduce(alone(), grads, (0, 1))
    sync_gradients(model, alone(), 0, compressor=PowerSGD(2))
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.dtype == getattr(torch, dtype)
        assert np.array_equal(param.grad.numpy(), expected[name].astype(dtype))
