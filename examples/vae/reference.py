# ruff: noqa
# fmt: off
"""
Reference loop for saturate's `vae` example: pytorch/examples' vae/main.py, the data swapped
for the example's and the sizes scaled to it.

PIN
  Repo    : https://github.com/pytorch/examples   (BSD 3-Clause licence, (c) 2017 Pytorch contributors)
  Commit  : 77f55b912142e11fcfdf5b530231fb9c52f181e8 (vae/main.py last changed at 28d16ff)
  Paths   : vae/main.py (this loop; its VAE and loss_function imported from
            examples/vae/vae.py, where they are copied)

CHANGED (and why; each line is marked "# CHANGED" below)
  1. Data swap: datasets.MNIST('../data', train=True/False, download=True,
     transform=ToTensor()) -> the example's splits from `examples.vae.vae.load_digits_flat()`
     (scikit-learn's 8x8 digits in [0, 1]: 1,500 to train on, the last 297 as the test set),
     each sample (x, x) where MNIST's is (x, label): the loop reads `data, _` as before.
  2. Sizes, forced by the data: VAE() -> VAE(features=64, hidden=128, latent=20) (the
     class's 784, 400 and 20), the test images and reconstructions viewed as 8x8 (MNIST's
     are (1, 28, 28) already; the reconstructions 28x28), the samples
     drawn from the same 20-dimensional prior; --epochs 10 -> 400 (12 batches an epoch
     against MNIST's 469).
  3. torchvision's save_image: torchvision is not installed beside saturate, so the images
     are made as written and not written (a no-op save_image; results/ is not made).
  4. Instrumentation (no effect on training): `--target` (the test loss per image, lower is
     better: the bench's target); the first optimizer step's time since process start, after
     every epoch's test() the time and the test loss, and at the end the final figures, as
     `BENCH ...` lines.

Run (from the repository root, so that `examples.vae` imports):
  PYTHONPATH=. python examples/vae/reference.py [--seed 1] [--target 24.2] [--epochs 400]

LICENCE (of the copied code; the CHANGED and instrumentation lines are saturate's)
  BSD 3-Clause License

  Copyright (c) 2017, Pytorch contributors
  All rights reserved.

  Redistribution and use in source and binary forms, with or without
  modification, are permitted provided that the following conditions are met:

  * Redistributions of source code must retain the above copyright notice, this
    list of conditions and the following disclaimer.

  * Redistributions in binary form must reproduce the above copyright notice,
    this list of conditions and the following disclaimer in the documentation
    and/or other materials provided with the distribution.

  * Neither the name of the copyright holder nor the names of its
    contributors may be used to endorse or promote products derived from
    this software without specific prior written permission.

  THIS SOFTWARE IS PROVIDED BY THE COPYRIGHT HOLDERS AND CONTRIBUTORS "AS IS"
  AND ANY EXPRESS OR IMPLIED WARRANTIES, INCLUDING, BUT NOT LIMITED TO, THE
  IMPLIED WARRANTIES OF MERCHANTABILITY AND FITNESS FOR A PARTICULAR PURPOSE ARE
  DISCLAIMED. IN NO EVENT SHALL THE COPYRIGHT HOLDER OR CONTRIBUTORS BE LIABLE
  FOR ANY DIRECT, INDIRECT, INCIDENTAL, SPECIAL, EXEMPLARY, OR CONSEQUENTIAL
  DAMAGES (INCLUDING, BUT NOT LIMITED TO, PROCUREMENT OF SUBSTITUTE GOODS OR
  SERVICES; LOSS OF USE, DATA, OR PROFITS; OR BUSINESS INTERRUPTION) HOWEVER
  CAUSED AND ON ANY THEORY OF LIABILITY, WHETHER IN CONTRACT, STRICT LIABILITY,
  OR TORT (INCLUDING NEGLIGENCE OR OTHERWISE) ARISING IN ANY WAY OUT OF THE USE
  OF THIS SOFTWARE, EVEN IF ADVISED OF THE POSSIBILITY OF SUCH DAMAGE.
"""
from __future__ import print_function
import os
import time


def _process_start_wall():
    """time.time() at the moment this process was created (from /proc, 10 ms resolution)."""
    try:
        with open('/proc/self/stat') as f:
            start_ticks = float(f.read().rsplit(')', 1)[1].split()[19])
        with open('/proc/uptime') as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - start_ticks / os.sysconf('SC_CLK_TCK'))
    except Exception:
        return time.time()


T0 = _process_start_wall()  # CHANGED: instrumentation

import argparse
import torch
import torch.utils.data
from torch import nn, optim
from torch.nn import functional as F

from examples.vae.vae import VAE, load_digits_flat, loss_function  # CHANGED: the example's data; VAE and loss_function copied there


def save_image(*args, **kwargs):  # CHANGED: torchvision's is not installed here: nothing is written
    pass


parser = argparse.ArgumentParser(description='VAE MNIST Example')
parser.add_argument('--batch-size', type=int, default=128, metavar='N',
                    help='input batch size for training (default: 128)')
parser.add_argument('--epochs', type=int, default=400, metavar='N',  # CHANGED: default 10
                    help='number of epochs to train (default: 400)')
parser.add_argument('--no-accel', action='store_true', 
                    help='disables accelerator')
parser.add_argument('--seed', type=int, default=1, metavar='S',
                    help='random seed (default: 1)')
parser.add_argument('--log-interval', type=int, default=10, metavar='N',
                    help='how many batches to wait before logging training status')
parser.add_argument('--target', type=float, default=24.2,  # CHANGED: added
                    help='test loss per image for the time to target (the bench)')
args = parser.parse_args()

use_accel = not args.no_accel and torch.accelerator.is_available()

torch.manual_seed(args.seed)


if use_accel:
    device = torch.accelerator.current_accelerator()
else:
    device = torch.device("cpu")

print(f"Using device: {device}")

kwargs = {'num_workers': 1, 'pin_memory': True} if use_accel else {}
_splits = load_digits_flat()  # CHANGED: was datasets.MNIST(...) for both loaders
train_loader = torch.utils.data.DataLoader(
    _splits['train'],  # CHANGED
    batch_size=args.batch_size, shuffle=True, **kwargs)
test_loader = torch.utils.data.DataLoader(
    _splits['val'],  # CHANGED
    batch_size=args.batch_size, shuffle=False, **kwargs)


# CHANGED: class VAE here, now imported from examples.vae.vae (copied as written, its sizes as arguments)


model = VAE(features=64, hidden=128, latent=20).to(device)  # CHANGED: VAE() (784, 400, 20)
optimizer = optim.Adam(model.parameters(), lr=1e-3)


# CHANGED: loss_function here, now imported from examples.vae.vae (copied as written)


def train(epoch):
    model.train()
    train_loss = 0
    for batch_idx, (data, _) in enumerate(train_loader):
        data = data.to(device)
        optimizer.zero_grad()
        recon_batch, mu, logvar = model(data)
        loss = loss_function(recon_batch, data, mu, logvar)
        loss.backward()
        train_loss += loss.item()
        optimizer.step()
        if not _FIRST:  # CHANGED: instrumentation
            _FIRST.append(time.time() - T0)
            print(f'BENCH first_step t={_FIRST[0]:.3f}', flush=True)
        if batch_idx % args.log_interval == 0:
            print('Train Epoch: {} [{}/{} ({:.0f}%)]\tLoss: {:.6f}'.format(
                epoch, batch_idx * len(data), len(train_loader.dataset),
                100. * batch_idx / len(train_loader),
                loss.item() / len(data)))

    print('====> Epoch: {} Average loss: {:.4f}'.format(
          epoch, train_loss / len(train_loader.dataset)))


def test(epoch):
    model.eval()
    test_loss = 0
    with torch.no_grad():
        for i, (data, _) in enumerate(test_loader):
            data = data.to(device)
            recon_batch, mu, logvar = model(data)
            test_loss += loss_function(recon_batch, data, mu, logvar).item()
            if i == 0:
                n = min(data.size(0), 8)
                comparison = torch.cat([data[:n].view(n, 1, 8, 8),  # CHANGED: data[:n] (MNIST's are (1, 28, 28))
                                      recon_batch.view(args.batch_size, 1, 8, 8)[:n]])  # CHANGED: 28, 28
                save_image(comparison.cpu(),
                         'results/reconstruction_' + str(epoch) + '.png', nrow=n)

    test_loss /= len(test_loader.dataset)
    print('====> Test set loss: {:.4f}'.format(test_loss))
    return test_loss  # CHANGED: instrumentation

_EVALS = []  # CHANGED: instrumentation, (wall_s, epoch, test_loss)
_FIRST = []  # CHANGED: instrumentation, the first optimizer step's time

if __name__ == "__main__":
    for epoch in range(1, args.epochs + 1):
        train(epoch)
        test_loss = test(epoch)  # CHANGED: instrumentation (this line and the next 3)
        _t = time.time() - T0
        _EVALS.append((_t, epoch, test_loss))
        print(f'BENCH eval t={_t:.3f} epoch={epoch} val_loss={test_loss:.5f}', flush=True)
        with torch.no_grad():
            sample = torch.randn(64, 20).to(device)
            sample = model.decode(sample).cpu()
            save_image(sample.view(64, 1, 8, 8),  # CHANGED: 28, 28
                       'results/sample_' + str(epoch) + '.png')
    # CHANGED: instrumentation
    _hit = next((e for e in _EVALS if e[2] <= args.target), None)
    print(f'BENCH target val_loss<={args.target} ' + (f't={_hit[0]:.3f} epoch={_hit[1]}' if _hit else 't=nan epoch=none'))
    print(f'BENCH final last_val_loss={_EVALS[-1][2]:.5f} best_val_loss={min(e[2] for e in _EVALS):.5f} '
          f'evals={len(_EVALS)} t_end={time.time() - T0:.3f}', flush=True)
