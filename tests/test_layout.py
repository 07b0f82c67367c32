"""The package's layout: every import points down the layers, with no cycle anywhere.

Imports are read from the source (``ast``), so imports inside functions and under
``TYPE_CHECKING`` count as much as those at the top. A subpackage's ``__init__`` importing
its own files is not an edge back to it: Python runs a package's ``__init__`` before its
files, and the public facades (``ckptfx.policies``, ``ckptfx.budget``, ``ckptfx.split``)
only re-export.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import ckptfx

PACKAGE = pathlib.Path(ckptfx.__file__).parent

# Bottom to top (README "How it works"): a module may import modules of its own layer (no
# cycle) or of a layer below, never above. Layers of one rank are siblings: they do not
# import each other. Unlisted modules fail the test, so a new file has to choose its layer.
LAYERS: list[tuple[int, tuple[str, ...]]] = [
    (0, ("ckptfx._compat", "ckptfx._ops", "ckptfx._format", "ckptfx._user_stack", "ckptfx._public")),
    (1, ("ckptfx.kernel",)),
    (2, ("ckptfx.policies",)),
    (2, ("ckptfx.offload",)),
    (3, ("ckptfx.recording",)),
    (3, ("ckptfx.func_path",)),
    (3, ("ckptfx.lowering",)),
    (4, ("ckptfx.budget",)),
    (5, ("ckptfx.split",)),
    (6, ("ckptfx.remat", "ckptfx.checkpoint", "ckptfx.sequential", "ckptfx.residuals")),
    (7, ("ckptfx.integrations", "ckptfx.pipelining")),
    (8, ("ckptfx",)),  # the public facade: tools use ckptfx's public names, as users do
    (9, ("ckptfx._term", "ckptfx.bench", "ckptfx.cli", "ckptfx.__main__")),
]


# Layers of single modules that may import each other (no cycle): front ends, integrations, tools.
_FLAT_LAYERS = (6, 7, 9)


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The ckptfx modules ``name`` imports, anywhere in its source."""
    is_package = path.name == "__init__.py"
    here = name.split(".") if is_package else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("ckptfx"):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in modules else target)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("ckptfx"))
    found.discard(name)
    if is_package:  # a package's __init__ importing its own files (see the docstring)
        found = {m for m in found if not m.startswith(name + ".")}
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _layer_of(module: str) -> tuple[int, str]:
    best: tuple[int, str, int] | None = None
    for rank, prefixes in LAYERS:
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[2]:
                    best = (rank, prefix.split(".")[1] if "." in prefix else prefix, len(prefix))
    if best is None:
        pytest.fail(f"{module} is in no layer of tests/test_layout.py: choose one for it")
    return best[0], best[1]


def test_no_import_cycle_even_inside_functions() -> None:
    graph = _graph()
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                cycle = stack[stack.index(n):] + [n]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if state.get(n) is None:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_every_import_points_down_the_layers() -> None:
    wrong = []
    for module, targets in sorted(_graph().items()):
        rank, group = _layer_of(module)
        for target in sorted(targets):
            t_rank, t_group = _layer_of(target)
            if t_rank > rank or (t_rank == rank and t_group != group
                                 and rank not in _FLAT_LAYERS):
                wrong.append(f"{module} (layer {rank}) imports {target} (layer {t_rank})")
    assert not wrong, "imports pointing up or sideways:\n" + "\n".join(wrong)


def test_the_kernel_imports_no_policy_recording_split_or_front_end() -> None:
    graph = _graph()
    kernel = {m: t for m, t in graph.items() if m.startswith("ckptfx.kernel")}
    assert kernel, "no ckptfx.kernel modules found"
    allowed = ("ckptfx.kernel", "ckptfx._compat", "ckptfx._ops", "ckptfx._user_stack")
    bad = {m: sorted(t for t in targets if not t.startswith(allowed))
           for m, targets in kernel.items()}
    assert not any(bad.values()), bad


def test_package_size_limits() -> None:
    """At most ~20 modules directly in ckptfx/, none over ~650 lines, no class over ~300."""
    top = [p for p in PACKAGE.glob("*.py")]
    assert len(top) <= 20, sorted(p.name for p in top)
    long_files = {}
    long_classes = {}
    for p in PACKAGE.rglob("*.py"):
        text = p.read_text()
        lines = text.count("\n")
        if lines > 650:
            long_files[str(p.relative_to(PACKAGE))] = lines
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                size = node.end_lineno - node.lineno + 1
                if size > 300:
                    long_classes[f"{p.relative_to(PACKAGE)}:{node.name}"] = size
    assert not long_files, long_files
    assert not long_classes, long_classes


def test_every_subpackage_states_its_rules() -> None:
    """Each subpackage's ``__init__`` docstring is its index: its files and a Rules note."""
    for init in PACKAGE.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "Rules" in doc, f"{init.relative_to(PACKAGE)} has no Rules note"
        for f in init.parent.glob("*.py"):
            if f.name != "__init__.py" and init.parent.name != "bench":
                assert f.name in doc, f"{init.relative_to(PACKAGE)} does not list {f.name}"


def test_no_issue_numbers_in_the_shipped_package() -> None:
    import re

    hits = [f"{p.relative_to(PACKAGE)}:{i}" for p in PACKAGE.rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if re.search(r"\bissue\s*#?\d+", line, re.IGNORECASE)
            and "github.com" not in line and "pytorch#" not in line]
    assert not hits, hits
