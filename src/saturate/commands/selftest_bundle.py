"""Everything `saturate selftest` needs on a GPU machine that reaches no package registry.

    saturate selftest-bundle selftest-bundle [--python-version 3.12]   # in saturate's checkout
    # copy selftest-bundle/ to the GPU machine (Python and a CUDA torch installed), then there:
    bash selftest-bundle/run-selftest.sh [selftest options, e.g. --budget 300]

Run on a machine with package-registry access, in saturate's checkout (the self-test runs
its train.py and examples; `--checkout DIR` names another). Writes into the folder:
- wheels/: saturate's dependencies and theirs, for that Python on x86-64 Linux (manylinux),
  except torch and what only torch needs (the GPU machine's own CUDA build is used);
  antlr4-python3-runtime, which PyPI has only as source, is built into a wheel here;
- requirements.txt: those distributions, pinned;
- saturate/: this checkout's files (tracked, and untracked ones git does not ignore);
- run-selftest.sh: one command that installs the wheels the machine's Python lacks, offline
  (pip --no-index --find-links wheels, into the bundle's site/), and runs the self-test with
  that Python and its own torch; results in selftest-bundle/out/ (or $OUT).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path.cwd()  # saturate's checkout (--checkout)
PLATFORMS = [
    "manylinux_2_28_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
]
# what the GPU machine's torch brings (its CUDA build, and what only torch needs)
TORCH_OWN = {
    "torch",
    "triton",
    "sympy",
    "mpmath",
    "networkx",
    "jinja2",
    "markupsafe",
    "filelock",
    "fsspec",
    "typing-extensions",
}
SOURCE_ONLY = ["antlr4-python3-runtime==4.9.3"]  # hydra-core's pin; PyPI has no wheel of it

RUNNER = """#!/usr/bin/env bash
# saturate selftest on this machine, offline. The carried wheels this Python lacks go into
# site/ (pip --no-index --find-links wheels; what it has already, any version, is kept), then
# the self-test runs from the carried checkout; results in $OUT (default: out/ beside this).
#   bash run-selftest.sh [--budget 300] [--only a,b] [--device cuda] ...
#   PYTHON=/path/to/python bash run-selftest.sh ...   (the Python with your CUDA torch; default python3)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
py=${PYTHON:-python3}
out=${OUT:-$here/out}
if ! "$py" -c "import torch"; then
  echo "run-selftest: $py cannot import torch; set PYTHON= to the Python with your torch" >&2
  exit 2
fi
"$py" - "$here" <<'PY'
import importlib.metadata, subprocess, sys
from pathlib import Path
here = Path(sys.argv[1])
need, kept = [], []
for line in (here / "requirements.txt").read_text().split():
    name = line.split("==")[0]
    try:
        kept.append(f"{name} {importlib.metadata.version(name)}")
    except importlib.metadata.PackageNotFoundError:
        need.append(line)
print("run-selftest: kept this Python's", ", ".join(kept) or "nothing")
if need:
    print("run-selftest: installing", " ".join(need), flush=True)
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-index", "--no-deps"]
    pip += ["--find-links", str(here / "wheels"), "--target", str(here / "site"), "--upgrade", *need]
    subprocess.run(pip, check=True)
PY
cd "$here/saturate"
PYTHONPATH="$here/site:$here/saturate/src" exec "$py" -m saturate.selftest --out "$out" "$@"
"""


def dependencies(full: bool) -> list[str]:
    """saturate's runtime requirements, torch left out; without `full` also scikit-learn (and
    so SciPy: 45 MB), which only data=digits imports and the self-test does not use."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # the same parser, before it joined the standard library
        import tomli as tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    left_out = {"torch"} | (set() if full else {"scikit-learn"})
    return [d for d in project["dependencies"] if re.split(r"[<>=!~ ;\[]", d, maxsplit=1)[0] not in left_out]


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args], check=True)


def target(python_version: str) -> list[str]:
    return [
        "--only-binary=:all:",
        "--implementation",
        "cp",
        "--python-version",
        python_version,
        *(f"--platform={p}" for p in PLATFORMS),
    ]


def resolve(wheels: Path, python_version: str, full: bool) -> list[tuple[str, str]]:
    """(name, version) of every distribution saturate needs on that Python, torch's own left out."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        pip(
            "install",
            "--quiet",
            "--dry-run",
            "--ignore-installed",
            "--report",
            str(report),
            "--find-links",
            str(wheels),
            "--target",
            str(Path(tmp) / "t"),
            *target(python_version),
            *dependencies(full),
        )
        found = [(i["metadata"]["name"], i["metadata"]["version"]) for i in json.loads(report.read_text())["install"]]
    return [
        (n, v)
        for n, v in found
        if n.lower().replace("_", "-") not in TORCH_OWN and not re.fullmatch(r"(nvidia|cuda)-.*-cu\d+", n.lower())
    ]


def checkout_files() -> list[str]:
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        .stdout.decode()
        .split("\0")
    )
    return [f for f in listed if f and (ROOT / f).is_file()]


def main(argv: list[str] | None = None) -> int:
    global ROOT
    parser = argparse.ArgumentParser(
        prog="saturate selftest-bundle", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkout", type=Path, default=Path.cwd(), help="saturate's checkout (default: here)")
    parser.add_argument("out", type=Path, help="the bundle's folder (created; must not exist or be empty)")
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's Python (default 3.12)")
    parser.add_argument(
        "--full",
        action="store_true",
        help="also scikit-learn and SciPy (data=digits); the self-test does not need them",
    )
    args = parser.parse_args(argv)
    ROOT = args.checkout.resolve()
    if not (ROOT / "train.py").is_file() or not (ROOT / "src" / "saturate").is_dir():
        parser.error(f"--checkout {ROOT}: expected saturate's checkout (its train.py and src/saturate/)")
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"{args.out} exists and is not empty")
    wheels = args.out / "wheels"
    wheels.mkdir(parents=True)
    pip("wheel", "--quiet", "--no-deps", "--wheel-dir", str(wheels), *SOURCE_ONLY)
    pinned = resolve(wheels, args.python_version, args.full)
    pip(
        "download",
        "--quiet",
        "--no-deps",
        "--dest",
        str(wheels),
        "--find-links",
        str(wheels),
        *target(args.python_version),
        *(f"{n}=={v}" for n, v in pinned),
    )
    (args.out / "requirements.txt").write_text("".join(f"{n}=={v}\n" for n, v in pinned))
    for name in checkout_files():
        (args.out / "saturate" / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, args.out / "saturate" / name)
    runner = args.out / "run-selftest.sh"
    runner.write_text(RUNNER)
    runner.chmod(0o755)
    size = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file()) / 2**20
    print(
        f"{args.out}: {len(pinned)} distributions for Python {args.python_version}, {size:.0f} MB. On the GPU "
        f"machine: bash {args.out}/run-selftest.sh"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
