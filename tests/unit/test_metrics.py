"""The Prometheus metrics a coordinator serves are the ones docs/metrics.md documents."""

from __future__ import annotations

from pathlib import Path

from cohort.coordinator.metrics import Metrics

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def test_every_metric_served_is_documented_with_its_type_and_no_other() -> None:
    served = {(f.name, f.type) for f in Metrics("j", "c1").registry.collect()}
    rows = [line.split("|") for line in DOC.read_text().splitlines() if line.startswith("| `")]
    documented = {(cells[1].strip().strip("`"), cells[2].strip()) for cells in rows}
    assert served == documented
