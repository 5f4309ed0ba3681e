"""Batch transforms of training batches (mix): mixup and CutMix as their papers define them
(one Beta(alpha, alpha) weight per batch, a permutation of the batch as partners, soft
targets), keyed draws, validation untouched, label smoothing composed, the user's own
transform; and the values refused in one message."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn
from torch.utils.data import Dataset

import saturate
from saturate.config.schema import MixConfig
from saturate.data.mix import BatchMix
from saturate.errors import UserError
from tests.conftest import ROOT, TINY, run_cli

N, K = 8, 4  # samples in a batch, classes


def mixer(**cfg) -> BatchMix:
    return BatchMix(OmegaConf.structured(MixConfig(**cfg)), num_classes=K, seed=0)


def labels() -> torch.Tensor:
    return torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])


def expected_targets(lam: float, partner: list[int]) -> torch.Tensor:
    one_hot = F.one_hot(labels(), K).float()
    return lam * one_hot + (1 - lam) * one_hot[partner]


def test_mixup_mixes_inputs_and_one_hot_targets_with_one_weight_per_batch():
    """Sample i is the unit vector e_i: after mixup it is lam e_i + (1 - lam) e_p(i), which
    gives lam and the partner; its target is the same mix of the one-hot labels."""
    out, soft = mixer(mixup=1.0)(torch.eye(N), labels(), epoch=0, batch=0)
    others = out - torch.diag(out.diagonal())  # each row without its own sample's weight
    partner = [i if out[i, i] == 1 else int(others[i].argmax()) for i in range(N)]
    moved = [i for i in range(N) if partner[i] != i]
    lam = out[moved[0], moved[0]].item()
    assert 0 < lam < 1 and all(out[i, i].item() == pytest.approx(lam) for i in moved)
    assert sorted(partner) == list(range(N))  # a permutation of the batch
    assert torch.allclose(soft, expected_targets(lam, partner))


def test_cutmix_pastes_one_box_of_the_partner_and_weighs_the_targets_by_the_area_kept():
    x = (torch.arange(N, dtype=torch.float32) + 1).view(N, 1, 1, 1).expand(N, 3, 16, 16).clone()
    out, soft = mixer(cutmix=1.0)(x, labels(), epoch=0, batch=3)
    foreign = out[:, 0] != x[:, 0]  # (N, H, W): pixels from the partner
    partner = [int(out[i, 0][foreign[i]][0].item()) - 1 if foreign[i].any() else i for i in range(N)]
    box = foreign[[i for i in range(N) if partner[i] != i][0]]
    rows, cols = box.any(1).nonzero().flatten(), box.any(0).nonzero().flatten()
    assert box[rows.min() : rows.max() + 1, cols.min() : cols.max() + 1].all()  # one rectangle
    assert all(torch.equal(foreign[i], box) for i in range(N) if partner[i] != i)  # the same box in every image
    lam = 1 - box.float().mean().item()
    assert torch.allclose(soft, expected_targets(lam, partner), atol=1e-6)


def test_the_draws_are_keyed_by_batch_and_leave_the_global_generators_alone():
    torch.manual_seed(5)
    before = torch.get_rng_state()
    first = mixer(mixup=0.4)(torch.eye(N), labels(), epoch=2, batch=7)
    assert torch.equal(torch.get_rng_state(), before)
    again = mixer(mixup=0.4)(torch.eye(N), labels(), epoch=2, batch=7)
    other = mixer(mixup=0.4)(torch.eye(N), labels(), epoch=2, batch=8)
    assert torch.equal(first[0], again[0]) and not torch.equal(first[0], other[0])


def test_prob_and_switch_prob_choose_which_batches_are_mixed_and_how():
    x = torch.rand(N, 3, 16, 16)
    kinds = {"plain": 0, "mixup": 0, "cutmix": 0}
    mix = mixer(mixup=1.0, cutmix=1.0, prob=0.5, switch_prob=0.5)
    for batch in range(200):
        out, _ = mix(x, labels(), 0, batch)
        changed = (out != x).any(1)  # (N, H, W)
        if not changed.any():
            kinds["plain"] += 1
        elif changed.all(-1).all(-1)[changed.any(-1).any(-1)].all():  # whole images changed: blended
            kinds["mixup"] += 1
        else:
            kinds["cutmix"] += 1
    assert 70 < kinds["plain"] < 130 and 30 < kinds["mixup"] < 70 and 30 < kinds["cutmix"] < 70, kinds


class Pairs(Dataset):
    """Sample i: a unit vector in 16 dimensions, class i % 4."""

    def __init__(self, n: int):
        self.x, self.y = torch.eye(16)[torch.arange(n) % 16], torch.arange(n) % K

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class Seen(nn.Module):
    """A linear model that records what it is given, in training and in evaluation."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, K)
        self.inputs = {True: [], False: []}

    def forward(self, x):
        self.inputs[self.training].append(x.detach().clone())
        return self.fc(x)


def test_training_batches_are_mixed_and_validation_batches_are_not(tmp_path):
    model, targets = Seen(), {True: [], False: []}

    def loss(outputs, target):
        targets[model.training].append(target)
        return F.cross_entropy(outputs, target)

    saturate.fit(model, Pairs(64), Pairs(32), loss=loss, run_dir=tmp_path, overrides=[*TINY, "mix.mixup=1.0"])
    blended = lambda x: ((x > 0) & (x < 1)).any().item()
    steps = [
        x for x in model.inputs[True] if len(x) == 32
    ]  # 64 samples: 2 steps (the cost probe's batches are smaller)
    assert len(steps) == 2 and all(blended(x) for x in steps)
    assert all(t.is_floating_point() and t.shape == (32, K) for t in targets[True] if len(t) == 32)  # soft targets
    assert model.inputs[False] and not any(blended(x) for x in model.inputs[False])
    assert targets[False] and all(not t.is_floating_point() for t in targets[False])  # class indices, in evaluation


def test_label_smoothing_composes_with_soft_targets():
    """The task's cross-entropy smooths the mixed targets: (1 - e) soft + e / K."""
    from saturate.tasks import Classification

    logits, soft = torch.randn(N, K), torch.softmax(torch.randn(N, K), 1)
    loss, _ = Classification(K, label_smoothing=0.1).forward(lambda x: logits, (torch.zeros(N, 1), soft))
    smoothed = 0.9 * soft + 0.1 / K
    assert loss.item() == pytest.approx(-(smoothed * logits.log_softmax(1)).sum(1).mean().item(), rel=1e-5)


def negate(inputs, targets):
    """A user's batch transform (here: the inputs negated)."""
    return -inputs, targets


def drop_one(inputs, targets):
    return inputs[1:], targets[1:]


def test_a_users_transform_runs_on_training_batches(tmp_path):
    model = Seen()
    overrides = [*TINY, "mix.transform={_target_:tests.data.test_mix.negate,_partial_:true}"]
    saturate.fit(model, Pairs(64), Pairs(32), run_dir=tmp_path, overrides=overrides)
    steps = [x for x in model.inputs[True] if len(x) == 32]  # the 2 steps (the cost probe's batches are smaller)
    assert len(steps) == 2 and all((x <= 0).all() and (x < 0).any() for x in steps)
    assert model.inputs[False] and all((x >= 0).all() for x in model.inputs[False])


def test_a_transform_that_changes_the_batch_size_is_named(tmp_path):
    overrides = [*TINY, "mix.transform={_target_:tests.data.test_mix.drop_one,_partial_:true}"]
    with pytest.raises(UserError, match=r"mix.transform: a batch of 32 came back with \[31\] samples"):
        saturate.fit(Seen(), Pairs(64), Pairs(32), run_dir=tmp_path, overrides=overrides)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("mix.mixup=-0.2", "mix.mixup=-0.2: expected 0 (off) or an alpha > 0"),
        ("mix.cutmix=abc", "mix.cutmix"),
        ("mix.prob=1.5", "mix.prob=1.5"),
    ],
)
def test_bad_mix_values_end_in_one_message(tmp_path, override, message):
    result = run_cli(*TINY, override, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert message in result.stderr and len(result.stderr.strip().splitlines()) <= 2, result.stderr


def test_cutmix_on_inputs_that_are_not_images_is_named(tmp_path):
    with pytest.raises(UserError, match="mix.cutmix: pastes a box of an image"):
        saturate.fit(Seen(), Pairs(64), Pairs(32), run_dir=tmp_path, overrides=[*TINY, "mix.cutmix=1.0"])


def test_the_examples_mixup_recipe_trains_from_the_command_line(tmp_path):
    conf = ROOT / "examples" / "mixup" / "conf"
    args = [f"hydra.searchpath=[file://{conf}]", "experiment=mixup", *TINY, "mix.cutmix=1.0"]
    result = run_cli(*args, f"hydra.run.dir={tmp_path / 'run'}", cwd=ROOT, env={"PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-2000:]
