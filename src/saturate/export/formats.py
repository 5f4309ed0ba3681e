"""The forms a model is exported to, each with how to run it for the check.

Each `to_<form>(model, example, dynamic, names, out, opened)` writes its file and returns a
`Made`, whose `difference(model, args)` is the largest absolute difference between the
export's outputs and the model's on `args`. An export that fails raises ExportFailed with
one line (saturate.export.why).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._pytree import tree_leaves

from saturate import files
from saturate.errors import UserError, printable
from saturate.export.why import ExportFailed, explain

RNN_OPS = ("lstm", "gru", "rnn_tanh", "rnn_relu")


@dataclass
class Made:
    file: Path
    run: Callable[[tuple], list]  # the export's outputs on these arguments, flattened

    def difference(self, args: tuple, expected: list[torch.Tensor]) -> float:
        """The largest absolute difference from `expected`, the model's outputs on `args`."""
        got = self.run(args)
        if len(got) != len(expected):
            return float("inf")
        diffs = [_difference(torch.as_tensor(g).to(e.dtype).cpu(), e) for g, e in zip(got, expected, strict=True)]
        return max(diffs, default=0.0)


def _difference(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest absolute difference, NaN where the model has NaN and inf where it has the
    same inf counting as equal (a model with non-finite weights is exported faithfully); a NaN
    on one side only is an infinite difference."""
    if not want.numel():
        return 0.0
    same = (got == want) | (got.isnan() & want.isnan())
    return (got - want).abs().masked_fill(same, 0.0).nan_to_num(nan=float("inf")).max().item()


FILES = {"onnx": "model.onnx", "program": "model.pt2", "torchscript": "model.ts", "safetensors": "model.safetensors"}


def written(path: Path, write: Callable[[str], object]) -> None:
    """`write(name)` makes the file under a temporary name made here (O_EXCL: never a link),
    then renamed onto `path`, so that a link at `path` is replaced, not followed; a failed
    write (a full disk) is one line naming `path`, and no part of a file is left."""
    try:
        tmp = str(files.fresh(path))
    except OSError as e:
        raise UserError(f"cannot write {printable(path)}: {e.strerror or e}") from None
    try:
        write(tmp)
        os.replace(tmp, path)
    except Exception as e:  # noqa: BLE001 (a library's writer raises what it raises: named in one line)
        Path(tmp).unlink(missing_ok=True)
        reason = e.strerror if isinstance(e, OSError) and e.strerror else " ".join(str(e).split())[:200]
        raise UserError(f"cannot write {printable(path)}: {reason or type(e).__name__}") from None


def in_memory(save: Callable[[io.BytesIO], object]) -> bytes:
    """What `save` writes to a file, as bytes: written to the disk by saturate.files, whose
    failure is one line (torch's C++ writers abort the process on a failed write)."""
    buffer = io.BytesIO()
    save(buffer)
    return buffer.getvalue()


def outputs(model: torch.nn.Module, args: tuple) -> list[torch.Tensor]:
    """The PyTorch model's outputs on `args`, flattened, on the CPU: what each export is held to."""
    with torch.no_grad():
        return [t.detach().cpu() for t in tree_leaves(model(*args)) if isinstance(t, torch.Tensor)]


@contextlib.contextmanager
def quiet():
    """The exporters' progress lines, warnings and log records kept off the console."""
    levels = {
        name: logging.getLogger(name).level for name in ("torch.onnx", "torch.export", "torch._export", "torch._dynamo")
    }
    for name in levels:
        logging.getLogger(name).setLevel(logging.ERROR)
    sink = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            warnings.simplefilter("ignore")
            yield
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def clear_rnn_caches() -> None:
    """An earlier export in this process leaves aten.lstm's resolved kernel cached, and the
    while_loop decomposition that keeps a sequence length dynamic is then bypassed
    (torch.export fails on the length, torch.onnx.export silently makes it fixed)."""
    for name in RNN_OPS:
        packet = getattr(torch.ops.aten, name)
        for overload in packet.overloads():
            getattr(packet, overload)._dispatch_cache.clear()


@contextlib.contextmanager
def rnn_while_loops(enabled: bool = True):
    """nn.LSTM/GRU as a while_loop (the decomposition torch.onnx uses itself, from a private
    module): without it torch.export unrolls them over the example's length, which makes
    that length fixed (pytorch/pytorch#115092). Only for a dynamic length (`enabled`): an
    unrolled program of a fixed length runs faster than the loop, step by step in Python."""
    if not enabled:
        clear_rnn_caches()
        yield
        return
    try:
        from torch.export._patches import (
            register_gru_while_loop_decomposition,
            register_lstm_while_loop_decomposition,
        )
    except ImportError:  # another torch: exported as it exports
        clear_rnn_caches()
        yield
        return
    clear_rnn_caches()
    with register_lstm_while_loop_decomposition(), register_gru_while_loop_decomposition():
        clear_rnn_caches()
        yield


def tensors(args: tuple) -> list[torch.Tensor]:
    return [a for a in args if isinstance(a, torch.Tensor)]


def to_program(model, example: tuple, dynamic: dict, names: list[str], out: Path, opened) -> Made:
    """model.pt2: a torch.export program, saved and loaded back for the check."""
    try:
        with quiet(), rnn_while_loops(any(d != 0 for dims in dynamic.values() if dims for d in dims)):
            program = torch.export.export(model, example, dynamic_shapes=dynamic)
    except Exception as e:  # noqa: BLE001 (whatever the exporter raises is named in one line)
        raise ExportFailed(explain(e, model, example)) from None
    path = out / FILES["program"]
    files.write_bytes(path, in_memory(lambda f: torch.export.save(program, f)))
    with quiet():  # loading logs a warning per data-dependent symbol the graph no longer holds
        loaded = torch.export.load(str(path)).module()

    def run(args: tuple) -> list:
        with torch.no_grad():
            return [t for t in tree_leaves(loaded(*args)) if isinstance(t, torch.Tensor)]

    return Made(path, run)


def to_onnx(model, example: tuple, dynamic: dict, names: list[str], out: Path, opened) -> Made:
    """model.onnx (weights inside) through torch.onnx.export's torch.export-based exporter; a
    dimension asked to be dynamic that the exporter made fixed is refused; run in ONNX
    Runtime on the CPU."""
    try:
        import onnx  # noqa: F401 (the exporter writes its graph with it: asked for here, named when missing)
        import onnxruntime
    except ImportError as e:
        raise UserError(f"saturate export --to onnx needs {e.name}: pip install 'saturate[export]'") from None
    path = out / FILES["onnx"]
    try:
        with quiet():
            clear_rnn_caches()
            program = torch.onnx.export(
                model,
                example,
                dynamo=True,
                dynamic_shapes=dynamic,
                input_names=[n for n, a in zip(names, example, strict=True) if isinstance(a, torch.Tensor)],
            )
            assert program is not None  # the dynamo exporter returns its program
            graph = program.model_proto
    except Exception as e:  # noqa: BLE001
        raise ExportFailed(explain(e, model, example)) from None
    fixed = _made_fixed(graph, dynamic)
    if fixed:
        raise ExportFailed(
            f"{fixed}: the model makes this dimension fixed (a tensor of the example's size in forward, e.g. a buffer "
            "sized to the batch); the ONNX file would take only that size"
        )
    _name_output_dims(graph, example)
    files.write_bytes(path, graph.SerializeToString())
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3  # errors only
    session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    inputs = [i.name for i in session.get_inputs()]

    def run(args: tuple) -> list:
        feed = {name: t.detach().cpu().numpy() for name, t in zip(inputs, tensors(args), strict=False)}
        return session.run(None, feed)

    return Made(path, run)


def _made_fixed(graph, dynamic: dict) -> str | None:
    """'input x, dimension 1' when a dimension asked to be dynamic is a number in the graph."""
    by_name = {i.name: i for i in graph.graph.input}
    for name, dims in dynamic.items():
        if not dims or name not in by_name:
            continue
        shape = by_name[name].type.tensor_type.shape.dim
        for d in dims:
            if d < len(shape) and not shape[d].dim_param:
                return f"input {name}, dimension {d} (exported as {shape[d].dim_value})"
    return None


def _name_output_dims(graph, example: tuple) -> None:
    """The exporter declares an output's length as the example's (f32[batch, 50, C] after an
    LSTM), and ONNX Runtime then warns at every other length: name each output dimension of
    a dynamic input's size after that input's, and drop the optional shape hints."""
    named: dict[int, str] = {}
    for i in graph.graph.input:
        for d, dim in enumerate(i.type.tensor_type.shape.dim):
            if dim.dim_param:
                named.setdefault(d, dim.dim_param)
    sizes = {d: tensors(example)[0].shape[d] for d in named if d < tensors(example)[0].ndim}
    for o in graph.graph.output:
        for d, dim in enumerate(o.type.tensor_type.shape.dim):
            if not dim.dim_param and d in sizes and dim.dim_value == sizes[d]:
                dim.dim_param = named[d]
    del graph.graph.value_info[:]


def to_torchscript(model, example: tuple, dynamic: dict, names: list[str], out: Path, opened) -> Made:
    """model.ts: torch.jit.trace (deprecated in torch 2.9+, for runtimes that still read it);
    traced on the example, so Python control flow is fixed to the example's path."""
    try:
        with quiet(), torch.no_grad():
            traced = torch.jit.trace(model, example, check_trace=False)
    except Exception as e:  # noqa: BLE001
        raise ExportFailed(explain(e, model, example)) from None
    path = out / FILES["torchscript"]
    files.write_bytes(path, in_memory(lambda f: torch.jit.save(traced, f)))
    loaded = torch.jit.load(str(path))

    def run(args: tuple) -> list:
        with torch.no_grad():
            return [t for t in tree_leaves(loaded(*args)) if isinstance(t, torch.Tensor)]

    return Made(path, run)


def to_safetensors(model, example: tuple, dynamic: dict, names: list[str], out: Path, opened) -> Made:
    """model.safetensors: the state dict (shared tensors saved once), read back into a copy of
    the model for the check (it holds weights only: the model's class is in the metadata)."""
    try:
        from safetensors.torch import load_model, save_model
    except ImportError:
        raise UserError("saturate export --to safetensors needs safetensors: pip install 'saturate[export]'") from None
    import copy

    path = out / FILES["safetensors"]
    target = str(opened.built.nodes["model"].get("_target_", type(model).__qualname__))
    metadata = {"saturate.model": target, "saturate.checkpoint": str(opened.path)}
    written(path, lambda name: save_model(model, name, metadata=metadata))
    copied = copy.deepcopy(model)
    for p in copied.parameters():
        p.data.zero_()  # the check reads the file's weights, not the copy's
    load_model(copied, str(path))

    def run(args: tuple) -> list:
        with torch.no_grad():
            return [t for t in tree_leaves(copied(*args)) if isinstance(t, torch.Tensor)]

    return Made(path, run)
