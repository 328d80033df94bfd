"""Tests and benchmarks import the package and the shared helper modules, never a test module's private names
or `tools/` through `sys.path`."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_no_test_imports_another_test_module():
    offenders = sorted(f"{path.relative_to(ROOT)} imports {name}" for path in (ROOT / "tests").rglob("*.py")
                       for name in _imported_modules(path) if name.split(".")[-1].startswith("test_"))
    assert offenders == []


def test_benchmarks_import_no_test_module():
    offenders = sorted(f"{path.relative_to(ROOT)} imports {name}" for path in (ROOT / "bench").rglob("*.py")
                       for name in _imported_modules(path) if name == "tests" or name.startswith("tests."))
    assert offenders == []


def test_no_test_imports_a_tool_script():
    """A tool's logic lives in the package (`tools/` are entry points); tests run the scripts as commands."""
    tools = {path.stem for path in (ROOT / "tools").rglob("*.py")}
    offenders = sorted(f"{path.relative_to(ROOT)} imports {name}" for path in (ROOT / "tests").rglob("*.py")
                       for name in _imported_modules(path) if name.split(".")[0] in tools)
    assert offenders == []
