"""Any real training code fits: batches of any structure, tasks as objects, a test split and
predictions, the user's metrics, data-derived constructor arguments, reproducible fit, and
every new key's mistakes in one message."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import TensorDataset

import saturate
from saturate.data import pad_collate
from saturate.errors import UserError
from saturate.loop.evaluate import joined
from saturate.tasks.base import Task
from tests.conftest import TINY, read_metrics, run_cli
from tests.hostile.test_bad_input import Samples, fit, mlp, windows
from tests.trainer.test_run import events


def digits_like(n: int = 256, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 3, (n,), generator=g)
    x = torch.randn(n, 6, 3, generator=g) + y[:, None, None].float()
    return TensorDataset(x, y)


def classifier(in_features: int = 3, num_classes: int = 3):
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(6 * in_features, num_classes))


def one_line(err) -> str:
    message = str(err.value)
    assert "\n" not in message and "Traceback" not in message, message
    return message


# -- the test split, predictions, metrics


def test_the_test_split_is_evaluated_once_with_best_pt_and_reported_everywhere(tmp_path):
    overrides = [*TINY, "trainer.max_epochs=2", "trainer.predict=test"]
    metrics = saturate.fit(
        classifier,
        digits_like(),
        digits_like(64, 1),
        test_data=digits_like(96, 2),
        run_dir=tmp_path,
        overrides=overrides,
    )
    saved = read_metrics(tmp_path)
    assert {"test/loss", "test/acc"} <= saved.keys() and saved["test/acc"] == metrics["test/acc"]
    assert "test/acc" in events(tmp_path).Tags()["scalars"]
    assert f"test/acc {saved['test/acc']:.4f}" in (tmp_path / "report.md").read_text()
    best = torch.load(tmp_path / "checkpoints" / "best.pt", weights_only=False)
    model = classifier()
    model.load_state_dict(best["model"])
    with np.load(tmp_path / "predictions" / "test.npz", allow_pickle=False) as p:
        x, y = digits_like(96, 2).tensors
        assert p["index"].tolist() == list(range(96)) and (p["target"] == y.numpy()).all()
        np.testing.assert_allclose(p["output"], model(x).detach().numpy(), rtol=1e-4, atol=1e-5)  # best.pt's outputs
        acc = float((p["output"].argmax(1) == p["target"]).mean())
    assert acc == pytest.approx(saved["test/acc"], abs=1e-6)


def test_predictions_of_different_widths_are_padded():
    a, b = np.array([[1, 2], [3, -1]]), np.array([[4, 5, 6]])
    assert joined([a, b]).tolist() == [[1, 2, -1], [3, -1, -1], [4, 5, 6]]
    f = joined([np.ones((1, 1), np.float32), np.ones((1, 2), np.float32)])
    assert np.isnan(f[0, 1]) and f.dtype == np.float32
    assert joined([np.arange(3), np.arange(2)]).tolist() == [0, 1, 2, 0, 1]


def test_user_metrics_are_logged_monitored_and_per_class(tmp_path):
    overrides = [
        *TINY,
        "+task.metrics.f1._target_=torchmetrics.classification.MulticlassF1Score",
        "+task.metrics.f1.num_classes=${data_info:num_classes}",
        "+task.metrics.f1.average=null",
        "+task.metrics.macro._target_=torchmetrics.classification.MulticlassF1Score",
        "+task.metrics.macro.num_classes=3",
        "checkpoint.monitor=val/macro",
    ]
    train = digits_like()
    train.classes = ["cat", "dog", "owl"]
    metrics = saturate.fit(classifier, train, digits_like(64, 1), run_dir=tmp_path, overrides=overrides)
    assert {"val/f1/cat", "val/f1/dog", "val/f1/owl", "val/macro"} <= metrics.keys() and "val/top5" not in metrics
    assert read_metrics(tmp_path)["monitor"] == "val/macro"
    assert float(metrics) == metrics["val/macro"]


def test_top5_only_where_it_means_something(tmp_path):
    assert "val/top5" not in fit(classifier, digits_like(), digits_like(64, 1), run_dir=tmp_path / "a")
    asked = fit(
        classifier, digits_like(), digits_like(64, 1), run_dir=tmp_path / "b", overrides=[*TINY, "task.top_k=2"]
    )
    assert "val/top2" in asked


def test_regression_metrics_in_the_targets_units(tmp_path):
    """target_inverse: y * 10 + 3 takes standardised targets back: every error scales by 10."""
    metrics = fit(
        mlp,
        Samples(64, windows),
        Samples(32, windows),
        test_data=Samples(32, windows),
        task="regression",
        target_inverse=lambda y: y * 10 + 3,
        run_dir=tmp_path,
    )
    for split in ("val", "test"):
        assert metrics[f"{split}/rmse_raw"] == pytest.approx(10 * metrics[f"{split}/rmse"], rel=1e-5)
        assert metrics[f"{split}/mae_raw"] == pytest.approx(10 * metrics[f"{split}/mae"], rel=1e-5)


# -- the model's arguments, reproducibility, workers


class Named(torch.nn.Module):
    """A model with its own argument names."""

    def __init__(self, window_size: int, num_features: int, output_size: int):
        super().__init__()
        self.shape = (window_size, num_features)
        self.fc = torch.nn.Linear(window_size * num_features, output_size)

    def forward(self, x):
        return self.fc(x.flatten(1))


def test_data_info_fills_a_models_own_argument_names(make_cfg, tmp_path):
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "named.yaml").write_text(
        "_target_: tests.tasks.test_tasks.Named\nwindow_size: ${data_info:input_shape.1}\nnum_features: "
        "${data_info:input_shape.2}\noutput_size: ${data_info:num_classes}\n"
    )
    cfg = make_cfg(
        f"hydra.searchpath=[file://{tmp_path / 'conf'}]",
        "model=named",
        "data=synthetic",
        "data.channels=1",
        "data.height=5",
        "data.width=7",
        "data.num_train=64",
        "data.num_val=32",
        "data.num_classes=4",
    )
    metrics = saturate.train(cfg)
    assert metrics["progress/step"] == 2
    model = torch.load(f"{cfg.run_dir}/checkpoints/last.pt", weights_only=False)["model"]
    assert model["fc.weight"].shape == (4, 5 * 7)  # output_size: the classes; window_size x num_features: H x W


def test_an_unknown_data_info_key_is_one_message(tmp_path):
    result = run_cli(*TINY, "model.width=${data_info:in_size}", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "data_info:in_size" in result.stderr and "in_features" in result.stderr


def test_fit_with_a_model_factory_is_reproducible(tmp_path):
    a = fit(classifier, digits_like(), digits_like(64, 1), run_dir=tmp_path / "a")
    b = fit(classifier, digits_like(), digits_like(64, 1), run_dir=tmp_path / "b")
    assert {k: v for k, v in a.items() if k.startswith(("val/", "train/loss"))} == {
        k: v for k, v in b.items() if k.startswith(("val/", "train/loss"))
    }


def test_num_workers_auto_is_0_for_data_in_memory_and_says_why(tmp_path):
    fit(
        classifier,
        digits_like(),
        digits_like(64, 1),
        run_dir=tmp_path,
        overrides=[*(t for t in TINY if "num_workers" not in t), "loader.resident=false"],  # auto: held resident
    )
    saved = read_metrics(tmp_path)
    assert saved["num_workers"] == 0
    assert "num_workers=auto: a sample takes" in (tmp_path / "report.md").read_text()
    assert "the data is in memory" in (tmp_path / "report.md").read_text()


# -- batches of any structure and user tasks


class Pairs(torch.utils.data.Dataset):
    """Dict samples of variable length whose target is the sum of the first feature."""

    def __init__(self, n: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.items = [torch.randn(int(torch.randint(3, 9, (1,), generator=g)), 4, generator=g) for _ in range(n)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        x = self.items[i]
        return {"input": x, "target": x[:, 0].sum(), "weight": torch.tensor(1.0)}


class MaskedMean(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 1)

    def forward(self, x, lengths):
        mask = (torch.arange(x.shape[1])[None, :] < lengths[:, None]).float()
        return (self.fc(x).squeeze(-1) * mask).sum(1)


class LengthAware(Task):
    """A user's task: the model gets the lengths; the loss is weighted by a batch entry."""

    name = "length_aware"

    def forward(self, model, batch):
        out = model(batch["input"], batch["input_length"])
        return ((out - batch["target"]) ** 2 * batch["weight"]).mean(), out

    def own_metrics(self):
        from torchmetrics import MeanSquaredError

        return {"mse": MeanSquaredError()}


def test_a_user_task_trains_dict_batches_of_variable_length(tmp_path):
    overrides = [
        *TINY,
        "trainer.max_epochs=10",
        "trainer.limit_train_batches=-1",
        "optim=adamw",
        "optim.optimizer.lr=0.05",
    ]
    padded = {"task": LengthAware(), "collate": pad_collate, "run_dir": tmp_path}
    metrics = fit(MaskedMean, Pairs(128), Pairs(32, 1), overrides=overrides, **padded)
    first = min(e.step for e in events(tmp_path).Scalars("val/mse"))
    assert metrics["val/mse"] < 0.1 * dict((e.step, e.value) for e in events(tmp_path).Scalars("val/mse"))[first]
    assert read_metrics(tmp_path)["task"] == "length_aware"


def test_samples_that_do_not_stack_name_the_field_and_the_fix(tmp_path):
    with pytest.raises(UserError) as err:
        fit(MaskedMean, Pairs(64), Pairs(16, 1), task=LengthAware(), run_dir=tmp_path)
    message = one_line(err)
    assert (
        "the input of sample 0 has shape (5, 4), of sample 1 (8, 4)" in message
        and "'collate': saturate.data.pad_collate" in message
        and "returns_batches = True" in message
    )


def test_loader_resident_with_variable_length_samples_is_a_start_up_error(tmp_path):
    with pytest.raises(UserError) as err:
        padded = {"task": LengthAware(), "collate": pad_collate, "run_dir": tmp_path}
        fit(MaskedMean, Pairs(64), Pairs(16, 1), overrides=[*TINY, "loader=resident"], **padded)
    assert "resident" in one_line(err) and "variable length" in one_line(err)


# -- hostile values of the new keys: one message each


def raising_collate(samples):
    raise KeyError("label")


class VectorLoss(LengthAware):
    def forward(self, model, batch):
        out = model(batch["input"], batch["input_length"])
        return (out - batch["target"]) ** 2, out  # not reduced


class NanLoss(LengthAware):
    def forward(self, model, batch):
        loss, out = super().forward(model, batch)
        return loss * float("nan"), out


def test_a_collate_that_raises_is_one_message(tmp_path):
    with pytest.raises(UserError) as err:
        fit(MaskedMean, Pairs(64), Pairs(16, 1), task=LengthAware(), collate=raising_collate, run_dir=tmp_path)
    message = one_line(err)
    assert "collate" in message and "raising_collate" in message and "KeyError" in message


@pytest.mark.parametrize(("task", "said"), [(VectorLoss, "a loss is one number"), (NanLoss, "nan")])
def test_a_task_whose_loss_is_not_one_finite_number_is_one_message(tmp_path, task, said):
    with pytest.raises(UserError) as err:
        fit(MaskedMean, Pairs(64), Pairs(16, 1), task=task(), collate=pad_collate, run_dir=tmp_path)
    assert said in one_line(err).lower()


@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        (["+task.metrics.bad._target_=collections.OrderedDict"], "task.metrics.bad"),
        (
            ["augmentation=kornia", "augmentation.transforms=[{_target_: collections.OrderedDict}]"],
            "augmentation.transforms[0]",
        ),
        (
            [
                "augmentation=kornia",
                "augmentation.transforms=[{_target_: kornia.augmentation.RandomAffine, degrees: nope}]",
            ],
            "augmentation.transforms[0]",
        ),
    ],
    ids=["metric-not-a-Metric", "augmentation-not-a-module", "augmentation-bad-argument"],
)
def test_a_bad_metric_or_augmentation_node_is_one_line(tmp_path, overrides, said):
    result = run_cli(*TINY, *overrides, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1 and "Traceback" not in result.stderr and len(lines) <= 2, result.stderr[-2000:]
    assert said in result.stderr


def test_a_test_set_of_another_structure_is_one_message(tmp_path):
    with pytest.raises(UserError) as err:
        fit(
            MaskedMean,
            Pairs(64),
            Pairs(16, 1),
            test_data=digits_like(16),
            task=LengthAware(),
            collate=pad_collate,
            run_dir=tmp_path,
        )
    assert "test samples are pairs, training samples dicts" in one_line(err)


def test_a_data_callable_returning_unknown_keys_is_one_message(tmp_path):
    (tmp_path / "mine.py").write_text("def load(**kwargs):\n    return {'train': [], 'validation': []}\n")
    result = run_cli(
        *TINY,
        "data._target_=mine.load",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
        env={"PYTHONPATH": str(tmp_path)},
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert (
        "'validation'" in result.stderr
        and "expected 'train' and any of val, test, collate, target_inverse" in result.stderr
    )


def test_float_images_take_every_image_option(tmp_path):
    """Images as ToTensor() makes them, float in [0, 1]: the built-in policy on the device and
    in the workers, channels_last and the resident store all accept them."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(96, 1, 16, 16, generator=g), torch.randint(0, 2, (96,), generator=g)
    data = TensorDataset(x, y)
    for setting in (["augmentation=gpu"], ["augmentation=cpu"], ["trainer.channels_last=true", "loader=resident"]):
        metrics = fit(
            lambda in_channels, num_classes: torch.nn.Sequential(
                torch.nn.Conv2d(in_channels, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4 * 14 * 14, num_classes)
            ),
            data,
            data,
            run_dir=tmp_path / setting[0].replace("=", "-"),
            overrides=[*TINY, *setting],
        )
        assert metrics["progress/step"] == 3
    assert json.loads((tmp_path / "augmentation-gpu" / "metrics.json").read_text())["status"] == "completed"


class DeviceLengths(TorchDispatchMode):
    """Counts the length tensors that reach PyTorch's CTC operators from the device: its
    Tensor overload (LossCTC.cpp, ctc_loss_tensor) copies each to the host with a blocking copy,
    a synchronisation every step. The `meta` device stands in for the GPU (none can exist
    here), and this mode answers for CTC's forward and backward, which have no meta kernel."""

    def __init__(self):
        super().__init__()
        self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("_ctc_loss", "_ctc_loss_backward"):
            lengths = args[2:4] if name == "_ctc_loss" else args[3:5]
            self.copies += sum(isinstance(t, torch.Tensor) and t.device.type != "cpu" for t in lengths)
            log_probs = args[0] if name == "_ctc_loss" else args[1]
            if name == "_ctc_loss_backward":
                return torch.zeros_like(log_probs)
            batch = log_probs.shape[1]
            return torch.zeros(batch, device=log_probs.device), torch.zeros(batch, 1, device=log_probs.device)
        return func(*args, **(kwargs or {}))


def test_ctc_lengths_stay_on_the_host_so_the_loss_copies_nothing_back(make_cfg):
    """The run's pipeline (built from the run's data description, for a `meta` device) leaves
    the lengths CTC reads on the host; the loss then copies nothing from the device."""
    from saturate.config.invocation import Invocation
    from saturate.config.schema import validate
    from saturate.data.loader import build_pipeline
    from saturate.scale.distributed import Dist
    from saturate.trainer.build import UserObjects, build_parts
    from tests.loop.test_hygiene import example

    run = validate(make_cfg(*example("sign"), "monitor.costs=false"))
    parts = build_parts(run, Invocation(), UserObjects(), Dist(None), torch.device("cpu"), show_images=None)
    host = next(iter(parts.loaders.train.epoch(0)))
    meta = torch.device("meta")
    batch = build_pipeline(run.loader, parts.spec, meta, run.trainer)(host)
    assert batch["input"].device == meta and batch["target"].device == meta
    assert batch["input_length"].device.type == batch["target_length"].device.type == "cpu"
    model = torch.nn.Linear(batch["input"].shape[-1], parts.task.num_classes).to(meta)
    parts.task.labels_checked = parts.task.CHECK_LABELS  # the first batches' labels are read once to check them
    with DeviceLengths() as counted:
        loss, _ = parts.task.forward(model, batch)
        loss.backward()
    assert counted.copies == 0
