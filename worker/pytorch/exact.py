"""Gradient sums whose bits do not depend on who computed what, through Redis
(docs/guarantees.md, "Exact sums"; gloo and NCCL sum along a tree instead, tree.py).

A constant global batch is cut into units (the micro-batches), each computed whole by one
rank: a unit's gradient is the same bits whichever rank computes it. Floating-point sums of
those gradients are not: they depend on the order and grouping of the additions, which
follow the world size (how many units each rank accumulates, then the collective's tree).
So each unit's gradient, weighted by its share of the global batch, becomes integers at a
scale of 2**e per tensor, and integers are summed instead: their addition is exact, so
associative and commutative, and the step's sum is one value however the units were
grouped, within a rank (its micro-batches) and across ranks (the collective).

- A unit's value v (its gradient times its share, in float32) becomes q = trunc(v * 2**e):
  scaling by a power of two is exact, so q is a function of v and e alone, computed by
  the same elementwise operations on any rank. |q| is bounded by 2**(62 - c), with 2**c >=
  the step's units, so the sum of every unit's q stays below 2**62 and int64 never wraps.
- The sum S comes back as S * 2**-e, rounded once to float32, alike on every rank.
- e follows the data, not the world: each step's e is chosen from the step before's sum
  (its largest magnitude, with HEADROOM bits of range above it), which every rank gets
  alike whatever the world. The exponents are training state: they travel with the weights
  to a new world and into checkpoints.
- A value beyond the range (a gradient more than 2**HEADROOM times the last step's
  largest) is clamped to it, and a non-finite one makes its tensor's sum NaN: both are
  functions of the unit alone, so they too come out alike at any world size; a clamped
  tensor is counted and logged (`saturated`), and the next step's range follows it up.

Precision: each unit's quantum is 2**-e and truncation costs less than one, so a sum of U
units (2**c >= U) is within U * 2**-e of the sum of their float32 values: at most
2**-(61 - 2c - HEADROOM) of the last step's largest value, 2**-29 at 256 units and 2**-37
at 16, then rounded once to float32 (2**-24 relative). A float32 sum of the same units may
be off by about U * 2**-24 of the sum of their magnitudes, and its bits change with the
grouping. The first step (no sum before it) covers values up to 2**FIRST_RANGE, at a
quantum of 2**-(62 - c - FIRST_RANGE).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

SUM_BITS = 62
"""|sum| < 2**62: int64 never wraps, however the units are grouped."""

HEADROOM = 16
"""Bits of range above the last step's largest summed value that a unit's value may use."""

FIRST_RANGE = 24
"""The range of a step with no sum before it: values up to 2**24."""

MAX_EXPONENT = 100
"""The factor weight * 2**e stays well inside float32's range (2**127)."""

NONFINITE, SATURATED = 0, 1
"""Per tensor, two counters travel with the sums: units whose values were not all finite,
and units clamped to the range."""


def unit_bits(units: int) -> int:
    """c with 2**c >= `units`: the bits a sum of that many units may add."""
    return max(units - 1, 0).bit_length()


def bound(units: int) -> int:
    """The largest |q| a unit may carry in a step of `units` units."""
    return 2 ** (SUM_BITS - unit_bits(units))


def first_exponent(units: int) -> int:
    """e for a step with no sum before it: values up to 2**FIRST_RANGE fit."""
    return SUM_BITS - unit_bits(units) - FIRST_RANGE


def next_exponent(exponent: int, largest: int, units: int) -> int:
    """The next step's e, from this step's (`exponent`) and the largest |S| of its sum: the
    next step's values may reach 2**HEADROOM times this one's, rounded up to a power of 2.
    An all-zero sum (a parameter nothing trained) keeps e."""
    if largest == 0:
        return exponent
    top = largest.bit_length() - exponent  # |S| * 2**-e < 2**top
    return min(SUM_BITS - unit_bits(units) - HEADROOM - top, MAX_EXPONENT)


@dataclass
class ExactSum:
    """The exact sum of one model's gradients over a step's units, on one rank: each unit's
    gradients quantized into int64 accumulators (`add`), the accumulators as one vector to
    sum over the world (`payload`), and that sum back into the gradients (`decode`).

    `exponents` (one per parameter, in the model's order) are the training state: every rank
    of a world holds the same ones (they travel with the weights), and `commit` moves them
    on only when a step applies. The buffers are kept from step to step (a fresh 200 MB
    tensor costs more in page faults than the arithmetic on it), but for a payload a
    collective may still write into (`discard`)."""

    exponents: list[int] | None = None
    units: int = 1
    """The step's units over the whole world (its global batch's micro-batches)."""
    saturated: int = 0
    """Units' tensors clamped to the range in the last decoded step, over the world."""
    _shapes: list[torch.Size] = field(default_factory=list)
    _flat: torch.Tensor | None = None
    _fresh: list[bool] = field(default_factory=list)
    """Per tensor: whether its accumulator holds nothing of this step yet (stale bytes)."""
    _scratch: tuple[torch.Tensor, torch.Tensor] | None = None
    """float32 and int64 room for the largest tensor: one unit's values on their way in."""
    _next: list[int] | None = None

    def begin(self, params: Sequence[torch.Tensor], units: int) -> None:
        """A step of `units` units begins: empty accumulators for `params`."""
        self.units = max(units, 1)
        if self.exponents is None or len(self.exponents) != len(params):
            self.exponents = [first_exponent(self.units)] * len(params)
        shapes = [p.shape for p in params]
        if shapes != self._shapes:
            self._shapes, self._flat, self._scratch = shapes, None, None
        self._fresh = [True] * (len(shapes) + 1)  # the last: the counters
        self._next = None

    def discard(self) -> None:
        """The step's payload went to a collective that did not finish (its world ended):
        the next step takes new memory, which a late write of that one cannot reach."""
        self._flat = None

    def add(self, grads: Sequence[torch.Tensor | None], weight: float, unit: int = 0) -> None:
        """One unit's gradients (None: no gradient, a zero), times `weight` (its share of
        the global batch), into the accumulators: per tensor, v = grad * f in float32, with
        f = weight * 2**e rounded to float32 (so v is grad * weight rounded, times 2**e
        exactly), then truncated toward zero to int64. The same elementwise operations run
        on any rank, so q is a function of the unit alone. Which of the rank's micro-batches
        it is (`unit`) does not matter here: integers are summed in any order."""
        assert self.exponents is not None, "begin() the step first"
        present = [(i, g.detach()) for i, g in enumerate(grads) if g is not None and g.numel()]
        if not present:
            return
        sums, counts = self._views(self._accumulators(present[0][1].device))
        if self._fresh[-1]:
            counts.zero_()
            self._fresh[-1] = False
        limit = float(bound(self.units))
        with torch.no_grad():
            ends = torch.stack([torch.stack(torch.aminmax(g)) for _, g in present]).tolist()
            for (i, grad), (low, high) in zip(present, ends, strict=True):
                factor = float32(weight * math.ldexp(1.0, self.exponents[i]))
                scaled = self._scaled(grad, factor)
                if not (-limit <= low * factor and high * factor <= limit):
                    bad = not (math.isfinite(low) and math.isfinite(high))  # inf or NaN
                    counts[i, NONFINITE if bad else SATURATED] += 1
                    scaled.nan_to_num_(0.0).clamp_(-limit, limit)
                self._into(i, sums[i], scaled)

    def _scaled(self, grad: torch.Tensor, factor: float) -> torch.Tensor:
        """grad * factor in float32, in the scratch room."""
        room = self._room(grad.device)[0][: grad.numel()].view(grad.shape)
        if grad.dtype == room.dtype:
            return torch.mul(grad, factor, out=room)
        return room.copy_(grad).mul_(factor)  # a bfloat16 gradient: widened first

    def _into(self, i: int, total: torch.Tensor, scaled: torch.Tensor) -> None:
        """`scaled`, truncated to int64, into accumulator `total` (tensor `i`'s)."""
        if self._fresh[i]:
            total.copy_(scaled)  # the first unit: converted straight in
            self._fresh[i] = False
            return
        whole = self._room(scaled.device)[1][: scaled.numel()].view(scaled.shape)
        total.add_(whole.copy_(scaled))

    def _room(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._scratch is None or self._scratch[0].device != device:
            largest = max((math.prod(s) for s in self._shapes), default=0)
            self._scratch = (
                torch.empty(largest, dtype=torch.float32, device=device),
                torch.empty(largest, dtype=torch.int64, device=device),
            )
        return self._scratch

    def _accumulators(self, device: torch.device) -> torch.Tensor:
        """The step's int64 sums, one flat vector (tensor by tensor, then two counters per
        tensor): the payload as it stands."""
        if self._flat is None or self._flat.device != device:
            total = sum(math.prod(s) for s in self._shapes) + 2 * len(self._shapes)
            self._flat = torch.empty(total, dtype=torch.int64, device=device)
            self._fresh = [True] * len(self._fresh)
        return self._flat

    def _views(self, flat: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Each tensor's sums, shaped as it is, and the counters, as views of `flat`."""
        sizes = [math.prod(s) for s in self._shapes]
        *parts, tail = torch.split(flat, [*sizes, 2 * len(sizes)])
        return [p.view(s) for p, s in zip(parts, self._shapes, strict=True)], tail.view(-1, 2)

    def payload(self, device: torch.device | None = None) -> torch.Tensor:
        """The step's accumulators and counters as one int64 vector (zeros where this rank
        had no unit): what the world sums, in place where the collective allows."""
        flat = self._accumulators(device or torch.device("cpu"))
        sums, counts = self._views(flat)
        for i, fresh in enumerate(self._fresh):
            if fresh:
                (sums[i] if i < len(sums) else counts).zero_()
        self._fresh = [False] * len(self._fresh)
        return flat

    def decode(self, summed: torch.Tensor, into: Sequence[torch.Tensor]) -> None:
        """The world's sum (`payload` summed over every rank) written into `into` (the
        gradients, one per parameter): S * 2**-e rounded once to float32, then to the
        gradient's dtype; NaN where a unit's value was not finite. Sets the exponents
        `commit` takes on."""
        assert self.exponents is not None
        parts, tail = self._views(summed)
        counts = tail.tolist()
        ends = [torch.stack(torch.aminmax(p)) if p.numel() else p.new_zeros(2) for p in parts]
        largest = [max(-low, high) for low, high in torch.stack(ends).tolist()] if ends else []
        with torch.no_grad():
            for part, grad, exponent, (nonfinite, _) in zip(
                parts, into, self.exponents, counts, strict=True
            ):
                if nonfinite:
                    grad.fill_(math.nan)
                elif grad.dtype == torch.float32:
                    grad.copy_(part).mul_(math.ldexp(1.0, -exponent))  # exact scaling
                else:
                    grad.copy_(part.to(torch.float32).mul_(math.ldexp(1.0, -exponent)))
        self.saturated = sum(saturated for _, saturated in counts)
        self._next = [
            exponent if nonfinite else next_exponent(exponent, int(top), self.units)
            for exponent, top, (nonfinite, _) in zip(self.exponents, largest, counts, strict=True)
        ]

    def commit(self) -> None:
        """The step applied: the next one's scales follow its sum."""
        if self._next is not None:
            self.exponents, self._next = self._next, None

    def state_dict(self) -> dict[str, Any]:
        return {"exponents": None if self.exponents is None else list(self.exponents)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        got = state.get("exponents")
        self.exponents = None if got is None else [int(e) for e in got]
        self._next = None


def float32(value: float) -> float:
    """`value` rounded to float32, as a multiplication of a float32 tensor by it uses it."""
    return float(torch.tensor(value, dtype=torch.float32))
