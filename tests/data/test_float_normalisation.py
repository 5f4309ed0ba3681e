"""Image normalisation as the run applies it: float images in [0, 1] (ToTensor()'s) with the
dataset's `mean`/`std` are normalised on the device with them, without them they reach the
model as they are; uint8 images with the data's statistics or a sample's. The run's `data:`
line says which."""

from __future__ import annotations

import logging

import pytest
import torch

import saturate
from saturate.data.base import describe
from saturate.errors import DataError
from tests.conftest import TINY


class Images(torch.utils.data.Dataset):
    """(image (C, 8, 8), class) pairs of random images; `mean`/`std` attributes when given."""

    def __init__(self, images: torch.Tensor, mean=None, std=None):
        g = torch.Generator().manual_seed(1)
        self.images, self.labels = images, torch.randint(0, 2, (len(images),), generator=g).tolist()
        if mean is not None:
            self.mean, self.std = mean, std

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return self.images[i], self.labels[i]


class Recording(torch.nn.Module):
    """A classifier that keeps every training input it is given."""

    def __init__(self, channels: int):
        super().__init__()
        self.seen: list[torch.Tensor] = []
        self.fc = torch.nn.Linear(channels * 8 * 8, 2)

    def forward(self, x):
        if self.training:
            self.seen.append(x.detach().clone())
        return self.fc(x.flatten(1))


def floats(channels: int = 1) -> torch.Tensor:
    return torch.rand(96, channels, 8, 8, generator=torch.Generator().manual_seed(0))


def trained(tmp_path, caplog, data, *overrides: str) -> tuple[torch.Tensor, str]:
    """The inputs the model saw in a run of 3 steps, and the run's `data:` line."""
    model = Recording(data.images.shape[1])
    with caplog.at_level(logging.INFO, logger="saturate"):
        metrics = saturate.fit(model, data, data, run_dir=tmp_path, overrides=[*TINY, *overrides])
    assert metrics["progress/step"] == 3
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data: Images: ")]
    assert len(lines) == 1, lines
    return torch.cat(model.seen), lines[0]


@pytest.mark.parametrize("augmentation", ["none", "gpu"])
def test_float_images_with_the_datas_mean_and_std_reach_the_model_normalised(tmp_path, caplog, augmentation):
    seen, line = trained(tmp_path, caplog, Images(floats(), mean=(0.5,), std=(0.5,)), f"augmentation={augmentation}")
    assert seen.min() < -0.9 and seen.max() > 0.9 and seen.min() >= -1 - 1e-6 and seen.max() <= 1 + 1e-6
    assert "normalised on the device with the data's mean/std (0.5)/(0.5)" in line


def test_float_images_without_mean_and_std_reach_the_model_as_they_are(tmp_path, caplog):
    images = floats(3)
    seen, line = trained(tmp_path, caplog, Images(images))
    assert seen.min() >= 0 and seen.max() <= 1 and seen.max() > 0.9
    assert all(any(torch.equal(s, image) for image in images) for s in seen[:4])  # each one of the data's images
    assert "not normalised (float images without mean/std)" in line


def test_uint8_images_are_normalised_with_a_samples_statistics_or_the_datas(tmp_path, caplog):
    images = torch.randint(0, 256, (96, 3, 8, 8), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    seen, line = trained(tmp_path / "measured", caplog, Images(images))
    assert abs(float(seen.mean())) < 0.1 and abs(float(seen.std()) - 1) < 0.1  # the sample is every image here
    assert "normalised on the device with statistics of 96 images" in line
    caplog.clear()
    seen, line = trained(tmp_path / "given", caplog, Images(images, mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0)))
    assert seen.min() >= 0 and seen.max() <= 1 and seen.max() > 0.99
    assert "normalised on the device with the data's mean/std (0, 0, 0)/(1, 1, 1)" in line


def test_the_normalisation_values_must_count_the_channels_for_float_images_too():
    with pytest.raises(DataError, match=r"data: 3 normalisation values \(mean/std\) for 1 image channels"):
        describe(Images(floats(), mean=(0.5,) * 3, std=(0.5,) * 3), None, name="x", classes=True)


def test_inputs_that_are_not_images_are_described_as_the_data_gives_them():
    data = [(torch.randn(6, 3), 0), (torch.randn(6, 3), 1)]
    assert describe(data, None, name="x", classes=True).normalisation == "inputs as the data gives them"


def test_one_number_stands_for_every_channel_and_a_half_given_pair_is_refused():
    spec = describe(Images(floats(3), mean=0.5, std=0.5), None, name="x", classes=True)
    assert spec.mean == spec.std == (0.5, 0.5, 0.5)
    assert spec.normalisation == "normalised on the device with the data's mean/std (0.5, 0.5, 0.5)/(0.5, 0.5, 0.5)"
    half = Images(floats())
    half.mean = (0.5,)
    with pytest.raises(
        DataError, match=r"^data: the data set gives `mean` but no `std`; image normalisation takes both"
    ):
        describe(half, None, name="x", classes=True)
    for std, said in ((0.0, r"std \(0.0,\): each must be > 0"), ("wide", r"std 'wide': expected a number or one per")):
        with pytest.raises(DataError, match=said):
            describe(Images(floats(), mean=0.5, std=std), None, name="x", classes=True)
