"""The README starts small and stays small; the docs pages carry the rest. Every page is
linked, every relative link resolves, headings do not skip a level, and no figure is a
placeholder waiting to be measured."""

from __future__ import annotations

import itertools
import re

from tests.conftest import ROOT

PAGES = sorted((ROOT / "docs").glob("*.md"))
TEXTS = [ROOT / "README.md", ROOT / "DEVELOPERS.md", *PAGES]


def _outside_code(text: str) -> list[str]:
    lines, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def test_the_readme_starts_with_what_saturate_is_and_the_two_commands_and_stays_small():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    headings = [line for line in _outside_code(text) if line.startswith("#")]
    assert headings[0] == "# saturate" and headings[1] == "## Quick start"
    quick = text.split("## Quick start", 1)[1]
    block = re.search(r"```bash\n(.*?)```", quick, re.S).group(1)
    commands = [line for line in block.splitlines() if line.strip() and not line.startswith("#")]
    assert commands == ['pip install torch==2.13.0 -e ".[dev]" && python train.py', "python -m pytest"]
    assert "saturate.fit(" in text.split("## Examples")[0]  # the Python entry on the first screens


def test_every_docs_page_is_linked_from_the_readme_and_every_relative_link_resolves():
    readme = (ROOT / "README.md").read_text()
    assert {p.name for p in PAGES} <= set(re.findall(r"\(docs/([\w.-]+\.md)\)", readme))
    broken = []
    for path in TEXTS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if not target.startswith(("http://", "https://")) and not (path.parent / target).exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}")
    assert broken == []


def test_each_page_has_one_title_and_no_heading_skips_a_level():
    for path in TEXTS:
        levels = [len(line) - len(line.lstrip("#")) for line in _outside_code(path.read_text()) if line.startswith("#")]
        assert levels[0] == 1 and levels.count(1) == 1, path.name
        assert all(b <= a + 1 for a, b in itertools.pairwise(levels)), path.name


def test_no_figure_is_a_placeholder():
    placeholder = re.compile(r"\bTIME_[A-Z0-9_]+\b|\bTODO\b|\bTBD\b|\?\?\?|\bXXX\b")
    found = [f"{p.relative_to(ROOT)}: {m}" for p in TEXTS for m in placeholder.findall(p.read_text())]
    assert found == []


# scripts/ holds saturate's own development tools; what a user runs is a `saturate` subcommand
DEV_SCRIPTS = {"probe_syncs", "local_slurm"} | {p.stem for p in (ROOT / "scripts").glob("bench_*.py")}


def test_the_docs_send_a_user_to_a_subcommand_never_to_a_script_of_the_checkout():
    held = {p.stem for p in (ROOT / "scripts").glob("*.py")} - {"__init__"}
    assert held == DEV_SCRIPTS, f"scripts/ holds {sorted(held - DEV_SCRIPTS)}: a user's tool is a saturate subcommand"
    told = []
    for path in [ROOT / "README.md", *PAGES]:
        for name in re.findall(r"scripts/(\w+)\.py", path.read_text()):
            if name not in DEV_SCRIPTS:
                told.append(f"{path.relative_to(ROOT)}: scripts/{name}.py")
    assert told == []
