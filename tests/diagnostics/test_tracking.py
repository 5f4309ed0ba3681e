"""The HParams columns and the recorded config read the checked config as plain dicts
(`tracking.plain`: dataclasses.asdict) where they read it through OmegaConf before: the two must
give the same values, on the default config, the presets, a user's metric node and every example,
except a text that still reads `${...}`, which is now recorded as the run used it."""

from __future__ import annotations

import pytest
from omegaconf import DictConfig, OmegaConf

from saturate.config.schema import validate
from saturate.diagnostics.tracking import _select, plain
from tests.conftest import ROOT, TINY, compose_config

CONFIGS = {
    "default": [],
    "presets": ["precision=bf16", "loader=fast", "augmentation.placement=gpu", "callbacks=[early_stopping,ema]"],
    "user-metric": [
        "+task.metrics.f1._target_=torchmetrics.classification.MulticlassF1Score",
        "+task.metrics.f1.num_classes=10",
        "+task.metrics.f1.average=macro",
    ],
    **{
        name: [f"hydra.searchpath=[file://{ROOT / 'examples' / name / 'conf'}]", f"experiment={name}"]
        for name in ("forecast", "har", "mixup", "pm25", "segmentation", "sign", "gray128")
    },
}


@pytest.mark.parametrize("overrides", list(CONFIGS.values()), ids=list(CONFIGS))
def test_plain_settings_are_what_omegaconf_resolves(overrides, tmp_path):
    run = validate(compose_config([*TINY, f"run_dir={tmp_path}", *overrides]))
    through_omegaconf = OmegaConf.structured(run)
    settings = plain(run)
    assert settings == OmegaConf.to_container(through_omegaconf, resolve=True)
    # every key an override can name, down to list items, selects the same value
    keys, stack = [], [("", settings)]
    while stack:
        prefix, node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for name, value in items:
            keys.append(f"{prefix}{name}")
            stack.append((f"{prefix}{name}.", value))
    assert len(keys) > 50
    for key in [*keys, "no.such.key", "trainer.max_epochs.deeper", "optim.optimizer.99"]:
        expected = OmegaConf.select(through_omegaconf, key, default="(absent)")
        if isinstance(expected, DictConfig) or OmegaConf.is_config(expected):
            expected = OmegaConf.to_container(expected, resolve=True)
        assert _select(settings, key, "(absent)") == expected, key


def test_an_escaped_interpolation_is_recorded_as_the_run_used_it(tmp_path):
    """`name=\\${oc.env:HOME}` names the run `${oc.env:HOME}`, literally: OmegaConf's round trip
    resolved it a second time (to the home folder), and failed the run on one that does not resolve."""
    for text in ("${oc.env:HOME}", "${nope}"):
        escaped = text.replace("${", "\\${")
        run = validate(compose_config([*TINY, f"run_dir={tmp_path}", f"name={escaped}"]))
        assert run.name == plain(run)["name"] == text


def test_a_last_evaluation_at_the_last_step_is_logged_once(make_cfg):
    """The run's end re-logs the final values to end each curve at the last step; one already
    logged there (an evaluation at the last step) is not logged a second time."""
    import saturate
    from tests.trainer.test_run import events

    cfg = make_cfg("trainer.eval_every=2")  # TINY: 3 steps, evaluations at steps 2 and 3 (the last)
    saturate.train(cfg)
    assert [e.step for e in events(cfg.run_dir).Scalars("val/loss")] == [2, 3]


def test_a_run_counted_in_steps_says_its_step_of_max_steps(make_cfg, caplog):
    import logging

    import saturate

    cfg = make_cfg("trainer.max_steps=2", "trainer.progress=true")  # TINY: 3 steps an epoch
    with caplog.at_level(logging.INFO, logger="saturate.diagnostics.tracking"):
        saturate.train(cfg)
    assert any(r.getMessage().startswith("step 2/2 (epoch 0.67): train/loss") for r in caplog.records)
