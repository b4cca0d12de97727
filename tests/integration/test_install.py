"""The wheel, installed into a fresh virtual environment, is one `cohort` namespace."""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import importlib, sys
for name in ("events", "worker", "coordinator"):
    try:
        importlib.import_module(name)
    except ImportError:
        continue
    sys.exit(f"{name} is importable: it should live only under cohort")
import cohort
from cohort.coordinator.election import library_source
assert "redis.register_function" in library_source()
print(cohort.__file__)
print(" ".join(sorted(cohort.__all__)))
"""


def dependency_paths() -> list[str]:
    """The folders this interpreter imports installed distributions from."""
    return [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages")]


@pytest.mark.slow
def test_the_wheel_in_a_fresh_venv_installs_only_cohort_with_its_data(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
         "-w", str(wheels), str(ROOT)],
        check=True, capture_output=True, cwd=tmp_path,
    )  # fmt: skip
    (wheel,) = wheels.glob("cohort_elastic-*.whl")
    env = tmp_path / "venv"
    venv.create(env, with_pip=False)
    python = env / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    # The dependencies come from the site-packages this test runs with (a virtual
    # environment's or the interpreter's own: `system_site_packages` would see only the
    # base interpreter's), after the new venv's own, which hold the package, from the wheel.
    (Path(site) / "_dependencies.pth").write_text("\n".join(dependency_paths()) + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", site, str(wheel)],
        check=True, capture_output=True,
    )  # fmt: skip
    installed = sorted(
        p.name
        for p in Path(site).iterdir()
        if not p.name.endswith(".dist-info") and p.name != "_dependencies.pth"
    )
    assert [n for n in installed if n not in ("bin", "__pycache__")] == ["cohort"]
    result = subprocess.run(
        [str(python), "-I", "-c", PROBE], capture_output=True, text=True, cwd=tmp_path
    )
    assert result.returncode == 0, result.stdout + result.stderr
    where, names = result.stdout.splitlines()
    assert where.startswith(site)
    assert {"Worker", "Collective", "RedisSettings", "connect", "WorldChangedError"} <= set(
        names.split()
    )
