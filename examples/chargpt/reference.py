# ruff: noqa
# fmt: off
"""
Reference loop for saturate's `chargpt` example: nanoGPT's train.py with its shakespeare_char
config, the data swapped for the example's and the sizes scaled down.

PIN
  Repo    : https://github.com/karpathy/nanoGPT   (MIT licence, (c) 2022 Andrej Karpathy)
  Commit  : 3adf61e154c3fe3fca428ad6bc3818b27a3b8291 (train.py, model.py last changed at dc81cb3)
  Paths   : train.py (the loop), config/train_shakespeare_char.py (its values),
            configurator.py (inlined), data/shakespeare_char/prepare.py (the split),
            model.py (imported from examples/chargpt/chargpt.py, where it is copied)

CHANGED (and why; each line is marked "# CHANGED" below)
  1. Data swap: prepare.py's tiny Shakespeare -> the example's corpus (Python's documentation
     topics) through `examples.chargpt.chargpt.encode_chars()`, the same steps as prepare.py
     (sorted characters, the first 90% to train on); get_batch reads the two splits from
     memory as uint16 arrays instead of np.memmap over train.bin / val.bin, and meta.pkl's
     vocab_size is the example's.
  2. Sizes, as config values (config/train_shakespeare_char.py's in brackets): n_layer 2 (6),
     n_head 2 (6), n_embd 64 (384), block_size 64 (256), batch_size 32 (64), dropout 0.0 (0.2),
     max_iters = lr_decay_iters 1500 (5000), eval_interval 150 (250), eval_iters 20 (200),
     log_interval 150 (10); warmup_iters 100, learning_rate 1e-3, min_lr 1e-4, beta2 0.99,
     grad_clip 1.0, weight_decay 0.1 kept. device 'cpu', compile False (the config's own
     advice "on macbook"), dtype 'float32'.
  3. configurator.py inlined (it is exec'd from the working directory), taking `--key value`
     as well as `--key=value`; two config values added: `seed` (torch.manual_seed(1337 +
     seed_offset) -> seed + seed_offset, default 1337) and `target` (the bench's).
  4. Instrumentation (no effect on training): the time since process start of the first
     optimizer step, of each estimate_loss with its losses, and at the end the final figures,
     as `BENCH ...` lines.
  5. init_from 'resume' and 'gpt2*' (a checkpoint, GPT-2's weights) are not ported: they raise.
     torch.cuda.amp.GradScaler -> torch.amp.GradScaler (the former is deprecated; disabled
     here, as in float32 the author's is). The DDP and wandb branches are kept as written
     (never taken here).

Run (from the repository root, so that `examples.chargpt` imports):
  PYTHONPATH=. python examples/chargpt/reference.py [--seed 1337] [--target 1.75] [--max_iters=1500]

LICENCE (of the copied code; the CHANGED and instrumentation lines are saturate's)
  MIT License

  Copyright (c) 2022 Andrej Karpathy

  Permission is hereby granted, free of charge, to any person obtaining a copy
  of this software and associated documentation files (the "Software"), to deal
  in the Software without restriction, including without limitation the rights
  to use, copy, modify, merge, publish, distribute, sublicense, and/or sell
  copies of the Software, and to permit persons to whom the Software is
  furnished to do so, subject to the following conditions:

  The above copyright notice and this permission notice shall be included in all
  copies or substantial portions of the Software.

  THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR
  IMPLIED, INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY,
  FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE
  AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER
  LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM,
  OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE
  SOFTWARE.
"""
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

import math
import pickle
from contextlib import nullcontext

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed import init_process_group, destroy_process_group

from examples.chargpt.chargpt import GPTConfig, GPT, encode_chars  # CHANGED: was `from model import GPTConfig, GPT`

# -----------------------------------------------------------------------------
# default config values designed to train a gpt2 (124M) on OpenWebText
# CHANGED: the values of config/train_shakespeare_char.py, scaled down (see the header)
# I/O
out_dir = 'out-shakespeare-char'
eval_interval = 150  # CHANGED: 250
log_interval = 150  # CHANGED: 10
eval_iters = 20  # CHANGED: 200
eval_only = False # if True, script exits right after the first eval
always_save_checkpoint = False # we expect to overfit on this small dataset, so only save when val improves
init_from = 'scratch' # 'scratch' or 'resume' or 'gpt2*'
# wandb logging
wandb_log = False # disabled by default
wandb_project = 'shakespeare-char'
wandb_run_name = 'mini-gpt'
# data
dataset = 'shakespeare_char'
gradient_accumulation_steps = 1 # used to simulate larger batch sizes
batch_size = 32  # CHANGED: 64
block_size = 64  # CHANGED: 256
# model
n_layer = 2  # CHANGED: 6
n_head = 2  # CHANGED: 6
n_embd = 64  # CHANGED: 384
dropout = 0.0  # CHANGED: 0.2
bias = False # do we use bias inside LayerNorm and Linear layers?
# adamw optimizer
learning_rate = 1e-3 # with baby networks can afford to go a bit higher
max_iters = 1500  # CHANGED: 5000
weight_decay = 1e-1
beta1 = 0.9
beta2 = 0.99 # make a bit bigger because number of tokens per iter is small
grad_clip = 1.0 # clip gradients at this value, or disable if == 0.0
# learning rate decay settings
decay_lr = True # whether to decay the learning rate
warmup_iters = 100 # not super necessary potentially
lr_decay_iters = 1500  # CHANGED: 5000 (make equal to max_iters usually)
min_lr = 1e-4 # learning_rate / 10 usually
# DDP settings
backend = 'nccl' # 'nccl', 'gloo', etc.
# system
device = 'cpu'  # CHANGED: 'cuda'
dtype = 'float32'  # CHANGED: 'bfloat16' if available else 'float16'
compile = False  # CHANGED: True
seed = 1337  # CHANGED: added (was the literal in torch.manual_seed(1337 + seed_offset))
target = 1.75  # CHANGED: added, the bench's target (val loss, lower is better)
# -----------------------------------------------------------------------------
config_keys = [k for k,v in globals().items() if not k.startswith('_') and isinstance(v, (int, float, bool, str))]
# CHANGED: configurator.py inlined (was `exec(open('configurator.py').read())`), `--key value` joined to `--key=value`
import sys
from ast import literal_eval
_argv, _i = [], 1
while _i < len(sys.argv):
    if sys.argv[_i].startswith('--') and '=' not in sys.argv[_i] and _i + 1 < len(sys.argv):
        _argv.append(sys.argv[_i] + '=' + sys.argv[_i + 1]); _i += 2
    else:
        _argv.append(sys.argv[_i]); _i += 1
for arg in _argv:
    # assume it's a --key=value argument
    assert arg.startswith('--')
    key, val = arg.split('=')
    key = key[2:]
    if key in globals():
        try:
            # attempt to eval it it (e.g. if bool, number, or etc)
            attempt = literal_eval(val)
        except (SyntaxError, ValueError):
            # if that goes wrong, just use the string
            attempt = val
        if isinstance(globals()[key], float) and isinstance(attempt, int):  # CHANGED: --target 2 is a float
            attempt = float(attempt)
        # ensure the types match ok
        assert type(attempt) == type(globals()[key])
        # cross fingers
        print(f"Overriding: {key} = {attempt}")
        globals()[key] = attempt
    else:
        raise ValueError(f"Unknown config key: {key}")
config = {k: globals()[k] for k in config_keys} # will be useful for logging
# -----------------------------------------------------------------------------

# various inits, derived attributes, I/O setup
ddp = int(os.environ.get('RANK', -1)) != -1 # is this a ddp run?
if ddp:
    init_process_group(backend=backend)
    ddp_rank = int(os.environ['RANK'])
    ddp_local_rank = int(os.environ['LOCAL_RANK'])
    ddp_world_size = int(os.environ['WORLD_SIZE'])
    device = f'cuda:{ddp_local_rank}'
    torch.cuda.set_device(device)
    master_process = ddp_rank == 0 # this process will do logging, checkpointing etc.
    seed_offset = ddp_rank # each process gets a different seed
    # world_size number of processes will be training simultaneously, so we can scale
    # down the desired gradient accumulation iterations per process proportionally
    assert gradient_accumulation_steps % ddp_world_size == 0
    gradient_accumulation_steps //= ddp_world_size
else:
    # if not ddp, we are running on a single gpu, and one process
    master_process = True
    seed_offset = 0
    ddp_world_size = 1
tokens_per_iter = gradient_accumulation_steps * ddp_world_size * batch_size * block_size
print(f"tokens per iteration will be: {tokens_per_iter:,}")

if master_process:
    os.makedirs(out_dir, exist_ok=True)
torch.manual_seed(seed + seed_offset)  # CHANGED: 1337 + seed_offset
torch.backends.cuda.matmul.allow_tf32 = True # allow tf32 on matmul
torch.backends.cudnn.allow_tf32 = True # allow tf32 on cudnn
device_type = 'cuda' if 'cuda' in device else 'cpu' # for later use in torch.autocast
# note: float16 data type will automatically use a GradScaler
ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype]
ctx = nullcontext() if device_type == 'cpu' else torch.amp.autocast(device_type=device_type, dtype=ptdtype)

# poor man's data loader
_chars, _train_ids, _val_ids = encode_chars()  # CHANGED: the example's corpus, split as prepare.py splits
_splits = {'train': _train_ids.numpy().astype(np.uint16), 'val': _val_ids.numpy().astype(np.uint16)}  # CHANGED
def get_batch(split):
    # CHANGED: the split from memory (was np.memmap over data_dir's train.bin / val.bin)
    data = _splits['train'] if split == 'train' else _splits['val']
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy((data[i:i+block_size]).astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy((data[i+1:i+1+block_size]).astype(np.int64)) for i in ix])
    if device_type == 'cuda':
        # pin arrays x,y, which allows us to move them to GPU asynchronously (non_blocking=True)
        x, y = x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    else:
        x, y = x.to(device), y.to(device)
    return x, y

# init these up here, can override if init_from='resume' (i.e. from a checkpoint)
iter_num = 0
best_val_loss = 1e9

# attempt to derive vocab_size from the dataset
meta_vocab_size = len(_chars)  # CHANGED: was read from data_dir's meta.pkl
print(f"found vocab_size = {meta_vocab_size}")

# model init
model_args = dict(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size,
                  bias=bias, vocab_size=None, dropout=dropout) # start with model_args from command line
if init_from == 'scratch':
    # init a new model from scratch
    print("Initializing a new model from scratch")
    # determine the vocab size we'll use for from-scratch training
    if meta_vocab_size is None:
        print("defaulting to vocab_size of GPT-2 to 50304 (50257 rounded up for efficiency)")
    model_args['vocab_size'] = meta_vocab_size if meta_vocab_size is not None else 50304
    gptconf = GPTConfig(**model_args)
    model = GPT(gptconf)
else:
    raise NotImplementedError('init_from resume / gpt2* is not ported')  # CHANGED
# crop down the model block size if desired, using model surgery
if block_size < model.config.block_size:
    model.crop_block_size(block_size)
    model_args['block_size'] = block_size # so that the checkpoint will have the right value
model.to(device)

# initialize a GradScaler. If enabled=False scaler is a no-op
scaler = torch.amp.GradScaler(enabled=(dtype == 'float16'))  # CHANGED: torch.cuda.amp.GradScaler (deprecated)

# optimizer
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)
checkpoint = None # free up memory

# compile the model
if compile:
    print("compiling the model... (takes a ~minute)")
    unoptimized_model = model
    model = torch.compile(model) # requires PyTorch 2.0

# wrap model into DDP container
if ddp:
    model = DDP(model, device_ids=[ddp_local_rank])

# helps estimate an arbitrarily accurate loss over either split using many batches
@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ['train', 'val']:
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split)
            with ctx:
                logits, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean()
    model.train()
    return out

# learning rate decay scheduler (cosine with warmup)
def get_lr(it):
    # 1) linear warmup for warmup_iters steps
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    # 2) if it > lr_decay_iters, return min learning rate
    if it > lr_decay_iters:
        return min_lr
    # 3) in between, use cosine decay down to min learning rate
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    assert 0 <= decay_ratio <= 1
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio)) # coeff ranges 0..1
    return min_lr + coeff * (learning_rate - min_lr)

# logging
if wandb_log and master_process:
    import wandb
    wandb.init(project=wandb_project, name=wandb_run_name, config=config)

_EVALS = []  # CHANGED: instrumentation, (wall_s, iter, train loss, val loss)

# training loop
X, Y = get_batch('train') # fetch the very first batch
t0 = time.time()
local_iter_num = 0 # number of iterations in the lifetime of this process
raw_model = model.module if ddp else model # unwrap DDP container if needed
running_mfu = -1.0
while True:

    # determine and set the learning rate for this iteration
    lr = get_lr(iter_num) if decay_lr else learning_rate
    for param_group in optimizer.param_groups:
        param_group['lr'] = lr

    # evaluate the loss on train/val sets and write checkpoints
    if iter_num % eval_interval == 0 and master_process:
        losses = estimate_loss()
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        # CHANGED: instrumentation (next 4 lines)
        _t = time.time() - T0
        _EVALS.append((_t, iter_num, float(losses['train']), float(losses['val'])))
        print(f"BENCH eval t={_t:.3f} step={iter_num} train_loss={float(losses['train']):.5f} "
              f"val_loss={float(losses['val']):.5f} lr={lr:.3g}", flush=True)
        if wandb_log:
            wandb.log({
                "iter": iter_num,
                "train/loss": losses['train'],
                "val/loss": losses['val'],
                "lr": lr,
                "mfu": running_mfu*100, # convert to percentage
            })
        if losses['val'] < best_val_loss or always_save_checkpoint:
            best_val_loss = losses['val']
            if iter_num > 0:
                checkpoint = {
                    'model': raw_model.state_dict(),
                    'optimizer': optimizer.state_dict(),
                    'model_args': model_args,
                    'iter_num': iter_num,
                    'best_val_loss': best_val_loss,
                    'config': config,
                }
                print(f"saving checkpoint to {out_dir}")
                torch.save(checkpoint, os.path.join(out_dir, 'ckpt.pt'))
    if iter_num == 0 and eval_only:
        break

    # forward backward update, with optional gradient accumulation to simulate larger batch size
    # and using the GradScaler if data type is float16
    for micro_step in range(gradient_accumulation_steps):
        if ddp:
            # in DDP training we only need to sync gradients at the last micro step.
            # the official way to do this is with model.no_sync() context manager, but
            # I really dislike that this bloats the code and forces us to repeat code
            # looking at the source of that context manager, it just toggles this variable
            model.require_backward_grad_sync = (micro_step == gradient_accumulation_steps - 1)
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps # scale the loss to account for gradient accumulation
        # immediately async prefetch next batch while model is doing the forward pass on the GPU
        X, Y = get_batch('train')
        # backward pass, with gradient scaling if training in fp16
        scaler.scale(loss).backward()
    # clip the gradient
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    # step the optimizer and scaler if training in fp16
    scaler.step(optimizer)
    scaler.update()
    # flush the gradients as soon as we can, no need for this memory anymore
    optimizer.zero_grad(set_to_none=True)
    if local_iter_num == 0:  # CHANGED: instrumentation
        print(f'BENCH first_step t={time.time() - T0:.3f}', flush=True)

    # timing and logging
    t1 = time.time()
    dt = t1 - t0
    t0 = t1
    if iter_num % log_interval == 0 and master_process:
        # get loss as float. note: this is a CPU-GPU sync point
        # scale up to undo the division above, approximating the true total loss (exact would have been a sum)
        lossf = loss.item() * gradient_accumulation_steps
        if local_iter_num >= 5: # let the training loop settle a bit
            mfu = raw_model.estimate_mfu(batch_size * gradient_accumulation_steps, dt)
            running_mfu = mfu if running_mfu == -1.0 else 0.9*running_mfu + 0.1*mfu
        print(f"iter {iter_num}: loss {lossf:.4f}, time {dt*1000:.2f}ms, mfu {running_mfu*100:.2f}%")
    iter_num += 1
    local_iter_num += 1

    # termination conditions
    if iter_num > max_iters:
        break

if ddp:
    destroy_process_group()

# CHANGED: instrumentation
_hit = next((e for e in _EVALS if e[3] <= target), None)
print(f'BENCH target val_loss<={target} ' + (f't={_hit[0]:.3f} step={_hit[1]}' if _hit else 't=nan step=none'))
print(f'BENCH final last_val_loss={_EVALS[-1][3]:.5f} best_val_loss={min(e[3] for e in _EVALS):.5f} '
      f'evals={len(_EVALS)} t_end={time.time() - T0:.3f}', flush=True)
