"""The ``ckptfx`` command: version, the residual report's policy argument, the demo."""

from __future__ import annotations

import pytest
import torch

import ckptfx
from ckptfx import cli


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == (
        f"ckptfx {ckptfx.__version__} (torch {torch.__version__})")


@pytest.mark.parametrize("policy", ["offload_dot_with_no_batch_dims", "save_only_these_names",
                                    "no_such_policy"])
def test_residuals_refuses_factories_and_unknown_names(policy: str) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["residuals", "--policy", policy])
    assert f"unknown or parametrised policy {policy!r}" in str(info.value.code)


def test_residuals_and_demo(capsys: pytest.CaptureFixture[str]) -> None:
    cli.main(["residuals", "--policy", "dots_saveable"])
    report = capsys.readouterr().out
    assert report.startswith("remat(policy=dots_saveable)") and "total: " in report
    cli.main(["demo"])
    lines = capsys.readouterr().out.splitlines()
    parity = [line for line in lines if "bitwise equal" in line]
    assert len(parity) == 4 and all(line.endswith("True") for line in parity)
