# ruff: noqa
# fmt: off
"""
Reference loop for saturate's `dcgan` example: the public code it was ported from, with only
its data swapped for the example's and its nets scaled to the example's 32x32 images.

PIN
  Repo    : https://github.com/pytorch/examples   (BSD 3-Clause, (c) 2017 Pytorch contributors)
  Commit  : 77f55b912142e11fcfdf5b530231fb9c52f181e8 (dcgan/main.py last changed at cc8e404)
  Path    : dcgan/main.py

CHANGED (and why; each line is marked "# CHANGED" below)
  1. Data swap: `--dataset mnist` (dset.MNIST with Resize, ToTensor, Normalize((0.5,), (0.5,)))
     -> the example's `examples.dcgan.dcgan.load_digits32()` training split (scikit-learn's
     digits upsampled to 32x32, float in [0, 1]: what ToTensor gives), with the author's
     Normalize((0.5,), (0.5,)) applied to each sample as the transform did. --dataset,
     --dataroot and --classes are no longer read (nothing is downloaded); nc = 1.
  2. Sizes, for 32x32 images: the Generator's first ConvTranspose2d(nz, ngf * 8) and its
     BatchNorm/ReLU dropped (the next takes nz), the Discriminator's Conv2d(ndf * 4, ndf * 8)
     and its BatchNorm/LeakyReLU dropped (the last takes ndf * 4): the example's Generator
     and Discriminator. Through the author's flags: --imageSize 64 -> 32, --nz 100 -> 32,
     --ngf 64 -> 32, --ndf 64 -> 32, --niter 25 -> 20, --workers 2 -> 0 (two workers
     re-forked every epoch for samples already in memory swamp a 2-core machine),
     --batchSize 64, --lr 2e-4 and --beta1 0.5 kept.
  3. torchvision is not installed: `vutils.save_image` of the real batch and of the fixed
     noise's fakes is skipped (the fixed noise's forward, which moves G's batch-norm
     statistics, is kept).
  4. Instrumentation (no effect on training): `--seed` sets --manualSeed (the bench's seed),
     `--target` (val/fd_pixels, lower is better: the bench's target); after every epoch,
     with G and D in eval mode under no grad, 300 images generated from the example's
     evaluation noise (seeded afresh each time) and their Fréchet distance to the 300
     validation images by the example's own `fd_pixels` (what saturate logs as
     val/fd_pixels); the first optimizer step's time, and at the end the time the target was
     first met and the final figures, as `BENCH ...` lines (seconds since the process began).

Run (from the repository root, so that `examples.dcgan` imports):
  PYTHONPATH=. python examples/dcgan/reference.py [--seed 1] [--target 2.0] [--niter 20]

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
import random
import torch
import torch.nn as nn
import torch.nn.parallel
import torch.backends.cudnn as cudnn
import torch.optim as optim
import torch.utils.data

from examples.dcgan.dcgan import NOISE_SEED, fd_pixels, load_digits32  # CHANGED: was torchvision's datasets, transforms and utils


parser = argparse.ArgumentParser()
parser.add_argument('--dataset', required=False, help='cifar10 | lsun | mnist |imagenet | folder | lfw | fake')  # CHANGED: required=True dropped (not read)
parser.add_argument('--dataroot', required=False, help='path to dataset')
parser.add_argument('--workers', type=int, help='number of data loading workers', default=0)  # CHANGED: default 2
parser.add_argument('--batchSize', type=int, default=64, help='input batch size')
parser.add_argument('--imageSize', type=int, default=32, help='the height / width of the input image to network')  # CHANGED: default 64
parser.add_argument('--nz', type=int, default=32, help='size of the latent z vector')  # CHANGED: default 100
parser.add_argument('--ngf', type=int, default=32, help='number of generator filters')  # CHANGED: default 64
parser.add_argument('--ndf', type=int, default=32, help='number of discriminator filters')  # CHANGED: default 64
parser.add_argument('--niter', type=int, default=20, help='number of epochs to train for')  # CHANGED: default 25
parser.add_argument('--lr', type=float, default=0.0002, help='learning rate, default=0.0002')
parser.add_argument('--beta1', type=float, default=0.5, help='beta1 for adam. default=0.5')
parser.add_argument('--dry-run', action='store_true', help='check a single training cycle works')
parser.add_argument('--ngpu', type=int, default=1, help='number of GPUs to use')
parser.add_argument('--netG', default='', help="path to netG (to continue training)")
parser.add_argument('--netD', default='', help="path to netD (to continue training)")
parser.add_argument('--outf', default='.', help='folder to output images and model checkpoints')
parser.add_argument('--manualSeed', type=int, help='manual seed')
parser.add_argument('--classes', default='bedroom', help='comma separated list of classes for the lsun data set')
parser.add_argument('--accel', action='store_true', default=False, help='enables accelerator')
parser.add_argument('--seed', type=int, help='the bench\'s seed: sets --manualSeed')  # CHANGED: added flag
parser.add_argument('--target', type=float, default=2.0, help='val/fd_pixels for the time to target (the bench)')  # CHANGED: added flag

opt = parser.parse_args()
print(opt)

try:
    os.makedirs(opt.outf)
except OSError:
    pass

if opt.seed is not None:  # CHANGED: instrumentation
    opt.manualSeed = opt.seed
if opt.manualSeed is None:
    opt.manualSeed = random.randint(1, 10000)
print("Random Seed: ", opt.manualSeed)
random.seed(opt.manualSeed)
torch.manual_seed(opt.manualSeed)

cudnn.benchmark = True

if opt.accel and torch.accelerator.is_available():
    device = torch.accelerator.current_accelerator()
else:
    device = torch.device("cpu")

print(f"Using device: {device}")


class _Normalized(torch.utils.data.Dataset):  # CHANGED: the example's images with the author's Normalize((0.5,), (0.5,))
    def __init__(self, images):
        self.images = images

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        image, label = self.images[i]
        return (image - 0.5) / 0.5, label


_splits = load_digits32(size=opt.imageSize)  # CHANGED: was dset.MNIST(root=opt.dataroot, download=True, transform=...)
dataset = _Normalized(_splits["train"])  # CHANGED
nc = 1  # CHANGED: the digits' one channel

assert dataset
dataloader = torch.utils.data.DataLoader(dataset, batch_size=opt.batchSize,
                                         shuffle=True, num_workers=int(opt.workers))

ngpu = int(opt.ngpu)
nz = int(opt.nz)
ngf = int(opt.ngf)
ndf = int(opt.ndf)


# custom weights initialization called on netG and netD
def weights_init(m):
    classname = m.__class__.__name__
    if classname.find('Conv') != -1:
        torch.nn.init.normal_(m.weight, 0.0, 0.02)
    elif classname.find('BatchNorm') != -1:
        torch.nn.init.normal_(m.weight, 1.0, 0.02)
        torch.nn.init.zeros_(m.bias)


class Generator(nn.Module):
    def __init__(self, ngpu):
        super(Generator, self).__init__()
        self.ngpu = ngpu
        self.main = nn.Sequential(
            # CHANGED: the first ConvTranspose2d(nz, ngf * 8, 4, 1, 0), BatchNorm2d(ngf * 8), ReLU dropped (32x32 images)
            # input is Z, going into a convolution
            nn.ConvTranspose2d(     nz, ngf * 4, 4, 1, 0, bias=False),  # CHANGED: was (ngf * 8, ngf * 4, 4, 2, 1)
            nn.BatchNorm2d(ngf * 4),
            nn.ReLU(True),
            # state size. (ngf*4) x 4 x 4
            nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf * 2),
            nn.ReLU(True),
            # state size. (ngf*2) x 8 x 8
            nn.ConvTranspose2d(ngf * 2,     ngf, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf),
            nn.ReLU(True),
            # state size. (ngf) x 16 x 16
            nn.ConvTranspose2d(    ngf,      nc, 4, 2, 1, bias=False),
            nn.Tanh()
            # state size. (nc) x 32 x 32
        )

    def forward(self, input):
        
        if (input.is_cuda or input.is_xpu) and self.ngpu > 1:
            output = nn.parallel.data_parallel(self.main, input, range(self.ngpu))
        else:
            output = self.main(input)
        return output


netG = Generator(ngpu).to(device)
netG.apply(weights_init)
if opt.netG != '':
    netG.load_state_dict(torch.load(opt.netG))
print(netG)


class Discriminator(nn.Module):
    def __init__(self, ngpu):
        super(Discriminator, self).__init__()
        self.ngpu = ngpu
        self.main = nn.Sequential(
            # input is (nc) x 32 x 32
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False),
            nn.LeakyReLU(0.2, inplace=True),
            # state size. (ndf) x 16 x 16
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 2),
            nn.LeakyReLU(0.2, inplace=True),
            # state size. (ndf*2) x 8 x 8
            nn.Conv2d(ndf * 2, ndf * 4, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 4),
            nn.LeakyReLU(0.2, inplace=True),
            # state size. (ndf*4) x 4 x 4
            # CHANGED: Conv2d(ndf * 4, ndf * 8, 4, 2, 1), BatchNorm2d(ndf * 8), LeakyReLU dropped (32x32 images)
            nn.Conv2d(ndf * 4, 1, 4, 1, 0, bias=False),  # CHANGED: was (ndf * 8, 1, 4, 1, 0)
            nn.Sigmoid()
        )

    def forward(self, input):
        if (input.is_cuda or input.is_xpu) and self.ngpu > 1:
            output = nn.parallel.data_parallel(self.main, input, range(self.ngpu))
        else:
            output = self.main(input)

        return output.view(-1, 1).squeeze(1)


netD = Discriminator(ngpu).to(device)
netD.apply(weights_init)
if opt.netD != '':
    netD.load_state_dict(torch.load(opt.netD))
print(netD)

criterion = nn.BCELoss()

fixed_noise = torch.randn(opt.batchSize, nz, 1, 1, device=device)
real_label = 1
fake_label = 0

# setup optimizer
optimizerD = optim.Adam(netD.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))
optimizerG = optim.Adam(netG.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))

if opt.dry_run:
    opt.niter = 1

# CHANGED: instrumentation (to the loop's start): the validation images, normalised as the training ones
_val = torch.stack([image for image, _ in _Normalized(_splits["val"])]).to(device)
_EVALS = []  # (wall_s, epoch, fd_pixels)
_FIRST = []


def _evaluate(epoch):  # CHANGED: instrumentation: what saturate's evaluation computes, the same noise each time
    netG.eval()
    netD.eval()
    with torch.no_grad():
        noise = torch.randn(len(_val), nz, generator=torch.Generator(device).manual_seed(NOISE_SEED), device=device)
        score = fd_pixels(_val, netG(noise.view(len(_val), nz, 1, 1)))
    netG.train()
    netD.train()
    _t = time.time() - T0
    _EVALS.append((_t, epoch + 1, score))
    print(f'BENCH eval t={_t:.3f} epoch={epoch + 1} fd_pixels={score:.4f}', flush=True)


for epoch in range(opt.niter):
    for i, data in enumerate(dataloader, 0):
        ############################
        # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
        ###########################
        # train with real
        netD.zero_grad()
        real_cpu = data[0].to(device)
        batch_size = real_cpu.size(0)
        label = torch.full((batch_size,), real_label,
                           dtype=real_cpu.dtype, device=device)

        output = netD(real_cpu)
        errD_real = criterion(output, label)
        errD_real.backward()
        D_x = output.mean().item()

        # train with fake
        noise = torch.randn(batch_size, nz, 1, 1, device=device)
        fake = netG(noise)
        label.fill_(fake_label)
        output = netD(fake.detach())
        errD_fake = criterion(output, label)
        errD_fake.backward()
        D_G_z1 = output.mean().item()
        errD = errD_real + errD_fake
        optimizerD.step()

        ############################
        # (2) Update G network: maximize log(D(G(z)))
        ###########################
        netG.zero_grad()
        label.fill_(real_label)  # fake labels are real for generator cost
        output = netD(fake)
        errG = criterion(output, label)
        errG.backward()
        D_G_z2 = output.mean().item()
        optimizerG.step()
        if not _FIRST:  # CHANGED: instrumentation
            _FIRST.append(time.time() - T0)
            print(f'BENCH first_step t={_FIRST[0]:.3f}', flush=True)

        print('[%d/%d][%d/%d] Loss_D: %.4f Loss_G: %.4f D(x): %.4f D(G(z)): %.4f / %.4f'
              % (epoch, opt.niter, i, len(dataloader),
                 errD.item(), errG.item(), D_x, D_G_z1, D_G_z2))
        if i % 100 == 0:
            # CHANGED: vutils.save_image(real_cpu, ...) skipped (torchvision)
            fake = netG(fixed_noise)
            # CHANGED: vutils.save_image(fake.detach(), ...) skipped (torchvision)

        if opt.dry_run:
            break
    # do checkpointing
    torch.save(netG.state_dict(), '%s/netG_epoch_%d.pth' % (opt.outf, epoch))
    torch.save(netD.state_dict(), '%s/netD_epoch_%d.pth' % (opt.outf, epoch))
    _evaluate(epoch)  # CHANGED: instrumentation

# CHANGED: instrumentation
_hit = next((e for e in _EVALS if e[2] <= opt.target), None)
print(f'BENCH target fd_pixels<={opt.target} ' + (f't={_hit[0]:.3f} epoch={_hit[1]}' if _hit else 't=nan epoch=none'))
print(f'BENCH final last_fd_pixels={_EVALS[-1][2]:.4f} best_fd_pixels={min(e[2] for e in _EVALS):.4f} '
      f'evals={len(_EVALS)} t_end={time.time() - T0:.3f}', flush=True)
