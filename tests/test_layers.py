"""The layers point down only (docs/architecture.md): the imports of every module, parsed, never run.

    core (data/core.py) < data < decoding < models < train < scripts
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = {"data": "data", "decoding": "decoding", "models": "models", "train": "train"}  # draftsmith.X -> folder
CORE = "draftsmith.data.core"
ALLOWED = {  # the draftsmith layers a module of each layer may import
    "core": set(),
    "data": {"core", "data"},
    "decoding": {"core", "data", "decoding"},
    "models": {"core", "data", "decoding", "models"},
    "train": {"core", "data", "decoding", "models", "train"},
}


def layer(module: str) -> str:
    if module == CORE:
        return "core"
    return module.split(".")[1]


def modules() -> dict[str, Path]:
    return {f"draftsmith.{pkg}.{p.stem}" if p.stem != "__init__" else f"draftsmith.{pkg}": p
            for pkg, folder in PACKAGES.items() for p in sorted((REPO / folder).glob("*.py"))}


def imports(path: Path) -> list[str]:
    """Every draftsmith module a file imports, at any depth (function-level imports too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    known = modules()
    return sorted({name for name in found if name.startswith("draftsmith.") and name in known})


def calls(path: Path) -> set[str]:
    """Names of the functions a file calls (`importlib.import_module` -> 'import_module')."""
    return {n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
            for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)}


@pytest.mark.parametrize("module", sorted(modules()))
def test_imports_point_down(module):
    path = modules()[module]
    mine = layer(module)
    wrong = [m for m in imports(path) if layer(m) not in ALLOWED[mine]]
    assert not wrong, f"{path.relative_to(REPO)} ({mine}) imports a higher layer: {wrong}"


def test_the_layering_check_sees_imports():
    assert "draftsmith.data.core" in imports(REPO / "models" / "medusa.py")
    assert layer("draftsmith.data.core") == "core" and layer("draftsmith.data.dataset") == "data"


def test_no_module_is_looked_up_by_name_and_nothing_loads_scripts():
    """Methods are found through models/registry.py, not importlib; tests import the package, not files by path."""
    files = [*modules().values(), *sorted((REPO / "tests").glob("*.py")), *sorted((REPO / "scripts").glob("*.py"))]
    for path in files:
        found = calls(path) & {"import_module", "spec_from_file_location", "run_path"}
        assert not found, f"{path.relative_to(REPO)} calls {sorted(found)}"
