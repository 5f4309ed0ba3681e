"""The segmentation task: per-pixel cross-entropy (or BCE for one logit) with an optional
soft Dice term; Dice and IoU from torchmetrics, per class with several, checked against a
hand computation; ignore_index; masks moved with their images by the augmentation (the
geometric transforms only); masks of another size refused in one message."""

from __future__ import annotations

import math

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.data import Dataset

import saturate
from saturate.data.augment import PRESETS, BatchAugment, SampleAugment, Schedule, Transforms, kornia_pipeline
from saturate.errors import UserError
from saturate.tasks import Segmentation
from tests.conftest import TINY, read_metrics
from tests.trainer.test_run import events


def hand_dice(preds: torch.Tensor, masks: torch.Tensor, classes: list[int]) -> tuple[float, dict[int, float]]:
    """The Dice of each image and foreground class, 2|P and T| / (|P| + |T|), a class absent
    from both left out; averaged over the classes of each image, then over the images; and
    per class, over the images where it is present."""
    per_image, per_class = [], {c: [] for c in classes}
    for p, t in zip(preds, masks, strict=True):
        scores = {}
        for c in classes:
            both, total = ((p == c) & (t == c)).sum().item(), (p == c).sum().item() + (t == c).sum().item()
            if total:
                scores[c] = 2 * both / total
                per_class[c].append(scores[c])
        per_image.append(sum(scores.values()) / len(scores))
    return sum(per_image) / len(per_image), {c: sum(v) / len(v) for c, v in per_class.items()}


class Logits(nn.Module):
    """Returns fixed logits: the predictions a test wants the metrics to see."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.logits = logits
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return self.logits[: len(x)] * self.scale


def masks_and_predictions(seed: int = 0, classes: int = 3, n: int = 4, size: int = 8):
    g = torch.Generator().manual_seed(seed)
    masks = torch.randint(0, classes, (n, size, size), generator=g)
    preds = torch.where(torch.rand(n, size, size, generator=g) < 0.7, masks, torch.randint(0, classes, (n, size, size)))
    preds[0][preds[0] == 2] = 1  # class 2 predicted nowhere in image 0
    return masks, preds


def test_dice_and_iou_match_a_hand_computation_per_class():
    masks, preds = masks_and_predictions()
    task = Segmentation(3)
    logits = torch.nn.functional.one_hot(preds, 3).permute(0, 3, 1, 2).float()
    metrics = task.metrics()
    task.update(metrics, logits, (torch.zeros(4, 1, 8, 8), masks))
    values = {name: metric.compute() for name, metric in metrics.items()}
    dice, _ = hand_dice(preds, masks, [1, 2])
    assert values["dice"].item() == pytest.approx(dice, abs=1e-5)
    _, per_class = hand_dice(preds, masks, [0, 1, 2])  # entry c is class c, background included
    assert values["dice_class"].tolist() == pytest.approx([per_class[0], per_class[1], per_class[2]], abs=1e-5)
    inter = lambda c, p, t: ((p == c) & (t == c)).sum().item()
    union = lambda c, p, t: ((p == c) | (t == c)).sum().item()
    iou = [
        sum(inter(c, p, t) / union(c, p, t) for c in (1, 2) if union(c, p, t)) / 2
        for p, t in zip(preds, masks, strict=True)
    ]
    assert values["iou"].item() == pytest.approx(sum(iou) / len(iou), abs=1e-5)


def test_the_own_metrics_are_fed_one_hot_masks_and_give_what_index_masks_give():
    """The task's Dice and IoU take one-hot masks (torchmetrics' index format one-hots each
    update into int64 itself, several times slower): their values are those of the same
    metrics fed index masks, over batches with a class predicted nowhere and ignored pixels;
    a user's metric in the index format still gets index masks."""
    from torchmetrics.segmentation import DiceScore, MeanIoU

    index = {
        "dice": DiceScore(3, include_background=False, average="macro", input_format="index"),
        "dice_class": DiceScore(3, include_background=True, average="none", input_format="index"),
        "iou": MeanIoU(3, include_background=False, input_format="index"),
    }
    task = Segmentation(3, ignore_index=255, metrics={"user_dice": index["dice"].clone()})
    metrics = task.metrics()
    assert [metrics[name].input_format for name in index] == ["one-hot"] * 3
    for seed in range(3):
        masks, preds = masks_and_predictions(seed)
        masks[seed, :3] = 255
        batch = (torch.zeros(4, 1, 8, 8), masks)
        logits = torch.nn.functional.one_hot(preds, 3).permute(0, 3, 1, 2).float()
        task.update(metrics, logits, batch)
        for metric in index.values():
            metric.update(*task.metric_inputs(logits, batch))
    for name, metric in index.items():
        assert torch.equal(metrics[name].compute(), metric.compute()), name
    assert torch.equal(metrics["user_dice"].compute(), index["dice"].compute())


def test_ignored_pixels_count_in_neither_the_loss_nor_the_metrics():
    masks, preds = masks_and_predictions(classes=2)
    wrong = 1 - preds  # every prediction wrong ...
    ignored = masks.clone()
    ignored[:, :, :4] = 255  # ... but the left half ignored, and right where it is kept
    wrong[:, :, 4:] = masks[:, :, 4:]
    logits = 10 * (2 * torch.nn.functional.one_hot(wrong, 2).permute(0, 3, 1, 2).float() - 1)
    task = Segmentation(2, ignore_index=255)
    metrics = task.metrics()
    task.update(metrics, logits, (torch.zeros(4, 1, 8, 8), ignored))
    assert metrics["dice"].compute().item() == pytest.approx(1.0)
    loss, _ = task.forward(Logits(logits), (torch.zeros(4, 1, 8, 8), ignored))
    assert loss.item() < 1e-6


def test_the_dice_term_is_one_minus_the_soft_dice_of_the_foreground():
    masks = torch.zeros(2, 4, 4, dtype=torch.long)
    masks[:, :2] = 1
    logits = torch.zeros(2, 1, 4, 4)  # sigmoid 0.5 everywhere
    plain, _ = Segmentation(2).forward(Logits(logits), (torch.zeros(2, 1, 4, 4), masks))
    with_dice, _ = Segmentation(2, dice_weight=1.0).forward(Logits(logits), (torch.zeros(2, 1, 4, 4), masks))
    assert plain.item() == pytest.approx(math.log(2), abs=1e-6)
    soft = 2 * (0.5 * 16) / (0.5 * 32 + 16)  # intersection 0.5 x 16 foreground pixels; sums 16 + 16
    assert with_dice.item() - plain.item() == pytest.approx(1 - soft, abs=1e-5)


class Squares(Dataset):
    """Dict samples: a dark image with a bright square, and its binary mask (or a mask of
    another size, with `mask_size`)."""

    num_classes = 2

    def __init__(self, n: int, seed: int = 0, size: int = 16, mask_size: int | None = None):
        g = torch.Generator().manual_seed(seed)
        self.images = torch.rand(n, 1, size, size, generator=g) * 0.3
        self.masks = torch.zeros(n, mask_size or size, mask_size or size, dtype=torch.long)
        for k, (y, x) in enumerate(torch.randint(0, size - 6, (n, 2), generator=g).tolist()):
            self.images[k, 0, y : y + 6, x : x + 6] += 0.6
            self.masks[k, y : y + 6, x : x + 6] = 1

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return {"image": self.images[i], "mask": self.masks[i]}


def tiny_segmenter(in_channels: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(in_channels, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 1, 3, padding=1))


SEGMENT = [*TINY, "task.input_key=image", "task.target_key=mask", "optim=adam", "optim.optimizer.lr=0.01"]


def test_a_segmenter_learns_and_exports_its_masks(tmp_path):
    longer = [*SEGMENT, "trainer.limit_train_batches=-1", "trainer.max_epochs=10", "trainer.predict=val"]
    longer += ["loader.batch_size=16", "optim.optimizer.lr=0.03"]
    metrics = saturate.fit(
        tiny_segmenter, Squares(128), Squares(32, 1), task="segmentation", run_dir=tmp_path, overrides=longer
    )
    assert read_metrics(tmp_path)["task"] == "segmentation"
    assert metrics["val/dice"] > 0.7 and 0 < metrics["val/iou"] <= metrics["val/dice"]
    import numpy as np

    with np.load(tmp_path / "predictions" / "val.npz", allow_pickle=False) as saved:
        assert saved["mask"].shape == (32, 16, 16) and saved["mask"].dtype == np.uint8
        assert ((saved["mask"] == 1) == (saved["target"] == 1)).mean() > 0.9
    assert read_metrics(tmp_path)["monitor"] == "val/dice"
    previews = events(tmp_path).Tags()["images"]
    assert "val/preview" in previews, previews  # image, mask and prediction side by side


@pytest.mark.parametrize(("every_s", "steps"), [(1e9, [1, 8]), (0.0, list(range(1, 9)))])
def test_previews_are_logged_at_the_first_evaluation_then_at_most_every_few_seconds_and_at_the_end(
    tmp_path, monkeypatch, every_s, steps
):
    """Each preview costs a PNG and TensorBoard's pure-Python CRC of it: with an evaluation every
    step (8 here), the images come at the first, then once tracking.PICTURES_EVERY_S has passed
    (never here, with 1e9 s; every time with 0), and at the last step; the metrics at every one."""
    from saturate.diagnostics import tracking

    monkeypatch.setattr(tracking, "PICTURES_EVERY_S", every_s)
    overrides = [*SEGMENT, "trainer.limit_train_batches=4", "trainer.max_epochs=2", "trainer.eval_every=1"]
    saturate.fit(
        tiny_segmenter, Squares(128), Squares(16, 1), task="segmentation", run_dir=tmp_path, overrides=list(overrides)
    )
    acc = EventAccumulator(str(tmp_path), size_guidance={"images": 0, "scalars": 0})  # every one, not a sample
    acc.Reload()
    assert [e.step for e in acc.Images("val/preview")] == steps
    assert sorted({e.step for e in acc.Scalars("val/dice")}) == list(range(1, 9))


class StopsAt:
    """A user's callback that stops the run at an evaluation (as early stopping would)."""

    def __init__(self, step: int):
        self.step = step

    def on_eval_end(self, run, metrics):
        if run.step == self.step:
            run.request_stop(f"stop at step {self.step}")


def test_a_run_stopped_at_an_evaluation_logs_its_images_there(tmp_path, monkeypatch):
    """The last evaluation's images are logged however the run ends: a stop asked for at an
    evaluation (early stopping, the target) makes it the last."""
    from saturate.diagnostics import tracking

    monkeypatch.setattr(tracking, "PICTURES_EVERY_S", 1e9)
    overrides = [*SEGMENT, "trainer.limit_train_batches=4", "trainer.max_epochs=2", "trainer.eval_every=1"]
    saturate.fit(
        tiny_segmenter,
        Squares(128),
        Squares(16, 1),
        task="segmentation",
        run_dir=tmp_path,
        overrides=list(overrides),
        callbacks=[StopsAt(5)],
    )
    acc = EventAccumulator(str(tmp_path), size_guidance={"images": 0})
    acc.Reload()
    assert [e.step for e in acc.Images("val/preview")] == [1, 5]


def test_masks_of_another_size_than_their_images_are_refused_in_one_message(tmp_path):
    with pytest.raises(UserError) as err:
        saturate.fit(
            tiny_segmenter,
            Squares(32, mask_size=8),
            Squares(8, 1, mask_size=8),
            task="segmentation",
            run_dir=tmp_path,
            overrides=SEGMENT,
        )
    assert str(err.value).startswith("data: masks of 8x8 for images of 16x16; task=segmentation needs")


def flipped_and_shifted(x: torch.Tensor, masks: torch.Tensor, seed: int = 3):
    """A batch and its masks through the 'standard' preset (flip, rotation, shift, colour) on
    the device path."""
    return BatchAugment(Schedule([(0, PRESETS["standard"])]), seed)(x, 0, 0, masks)


def test_the_device_augmentation_moves_each_mask_with_its_image_and_never_recolours_it():
    """A mask that is the image's own bright pixels stays so after the geometric transforms
    (up to the edge pixels of the interpolation); it holds class indices only."""
    data = Squares(16, size=32)
    x, masks = data.images.expand(-1, 3, -1, -1).contiguous(), data.masks
    out, moved = flipped_and_shifted(x, masks)
    assert moved.dtype == torch.long and set(moved.unique().tolist()) <= {0, 1}
    assert not torch.equal(moved, masks)  # they did move
    bright = out.mean(1) > out.mean(dim=(1, 2, 3), keepdim=True)[:, 0] + 0.15
    agree = (bright == (moved == 1)).float().mean().item()
    assert agree > 0.97, agree


def test_a_users_kornia_transforms_move_the_masks_and_other_modules_are_refused():
    import kornia.augmentation as K

    data = Squares(8, size=16)
    own = Transforms([K.RandomHorizontalFlip(p=1.0), K.RandomBrightness(brightness=(1.5, 1.5), p=1.0)])
    out, moved = BatchAugment(own, 0)(data.images, 0, 0, data.masks)
    assert torch.equal(moved, data.masks.flip(-1))  # flipped, not brightened
    assert torch.allclose(out, (data.images.flip(-1) + 0.5).clamp(0, 1), atol=1e-6)
    with pytest.raises(UserError, match="augmentation.transforms: Identity cannot move the masks"):
        BatchAugment(Transforms([nn.Identity()]), 0)(data.images, 0, 0, data.masks)


def test_the_per_sample_augmentation_moves_the_mask_as_the_device_does():
    """The CPU placement's samples: each mask moved by its image's own draw; with a flip
    only, exactly the image's flip."""
    data = Squares(16, size=16)
    flips = Schedule([(0, PRESETS["minimal"].__class__("flip", hflip=0.5))])
    augmented = SampleAugment(data, flips, seed=0, entry="image", mask_entry="mask")
    flipped = 0
    for i in range(16):
        sample = augmented[(0, i)]
        turned = not torch.allclose(sample["image"], data.images[i])
        assert torch.allclose(sample["image"], data.images[i].flip(-1) if turned else data.images[i])
        assert torch.equal(sample["mask"], data.masks[i].flip(-1) if turned else data.masks[i])
        flipped += turned
    assert 0 < flipped < 16
    assert kornia_pipeline(PRESETS["minimal"], masks=True) is not None
