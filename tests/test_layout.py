"""The code's shape, as issue 27 fixed it: a composition root one can read, short functions,
and hooks reached through the public protocol, never by patching a saturate module."""

from __future__ import annotations

import ast
import re

from tests.conftest import ROOT


def test_no_function_in_saturate_is_over_60_lines_and_run_py_is_a_short_root():
    long = []
    for path in (ROOT / "src" / "saturate").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 60:
                long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert long == []
    assert len((ROOT / "src" / "saturate" / "compose" / "run.py").read_text().splitlines()) <= 300


def test_no_test_or_script_patches_a_saturate_module_to_reach_a_hook():
    patched = re.compile(r"monkeypatch\.setattr\((saturate\.|run,|\"saturate\.)|setattr\(run,")
    found = [f"{p.relative_to(ROOT)}:{i}" for folder in ("tests", "scripts") for p in (ROOT / folder).rglob("*.py")
             if p.name != "test_layout.py" for i, line in enumerate(p.read_text().splitlines(), 1) if patched.search(line)]  # fmt: skip
    assert found == []
