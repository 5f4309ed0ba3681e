"""One policy, two placements: the per-sample CPU path and Kornia's batched path agree."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils.data import DataLoader

import saturate
from saturate.data.augment import (
    PRESETS,
    BatchAugment,
    Policy,
    SampleAugment,
    SampleParams,
    Schedule,
    Transforms,
    apply_params,
    augment_sample,
    kornia_pipeline,
)
from saturate.data.base import ImageTensors
from saturate.data.loader import ResumableSampler
from tests.conftest import TINY
from tests.trainer.test_run import events

EVERYTHING = Policy("everything", hflip=0.5, rotation=25, brightness=0.3, contrast=0.3, translate=0.2, erasing=0.7)


def kornia_params_per_sample(params) -> list[SampleParams]:
    """Kornia's drawn parameters of a batch, as one SampleParams per sample."""
    d = {p.name.rsplit("_", 1)[0]: p.data for p in params}
    out = []
    for i in range(len(d["RandomAffine"]["angle"])):
        erase = None
        if d["RandomErasing"]["batch_prob"][i] > 0.5:
            e = d["RandomErasing"]
            erase = (int(e["ys"][i]), int(e["xs"][i]), int(e["heights"][i]), int(e["widths"][i]))
        out.append(
            SampleParams(
                flip=bool(d["RandomHorizontalFlip"]["batch_prob"][i] > 0.5),
                angle=float(d["RandomAffine"]["angle"][i]),
                shift=tuple(d["RandomAffine"]["translations"][i].tolist()),
                brightness=float(d["RandomBrightness"]["brightness_factor"][i]) - 1,
                contrast=float(d["RandomContrast"]["contrast_factor"][i]),
                erase=erase,
            )
        )
    return out


@pytest.mark.parametrize("shape", [(3, 32, 32), (1, 8, 8), (3, 24, 40)])
def test_per_sample_path_reproduces_kornia_given_the_same_parameters(shape):
    torch.manual_seed(0)
    x = torch.rand(48, *shape)
    pipeline = kornia_pipeline(EVERYTHING)
    params = pipeline.forward_parameters(x.shape)
    batched = pipeline(x, params=params)
    drawn = kornia_params_per_sample(params)
    assert any(p.flip for p in drawn) and any(p.erase for p in drawn)  # the draw exercises every op
    for i, p in enumerate(drawn):
        torch.testing.assert_close(apply_params(x[i], EVERYTHING, p), batched[i], atol=1e-5, rtol=0)


def zero_strength() -> Schedule:
    return Schedule([(0, Policy("zero"))])


def test_zero_strength_policy_is_the_identity_in_both_placements():
    images = torch.randint(0, 256, (16, 3, 12, 12), dtype=torch.uint8)
    data = SampleAugment(ImageTensors(images, torch.zeros(16, dtype=torch.long)), zero_strength(), seed=0)
    assert torch.equal(torch.stack([data[(0, i)][0] for i in range(16)]), images)
    x = images.float() / 255
    assert torch.equal(BatchAugment(zero_strength(), seed=0)(x.clone(), epoch=0, batch=0), x)


def flipped_share(before: torch.Tensor, after: torch.Tensor) -> float:
    return (after == before.flip(-1)).flatten(1).all(1).float().mean().item()


def test_flip_rates_agree_between_placements():
    n = 2048
    flip_only = Schedule([(0, Policy("flip", hflip=0.3))])
    images = torch.randint(0, 256, (n, 1, 6, 6), dtype=torch.uint8)  # asymmetric: a flip is visible
    data = SampleAugment(ImageTensors(images, torch.zeros(n, dtype=torch.long)), flip_only, seed=1)
    per_sample = torch.stack([data[(0, i)][0] for i in range(n)])
    x = images.float() / 255
    batched = torch.cat([BatchAugment(flip_only, seed=1)(x[i : i + 256], epoch=0, batch=i) for i in range(0, n, 256)])
    rate_cpu, rate_gpu = flipped_share(images, per_sample), flipped_share(x, batched)
    assert abs(rate_cpu - 0.3) < 0.04 and abs(rate_gpu - 0.3) < 0.04
    assert abs(rate_cpu - rate_gpu) < 0.05


@pytest.mark.parametrize(
    ("policy", "low", "high"),
    [(Policy("b", brightness=0.3), 0.2, 0.8), (Policy("c", contrast=0.4), 0.3, 0.7)],
    ids=["brightness", "contrast"],
)
def test_value_ranges_agree_between_placements(policy, low, high):
    n = 1024
    grey = torch.full((n, 3, 4, 4), 0.5)
    rng = random.Random(0)
    per_sample = torch.stack([augment_sample(grey[i], policy, rng) for i in range(n)])
    batched = BatchAugment(Schedule([(0, policy)]), seed=0)(grey.clone(), epoch=0, batch=0)
    for out in (per_sample, batched):
        values = out.mean((1, 2, 3))
        assert low - 1e-6 <= values.min() < low + 0.02 and high - 0.02 < values.max() <= high + 1e-6
        assert abs(values.mean().item() - 0.5) < 0.02
    assert abs(per_sample.std().item() - batched.std().item()) < 0.02


def test_geometry_agrees_between_placements():
    """Rotation and translation fill with zeros: the share of zeroed pixels matches."""
    n = 512
    policy = Policy("geo", rotation=30, translate=0.2)
    ones = torch.ones(n, 1, 16, 16)
    rng = random.Random(0)
    per_sample = torch.stack([augment_sample(ones[i], policy, rng) for i in range(n)])
    batched = BatchAugment(Schedule([(0, policy)]), seed=0)(ones.clone(), epoch=0, batch=0)
    dark_cpu, dark_gpu = (per_sample < 0.5).float().mean().item(), (batched < 0.5).float().mean().item()
    assert 0.1 < dark_cpu < 0.4
    assert abs(dark_cpu - dark_gpu) < 0.02


def test_per_sample_results_do_not_depend_on_the_worker():
    images = torch.randint(0, 256, (64, 3, 8, 8), dtype=torch.uint8)
    data = SampleAugment(ImageTensors(images, torch.arange(64)), Schedule([(0, PRESETS["strong"])]), seed=3)

    def batches(workers: int) -> list[torch.Tensor]:
        sampler = ResumableSampler(data, batch_size=16, seed=0, rank=0, world_size=1, keyed=True)
        sampler.set_epoch(2)
        return [x for x, _ in DataLoader(data, batch_size=16, sampler=sampler, num_workers=workers)]

    for a, b in zip(batches(0), batches(2), strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(data[(0, 5)][0], data[(1, 5)][0])  # a new epoch draws anew


def test_batched_draws_are_keyed_and_leave_the_global_generator_alone():
    aug = BatchAugment(Schedule([(0, PRESETS["strong"])]), seed=0)
    x = torch.rand(32, 3, 16, 16)
    torch.manual_seed(123)
    a = aug(x.clone(), epoch=1, batch=4)
    after = torch.rand(3)
    torch.manual_seed(123)
    assert torch.equal(torch.rand(3), after)  # the augmentation consumed nothing from it
    assert torch.equal(aug(x.clone(), epoch=1, batch=4), a)
    assert not torch.equal(aug(x.clone(), epoch=1, batch=5), a)


def test_the_users_kornia_transforms_draw_from_the_seeded_generator_whatever_the_device():
    """Moving the user's transforms to the batch's device moved Kornia's parameter samplers
    there too: on a GPU they drew from the CUDA generator, which the seeding does not touch (a
    resumed run augmented differently, and dropout's CUDA stream shifted). The `meta` device
    stands in for the GPU (a GPU cannot exist here): a sampler left on it cannot draw at all."""
    import kornia.augmentation as K

    affine = K.RandomAffine(degrees=30, translate=(0.1, 0.1), p=1.0)
    augment = BatchAugment(Transforms([affine]), seed=7)
    x = torch.rand(4, 3, 8, 8, device="meta")
    drawn = []
    for batch in (0, 0, 1):
        assert augment(x, epoch=2, batch=batch).device.type == "meta"
        drawn.append(affine._params["angle"])
    assert affine.device.type == "cpu" and drawn[0].device.type == "cpu"
    assert torch.equal(drawn[0], drawn[1]) and not torch.equal(drawn[0], drawn[2])  # keyed by (seed, epoch, batch)


def test_schedule_picks_the_stage_by_epoch():
    schedule = Schedule([(0, PRESETS["minimal"]), (3, PRESETS["strong"])])
    assert [schedule.policy(e).name for e in range(5)] == ["minimal"] * 3 + ["strong"] * 2


@pytest.mark.parametrize("placement", ["cpu", "gpu"])
def test_progressive_run_shows_a_grid_per_policy_and_never_augments_validation(make_cfg, placement):
    cfg = make_cfg(
        "augmentation=progressive",
        f"augmentation.placement={placement}",
        "augmentation.schedule=[{from_epoch:0,preset:minimal},{from_epoch:1,preset:strong}]",
        "trainer.max_epochs=2",
        f"loader.num_workers={2 if placement == 'cpu' else 0}",
    )
    metrics = saturate.train(cfg)
    assert metrics["progress/step"] == 6
    acc = events(cfg.run_dir)
    assert set(acc.Tags()["images"]) == {"inputs/minimal", "inputs/strong"}
    assert [e.step for e in acc.Images("inputs/strong")] == [1]  # recorded when epoch 1 began


def test_validation_batches_are_not_augmented(tmp_path):
    """Seen from the model: validation batches are the plain normalised images, in order;
    training batches with augmentation=gpu are not."""
    from saturate.data.base import channel_stats
    from saturate.data.digits import load_digits
    from saturate.models import SmallCNN

    class Recording(SmallCNN):
        seen: list = []

        def forward(self, x):
            self.seen.append((self.training, x.detach().clone()))
            return super().forward(x)

    train, val = load_digits(val_fraction=0.2, split_seed=0)
    model = Recording(in_channels=1, num_classes=10, width=8)
    saturate.fit(
        model, train, val, overrides=[*TINY, "augmentation=gpu", "augmentation.preset=strong"], run_dir=tmp_path
    )
    mean, std = channel_stats(train.images)
    # the last evaluation's 2 batches (after training, the report's advice checks run 2 samples)
    evaluated = torch.cat([x for training, x in model.seen if not training and len(x) == 32][-2:])
    plain = (val.images[: len(evaluated)].float() / 255 - mean[0]) / std[0]
    torch.testing.assert_close(evaluated, plain)

    def on_uint8_grid(x):  # the share of values that are a normalised uint8 level (k / 255 - mean) / std
        level = (x * std[0] + mean[0]) * 255
        return ((level - level.round()).abs() < 1e-3).float().mean().item()

    trained = [x for training, x in model.seen if training and len(x) == 32][-1]  # (the cost probes after: 8)
    assert trained.shape == (32, 1, 8, 8)
    assert on_uint8_grid(evaluated) == 1.0
    assert on_uint8_grid(trained) < 0.5  # rotated, shifted, brightness and contrast: interpolated values
