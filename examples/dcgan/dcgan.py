"""A DCGAN, trained as `pytorch/examples`' dcgan/main.py trains one (BSD-3; the Generator, the
Discriminator and `weights_init` below are its code, scaled to 32x32 images): two networks,
two optimizers, one loop body. What its loop does, and where it lives here:

- MNIST resized, ToTensor(), Normalize((0.5,), (0.5,))
                            -> `load_digits32`: scikit-learn's bundled 8x8 digits (no
                               download) upsampled once to (1, 32, 32) float images in
                               [0, 1], bilinear; the dataset's `mean`/`std` (0.5,) make
                               saturate normalise them on the device as the author's
                               Normalize does. 1497 to train, 300 to validate.
- Generator(nz -> 64x64), Discriminator(64x64 -> 1), weights_init
                            -> `Generator`, `Discriminator`: one transposed conv (the
                               ngf * 8 one) and one conv (the ndf * 8 one) fewer, for
                               32x32; `GAN` holds both (one module: checkpointed,
                               evaluated, averaged; its forward is the generator's)
- Adam(lr 2e-4, betas (0.5, 0.999)) for each net
                            -> optim.optimizers: {D: netD, G: netG}, schedule constant,
                               no warm-up
- the loop body: D on a real batch (label 1) then on G's fakes (label 0, detached), a
  backward of each, D's step; G's step on D's output for the same fakes with the real
  label; BCELoss           -> `GANTask.training_step`
- batches of 64, shuffled, the last partial one kept -> loader.batch_size: 64,
                               loader.drop_last: false

Evaluation, which the author's loop does not have (it saves image grids): `GANTask.forward`
generates as many images as the validation batch holds, from noise drawn by a generator
seeded afresh at each evaluation (the same noise every time), in eval mode; its loss is
the generator's BCE against D (`val/loss`). `val/fd_pixels` is the Fréchet distance between
Gaussians fitted to the validation images and to the generated ones, each image seen as its
64 pixels after a 4x4 average pooling (the digits' own 8x8 grid), in the normalised [-1, 1]
units: torchmetrics' FrechetInceptionDistance with `PooledPixels` as its feature extractor
(no Inception network). Lower is better; 0 for two identical sets; two halves of the
validation set are 0.82 apart. The bench's target, val/fd_pixels <= 2.0, was chosen from two
runs of reference.py (seeds 1 and 2, 20 epochs) before any time was measured: they met it at
epochs 15 and 14 (2.32 and 2.31 at epoch 12, 1.44 and 1.24 at epoch 20).

Copyright (c) 2017, Pytorch contributors (the Generator, Discriminator and weights_init);
BSD 3-Clause License, as in reference.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset
from torchmetrics.image.fid import FrechetInceptionDistance

from saturate.tasks import Task

NOISE_SEED = 1234  # the evaluation's noise: the same at every evaluation


class DigitImages(Dataset):
    """(float image (1, 32, 32) in [0, 1], digit); `mean`/`std` for the device's
    normalisation, the author's Normalize((0.5,), (0.5,))."""

    mean, std = (0.5,), (0.5,)

    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        self.images, self.targets = images, labels

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int):
        return self.images[i], self.targets[i]


def load_digits32(size: int = 32, n_val: int = 300, seed: int = 0) -> dict:
    """scikit-learn's 1797 8x8 digits (0..16) as (1, size, size) float images in [0, 1],
    upsampled bilinearly once; a shuffled train/val split."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    small = torch.from_numpy((x / 16).astype(np.float32).reshape(-1, 1, 8, 8))
    images = F.interpolate(small, size=(size, size), mode="bilinear").clamp(0, 1).contiguous()
    labels = torch.from_numpy(y.astype(np.int64))
    order = torch.from_numpy(np.random.default_rng(seed).permutation(len(y)))
    parts = {"val": order[:n_val], "train": order[n_val:]}
    return {split: DigitImages(images[rows], labels[rows]) for split, rows in parts.items()}


def weights_init(m: Any) -> None:
    """The author's: N(0, 0.02) convolutions, N(1, 0.02) batch-norm scales, zero shifts."""
    classname = m.__class__.__name__
    if classname.find("Conv") != -1:
        torch.nn.init.normal_(m.weight, 0.0, 0.02)
    elif classname.find("BatchNorm") != -1:
        torch.nn.init.normal_(m.weight, 1.0, 0.02)
        torch.nn.init.zeros_(m.bias)


class Generator(nn.Module):
    """The author's, for 32x32: its first transposed conv (nz -> ngf * 8) dropped, the
    next takes nz."""

    def __init__(self, nz: int = 32, ngf: int = 32, nc: int = 1):
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 4, 4, 1, 0, bias=False),  # (ngf*4) x 4 x 4
            nn.BatchNorm2d(ngf * 4),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False),  # (ngf*2) x 8 x 8
            nn.BatchNorm2d(ngf * 2),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False),  # ngf x 16 x 16
            nn.BatchNorm2d(ngf),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf, nc, 4, 2, 1, bias=False),  # nc x 32 x 32
            nn.Tanh(),
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.main(input)


class Discriminator(nn.Module):
    """The author's, for 32x32: its ndf * 4 -> ndf * 8 conv dropped, the last takes ndf * 4."""

    def __init__(self, ndf: int = 32, nc: int = 1):
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False),  # ndf x 16 x 16
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False),  # (ndf*2) x 8 x 8
            nn.BatchNorm2d(ndf * 2),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 2, ndf * 4, 4, 2, 1, bias=False),  # (ndf*4) x 4 x 4
            nn.BatchNorm2d(ndf * 4),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 4, 1, 4, 1, 0, bias=False),  # 1 x 1 x 1
            nn.Sigmoid(),
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.main(input).view(-1, 1).squeeze(1)


class GAN(nn.Module):
    """Both nets as one module; its forward is the generator's: noise (B, nz) -> images."""

    def __init__(self, nz: int = 32, ngf: int = 32, ndf: int = 32, in_channels: int = 1):
        super().__init__()
        self.nz = nz
        self.netG = Generator(nz, ngf, in_channels)
        self.netD = Discriminator(ndf, in_channels)
        self.netG.apply(weights_init)
        self.netD.apply(weights_init)

    def forward(self, noise: torch.Tensor) -> torch.Tensor:
        return self.netG(noise.reshape(-1, self.nz, 1, 1))  # (B, nz) or (B, nz, 1, 1)


class PooledPixels(nn.Module):
    """The Fréchet distance's fixed features: each image's 4x4-average-pooled pixels (64 for
    a 32x32 image)."""

    num_features = 64

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return F.avg_pool2d(images.float(), 4).flatten(1)


def fd_pixels_metric() -> FrechetInceptionDistance:
    """val/fd_pixels: torchmetrics' Fréchet distance over `PooledPixels` features."""
    return FrechetInceptionDistance(feature=PooledPixels(), reset_real_features=True)


def fd_pixels(real: torch.Tensor, fake: torch.Tensor) -> float:
    """The Fréchet distance between two sets of normalised images, as validation logs it."""
    metric = fd_pixels_metric().to(real.device)
    metric.update(real, real=True)
    metric.update(fake, real=False)
    return float(metric.compute())


def bce(output: torch.Tensor, label: float) -> torch.Tensor:
    """The author's BCELoss against a constant label, in float32 (BCELoss refuses autocast)."""
    with torch.autocast(output.device.type, enabled=False):
        return F.binary_cross_entropy(output.float(), torch.full_like(output, label, dtype=torch.float32))


class GANTask(Task):
    """The author's loop body as `training_step`; `forward` (evaluation) generates images."""

    name = "gan"
    main = "fd_pixels"
    real_label, fake_label = 1.0, 0.0

    def __init__(self, noise_seed: int = NOISE_SEED, **options):
        super().__init__(**options)
        self.noise_seed = noise_seed
        self.noise: torch.Generator | None = None

    def training_step(self, model: GAN, batch, optimizers) -> torch.Tensor:
        real = self.input(batch)
        netG, netD = model.netG, model.netD
        # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
        optimizers.zero_grad("D")
        errD_real = bce(netD(real), self.real_label)
        optimizers.backward(errD_real)
        noise = torch.randn(len(real), model.nz, 1, 1, device=real.device)
        fake = netG(noise)
        errD_fake = bce(netD(fake.detach()), self.fake_label)
        optimizers.backward(errD_fake)
        optimizers.step("D")
        # (2) Update G network: maximize log(D(G(z))), the fakes labelled real
        optimizers.zero_grad("G")
        errG = bce(netD(fake), self.real_label)
        optimizers.backward(errG)
        optimizers.step("G")
        return errG.detach()

    def reset(self, split: str) -> None:
        """Each evaluation draws the same noise: its generator starts afresh."""
        super().reset(split)
        self.noise = None

    def forward(self, model: GAN, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(the generator's BCE against D, as many generated images as the batch holds)."""
        real = self.input(batch)
        if self.noise is None or self.noise.device != real.device:
            self.noise = torch.Generator(real.device).manual_seed(self.noise_seed)
        noise = torch.randn(len(real), model.nz, generator=self.noise, device=real.device)
        fake = model(noise)
        return bce(model.netD(fake), self.real_label), fake

    def own_metrics(self) -> dict:
        return {"fd_pixels": fd_pixels_metric()}

    def update(self, metrics: dict, outputs: torch.Tensor, batch) -> None:
        """The validation images as the real set, the generated ones as the fake set."""
        metric = metrics["fd_pixels"]
        metric.update(self.input(batch), real=True)
        metric.update(outputs, real=False)
