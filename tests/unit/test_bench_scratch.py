"""A benchmark's process logs (bench/scratch.py `log_file`): one directory per benchmark
process, gone when it exits well, kept (and named on stderr) when an uncaught exception
ends it, so that a run leaves nothing behind in /tmp but a failure's record."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROGRAM = """
import sys
from bench.scratch import log_file
logs = [log_file("cohort-bench-a"), log_file("cohort-bench-a")]
for log in logs:
    log.write_text("a line\\n")
print(logs[0].parent, flush=True)
assert logs[0] != logs[1] and logs[0].parent == logs[1].parent
if sys.argv[1] == "fail":
    raise RuntimeError("the benchmark failed")
"""


@pytest.mark.parametrize("how", ["succeed", "fail"])
def test_the_logs_go_when_the_benchmark_succeeds_and_stay_when_it_fails(
    how: str, tmp_path: Path
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM, how],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={"PATH": "/usr/bin:/bin", "TMPDIR": str(tmp_path)},
    )  # fmt: skip
    where = Path(done.stdout.strip())
    assert where.parent == tmp_path and where.name.startswith("cohort-bench-logs-")
    if how == "succeed":
        assert done.returncode == 0, done.stderr
        assert not where.exists()
    else:
        assert done.returncode == 1 and "RuntimeError: the benchmark failed" in done.stderr
        assert f"the failed run's process logs are kept in {where}" in done.stderr
        assert sorted(p.read_text() for p in where.iterdir()) == ["a line\n", "a line\n"]
