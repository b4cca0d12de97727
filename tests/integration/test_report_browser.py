"""The report page in a real browser: headless Chromium loads it offline, runs its script
without errors and paints it. Skipped where no Chromium is installed (Debian: `apt-get
install chromium`), unless COHORT_REQUIRE_CHROMIUM=1, where a skip would hide a broken page.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cohort.coordinator.replay import Run, export
from tests.unit.test_report import PLOTS, T0, a_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    reason = "no chromium or chromium-browser on PATH (Debian: apt-get install chromium)"
    if os.environ.get("COHORT_REQUIRE_CHROMIUM") == "1":
        pytest.fail(f"{reason}; COHORT_REQUIRE_CHROMIUM=1 asks for the browser test")
    pytest.skip(reason)


def _browse(chromium: str, page: Path, profile: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            chromium,
            "--headless=new",
            "--disable-gpu",
            "--no-sandbox",
            "--no-first-run",
            "--enable-logging=stderr",
            "--v=0",
            f"--user-data-dir={profile}",
            *args,
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _console(stderr: str, page: Path) -> list[str]:
    """What the page said on the console (Chromium logs it as INFO:CONSOLE ... source: URL)."""
    return [line for line in stderr.splitlines() if ":CONSOLE" in line and page.as_uri() in line]


def _report(run: Run, tmp_path: Path) -> Path:
    """The page as `cohort report --file` writes it, from an exported run."""
    source = tmp_path / "run.cohort"
    with source.open("wb") as out:
        export(run, out, T0 + 60)
    page = tmp_path / "report.html"
    done = subprocess.run(
        [sys.executable, "-m", "cohort", "report", "--file", str(source), "-o", str(page)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(page)
    return page


@pytest.mark.parametrize("which", ["a run", "an empty run"])
def test_report_loads_offline_in_chromium_runs_its_script_and_paints(
    which: str, tmp_path: Path
) -> None:
    chromium = _chromium()
    run = a_run() if which == "a run" else Run("empty")
    page = _report(run, tmp_path)

    dom = _browse(chromium, page, tmp_path / "profile", "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    gpu = [plot for plot in PLOTS if plot.startswith("plot-gpu")]
    for plot in PLOTS:
        if which == "an empty run" and plot in gpu:
            continue  # a run without GPU readings says so instead of plotting nothing
        assert re.search(rf'<svg[^>]*\bid="{plot}"', dom.stdout), plot
    if which == "an empty run":
        assert gpu and 'id="no-gpu"' in dom.stdout
    assert re.search(r'<body[^>]*\bdata-ok="1"', dom.stdout), "the page's script did not finish"
    assert _console(dom.stderr, page) == []

    shot = tmp_path / "report.png"
    painted = _browse(
        chromium, page, tmp_path / "profile", f"--screenshot={shot}", "--window-size=1100,1800"
    )
    assert painted.returncode == 0, painted.stderr[-2000:]
    data = shot.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000, len(data)
    assert _console(painted.stderr, page) == []


def test_a_script_error_would_be_caught(tmp_path: Path) -> None:
    """The console check above can fail: an uncaught error shows up in what it reads."""
    chromium = _chromium()
    page = tmp_path / "broken.html"
    page.write_text("<!DOCTYPE html><html><body><script>notDefined();</script></body></html>")
    dom = _browse(chromium, page, tmp_path / "profile", "--dump-dom")
    assert any("Uncaught" in line for line in _console(dom.stderr, page)), dom.stderr[-2000:]
    assert "data-ok" not in dom.stdout
