"""`saturate selftest`: does every path the configuration can take work on this machine, and
how fast is the fast path here.

    saturate selftest [--device auto|cuda|cpu] [--budget 480] [--out outputs/selftest] [--only a,b] [--dry]
                      [--checks module]
    python -m saturate.selftest ...   (the same)

The crash checks (saturate.selftest.checks) come first, each in a process of its own under its
own time limit, so that one that fails, hangs or kills its interpreter leaves the others to run;
a check that has no meaning on this device is skipped with the reason. Then, on a GPU, the
measurements (saturate.selftest.measure) within --budget seconds, each skipped with the reason
when what is left would not hold it. Writes OUT/selftest.md (one row per check: PASS, FAIL with
its one-line error, or SKIP with why), OUT/selftest.json and OUT/work/logs/<check>.log; exits 1
when a check failed. --dry runs the measurements at toy sizes on any device: their commands and
figures are checked, nothing is measured (CI keeps them working this way). --checks imports a
module of your own that registers more checks with saturate.selftest.base.check.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

from saturate.selftest import checks, measure, risks  # noqa: F401  (they register the checks)
from saturate.selftest.base import REGISTRY, Context
from saturate.selftest.runner import Row, run_all, run_one, selected


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="saturate selftest", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--device", choices=["auto", "cuda", "cpu"], default="auto", help="auto: the GPU when one is visible"
    )
    p.add_argument(
        "--budget", type=float, default=480.0, help="seconds for the measurements, after the crash checks (default 480)"
    )
    p.add_argument("--out", default="outputs/selftest", help="where selftest.md, selftest.json and work/ go")
    p.add_argument("--only", default="", help="comma-separated checks to run (default: all); --list names them")
    p.add_argument("--list", action="store_true", help="list the checks and exit")
    p.add_argument(
        "--dry",
        action="store_true",
        help="measurements at toy sizes, on any device: checks their commands, measures nothing",
    )
    p.add_argument("--checks", action="append", default=[], help="a module of your own checks to import (repeatable)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the runner's child: run this one check
    p.add_argument("--work", default=None, help=argparse.SUPPRESS)
    p.add_argument("--gpus", type=int, default=None, help=argparse.SUPPRESS)  # the child: the GPUs the runner counted
    return p


def machine(device: str) -> dict:
    import torch

    facts = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": device,
        "cpu": platform.processor() or platform.machine(),
        "cpus": __import__("os").cpu_count(),
    }
    if device == "cuda":
        facts["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        facts["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        from saturate.diagnostics.environment import nvidia_driver

        facts["driver"] = nvidia_driver()
    return facts


def table(rows: list[Row], facts: dict, command: str, seconds: float) -> str:
    """selftest.md: the machine, then one table for the crash checks and one for the measurements."""
    where = ", ".join(facts.get("gpus", [])) or f"CPU ({facts['cpu']}, {facts['cpus']} CPUs)"
    counts = {s: sum(r.status == s for r in rows) for s in ("PASS", "FAIL", "SKIP")}
    out = [
        f"# saturate selftest: {where}",
        "",
        f"`{command}` on {time.strftime('%Y-%m-%d %H:%M')}, {seconds:.0f} s; torch {facts['torch']}, CUDA "
        f"{facts['cuda'] or '-'}, "
        f"driver {facts.get('driver') or '-'}, Python {facts['python']}",
        "",
        f"**{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped.**",
    ]
    for kind, title in (("check", "Crash checks"), ("measure", "Measurements")):
        mine = [r for r in rows if r.kind == kind]
        if mine:
            out += [
                "",
                f"## {title}",
                "",
                "| check | result | what it found | s | what it exercises |",
                "|---|---|---|---:|---|",
            ]
            out += [
                f"| {r.name} | {r.status} | {r.detail.replace('|', '/')} | {r.seconds:.0f} | "
                f"{r.what.replace('|', '/')} |"
                for r in mine
            ]
    out += ["", "Each check's output: work/logs/<check>.log; its runs: work/runs/. Figures: selftest.json."]
    return "\n".join(out) + "\n"


def resolve_device(asked: str) -> tuple[str, int]:
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if asked == "cuda" and not count:
        raise SystemExit(
            "saturate selftest: --device cuda: no CUDA device is visible (torch.cuda.is_available() is False)"
        )
    return ("cuda" if count and asked != "cpu" else "cpu"), count


def _import_checks(given: str) -> None:
    """--checks: a module name, or a path to a .py file (imported under its file's stem);
    one that is not there, or raises as it is imported, is one line."""
    path = Path(given)
    try:
        if given.endswith(".py") or os.sep in given:
            if not path.is_file():
                raise SystemExit(f"saturate selftest: --checks {given}: no such file")
            spec = importlib.util.spec_from_file_location(f"saturate_user_checks.{path.stem}", path.resolve())
            assert spec is not None and spec.loader is not None  # a .py file always has a loader
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
        else:
            importlib.import_module(given)
    except SystemExit:
        raise
    except ModuleNotFoundError as e:
        if e.name and given.startswith(e.name):
            raise SystemExit(
                f"saturate selftest: --checks {given}: no module of that name (a module on sys.path, or a path to "
                "a .py file)"
            ) from None
        raise SystemExit(f"saturate selftest: --checks {given}: importing it raised ModuleNotFoundError: {e}") from None
    except Exception as e:  # noqa: BLE001 (the user's module: one line)
        raise SystemExit(
            f"saturate selftest: --checks {given}: importing it raised {type(e).__name__}: "
            f"{' '.join(str(e).split())[:200]}"
        ) from None


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    for module in args.checks:
        _import_checks(module)
    if args.list:
        for c in REGISTRY.values():
            print(f"{c.name:<26} {c.kind:<8} {c.what}")
        return 0
    if args.one:  # the child: one check, its row written for the runner
        # the device as the runner resolved it: the child imports torch (2-5 s, and CUDA's start) only if its check
        # does; most checks run train.py commands, whose processes import it themselves
        device, gpus = (args.device, args.gpus) if args.gpus is not None else resolve_device(args.device)
        ctx = Context(device, Path(args.work), dry=args.dry, gpus=gpus)
        run_one(REGISTRY[args.one], ctx, ctx.work / "logs" / f"{args.one}.result.json")
        return 0
    todo = selected([n for n in args.only.split(",") if n])
    device, gpus = resolve_device(args.device)
    out = Path(args.out).resolve()
    ctx = Context(device, out / "work", dry=args.dry, gpus=gpus)
    ctx.work.mkdir(parents=True, exist_ok=True)
    extra = ["--dry"] * args.dry + [a for m in args.checks for a in ("--checks", m)]
    facts = machine(device)
    print(
        f"saturate selftest on {', '.join(facts.get('gpus', [])) or 'the CPU'}: {len(todo)} checks; output in {out}",
        flush=True,
    )
    start = time.monotonic()
    rows = run_all(todo, ctx, budget_s=args.budget, extra=extra, say=lambda line: print(line, flush=True))
    command = "saturate selftest " + " ".join(sys.argv[1:] if argv is None else argv)
    (out / "selftest.md").write_text(table(rows, facts, command.strip(), time.monotonic() - start))
    (out / "selftest.json").write_text(json.dumps({"machine": facts, "rows": [asdict(r) for r in rows]}, indent=1))
    failed = [r.name for r in rows if r.status == "FAIL"]
    print(f"\n{out / 'selftest.md'}: " + (f"{len(failed)} failed: {', '.join(failed)}" if failed else "nothing failed"))
    return 1 if failed else 0


def command() -> None:
    """The `saturate` console command: `saturate selftest [...]`."""
    if len(sys.argv) < 2 or sys.argv[1] not in ("selftest",):
        sys.exit(
            "usage: saturate selftest [--device auto|cuda|cpu] [--budget S] [--only a,b] [--dry] [--list]  "
            "(training: python train.py; see the README)"
        )
    sys.exit(main(sys.argv[2:]))
