"""GPU rules: hysteresis, priorities, effective advice, rules files that explain their errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from cohort.coordinator.gpu_rules import (
    DEFAULT_RULES,
    Action,
    ActiveKey,
    Condition,
    Effective,
    Rule,
    Rules,
    RulesError,
    current_advice,
    evaluate,
    load_rules,
    metric_value,
    next_active,
)
from cohort.events.models import FACTS, GpuDevice, GpuReading

GiB = 2**30


def device(index: int = 0, memory_pct: float | None = 50.0, **values: float | None) -> GpuDevice:
    total = 100 * GiB if memory_pct is not None else 0
    used = int(total * memory_pct / 100) if memory_pct is not None else 0
    return GpuDevice(index=index, memory_total=total, memory_used=used, **values)  # type: ignore[arg-type]


def reading(*devices: GpuDevice, worker: str = "w1") -> GpuReading:
    return GpuReading(at=1.0, job="j", worker=worker, devices=devices)


def rule(
    name: str,
    metric: str = "memory_pct",
    above: float = 90,
    clear_below: float | None = None,
    kind: str = "reduce_prefetch",
    priority: int = 0,
    scope: str = "device",
) -> Rule:
    params = {"reduce_prefetch": {"factor": 0.5}, "delay_transfers": {"seconds": 2.0}}
    return Rule.model_validate(
        {
            "name": name,
            "condition": {"metric": metric, "above": above, "clear_below": clear_below},
            "action": {"kind": kind, **params.get(kind, {})},
            "priority": priority,
            "scope": scope,
        }
    )


# ---------------------------------------------------------------- examples


def test_default_rules_follow_the_seaweedfs_seed() -> None:
    hot = reading(device(0, memory_pct=90, temperature=88), device(1, memory_pct=10))
    issues, clears = evaluate(DEFAULT_RULES, frozenset(), hot)
    assert clears == []
    assert {(a.device, a.action.kind) for a in issues} == {
        (0, "reduce_prefetch"),
        (0, "prioritise_model_files"),
        (0, "delay_transfers"),
    }
    active = next_active(frozenset(), issues, clears)
    assert current_advice(active, DEFAULT_RULES)["w1"] == Effective(
        prefetch_factor=0.5,
        delay_seconds=30.0,
        prioritise_model_files=True,
        rules=(
            "delay_transfers_on_temperature",
            "prioritise_model_files_on_memory_pressure",
            "reduce_prefetch_on_memory_pressure",
        ),
    )


def test_advice_in_the_hysteresis_band_stays_and_clears_below_it() -> None:
    rules = Rules(rules=(rule("mem", above=90, clear_below=80),))
    issues, _ = evaluate(rules, frozenset(), reading(device(memory_pct=91)))
    (advice,) = issues
    assert (advice.metric, advice.value, advice.threshold) == ("memory_pct", 91.0, 90.0)
    active = next_active(frozenset(), issues, [])
    for pct in (90.0, 85.0, 80.0, 95.0):  # inside the band, or above: nothing changes
        assert evaluate(rules, active, reading(device(memory_pct=pct))) == ([], [])
    issues, clears = evaluate(rules, active, reading(device(memory_pct=79)))
    assert issues == [] and [(c.rule, c.device, c.value) for c in clears] == [("mem", 0, 79.0)]


def test_exactly_at_the_threshold_does_not_issue() -> None:
    rules = Rules(rules=(rule("hot", metric="temperature", above=85),))
    assert evaluate(rules, frozenset(), reading(device(temperature=85))) == ([], [])
    assert rules.rules[0].condition.clear_below == 80  # the default margin


def test_a_higher_priority_rule_supersedes_an_active_one_of_the_same_kind() -> None:
    rules = Rules(
        rules=(
            rule("gentle", above=80, clear_below=70, priority=1),
            rule("hard", above=95, clear_below=90, priority=5),
        )
    )
    issues, _ = evaluate(rules, frozenset(), reading(device(memory_pct=85)))
    active = next_active(frozenset(), issues, [])
    assert active == {("w1", 0, "gentle")}

    issues, clears = evaluate(rules, active, reading(device(memory_pct=97)))
    assert [a.rule for a in issues] == ["hard"] and [c.rule for c in clears] == ["gentle"]
    active = next_active(active, issues, clears)

    issues, clears = evaluate(rules, active, reading(device(memory_pct=85)))
    assert [a.rule for a in issues] == ["gentle"] and [c.rule for c in clears] == ["hard"]


def test_rules_of_different_kinds_fire_together() -> None:
    rules = Rules(rules=(rule("a", priority=1), rule("b", kind="delay_transfers", priority=0)))
    issues, _ = evaluate(rules, frozenset(), reading(device(memory_pct=99)))
    assert sorted(a.rule for a in issues) == ["a", "b"]


def test_any_device_rule_watches_the_hottest_device() -> None:
    rules = Rules(rules=(rule("any", metric="temperature", above=80, scope="any_device"),))
    two = reading(device(0, temperature=70), device(1, temperature=83))
    (advice,), _ = evaluate(rules, frozenset(), two)
    assert (advice.device, advice.value) == (None, 83.0)
    active = next_active(frozenset(), [advice], [])
    assert evaluate(
        rules, active, reading(device(0, temperature=76), device(1, temperature=74))
    ) == (
        [],
        [],
    )
    _, (clear,) = evaluate(
        rules, active, reading(device(0, temperature=70), device(1, temperature=74))
    )
    assert (clear.device, clear.value) == (None, 74.0)


def test_advice_for_a_device_that_disappeared_is_cleared_without_a_value() -> None:
    rules = Rules(rules=(rule("mem"),))
    active = frozenset({("w1", 1, "mem")})
    _, (clear,) = evaluate(rules, active, reading(device(0, memory_pct=99)))
    assert (clear.device, clear.metric, clear.value) == (1, "memory_pct", None)


def test_a_value_the_device_does_not_report_changes_nothing() -> None:
    rules = Rules(rules=(rule("hot", metric="temperature", above=80),))
    active = frozenset({("w1", 0, "hot")})
    assert evaluate(rules, active, reading(device(temperature=None))) == ([], [])
    assert evaluate(rules, frozenset(), reading(device(temperature=None))) == ([], [])


def test_advice_of_a_rule_no_longer_configured_is_cleared() -> None:
    active = frozenset({("w1", 0, "gone"), ("w2", 0, "gone")})
    _, clears = evaluate(Rules(), active, reading(device()))
    assert [(c.worker, c.rule, c.metric, c.value) for c in clears] == [("w1", "gone", None, None)]


def test_advice_and_clears_become_valid_facts() -> None:
    rules = Rules(rules=(rule("mem", above=90, clear_below=80),))
    (advice,), _ = evaluate(rules, frozenset(), reading(device(memory_pct=95)))
    issued = advice.fact(at=2.0, job="j")
    assert FACTS.validate_python(issued.model_dump()) == issued
    assert (issued.action, issued.factor, issued.seconds) == ("reduce_prefetch", 0.5, None)
    _, (clear,) = evaluate(rules, frozenset({advice.key}), reading(device(memory_pct=50)))
    cleared = clear.fact(at=3.0, job="j")
    assert FACTS.validate_python(cleared.model_dump()) == cleared
    assert (cleared.rule, cleared.value) == ("mem", 50.0)


def test_effective_advice_takes_the_smallest_factor_and_longest_delay() -> None:
    rules = Rules(
        rules=(
            Rule(
                name="half",
                condition=Condition(metric="memory_pct", above=80),
                action=Action(kind="reduce_prefetch", factor=0.5),
            ),
            Rule(
                name="quarter",
                condition=Condition(metric="utilization_gpu", above=80),
                action=Action(kind="reduce_prefetch", factor=0.25),
            ),
            Rule(
                name="wait2",
                condition=Condition(metric="temperature", above=80),
                action=Action(kind="delay_transfers", seconds=2),
            ),
            Rule(
                name="wait9",
                condition=Condition(metric="power_w", above=300),
                action=Action(kind="delay_transfers", seconds=9),
            ),
        )
    )
    active: frozenset[ActiveKey] = frozenset(
        {
            ("w1", 0, "half"),
            ("w1", 1, "quarter"),
            ("w1", 0, "wait2"),
            ("w1", 1, "wait9"),
            ("w2", 0, "half"),
        }
        | {("w3", 0, "removed")}
    )
    advice = current_advice(active, rules)
    assert (advice["w1"].prefetch_factor, advice["w1"].delay_seconds) == (0.25, 9.0)
    assert not advice["w1"].prioritise_model_files
    assert advice["w2"] == Effective(prefetch_factor=0.5, rules=("half",))
    assert "w3" not in advice


def test_memory_pct_is_used_over_total() -> None:
    assert metric_value(GpuDevice(index=0, memory_total=200, memory_used=50), "memory_pct") == 25.0
    assert metric_value(GpuDevice(index=0), "memory_pct") is None


def test_memory_pct_leaves_out_pytorch_s_cache_of_the_process() -> None:
    cached = GpuDevice(index=0, memory_total=200, memory_used=180, memory_cached=100)
    assert metric_value(cached, "memory_pct") == 40.0
    odd = GpuDevice(index=0, memory_total=200, memory_used=50, memory_cached=80)
    assert metric_value(odd, "memory_pct") == 0.0  # never below nothing


def test_a_process_that_merely_caches_gets_no_memory_advice_by_default() -> None:
    """PyTorch's allocator keeps freed blocks reserved: NVML says 90 % used, but 40 % of the
    GPU is cache the process's next tensors reuse. No pressure, no advice; without the cache
    figure (a reading that cannot tell it) the same 90 % is advised as before."""
    total = 100 * GiB
    caching = GpuDevice(index=0, memory_total=total, memory_used=90 * GiB, memory_cached=40 * GiB)
    assert evaluate(DEFAULT_RULES, frozenset(), reading(caching)) == ([], [])
    unknown = caching.model_copy(update={"memory_cached": None})
    issues, _ = evaluate(DEFAULT_RULES, frozenset(), reading(unknown))
    assert {a.action.kind for a in issues} == {"reduce_prefetch", "prioritise_model_files"}


# ---------------------------------------------------------------- properties

METRICS = ("memory_pct", "temperature")
KINDS = ("reduce_prefetch", "delay_transfers", "prioritise_model_files")
WORKERS = ("w1", "w2")


@st.composite
def rule_sets(draw: st.DrawFn) -> Rules:
    out = []
    for i in range(draw(st.integers(1, 6))):
        above = draw(st.sampled_from([50.0, 60.0, 70.0, 80.0, 90.0]))
        out.append(
            rule(
                f"r{i}",
                metric=draw(st.sampled_from(METRICS)),
                above=above,
                clear_below=above - draw(st.sampled_from([1.0, 5.0, 20.0])),
                kind=draw(st.sampled_from(KINDS)),
                priority=draw(st.integers(0, 3)),
                scope=draw(st.sampled_from(["device", "device", "any_device"])),
            )
        )
    return Rules(rules=tuple(out))


values = st.one_of(st.none(), st.floats(30, 99).map(lambda v: round(v)))


@st.composite
def readings(draw: st.DrawFn) -> GpuReading:
    indices = draw(st.sets(st.integers(0, 2), max_size=3))
    devices = tuple(
        device(i, memory_pct=draw(st.floats(30, 99)), temperature=draw(values))
        for i in sorted(indices)
    )
    return reading(*devices, worker=draw(st.sampled_from(WORKERS)))


@settings(max_examples=200, deadline=None)
@given(rule_sets(), st.lists(readings(), min_size=1, max_size=30))
def test_hysteresis_never_issues_twice_without_a_clear_between(
    rules: Rules, sequence: list[GpuReading]
) -> None:
    active: frozenset[ActiveKey] = frozenset()
    history: dict[ActiveKey, list[str]] = {}
    for r in sequence:
        issues, clears = evaluate(rules, active, r)
        for c in clears:
            history.setdefault(c.key, []).append("clear")
        for a in issues:
            history.setdefault(a.key, []).append("issue")
        active = next_active(active, issues, clears)
        assert evaluate(rules, active, r) == ([], []), "the same reading again changed something"
        groups = [(w, d, rules.named(n).action.kind) for w, d, n in active]  # type: ignore[union-attr]
        assert len(groups) == len(set(groups)), "two active rules of one kind on one device"
    for key, events in history.items():
        assert events[0] == "issue", f"{key} cleared before it was issued: {events}"
        for before, after in zip(events, events[1:], strict=False):
            assert before != after, f"{key}: {events}"


@settings(max_examples=200, deadline=None)
@given(rule_sets(), readings())
def test_priority_decides_between_rules_that_fire_together(rules: Rules, r: GpuReading) -> None:
    issues, clears = evaluate(rules, frozenset(), r)
    assert clears == []
    issued = {(a.device, a.action.kind): a.rule for a in issues}
    assert len(issued) == len(issues)
    firing: dict[tuple[int | None, str], list[tuple[int, int, str]]] = {}
    for order, x in enumerate(rules.rules):
        targets: list[tuple[int | None, float | None]]
        if x.scope == "any_device":
            vs = [v for d in r.devices if (v := metric_value(d, x.condition.metric)) is not None]
            targets = [(None, max(vs))] if vs else []
        else:
            targets = [(d.index, metric_value(d, x.condition.metric)) for d in r.devices]
        for dev, v in targets:
            if v is not None and v > x.condition.above:
                firing.setdefault((dev, x.action.kind), []).append((-x.priority, order, x.name))
    assert issued == {group: min(candidates)[2] for group, candidates in firing.items()}


# ---------------------------------------------------------------- rules files

DEFAULTS_TOML = """
[[rules]]
name = "reduce_prefetch_on_memory_pressure"
priority = 10
condition = { metric = "memory_pct", above = 85, clear_below = 80 }
action = { kind = "reduce_prefetch", factor = 0.5 }

[[rules]]
name = "prioritise_model_files_on_memory_pressure"
priority = 15
condition = { metric = "memory_pct", above = 80, clear_below = 75 }
action = { kind = "prioritise_model_files" }

[[rules]]
name = "delay_transfers_on_temperature"
priority = 20
condition = { metric = "temperature", above = 87, clear_below = 82 }
action = { kind = "delay_transfers", seconds = 30 }
"""


def test_default_rules_load_from_toml_and_yaml(tmp_path: Path) -> None:
    toml = tmp_path / "rules.toml"
    toml.write_text(DEFAULTS_TOML)
    assert load_rules(toml) == DEFAULT_RULES
    for suffix in (".yaml", ".yml"):
        path = tmp_path / f"rules{suffix}"
        path.write_text(yaml.safe_dump(DEFAULT_RULES.model_dump(exclude_none=True)))
        assert load_rules(path) == DEFAULT_RULES


def test_an_empty_rules_file_has_no_rules(tmp_path: Path) -> None:
    (tmp_path / "empty.yaml").write_text("")
    (tmp_path / "empty.toml").write_text("")
    assert load_rules(tmp_path / "empty.yaml") == Rules()
    assert load_rules(tmp_path / "empty.toml") == Rules()


BAD = [
    (
        {
            "name": "hot",
            "condition": {"metric": "temperature", "above": 80, "clear_below": 85},
            "action": {"kind": "delay_transfers", "seconds": 1},
        },
        r"rules\[0\] \(hot\)\.condition: clear_below \(85\.0\) must be less than above \(80\.0\)",
    ),
    (
        {
            "name": "mem",
            "condition": {"metric": "memory_pct", "above": 90},
            "action": {"kind": "reduce_prefetch", "factor": 1.5},
        },
        r"rules\[0\] \(mem\)\.action\.factor: Input should be less than or equal to 1 \(got 1\.5\)",
    ),
    (
        {
            "name": "mem",
            "condition": {"metric": "memory_pct", "above": 90},
            "action": {"kind": "reduce_prefetch"},
        },
        r"rules\[0\] \(mem\)\.action: factor is required for reduce_prefetch",
    ),
    (
        {
            "name": "mem",
            "condition": {"metric": "memory", "above": 90},
            "action": {"kind": "prioritise_model_files"},
        },
        r"rules\[0\] \(mem\)\.condition\.metric: Input should be 'memory_pct', .* \(got 'memory'\)",
    ),
    (
        {
            "name": "mem",
            "condition": {"metric": "memory_pct", "above": 90},
            "action": {"kind": "prioritise_model_files"},
            "priorty": 3,
        },
        r"rules\[0\] \(mem\)\.priorty: Extra inputs are not permitted",
    ),
    (
        {
            "name": "mem",
            "condition": {"metric": "memory_pct", "above": 90},
            "action": {"kind": "delay_transfers", "seconds": 2, "factor": 0.5},
        },
        r"rules\[0\] \(mem\)\.action: factor does not apply to delay_transfers",
    ),
]


@pytest.mark.parametrize(("bad", "message"), BAD)
@pytest.mark.parametrize("suffix", [".toml", ".yaml"])
def test_a_bad_rules_file_names_the_file_and_the_field(
    tmp_path: Path, bad: dict, message: str, suffix: str
) -> None:
    path = tmp_path / f"rules{suffix}"
    if suffix == ".toml":
        path.write_text(_toml({"rules": [bad]}))
    else:
        path.write_text(yaml.safe_dump({"rules": [bad]}))
    with pytest.raises(RulesError, match=rf"^{path}: .*{message}"):
        load_rules(path)


def test_rule_names_must_be_unique(tmp_path: Path) -> None:
    path = tmp_path / "rules.yaml"
    one = {
        "name": "x",
        "condition": {"metric": "power_w", "above": 300},
        "action": {"kind": "prioritise_model_files"},
    }
    path.write_text(yaml.safe_dump({"rules": [one, one]}))
    with pytest.raises(RulesError, match="rule names must be unique: 'x' appears twice"):
        load_rules(path)


def test_unreadable_rules_files_say_why(tmp_path: Path) -> None:
    (tmp_path / "bad.toml").write_text("[[rules]\n")
    (tmp_path / "bad.yaml").write_text("rules: [\n")
    (tmp_path / "list.yaml").write_text("- 1\n")
    (tmp_path / "rules.json").write_text("{}")
    with pytest.raises(RulesError, match="bad.toml: not valid TOML"):
        load_rules(tmp_path / "bad.toml")
    with pytest.raises(RulesError, match="bad.yaml: not valid YAML"):
        load_rules(tmp_path / "bad.yaml")
    with pytest.raises(RulesError, match="list.yaml: expected a mapping with a 'rules' list"):
        load_rules(tmp_path / "list.yaml")
    with pytest.raises(RulesError, match="unknown rules format '.json'"):
        load_rules(tmp_path / "rules.json")
    with pytest.raises(RulesError, match="missing.toml: cannot read the rules file"):
        load_rules(tmp_path / "missing.toml")


def _toml(data: dict) -> str:
    """Just enough TOML for the cases above: an array of tables with inline tables."""

    def value(v: object) -> str:
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + " }"
        if isinstance(v, str):
            return f'"{v}"'
        return repr(v)

    out = []
    for table in data["rules"]:
        out.append("[[rules]]")
        out.extend(f"{k} = {value(v)}" for k, v in table.items())
    return "\n".join(out) + "\n"
