"""Why a model cannot be exported, in one line: the operator or construct the exporter
stopped at, and the model's own source line where it can be found.

The exporters' errors are long (the strategies tried, links, colour codes); the cause is a
known phrase somewhere in the chain of exceptions. The model's line is the last traceback
frame outside torch (a data-dependent `if`), or, for an operator without an ONNX
translation, the stack trace torch.export keeps on the graph node that calls it.
"""

from __future__ import annotations

import re
import traceback
from pathlib import Path

import torch

TORCH = str(Path(torch.__file__).parent)
HERE = str(Path(__file__).parent)

PATTERNS = [
    (
        r"No ONNX function found for <OpOverload\(op='([^']+)', overload='([^']+)'\)>",
        "operator {0}.{1} has no ONNX translation",
    ),
    (
        r"Could not guard on data-dependent expression (\w+) \(unhinted",
        "a tensor's value used as a Python number ({0}, .item(), float() or int()): the graph would depend on the data",
    ),
    (
        r"Could not guard on data-dependent expression (.+?) \(unhinted",
        "a Python condition on a tensor's value ({0}): the graph would depend on the data; use torch.where or "
        "torch.cond",
    ),
    (
        r"Could not extract specialized integer from data-dependent expression (\S+)",
        "a tensor's value used as a Python number ({0}, .item() or int()): the graph would depend on the data",
    ),
    (
        r"You marked (\w+) as dynamic but your code specialized it to be a constant \((\d+)\)",
        "dimension {0} is asked to be dynamic, but the model makes it {1} (a tensor of the example's size in forward, "
        "e.g. a buffer sized to the batch)",
    ),
    (r"Constraints violated \((\w+)\)!.*?\n\s*- ([^\n]+)", "dynamic dimension {0}: {1}"),
    (r"(\.numpy\(\) is not supported[^\n]*)", "{0} (a call out of torch in forward)"),
    (r"Unsupported FX nodes: \{'call_function': \[([^\]]+)\]", "operators without an ONNX translation: {0}"),
]


class ExportFailed(Exception):
    """An export the model does not allow; its message is the one line."""


def _chain(error: BaseException | None) -> list[BaseException]:
    chain: list[BaseException] = []
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        chain.append(error)
        error = error.__cause__ or error.__context__
    return chain


def _clean(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def explain(error: BaseException, model: torch.nn.Module, example: tuple) -> str:
    """One line: what the exporter could not take, and where in the model."""
    chain = _chain(error)
    text = _clean("\n".join(f"{type(e).__name__}: {e}" for e in chain))
    what = None
    for pattern, said in PATTERNS:
        found = re.search(pattern, text, re.DOTALL)
        if found:
            what = said.format(*(" ".join(g.split()) for g in found.groups()))
            break
    if what is None:
        last = chain[-1]
        first = next((line.strip() for line in _clean(str(last)).splitlines() if line.strip()), "")
        what = f"{type(last).__name__}: {first[:200]}"
    where = _model_line(chain)
    if where is None and "has no ONNX translation" in what:
        where = _caller_of(what.split()[1].rsplit(".", 1)[0], model, example)
    return what + (f", at {where}" if where else "")


def _model_line(chain: list[BaseException]) -> str | None:
    """The last traceback frame in forward outside torch and this package: the model's line."""
    frames = [f for e in chain for f in traceback.extract_tb(e.__traceback__)]
    text = "\n".join(_clean(str(e)) for e in chain)
    # strict export reports the user's frame in its message only
    frames += [
        traceback.FrameSummary(path, int(line), name, line=code)
        for path, line, name, code in re.findall(r'File "([^"]+)", line (\d+), in (\w+)\n\s+([^\n]+)', text)
    ]
    mine = [
        f
        for f in frames
        if f.name == "forward" and not f.filename.startswith((TORCH, HERE)) and "site-packages" not in f.filename
    ]
    if not mine:
        return None
    f = mine[-1]
    return f"{Path(f.filename).name}:{f.lineno}: {(f.line or '').strip()}"


def _caller_of(op: str, model: torch.nn.Module, example: tuple) -> str | None:
    """The model's line calling `op` (aten.kthvalue.default), from torch.export's node stack traces."""
    try:
        program = torch.export.export(model, example)
    except Exception:  # noqa: BLE001 (only a hint)
        return None
    for node in program.graph.nodes:
        if node.op == "call_function" and str(node.target).startswith(op):
            frames = re.findall(r'File "([^"]+)", line (\d+), in (\w+)\n\s+(.+)', node.meta.get("stack_trace") or "")
            if frames:
                path, line, _, code = frames[-1]
                return f"{Path(path).name}:{line}: {code.strip()}"
    return None
