"""The public names: ``ckptfx.__all__`` is sorted, complete, and every name reports where
users import it from (its ``__module__``), as httpx's ``tests/test_exported_members.py`` does."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch.utils.checkpoint

import ckptfx

PUBLIC_MODULES = ("ckptfx", "ckptfx.policies", "ckptfx.budget", "ckptfx.pipelining")


def test_all_is_sorted_and_names_exist() -> None:
    assert ckptfx.__all__ == sorted(ckptfx.__all__)
    assert len(set(ckptfx.__all__)) == len(ckptfx.__all__)
    missing = [n for n in ckptfx.__all__ if not hasattr(ckptfx, n)]
    assert not missing


def test_every_public_name_reports_a_public_module() -> None:
    wrong = {}
    for name in ckptfx.__all__:
        obj = getattr(ckptfx, name)
        if obj is torch.utils.checkpoint.noop_context_fn:
            continue  # torch's own object, re-exported so ``context_fn is noop_context_fn`` holds
        module = getattr(obj, "__module__", None)
        if module not in PUBLIC_MODULES:
            wrong[name] = module
    assert not wrong, f"public names reporting private homes: {wrong}"


# Importable from ``ckptfx`` before the package had subpackages, kept (and labelled so in
# ckptfx/__init__.py) for code written then; not in ``__all__``.
BACK_COMPAT = {"memory_budget"}


def test_nothing_public_looking_hides_outside_all() -> None:
    """Nothing public-looking is in the package namespace outside ``__all__`` but the
    labelled back-compat names."""
    extra = {n for n, v in vars(ckptfx).items()
             if not n.startswith("_") and n not in ckptfx.__all__
             and not isinstance(v, type(ckptfx))}  # submodules are reachable as attributes
    assert extra == BACK_COMPAT


def test_public_classes_keep_their_type_hints() -> None:
    """Reporting the public module as ``__module__`` does not break ``typing.get_type_hints``
    (config tools read dataclass fields with it), for every public class and policy class."""
    import typing

    from ckptfx import policies

    classes = [getattr(ckptfx, n) for n in ckptfx.__all__ if isinstance(getattr(ckptfx, n), type)]
    classes += [v for v in vars(policies).values() if isinstance(v, type)]
    classes += [ckptfx.budget.MemoryBudget, ckptfx.budget.BlockShare, ckptfx.budget.ModelBudget]
    for cls in classes:
        typing.get_type_hints(cls)  # raises NameError where an annotation cannot be resolved
    hints = typing.get_type_hints(ckptfx.SessionStats)
    assert hints and all(not isinstance(h, str) for h in hints.values())


@pytest.mark.parametrize("path", [
    "ckptfx.policies.save_only_these_names", "ckptfx.policies.checkpoint_policies",
    "ckptfx.policies.Offload", "ckptfx.policies.decide", "ckptfx.policies.DotsSaveable",
    "ckptfx.policies.call_policy", "ckptfx.budget.memory_budget",
    "ckptfx.budget.memory_budget_policies", "ckptfx.budget.MemoryBudget",
    "ckptfx.pipelining.PipelineStage", "ckptfx.integrations.find_blocks", "ckptfx.cli.main",
    "ckptfx.split.vjp_split", "ckptfx.split.grad_split",
    "ckptfx.checkpoint_policies.memory_budget",
])
def test_documented_import_paths_keep_working(path: str) -> None:
    module, _, name = path.rpartition(".")
    if module == "ckptfx.checkpoint_policies":
        assert callable(getattr(ckptfx.checkpoint_policies, name))
        return
    assert getattr(importlib.import_module(module), name) is not None


def test_module_singletons_stay_single() -> None:
    """A name reached through a public module is the same object as at its home."""
    from ckptfx.budget import memory_budget
    from ckptfx.kernel.session import recompute_session_ctx
    from ckptfx.policies.budget_policy import memory_budget as home
    from ckptfx.policies.named import checkpoint_policies

    assert memory_budget is home is ckptfx.checkpoint_policies.memory_budget
    assert ckptfx.recompute_session_ctx is recompute_session_ctx
    assert ckptfx.checkpoint_policies is checkpoint_policies is (
        importlib.import_module("ckptfx.policies").checkpoint_policies)


def test_front_end_modules_stay_importable_by_path() -> None:
    """``ckptfx.checkpoint`` and ``ckptfx.remat`` are the functions (the package attribute);
    their modules stay at those paths, which pickles name (test_pickle_compat.py)."""
    assert callable(ckptfx.checkpoint) and callable(ckptfx.remat)
    assert importlib.import_module("ckptfx.checkpoint").checkpoint is ckptfx.checkpoint
    assert importlib.import_module("ckptfx.remat").remat is ckptfx.remat


def test_module_entry_points_run() -> None:
    """``python -m ckptfx`` runs the command; ``python -m ckptfx.bench.measure`` (the bench's
    child process, started by ``ckptfx bench``) is found where the bench starts it."""
    out = subprocess.run([sys.executable, "-m", "ckptfx", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "usage" in out.stdout.lower()
    assert callable(importlib.import_module("ckptfx.bench.measure").main)
