"""`saturate export`: the default model and the har and sign examples' models to ONNX (run
in ONNX Runtime) and to a torch.export program, with a dynamic batch (and sign's variable
length), each within 1e-4 of PyTorch on validation batches; safetensors weights read back
equal; a model that cannot be exported gets one line naming the construct. The exports take
seconds each: slow set, but for the quick checks of what needs no exporter."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

import saturate
from saturate.cli import checkpoint_command
from tests.conftest import ROOT, TINY, compose_config

EXAMPLE_CONF = {name: f"hydra.searchpath=[file://{ROOT / 'examples' / name / 'conf'}]" for name in ("har", "sign")}


def trained(tmp_path, *overrides: str):
    run_dir = tmp_path / "run"
    saturate.train(
        compose_config([*TINY, "trainer.limit_train_batches=1", "logger=[]", *overrides, f"run_dir={run_dir}"])
    )
    return run_dir


def exported(capsys, run_dir, out, *args: str) -> tuple[int, dict, str]:
    code = checkpoint_command("export", [str(run_dir), "--out", str(out), *args])
    printed = capsys.readouterr()
    report = json.loads((out / "export.json").read_text()) if (out / "export.json").is_file() else {}
    return code, report, printed.out + printed.err


@pytest.mark.slow
@pytest.mark.parametrize(
    "example, overrides, dynamic",
    [
        ("default", [], {"x": {"0": "batch"}}),
        ("har", [EXAMPLE_CONF["har"], "experiment=har", "model.n_hidden=16"], {"x": {"0": "batch"}}),
        ("sign", [EXAMPLE_CONF["sign"], "experiment=sign", "model.hidden_dim=16"], {"x": {"0": "batch", "1": "x_1"}}),
    ],
)
def test_export_to_onnx_and_a_program_runs_validation_batches_within_1e_4(
    example, overrides, dynamic, tmp_path, capsys
):
    overrides = [*overrides, "loader.batch_size=16"]
    run_dir = trained(tmp_path, *overrides)
    code, report, printed = exported(capsys, run_dir, tmp_path / "out", *TINY, "logger=[]", *overrides)
    assert code == 0 and report["ok"], printed
    assert report["dynamic"] == dynamic
    for form in ("onnx", "program", "safetensors"):
        row = report["formats"][form]
        assert row["max_abs_diff"] <= 1e-4 and (tmp_path / "out" / row["file"].rsplit("/", 1)[1]).is_file(), row
    assert report["formats"]["safetensors"]["max_abs_diff"] == 0.0
    sizes = {shapes[0][0] for shapes in report["checked_on"]}
    assert 1 in sizes and len(sizes) >= 2  # other batch sizes than the example's
    if example == "sign":  # other lengths than the example's too
        assert len({shapes[0][1] for shapes in report["checked_on"]}) >= 2
    import onnxruntime

    session = onnxruntime.InferenceSession(str(tmp_path / "out" / "model.onnx"), providers=["CPUExecutionProvider"])
    shape = session.get_inputs()[0].shape
    assert shape[0] == "batch" and (example != "sign" or isinstance(shape[1], str)), shape
    program = torch.export.load(str(tmp_path / "out" / "model.pt2")).module()
    x = torch.randn(3, *report["inputs"]["x"][1:])
    assert program(x).shape[0] == 3


BRANCHY = """
    import torch
    from torch import nn


    class Branchy(nn.Module):
        def __init__(self, in_channels: int, num_classes: int, **unused):
            super().__init__()
            self.fc = nn.Linear(in_channels * 64, num_classes)

        def forward(self, x):
            if x.sum() > 0:  # a Python branch on a tensor's value
                return self.fc(x.flatten(1))
            return -self.fc(x.flatten(1))
"""


@pytest.mark.slow
def test_a_model_that_cannot_be_exported_gets_one_line_naming_the_construct(tmp_path, capsys, monkeypatch):
    (tmp_path / "branchy_model.py").write_text(textwrap.dedent(BRANCHY))
    monkeypatch.syspath_prepend(str(tmp_path))
    model = ["model._target_=branchy_model.Branchy"]
    run_dir = trained(tmp_path, *model)
    code, report, printed = exported(capsys, run_dir, tmp_path / "out", *TINY, *model, "--to", "onnx,program")
    assert code == 1 and not report["ok"]
    for form in ("onnx", "program"):
        error = report["formats"][form]["error"]
        assert "\n" not in error and "condition on a tensor's value" in error, error
        assert "branchy_model.py" in error and "if x.sum() > 0" in error, error
    lines = [line for line in printed.splitlines() if "cannot export" in line]
    assert len(lines) == 2, printed


UNEXPORTABLE = """
    import torch
    from torch import nn


    class Kth(nn.Module):  # an operator ONNX has no translation for
        def __init__(self, in_channels: int, num_classes: int, **unused):
            super().__init__()
            self.fc = nn.Linear(in_channels * 64, num_classes)

        def forward(self, x):
            return torch.kthvalue(self.fc(x.flatten(1)), 2, dim=1)[0][:, None].expand(-1, 10)


    class Sized(nn.Module):  # a buffer of the training batch's size makes the batch fixed
        def __init__(self, in_channels: int, num_classes: int, **unused):
            super().__init__()
            self.fc = nn.Linear(in_channels * 64, num_classes)
            self.register_buffer("offset", torch.zeros(32, num_classes))

        def forward(self, x):
            return self.fc(x.flatten(1)) + self.offset
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, form, says",
    [
        ("Kth", "onnx", "operator aten.kthvalue.default has no ONNX translation, at unexportable.py:"),
        ("Sized", "onnx", "input x, dimension 0 (exported as 32): the model makes this dimension fixed"),
        ("Sized", "program", "dimension batch is asked to be dynamic, but the model makes it 32"),
    ],
)
def test_an_operator_without_onnx_and_a_batch_made_fixed_are_named(name, form, says, tmp_path, capsys, monkeypatch):
    (tmp_path / "unexportable.py").write_text(textwrap.dedent(UNEXPORTABLE))
    monkeypatch.syspath_prepend(str(tmp_path))
    import unexportable

    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    weights = getattr(unexportable, name)(1, 10).state_dict()
    torch.save({"model": weights, "step": 0}, tmp_path / "run" / "checkpoints" / "last.pt")
    model = f"model._target_=unexportable.{name}"
    code, report, printed = exported(capsys, tmp_path / "run", tmp_path / "out", *TINY, model, "--to", form)
    error = report["formats"][form]["error"]
    assert code == 1 and "\n" not in error and error.startswith(says), error


def test_an_unknown_form_is_one_line(tmp_path, capsys):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    torch.save({"model": {}, "step": 0}, run_dir / "checkpoints" / "last.pt")
    code, _, printed = exported(capsys, run_dir, tmp_path / "out", "--to", "onnx,tflite")
    assert code == 1 and printed.count("\n") == 1 and "tflite is not a form" in printed, printed
