"""A variational autoencoder, trained as `pytorch/examples`' vae/main.py trains one (BSD-3,
(c) 2017 Pytorch contributors; VAE and loss_function copied below). What its loop does, and
where it lives here:

- MNIST's 28x28 images in [0, 1] (ToTensor), 60,000 to train, the 10,000 test images to
  evaluate on                         -> `load_digits_flat`: scikit-learn's bundled 8x8 digits
                                           (no download), 0..16 divided by 16 into [0, 1], 64
                                           values; the last 297 images to evaluate on, the
                                           1,500 before them to train on; each sample (x, x)
- `recon_batch, mu, logvar = model(data)`
                                        -> the model returns the tuple; task=regression with
                                           task.output_key=0 (the reconstruction, against x:
                                           what predictions read); task.metrics drops the
                                           regression metrics (the author computes the loss
                                           only)
- loss_function(recon_x, x, mu, logvar): binary cross-entropy with reduction='sum' plus the
  KL divergence, summed over the batch, backpropagated as it is
                                        -> task.loss: `vae_loss(outputs, targets)` (it gets
                                           the whole tuple), task.loss_reduction=sum (the
                                           gradients are the sum's; train/loss and val/loss
                                           are per sample)
- `test_loss /= len(test_loader.dataset)`: the test loss per image
                                        -> val/loss (the mean over samples)
- Adam at 1e-3, no schedule, batches of 128 with the last partial one trained
                                        -> optim=adam, optim.schedule=constant,
                                           optim.warmup_epochs=0, loader.batch_size=128,
                                           loader.drop_last=false

Sizes scaled to 64 inputs: 64 -> 128 -> 20 (latent) -> 128 -> 64 (the author's 784 -> 400 ->
20 -> 400 -> 784); 400 epochs of 12 batches (the author's 10 of 469).
Target (scripts/bench_examples.py): val/loss <= 24.2 (nats per image), met by the reference at
epoch 140 with seed 1 (24.17; 27.1 after 10 epochs, 24.5 after 100, 24.2 after 150).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset


class Autoencoded(Dataset):
    """(x, x): one image's 64 values in [0, 1] as input and as target."""

    def __init__(self, x: torch.Tensor):
        self.x = x

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.x[i]


def load_digits_flat(n_test: int = 297) -> dict:
    """scikit-learn's 1,797 digits as float32 (64,) in [0, 1] (0..16 / 16), in the order
    scikit-learn gives them: the last n_test to evaluate on, the rest to train on."""
    from sklearn.datasets import load_digits

    x = torch.from_numpy(load_digits().data.astype("float32") / 16)
    return {"train": Autoencoded(x[:-n_test]), "val": Autoencoded(x[-n_test:])}


# ---------------------------------------------------------------- vae/main.py (BSD-3)
# Copied from pytorch/examples at 77f55b9 (vae/main.py last changed at 28d16ff); the sizes
# (784, 400, 20) are arguments here, the module otherwise as written.


class VAE(nn.Module):
    def __init__(self, features: int = 64, hidden: int = 128, latent: int = 20):
        super(VAE, self).__init__()  # noqa: UP008 (as written)
        self.features = features

        self.fc1 = nn.Linear(features, hidden)
        self.fc21 = nn.Linear(hidden, latent)
        self.fc22 = nn.Linear(hidden, latent)
        self.fc3 = nn.Linear(latent, hidden)
        self.fc4 = nn.Linear(hidden, features)

    def encode(self, x):
        h1 = F.relu(self.fc1(x))
        return self.fc21(h1), self.fc22(h1)

    def reparameterize(self, mu, logvar):
        std = torch.exp(0.5 * logvar)
        eps = torch.randn_like(std)
        return mu + eps * std

    def decode(self, z):
        h3 = F.relu(self.fc3(z))
        return torch.sigmoid(self.fc4(h3))

    def forward(self, x):
        mu, logvar = self.encode(x.view(-1, self.features))
        z = self.reparameterize(mu, logvar)
        return self.decode(z), mu, logvar


# Reconstruction + KL divergence losses summed over all elements and batch
def loss_function(recon_x, x, mu, logvar):
    BCE = F.binary_cross_entropy(recon_x, x.view(-1, recon_x.shape[-1]), reduction="sum")

    # see Appendix B from VAE paper:
    # Kingma and Welling. Auto-Encoding Variational Bayes. ICLR, 2014
    # https://arxiv.org/abs/1312.6114
    # 0.5 * sum(1 + log(sigma^2) - mu^2 - sigma^2)
    KLD = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())

    return BCE + KLD


def vae_loss(outputs, targets):
    """task.loss: the model's (recon, mu, logvar) and the batch's images, to loss_function."""
    recon, mu, logvar = outputs
    return loss_function(recon, targets, mu, logvar)
