"""metrics.json, a run's record: one module writes it and reads it back (saturate.record);
reading never follows a link nor waits on a FIFO, and says why a file is not a record."""

from __future__ import annotations

import ast
import os

import pytest

from saturate import record as run_record
from saturate.record import RunRecord, Unreadable
from tests.conftest import ROOT

SRC = ROOT / "src" / "saturate"


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring constants in a module."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def test_only_the_record_module_names_the_file_in_code():
    """Every writer and reader goes through saturate.record: no other module's code (its
    docstrings and comments aside) spells the file's name."""
    named = []
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text())
        skip = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
                if "metrics.json" in node.value:
                    named.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert named == ["src/saturate/record.py:" + str(_line_of_file_constant())]


def _line_of_file_constant() -> int:
    lines = (SRC / "record.py").read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.startswith('FILE = "metrics.json"'))


def test_a_record_written_is_read_back_with_its_typed_fields(tmp_path):
    entries = {
        "status": "preempted",
        "stopped_by": "SIGTERM",
        "resume_with": "saturate train trainer.resume=auto",
        "val/acc": 0.5,
        "progress/step": 12,
        "synthetic": False,
        "best": {"metric": "val/acc", "value": 0.5, "epoch": 1, "step": 12},
        "facts": {"cpus": 2},
    }
    run_record.write(tmp_path, RunRecord(entries))
    back = run_record.read(tmp_path)
    assert back is not None and back.entries == entries
    assert (back.status, back.stopped_by, back.resume_with) == ("preempted", "SIGTERM", entries["resume_with"])
    assert back.error is None and back.best == entries["best"] and back.verdict is None
    assert not list(tmp_path.glob(".*.tmp"))  # written through a temporary file, replaced whole


def test_no_record_is_none_and_a_file_that_is_not_one_says_why(tmp_path):
    assert run_record.read(tmp_path) is None and run_record.load(tmp_path) is None
    cases = {
        "list": (b"[1, 2]", "not a JSON object"),
        "text": (b"not json", "not valid JSON"),
        "latin1": (b'{"status": "\xe9"}', "not UTF-8"),
    }
    for name, (data, why) in cases.items():
        run_dir = tmp_path / name
        run_dir.mkdir()
        (run_dir / run_record.FILE).write_bytes(data)
        with pytest.raises(Unreadable, match=why):
            run_record.load(run_dir)
        assert run_record.read(run_dir) is None
    wrong_type = tmp_path / "wrong_type"
    wrong_type.mkdir()
    (wrong_type / run_record.FILE).write_text('{"status": 3, "best": [1]}')
    back = run_record.read(wrong_type)
    assert back is not None and back.status is None and back.best is None  # typed fields hold only their type


def test_reading_follows_no_link_and_waits_on_no_fifo(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run_record.write(elsewhere, RunRecord({"status": "completed"}))
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / run_record.FILE).symlink_to(elsewhere / run_record.FILE)
    with pytest.raises(Unreadable):
        run_record.load(linked)
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / run_record.FILE)
    with pytest.raises(Unreadable, match="not a regular file"):  # at once: no writer is waited for
        run_record.load(fifo)
