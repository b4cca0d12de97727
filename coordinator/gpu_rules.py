"""GPU rules: which advice a worker's GPU reading calls for, with hysteresis and priorities.

A rule watches one metric of a reading (`memory_pct` = used/total memory in %, less
PyTorch's cache where the reading tells it, `temperature` in °C, `power_w`,
`utilization_gpu`, `utilization_memory` in %) and advises the worker's data loader
(`reduce_prefetch` by a factor, `delay_transfers` by some seconds,
`prioritise_model_files`), after the SeaweedFS GPU coordinator seed. Everything
here is pure: `decide` asks `evaluate` what changed and journals the answer as
`GpuAdviceIssued` / `GpuAdviceCleared`; `fold` keeps the active set with
`next_active`.

Exact semantics of `evaluate(rules, active, reading)`, per rule and per target
(each device of the reading for scope "device"; the worker as a whole, device
None, for scope "any_device", whose value is the largest over its devices):

- A rule *holds* for a target when it is not active and value > `above`, or
  when it is active and value >= `clear_below` (the hysteresis band keeps
  active advice active; both comparisons are strict at the edge that changes
  state). A value the device does not report (None) changes nothing: active
  advice stays, inactive advice is not issued.
- Among the rules holding for the same target and the same action kind, the
  one with the highest `priority` wins (ties: the earlier rule in the file). The
  winner is issued unless already active; every other active rule of that
  target and kind is cleared (superseded), so at most one advice per worker,
  target and kind is active. Scope "device" and "any_device" are different
  targets and do not compete.
- Active advice that no longer holds is cleared with the value that fell below
  `clear_below`; advice for a device missing from the reading (or any_device
  advice of a reading without devices) is cleared with value None; advice of a
  rule no longer configured or disabled is cleared with metric and value None.
- Only `reading.worker`'s advice is looked at. Evaluating the same reading
  again gives nothing: the result is a fixed point.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from cohort.coordinator.errors import CoordinatorError
from cohort.events.models import (
    GpuAction,
    GpuAdviceCleared,
    GpuAdviceIssued,
    GpuDevice,
    GpuMetric,
    GpuReading,
    RuleName,
)

PERCENT_METRICS = frozenset({"memory_pct", "utilization_gpu", "utilization_memory"})
MARGINS: Mapping[str, float] = {
    "memory_pct": 5.0,
    "utilization_gpu": 5.0,
    "utilization_memory": 5.0,
    "temperature": 5.0,
    "power_w": 25.0,
}
"""Default hysteresis: `clear_below = above - MARGINS[metric]` when a rule gives none."""

Finite = Annotated[float, Field(allow_inf_nan=False, ge=-1e6, le=1e6)]
ActiveKey = tuple[str, int | None, str]
"""(worker, device or None for any_device, rule name): one piece of active advice."""


class RulesError(CoordinatorError, ValueError):
    """A rules file is unreadable or invalid; the message names the file and the bad field."""


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Condition(_Model):
    """`metric` above `above` fires; the advice holds until it falls below `clear_below`."""

    metric: GpuMetric
    above: Finite
    clear_below: Finite | None = None

    @model_validator(mode="before")
    @classmethod
    def _default_clear_below(cls, data: Any) -> Any:
        if (
            isinstance(data, dict)
            and data.get("clear_below") is None
            and isinstance(data.get("above"), int | float)
            and data.get("metric") in MARGINS
        ):
            return {**data, "clear_below": data["above"] - MARGINS[data["metric"]]}
        return data

    @model_validator(mode="after")
    def _band(self) -> Condition:
        assert self.clear_below is not None  # filled in before validation
        if self.clear_below >= self.above:
            raise ValueError(
                f"clear_below ({self.clear_below}) must be less than above ({self.above}), "
                "or the advice would flap"
            )
        if self.metric in PERCENT_METRICS and not 0 <= self.above < 100:
            raise ValueError(
                f"above ({self.above}) must be in [0, 100) for {self.metric}, a percentage"
            )
        return self

    @property
    def release(self) -> float:
        """The value below which active advice clears."""
        assert self.clear_below is not None
        return self.clear_below


class Action(_Model):
    """What the worker's data loader should do while the advice is active."""

    kind: GpuAction
    factor: Annotated[float, Field(gt=0, le=1)] | None = None
    """reduce_prefetch: multiply the prefetch depth by this (0 < factor <= 1)."""
    seconds: Annotated[float, Field(gt=0, le=3600, allow_inf_nan=False)] | None = None
    """delay_transfers: wait this long before starting a transfer."""

    @model_validator(mode="after")
    def _parameters(self) -> Action:
        wants = {"reduce_prefetch": "factor", "delay_transfers": "seconds"}.get(self.kind)
        for name in ("factor", "seconds"):
            given = getattr(self, name) is not None
            if name == wants and not given:
                raise ValueError(f"{name} is required for {self.kind}")
            if name != wants and given:
                raise ValueError(f"{name} does not apply to {self.kind}")
        return self


class Rule(_Model):
    name: RuleName
    condition: Condition
    action: Action
    priority: Annotated[int, Field(ge=-1_000_000, le=1_000_000)] = 0
    """Higher wins among rules of the same action kind holding for the same target."""
    scope: Literal["device", "any_device"] = "device"
    enabled: bool = True


class Rules(_Model):
    rules: tuple[Rule, ...] = Field(default=(), max_length=256)

    @model_validator(mode="after")
    def _unique_names(self) -> Rules:
        seen: set[str] = set()
        for rule in self.rules:
            if rule.name in seen:
                raise ValueError(f"rule names must be unique: {rule.name!r} appears twice")
            seen.add(rule.name)
        return self

    def named(self, name: str) -> Rule | None:
        return next((r for r in self.rules if r.name == name), None)


DEFAULT_RULES = Rules(
    rules=(
        # The SeaweedFS seed's rules, minus its file-type condition and staging rule
        # (about transfers cohort does not make); its priorities, higher = stronger.
        Rule(
            name="reduce_prefetch_on_memory_pressure",
            condition=Condition(metric="memory_pct", above=85, clear_below=80),
            action=Action(kind="reduce_prefetch", factor=0.5),
            priority=10,
        ),
        Rule(
            name="prioritise_model_files_on_memory_pressure",
            condition=Condition(metric="memory_pct", above=80, clear_below=75),
            action=Action(kind="prioritise_model_files"),
            priority=15,
        ),
        Rule(
            name="delay_transfers_on_temperature",
            condition=Condition(metric="temperature", above=87, clear_below=82),
            action=Action(kind="delay_transfers", seconds=30),
            priority=20,
        ),
    )
)


# ---------------------------------------------------------------- loading


def _where(loc: tuple[int | str, ...], data: Any) -> str:
    """`rules[0] (hot).action.factor` from pydantic's loc: the path an operator edits."""
    if not loc:
        return "rules"
    parts: list[str] = []
    node = data
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
            node = node[item] if isinstance(node, list | tuple) and item < len(node) else None
            if isinstance(node, dict) and isinstance(node.get("name"), str) and len(loc) > 1:
                parts.append(f" ({node['name']})")
        else:
            parts.append(f".{item}" if parts else item)
            node = node.get(item) if isinstance(node, dict) else None
    return "".join(parts)


def _describe(exc: ValidationError, data: Any) -> str:
    problems = []
    for err in exc.errors():
        text = f"{_where(err['loc'], data)}: {err['msg'].removeprefix('Value error, ')}"
        if err["type"] not in ("missing", "value_error"):
            text += f" (got {err['input']!r:.80})"
        problems.append(text)
    return "; ".join(problems)


def parse_rules(data: Any, source: str = "rules") -> Rules:
    """Rules from parsed TOML/YAML: a mapping with a `rules` list (an empty mapping: no rules)."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RulesError(f"{source}: expected a mapping with a 'rules' list, got {data!r:.80}")
    try:
        return Rules.model_validate(data)
    except ValidationError as exc:
        raise RulesError(f"{source}: {_describe(exc, data)}") from exc


def load_rules(path: str | Path) -> Rules:
    """Rules from a `.toml`, `.yaml` or `.yml` file; RulesError names the file and the bad field."""
    path = Path(path)
    suffix = path.suffix.lower()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RulesError(f"{path}: cannot read the rules file: {exc}") from exc
    if suffix == ".toml":
        try:
            data: Any = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise RulesError(f"{path}: not valid TOML: {exc}") from exc
    elif suffix in (".yaml", ".yml"):
        try:
            import yaml  # optional: only YAML rules files need PyYAML
        except ImportError as exc:
            raise RulesError(f"{path}: YAML rules need PyYAML (pip install pyyaml)") from exc
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise RulesError(f"{path}: not valid YAML: {exc}") from exc
    else:
        raise RulesError(f"{path}: unknown rules format {suffix!r}; use .toml, .yaml or .yml")
    return parse_rules(data, str(path))


# ---------------------------------------------------------------- evaluation


@dataclass(frozen=True)
class Advice:
    """Advice to issue: `rule` fired on the device as `metric` = `value` exceeded `threshold`."""

    worker: str
    device: int | None
    rule: str
    action: Action
    metric: GpuMetric
    value: float
    threshold: float

    @property
    def key(self) -> ActiveKey:
        return (self.worker, self.device, self.rule)

    def fact(self, at: float, job: str) -> GpuAdviceIssued:
        return GpuAdviceIssued(
            at=at,
            job=job,
            worker=self.worker,
            device=self.device,
            rule=self.rule,
            action=self.action.kind,
            factor=self.action.factor,
            seconds=self.action.seconds,
            metric=self.metric,
            value=self.value,
            threshold=self.threshold,
        )


Issue = Advice


@dataclass(frozen=True)
class Clear:
    """Advice to end; `value` None: nothing left to measure (device or rule gone)."""

    worker: str
    device: int | None
    rule: str
    metric: GpuMetric | None
    value: float | None

    @property
    def key(self) -> ActiveKey:
        return (self.worker, self.device, self.rule)

    def fact(self, at: float, job: str) -> GpuAdviceCleared:
        return GpuAdviceCleared(
            at=at,
            job=job,
            worker=self.worker,
            device=self.device,
            rule=self.rule,
            metric=self.metric,
            value=self.value,
        )


def metric_value(device: GpuDevice, metric: GpuMetric) -> float | None:
    """The metric of one device; None when the device does not report it. Memory in use
    leaves out PyTorch's cache (`memory_cached`), which the process reuses before it asks
    the GPU for more: a process that merely caches is under no pressure."""
    if metric == "memory_pct":
        if device.memory_total <= 0:
            return None
        used = max(0, device.memory_used - (device.memory_cached or 0))
        return min(100.0, 100.0 * used / device.memory_total)
    value: float | None = getattr(device, metric)
    return None if value is None or math.isnan(value) else float(value)


def _targets(
    rule: Rule, devices: Mapping[int, GpuDevice], active_devices: Iterable[int | None]
) -> Iterator[tuple[int | None, bool, float | None]]:
    """(device key, present?, value) for each target of `rule` in this reading."""
    metric = rule.condition.metric
    if rule.scope == "any_device":
        values = [v for d in devices.values() if (v := metric_value(d, metric)) is not None]
        yield None, bool(devices), max(values) if values else None
        return
    for index in sorted(set(devices) | {d for d in active_devices if d is not None}):
        device = devices.get(index)
        yield index, device is not None, None if device is None else metric_value(device, metric)


def evaluate(
    rules: Rules, active: frozenset[ActiveKey], reading: GpuReading
) -> tuple[list[Advice], list[Clear]]:
    """What `reading` changes in `reading.worker`'s advice (module docstring: exact semantics).

    Journal the clears before the issues: a superseded rule ends before its successor starts.
    """
    run = _Evaluation(reading, active)
    enabled = [(order, rule) for order, rule in enumerate(rules.rules) if rule.enabled]
    for order, rule in enabled:
        run.judge(order, rule)
    run.pick_winners()
    run.clear_unconfigured({rule.name for _, rule in enabled})
    return run.result()


_Candidate = tuple[int, Rule, float | None, bool]
"""(order in the file, rule, value, is it active) of a rule that holds for a target."""


class _Evaluation:
    """One reading's evaluation: the rules that hold per target and kind, and the clears."""

    def __init__(self, reading: GpuReading, active: frozenset[ActiveKey]) -> None:
        self.worker = reading.worker
        self.mine = {(device, rule) for w, device, rule in active if w == self.worker}
        self.devices = {d.index: d for d in reading.devices}
        self.holding: dict[tuple[int | None, str], list[_Candidate]] = {}
        """(device, action kind) -> the rules that hold there"""
        self.clears: list[Clear] = []
        self.issues: list[Advice] = []

    def judge(self, order: int, rule: Rule) -> None:
        """Does `rule` hold for each of its targets? Active advice that does not is cleared."""
        cond = rule.condition
        mine_here = (d for d, r in self.mine if r == rule.name)
        for device, present, value in _targets(rule, self.devices, mine_here):
            is_active = (device, rule.name) in self.mine
            if not present:
                if is_active:
                    self.clears.append(Clear(self.worker, device, rule.name, cond.metric, None))
                continue
            if _holds(cond, value, is_active):
                self.holding.setdefault((device, rule.action.kind), []).append(
                    (order, rule, value, is_active)
                )
            elif is_active:
                self.clears.append(Clear(self.worker, device, rule.name, cond.metric, value))

    def pick_winners(self) -> None:
        """Per target and kind, the highest priority issues unless active; the rest clear."""
        worker = self.worker
        for (device, _kind), candidates in self.holding.items():
            candidates.sort(key=lambda c: (-c[1].priority, c[0]))
            _, winner, value, was_active = candidates[0]
            for _, loser, loser_value, loser_active in candidates[1:]:
                if loser_active:
                    self.clears.append(
                        Clear(worker, device, loser.name, loser.condition.metric, loser_value)
                    )
            if not was_active:
                # an inactive rule holds only on a value above its threshold
                assert value is not None
                cond = winner.condition
                self.issues.append(
                    Advice(
                        worker, device, winner.name, winner.action, cond.metric, value, cond.above
                    )
                )

    def clear_unconfigured(self, configured: set[str]) -> None:
        """Active advice of a rule no longer configured (or disabled) ends, unmeasured."""
        for device, name in sorted(self.mine, key=_device_then_name):
            if name not in configured:
                self.clears.append(Clear(self.worker, device, name, None, None))

    def result(self) -> tuple[list[Advice], list[Clear]]:
        self.clears.sort(key=lambda c: _device_then_name((c.device, c.rule)))
        self.issues.sort(key=lambda a: _device_then_name((a.device, a.rule)))
        return self.issues, self.clears


def _holds(cond: Condition, value: float | None, is_active: bool) -> bool:
    """Hysteresis: inactive advice starts above `above`, active advice holds down to
    `clear_below`; an unreported value changes nothing."""
    if value is None:
        return is_active
    return value >= cond.release if is_active else value > cond.above


def _device_then_name(key: tuple[int | None, str]) -> tuple[int, str]:
    device, name = key
    return (-1 if device is None else device, name)


def next_active(
    active: frozenset[ActiveKey], issues: Iterable[Advice], clears: Iterable[Clear]
) -> frozenset[ActiveKey]:
    """The active set after journaling `clears` then `issues` (what fold will keep)."""
    return (active - {c.key for c in clears}) | {a.key for a in issues}


@dataclass(frozen=True)
class Effective:
    """What a worker's data loader should do now, all its active advice combined.

    `prefetch_factor` is the smallest factor of its active reduce_prefetch advice
    (not the product: two hot devices should not quarter the prefetch depth);
    `delay_seconds` the longest delay; `prioritise_model_files` whether any advises it.
    """

    prefetch_factor: float = 1.0
    delay_seconds: float = 0.0
    prioritise_model_files: bool = False
    rules: tuple[str, ...] = ()


def current_advice(active: Iterable[ActiveKey], rules: Rules) -> dict[str, Effective]:
    """Effective advice per worker that has any; rules no longer configured are ignored."""
    out: dict[str, Effective] = {}
    for worker, _device, name in sorted(active, key=lambda k: (k[0], *_device_then_name(k[1:]))):
        rule = rules.named(name)
        if rule is None or not rule.enabled:
            continue
        now = out.get(worker, Effective())
        action = rule.action
        out[worker] = Effective(
            prefetch_factor=min(now.prefetch_factor, action.factor)
            if action.kind == "reduce_prefetch" and action.factor is not None
            else now.prefetch_factor,
            delay_seconds=max(now.delay_seconds, action.seconds)
            if action.kind == "delay_transfers" and action.seconds is not None
            else now.delay_seconds,
            prioritise_model_files=now.prioritise_model_files
            or action.kind == "prioritise_model_files",
            rules=now.rules if name in now.rules else (*now.rules, name),
        )
    return out
