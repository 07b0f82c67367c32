"""The package type-checks: ``python -m mypy -p ckptfx`` under the configuration in
pyproject.toml (``[tool.mypy]``) reports nothing. Skipped when mypy is not installed
(``pip install -e ".[test]"`` installs it)."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None,
                    reason="mypy is not installed (it is in the test extra)")
def test_mypy_is_clean() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # The package under test is the one in this checkout, whatever is installed.
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "-p", "ckptfx", "--config-file",
         str(ROOT / "pyproject.toml")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stdout + result.stderr
