"""Building a run's parts as such: from the validated config in one direction. Builders
return what they chose (the batch size a search found) and write nothing into the config;
the data's values reach the model and task nodes as arguments, never through module state."""

from __future__ import annotations

import torch
from torch import nn

from saturate.config import data_info, registration
from saturate.config.invocation import Invocation
from saturate.config.schema import validate
from saturate.scale.distributed import Dist
from saturate.trainer.build import UserObjects, build_parts
from tests.conftest import compose_config

CPU = torch.device("cpu")


class Wide(nn.Module):
    """A model given the data's values two ways: `in_features` (W) by its name, its own `rows`
    (H) and `outputs` by interpolation in its node."""

    def __init__(self, rows: int, in_features: int, outputs: int):
        super().__init__()
        self.rows = rows
        self.fc = nn.Linear(rows * in_features, outputs)

    def forward(self, x):
        return self.fc(x.float().flatten(1))


def built(tmp_path, *overrides: str):
    cfg = compose_config(
        [
            f"run_dir={tmp_path}",
            "data=synthetic",
            "data.channels=1",
            "data.height=4",
            "data.width=4",
            "data.num_train=64",
            "data.num_val=32",
            "loader.num_workers=0",
            "loader.batch_size=16",
            "monitor.costs=false",
            *overrides,
        ]
    )
    run = validate(cfg)
    torch.manual_seed(0)
    return run, build_parts(run, Invocation(), UserObjects(), Dist(None), CPU, show_images=None)


def test_the_search_leaves_the_runs_grad_scaler_as_it_was(tmp_path):
    """fp16: the search's trial steps ran through the run's own GradScaler, whose update()
    after each trial step moved its growth tracker (and halved the scale on overflow): the
    run started from the state the trials left, although the search is to change nothing."""
    searched = ["loader.batch_size=auto", "batch_search.min=8", "batch_search.max=32", "batch_search.cache="]
    run, parts = built(tmp_path, "precision=fp16", "batch_search.steps=1", *searched)
    fresh = torch.amp.GradScaler("cpu", init_scale=run.precision.init_scale)
    assert parts.trials and parts.precision.scaler.state_dict() == fresh.state_dict()


def test_a_search_returns_the_batch_size_it_chose_and_leaves_the_config_as_given(tmp_path):
    searched = ["loader.batch_size=auto", "batch_search.min=8", "batch_search.max=32", "batch_search.cache="]
    run, parts = built(tmp_path, *searched)
    assert run.loader.batch_size == "auto"  # the config as the user gave it
    assert parts.batch_size in (8, 16, 32) and [t.size for t in parts.trials][0] == 8
    assert parts.loaders.train.batch_size == parts.batch_size


def test_the_datas_values_are_bound_into_the_nodes_as_built_never_kept_between_runs(tmp_path):
    node = [
        "model._target_=tests.trainer.test_build.Wide",
        "~model.width",
        "~model.norm",
        "+model.rows=${data_info:input_shape.1}",
        "+model.outputs=${data_info:num_classes}",
    ]
    run3, parts3 = built(tmp_path / "a", *node, "data.num_classes=3", "data.height=5")
    run5, parts5 = built(tmp_path / "b", *node, "data.num_classes=5", "data.height=6")
    assert run3.model["outputs"] == data_info.placeholder("num_classes")  # the config keeps what it was given
    assert (parts3.nodes["model"]["rows"], parts3.nodes["model"]["outputs"]) == (5, 3)
    assert (parts5.nodes["model"]["rows"], parts5.nodes["model"]["outputs"]) == (6, 5)
    assert parts3.models.raw.fc.weight.shape == (3, 5 * 4) and parts5.models.raw.fc.weight.shape == (5, 6 * 4)
    module_state = [k for k, v in vars(registration).items() if isinstance(v, (dict, list, set)) and k[:2] != "__"]
    assert module_state == []  # nothing carries a run's data to the next one
