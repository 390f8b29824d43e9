"""The package type-checks: mypy over launcher/rlbatch with the project's settings
(pyproject.toml [tool.mypy]). It runs inside the test command, beside the other tests on the
workers, rather than before them: on CI's two cores the check's minute of one core no longer
holds up the whole suite."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO


def test_the_package_type_checks(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache")],
        capture_output=True, text=True, cwd=REPO, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert "Success: no issues found" in proc.stdout
