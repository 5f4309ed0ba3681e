"""Pretrained weights and frozen layers: a state dict loaded (read as data only), its key
prefixes renamed, missing and unexpected keys named in one message; parameters frozen by
name pattern keep their values and get no optimizer state."""

from __future__ import annotations

import pickle

import pytest
import torch

import saturate
from saturate.checkpoint.files import UnsafeCheckpoint
from saturate.errors import ConfigError, UserError
from saturate.models import SmallCNN


def weights(path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=False)["model"]


@pytest.fixture
def donor(tmp_path) -> dict[str, torch.Tensor]:
    """The weights of another SmallCNN for the digits (1 channel, 10 classes), seeded apart."""
    torch.manual_seed(123)
    return {k: v.clone() for k, v in SmallCNN(1, 10).state_dict().items()}


def test_weights_load_and_frozen_layers_keep_them_with_no_optimizer_state(make_cfg, tmp_path, donor):
    torch.save({f"module.{k}": v for k, v in donor.items()}, tmp_path / "ddp_saved.pt")  # as a DDP script saves
    cfg = make_cfg(
        f"pretrained.path={tmp_path / 'ddp_saved.pt'}",
        "pretrained.rename={module.: ''}",
        "pretrained.freeze=[features.*]",
    )
    saturate.train(cfg)
    ckpt = torch.load(f"{cfg.run_dir}/checkpoints/last.pt", weights_only=False)
    trained = ckpt["model"]
    frozen = [k for k in donor if k.startswith("features.") and "running" not in k and "num_batches" not in k]
    assert frozen and all(torch.equal(trained[k], donor[k]) for k in frozen)  # loaded, then kept
    assert not torch.equal(trained["head.weight"], donor["head.weight"])  # loaded, then trained
    counted = sum(len(g["params"]) for g in ckpt["optimizer"]["param_groups"])
    assert counted == 2 and len(ckpt["optimizer"]["state"]) == 2  # the head's weight and bias only


def test_missing_and_unexpected_keys_are_named_in_one_message(make_cfg, tmp_path, donor):
    state = {("encoder." + k if k.startswith("features.0") else k): v for k, v in donor.items()}
    torch.save(state, tmp_path / "renamed.pt")
    with pytest.raises(UserError) as err:
        saturate.train(make_cfg(f"pretrained.path={tmp_path / 'renamed.pt'}"))
    message = str(err.value)
    assert message.startswith(f"pretrained.path={tmp_path / 'renamed.pt'}: missing: features.0.0.weight")
    assert "unexpected: encoder.features.0.0.weight" in message and "pretrained.rename maps key prefixes" in message
    assert len(message.splitlines()) == 1


def test_not_strict_loads_what_matches(make_cfg, tmp_path, donor):
    torch.save({k: v for k, v in donor.items() if k.startswith("features.")}, tmp_path / "backbone.pt")
    cfg = make_cfg(f"pretrained.path={tmp_path / 'backbone.pt'}", "pretrained.strict=false", "trainer.max_steps=1")
    assert saturate.train(cfg)["progress/step"] == 1


def test_a_shape_that_differs_is_named(make_cfg, tmp_path, donor):
    torch.save({**donor, "head.weight": torch.zeros(5, donor["head.weight"].shape[1])}, tmp_path / "five.pt")
    with pytest.raises(UserError, match=r"shapes differ: head.weight \(5, 128\) \(the model's \(10, 128\)\)"):
        saturate.train(make_cfg(f"pretrained.path={tmp_path / 'five.pt'}"))


class Payload:
    def __reduce__(self):
        return (print, ("this ran",))


def test_a_file_that_would_run_code_is_refused(make_cfg, tmp_path, capsys):
    (tmp_path / "evil.pt").write_bytes(pickle.dumps({"head.weight": Payload()}, protocol=2))
    with pytest.raises(UnsafeCheckpoint, match="pretrained.path: refusing .*evil.pt: it holds objects") as err:
        saturate.train(make_cfg(f"pretrained.path={tmp_path / 'evil.pt'}"))
    assert "weights_only" not in str(err.value)  # never torch's advice to load it unsafely
    assert "this ran" not in capsys.readouterr().out


def test_a_freeze_pattern_that_matches_nothing_is_named(make_cfg):
    with pytest.raises(ConfigError) as err:
        saturate.train(make_cfg("pretrained.freeze=[backbone.*]"))
    assert "pretrained.freeze[0]='backbone.*': expected a pattern matching some of SmallCNN's parameters" in str(
        err.value
    )


def test_everything_frozen_is_named(make_cfg):
    with pytest.raises(UserError, match="none of its .* parameters requires a gradient"):
        saturate.train(make_cfg("pretrained.freeze=['*']"))
