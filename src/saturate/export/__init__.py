"""`saturate export`: a checkpoint's model taken out of saturate, each form checked against
the PyTorch model on real validation batches.

    saturate export CHECKPOINT [overrides ...] [--to onnx,program,torchscript,safetensors] [--out DIR]

- `onnx`: model.onnx through torch.onnx.export's current (torch.export-based) exporter, run
  in ONNX Runtime;
- `program`: model.pt2, a torch.export program (torch.export.load(...).module() runs it);
- `torchscript` (asked for by name: TorchScript is deprecated in torch 2.9+): model.ts, traced;
- `safetensors`: the weights alone, model.safetensors (safetensors.torch.load_file).

The model is built from the config composed as for training, with the checkpoint's weights
(saturate.trainer.evaluation.open_checkpoint). Its inputs are what the task passes it on the
validation batches (recorded at the model's call), so an export takes what `forward` takes:
normalised images, a padded sequence. The first dimension of each input is the batch and is
dynamic; any other dimension that differs between validation batches (a padded sequence's
length) is dynamic too. Each export runs the validation batches and a batch of one; the
largest difference from the PyTorch model is reported against --tolerance. A model that
cannot be exported gets one line naming the operator or construct (saturate.export.why).
onnx, onnxruntime and onnxscript (the `export` extra) are imported only here.
"""

from __future__ import annotations

import inspect
import json
import time
from pathlib import Path

import torch
from omegaconf import DictConfig

from saturate import files
from saturate.errors import UserError
from saturate.export import formats
from saturate.export.why import ExportFailed
from saturate.trainer.evaluation import Opened, open_checkpoint

FORMATS = {
    "onnx": formats.to_onnx,
    "program": formats.to_program,
    "torchscript": formats.to_torchscript,
    "safetensors": formats.to_safetensors,
}


def export_checkpoint(
    cfg: DictConfig, path: Path, *, out: Path, to: list[str], batches: int = 3, tolerance: float = 1e-4
) -> dict:
    """Export the checkpoint's model in each form of `to`, check each, write out/export.json
    and print a table; returns the report (`ok`: every form exported within `tolerance`)."""
    unknown = [f for f in to if f not in FORMATS]
    if unknown:
        raise UserError(f"--to {','.join(to)}: {', '.join(unknown)} is not a form; any of {', '.join(FORMATS)}")
    opened = open_checkpoint(cfg, path, "saturate export")
    try:
        samples = model_inputs(opened, batches)
    finally:
        opened.built.loaders.close()
    model = opened.built.model.eval()
    names = argument_names(model, samples[0])
    dynamic = dynamic_shapes(samples, names)
    checks = [*samples, one_sample(samples[0])]
    expected = [formats.outputs(model, args) for args in checks]
    out.mkdir(parents=True, exist_ok=True)
    _clear(out, to)
    rows = {}
    for form in to:
        start = time.perf_counter()
        try:
            made = FORMATS[form](model, samples[0], dynamic, names, out, opened)
            seconds, start = time.perf_counter() - start, time.perf_counter()
            diff = max(made.difference(args, want) for args, want in zip(checks, expected, strict=True))
            rows[form] = {"file": str(made.file), "seconds": round(seconds, 2), "max_abs_diff": diff}
            rows[form]["check_seconds"] = round(time.perf_counter() - start, 2)
            rows[form]["ok"] = diff <= tolerance
        except ExportFailed as e:
            rows[form] = {"error": str(e), "ok": False, "seconds": round(time.perf_counter() - start, 2)}
    report = {
        "checkpoint": str(path.resolve()),
        "model": opened.built.nodes["model"].get("_target_"),
        "inputs": {n: list(t.shape) for n, t in zip(names, samples[0], strict=True) if isinstance(t, torch.Tensor)},
        "dynamic": {n: {str(d): dim.__name__ for d, dim in dims.items()} for n, dims in dynamic.items() if dims},
        "checked_on": [[list(t.shape) for t in args if isinstance(t, torch.Tensor)] for args in checks],
        "tolerance": tolerance,
        "formats": rows,
        "ok": all(r["ok"] for r in rows.values()),
    }
    files.write_text(out / "export.json", json.dumps(report, indent=2) + "\n")
    print(table(report, out))
    return report


def _clear(out: Path, to: list[str]) -> None:
    """An earlier export's export.json, and the files it lists of forms this one does not
    write, removed from `out`: what is left there is this export's alone (its own files are
    replaced as they are written; the command holds `out` while it exports). A file export.json
    does not list (a model.onnx of the user's own) is left alone."""
    try:
        with files.open_regular(out / "export.json", "--out") as f:
            earlier = json.loads(f.read(1 << 20))
    except (OSError, ValueError, UserError):
        return  # no earlier export here, or not one saturate wrote
    listed = earlier.get("formats") if isinstance(earlier, dict) else None
    written = {form for form in listed if form in FORMATS} if isinstance(listed, dict) else set()
    for form in written - set(to):
        (out / formats.FILES[form]).unlink(missing_ok=True)
    (out / "export.json").unlink(missing_ok=True)


def model_inputs(opened: Opened, count: int) -> list[tuple]:
    """The positional arguments the task passes the model on the first `count` validation
    batches (as the evaluation makes them: on the device, normalised), recorded at the call."""
    built = opened.built
    batches = built.loaders.val or built.loaders.test
    if batches is None:
        raise UserError("saturate export: the data has no val or test split to check the exports on")
    seen: list[tuple] = []

    def record(module, args, kwargs):
        if kwargs:
            raise UserError(
                f"saturate export: {type(module).__name__} is called with keyword arguments ({', '.join(kwargs)}); "
                "export takes models called with positional ones"
            )
        seen.append(tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args))

    handle = built.model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        with torch.inference_mode():
            for i, batch in enumerate(batches.epoch(0)):
                if i == count:
                    break
                built.task.forward(built.model, batches.to_device(batch))
    finally:
        handle.remove()
    # inference tensors cannot be saved for autograd or traced: plain copies
    return [tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args) for args in seen]


def argument_names(model: torch.nn.Module, args: tuple) -> list[str]:
    """The names of forward's parameters the arguments bind to (the ONNX inputs' names)."""
    bound = inspect.signature(model.forward).bind(*args)
    return list(bound.arguments)


def dynamic_shapes(samples: list[tuple], names: list[str]) -> dict[str, dict | None]:
    """{argument: {dimension: Dim}}: the batch (dimension 0 of every input of the batch's
    size), and each other dimension whose size differs between the samples."""
    from torch.export import Dim

    batch = Dim("batch", min=1)
    first, size = samples[0], samples[0][0].shape[0] if isinstance(samples[0][0], torch.Tensor) else None
    shapes: dict[str, dict | None] = {}
    for i, (name, arg) in enumerate(zip(names, first, strict=True)):
        if not isinstance(arg, torch.Tensor) or arg.ndim == 0:
            shapes[name] = None
            continue
        dims = {0: batch} if arg.shape[0] == size else {}
        for d in range(1, arg.ndim):
            if len({s[i].shape[d] for s in samples}) > 1:
                dims[d] = Dim(f"{name}_{d}", min=1)
        shapes[name] = dims
    return shapes


def one_sample(args: tuple) -> tuple:
    """The first sample of a batch, as a batch of one (each batch-sized input sliced)."""
    size = args[0].shape[0]
    return tuple(a[:1] if isinstance(a, torch.Tensor) and a.ndim and a.shape[0] == size else a for a in args)


def table(report: dict, out: Path) -> str:
    inputs = ", ".join(f"{n} {tuple(s)}" for n, s in report["inputs"].items())
    dynamic = "; ".join(f"{n}: {', '.join(d.values())}" for n, d in report["dynamic"].items()) or "none"
    lines = [
        f"saturate export: {report['checkpoint']} ({report['model']}); inputs {inputs}; dynamic: {dynamic}; checked "
        f"on {len(report['checked_on'])} batches",
    ]
    for form, row in report["formats"].items():
        if "error" in row:
            lines.append(f"  {form:<12} cannot export: {row['error']}")
        else:
            verdict = "ok" if row["ok"] else f"OVER the tolerance {report['tolerance']:g}"
            lines.append(
                f"  {form:<12} {row['file']}  {row['seconds']:.1f} s (checked in {row['check_seconds']:.1f} s)  "
                f"max |diff| {row['max_abs_diff']:.2e}  {verdict}"
            )
    lines.append(f"-> {out / 'export.json'}")
    return "\n".join(lines)
