"""The code's shape, held against docs/architecture.json: every import between parts is an
arrow the drawing allows and none is one it forbids; a handful of top-level modules; no
folder with more than a third of the source; Hydra's runtime config read in one module;
metric names written in one; a composition root one can read, short functions; hooks
reached through the public protocol, never by patching a saturate module; no dependency's
private modules imported and sys.modules left alone; no module over 500 lines (300 at the
top level); no comment naming an issue or a commit."""

from __future__ import annotations

import ast
import json
import re

from tests.conftest import ROOT

SRC = ROOT / "src" / "saturate"


def _drawing() -> dict:
    return json.loads((ROOT / "docs" / "architecture.json").read_text())


def _part_of(rel: str, parts: dict) -> str | None:
    """The part holding a file: the longest of the parts' paths that covers it."""
    best = None
    for name, spec in parts.items():
        for path in spec["is"]:
            if rel == path or (path.endswith("/") and rel.startswith(path)):
                if best is None or len(path) > best[1]:
                    best = (name, len(path))
    return best[0] if best else None


def _module_file(module: str) -> str | None:
    base = ROOT / "src" / module.replace(".", "/")
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return str(candidate.relative_to(ROOT))
    return None


def _imports(path) -> set[str]:
    """The saturate modules a file imports, at any depth (a lazy import inside a function too);
    `from saturate import names` imports saturate.names."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {n.name for n in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            named = [f"{node.module}.{n.name}" for n in node.names if _module_file(f"{node.module}.{n.name}")]
            found |= set(named) | ({node.module} if len(named) < len(node.names) else set())
    return {m for m in found if m.split(".")[0] == "saturate"}


def _edges(parts: dict) -> dict[tuple[str, str], list[str]]:
    edges: dict[tuple[str, str], list[str]] = {}
    files = [ROOT / "train.py", *SRC.rglob("*.py"), *(ROOT / "src" / "hydra_plugins").rglob("*.py")]
    files += (ROOT / "scripts").glob("*.py")
    for path in files:
        rel = str(path.relative_to(ROOT))
        here = _part_of(rel, parts)
        assert here is not None, f"{rel} is on no part of docs/architecture.json"
        for module in _imports(path):
            target = _module_file(module)
            there = _part_of(target, parts) if target else None
            if there and there != here:
                edges.setdefault((here, there), []).append(f"{rel} -> {target}")
    return edges


def test_every_import_between_parts_is_an_arrow_the_drawing_allows():
    drawing = _drawing()
    edges = _edges(drawing["parts"])
    allowed = {tuple(a[:2]) for a in drawing["arrows"]}
    never = {(a, b): why for a, b, why in drawing["never"]}
    forbidden = {pair: (never[pair], files[:3]) for pair, files in edges.items() if pair in never}
    assert forbidden == {}
    undrawn = {pair: files[:3] for pair, files in edges.items() if pair not in allowed}
    assert undrawn == {}, "imports the drawing does not allow: draw the arrow, or remove the import"
    assert not (allowed & set(never)), "an arrow both allowed and forbidden"


def test_a_handful_of_top_level_modules_and_no_folder_holds_a_third_of_the_source():
    top = sorted(p.name for p in SRC.glob("*.py"))
    assert len(top) <= 9, top
    lines = {p: len(p.read_text().splitlines()) for p in SRC.rglob("*.py")}
    total = sum(lines.values())
    for folder in (d for d in SRC.iterdir() if d.is_dir() and d.name != "__pycache__"):
        share = sum(n for p, n in lines.items() if folder in p.parents) / total
        assert share <= 1 / 3, f"{folder.name} holds {share:.0%} of the source"


def test_no_module_is_over_500_lines_and_no_top_level_module_over_300():
    lines = {str(p.relative_to(SRC)): len(p.read_text().splitlines()) for p in SRC.rglob("*.py")}
    assert {p: n for p, n in lines.items() if n > 500} == {}
    assert {p: n for p, n in lines.items() if "/" not in p and n > 300} == {}


# An issue or pull request number ("issue 35", "#35"), or a commit hash (7 to 40 hex digits, at
# least one a letter and one a digit): history, which git keeps; the code says what is and why.
HISTORY = re.compile(r"\bissues? #?\d+|(?<![\w&])#\d{2,}\b|\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b")


def test_no_comment_or_docstring_in_saturate_names_an_issue_or_a_commit():
    import io
    import tokenize

    found = []
    for path in sorted(SRC.rglob("*.py")):
        for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
            if token.type in (tokenize.COMMENT, tokenize.STRING) and HISTORY.search(token.string):
                found.append(f"{path.relative_to(ROOT)}:{token.start[0]} {HISTORY.search(token.string).group()}")
    assert found == []
    assert HISTORY.search("see issue 33") and HISTORY.search("(git show 443645e)") and HISTORY.search("fixed in #35")
    assert not HISTORY.search("an integer in [0, 4294967295]") and not HISTORY.search("torch.float16, cafe")


def test_hydras_runtime_config_is_read_in_one_module_and_metric_names_written_in_one():
    readers = sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if "HydraConfig" in p.read_text())
    assert readers == ["config/invocation.py"]
    tree = ast.parse((SRC / "names.py").read_text())
    names = {n.value.value for n in tree.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)}
    assert {"perf/samples_per_s", "train/loss", "val/loss", "time/wall_s"} <= names
    elsewhere = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.value}"
        for path in [*SRC.rglob("*.py"), *(ROOT / "scripts").glob("*.py")]
        if path.name != "names.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and node.value in names
    ]
    assert elsewhere == []


def test_no_function_in_saturate_is_over_60_lines_and_the_composition_root_is_short():
    long = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 60:
                size = node.end_lineno - node.lineno + 1
                long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({size} lines)")
    assert long == []
    assert len((SRC / "trainer" / "run.py").read_text().splitlines()) <= 300


def test_no_test_or_script_patches_a_saturate_module_to_reach_a_hook():
    patched = re.compile(r"monkeypatch\.setattr\((saturate\.|run,|\"saturate\.)|setattr\(run,")
    found = [
        f"{p.relative_to(ROOT)}:{i}"
        for folder in ("tests", "scripts")
        for p in (ROOT / folder).rglob("*.py")
        if p.name != "test_architecture.py"
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if patched.search(line)
    ]
    assert found == []


PRIVATE = ("torch", "torchmetrics", "hydra", "omegaconf")  # dependencies whose underscore modules are theirs alone
# torch's underscore modules still imported, for want of a public counterpart in torch 2.13 (pytree: torch has no
# public module; TorchDispatchMode: the one torch's own docs of __torch_dispatch__ name; the DataLoader's worker pids
# and export's RNN decompositions): to go, each, when torch makes it public or saturate stops needing it
STILL_IMPORTED = {
    "torch.utils._pytree",
    "torch.utils._python_dispatch",
    "torch.utils.data._utils.signal_handling",
    "torch.export._patches",
}


def test_no_dependencys_private_module_is_imported_or_patched_and_sys_modules_is_left_alone():
    """What breaks silently when a dependency changes: an import of one of its underscore
    modules (hydra._internal, torch._dynamo), Hydra's `_locate`, or an entry put into or
    taken out of sys.modules. The one exception is the standard importlib recipe that loads
    a module from a file (spec_from_file_location, then sys.modules[spec.name] = module)."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        rel = path.relative_to(ROOT)
        for node in ast.walk(ast.parse(text)):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            for name in names:
                top, *rest = name.split(".")
                if any(name == known or name.startswith(f"{known}.") for known in STILL_IMPORTED):
                    continue
                if (top in PRIVATE and any(part.startswith("_") for part in rest)) or name.endswith("._locate"):
                    found.append(f"{rel}:{node.lineno}: imports {name}")
            if isinstance(node, (ast.Assign, ast.Delete)):
                targets = node.targets
                for target in targets:
                    if isinstance(target, ast.Subscript) and ast.unparse(target.value) == "sys.modules":
                        if "spec_from_file_location" not in text:
                            found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
            if isinstance(node, ast.Call) and ast.unparse(node.func).startswith("sys.modules."):
                if ast.unparse(node.func).rsplit(".", 1)[1] in ("update", "pop", "setdefault", "clear", "popitem"):
                    found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "\n".join(found)
