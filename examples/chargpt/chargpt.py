"""A character-level GPT, trained as `karpathy/nanoGPT`'s train.py trains its shakespeare_char
config (MIT, (c) 2022 Andrej Karpathy; model.py copied below). What its loop does, and where
it lives here:

- data/shakespeare_char/prepare.py: the text's characters as the vocabulary, the first 90% of
  the text to train on, the rest to validate on
                                        -> `load_chars`: Python's own documentation topics
                                           (`pydoc_data.topics`, sorted by name, joined: no
                                           download) split the same way
- get_batch: batch_size windows of block_size characters at random offsets, the next
  characters as targets             -> `CharWindows`: one sample per offset (every window
                                           get_batch can draw), shuffled (loader.order
                                           default)
- `logits, loss = model(X, Y)`       -> task=classification with task.model_loss=1 (the model
                                           returns its own loss, the targets passed to it as
                                           its last argument) and task.output_key=0 (the
                                           logits (B, T, V): a class per position);
                                           task.top_k=0 and task.metrics: acc null: no
                                           val/top5 and no val/acc, which the author's loop
                                           does not compute (estimate_loss: the loss only)
- max_iters, eval_interval, estimate_loss over eval_iters random batches of train and val
                                        -> trainer.max_steps, trainer.eval_every,
                                           trainer.limit_val_batches with
                                           trainer.limit_val_random=true and
                                           trainer.train_est_batches (train_est/loss)
- AdamW (betas 0.9, 0.99, weight decay 0.1 on the 2-D weights only), get_lr: linear warm-up
  `lr * (it + 1) / (warmup_iters + 1)`, cosine to min_lr = lr / 10 at lr_decay_iters
                                        -> optim=adamw, optim.warmup_steps,
                                           optim.warmup_start_factor=1/(warmup_iters+1),
                                           optim.decay_steps, optim.min_lr_ratio=0.1
                                           (saturate leaves biases and norms undecayed too)
- clip_grad_norm_(model.parameters(), 1.0)   -> trainer.grad_clip=1.0

Sizes scaled to a 2-core CPU: 2 layers, 2 heads, 64 wide, windows of 64, batches of 32, dropout
0, 1500 iterations (warm-up 100, the cosine's end at 1500), an evaluation every 150 over 20
batches of each split (the config's 6, 6, 384, 256, 64, 0.2, 5000, 100, 250 and 200).
Target (scripts/bench_examples.py): val/loss <= 1.75 (cross-entropy per character, nats), met by
the reference between iterations 900 and 1050 with seeds 1-3.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.utils.data import Dataset


def corpus() -> str:
    """Python's documentation topics (shipped with every Python), sorted by name and joined:
    about 465,000 characters of English, the same on every machine with the same Python."""
    from pydoc_data.topics import topics

    return "\n".join(topics[name] for name in sorted(topics))


class CharWindows(Dataset):
    """(block_size characters from offset i, the block_size characters after each): every
    window nanoGPT's get_batch can draw from this split (offsets 0 to len - block_size - 1)."""

    def __init__(self, data: torch.Tensor, block_size: int, chars: list[str]):
        self.data, self.block_size, self.classes = data, block_size, chars

    def __len__(self) -> int:
        return len(self.data) - self.block_size

    def __getitem__(self, i: int):
        return self.data[i : i + self.block_size], self.data[i + 1 : i + 1 + self.block_size]


def encode_chars(text: str | None = None) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """prepare.py's steps: the sorted characters as the vocabulary, the text as their indices
    (int64), the first 90% to train on and the rest to validate on."""
    text = corpus() if text is None else text
    chars = sorted(set(text))
    stoi = {ch: i for i, ch in enumerate(chars)}
    ids = torch.tensor([stoi[c] for c in text], dtype=torch.int64)
    n = int(len(ids) * 0.9)
    return chars, ids[:n], ids[n:]


def load_chars(block_size: int = 64) -> dict:
    chars, train, val = encode_chars()
    return {"train": CharWindows(train, block_size, chars), "val": CharWindows(val, block_size, chars)}


# ---------------------------------------------------------------- nanoGPT's model.py (MIT)
# Copied from karpathy/nanoGPT at 3adf61e (model.py last changed at dc81cb3), trimmed of what
# the example does not use: the non-flash attention path (torch >= 2.0 always has
# scaled_dot_product_attention), from_pretrained and generate. Everything else as written.


class LayerNorm(nn.Module):
    """LayerNorm but with an optional bias. PyTorch doesn't support simply bias=False"""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        # key, query, value projections for all heads, but in a batch
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        # output projection
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        # regularization
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout

    def forward(self, x):
        B, T, C = x.size()  # batch size, sequence length, embedding dimensionality (n_embd)

        # calculate query, key, values for all heads in batch and move head forward to be the batch dim
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)

        # causal self-attention; Self-attend: (B, nh, T, hs) x (B, nh, hs, T) -> (B, nh, T, T)
        y = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble all head outputs side by side

        # output projection
        y = self.resid_dropout(self.c_proj(y))
        return y


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        x = self.c_fc(x)
        x = self.gelu(x)
        x = self.c_proj(x)
        x = self.dropout(x)
        return x


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304  # GPT-2 vocab_size of 50257, padded up to nearest multiple of 64 for efficiency
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # True: bias in Linears and LayerNorms, like GPT-2. False: a bit better and faster


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        assert config.vocab_size is not None
        assert config.block_size is not None
        self.config = config

        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # with weight tying when using torch.compile() some warnings get generated:
        # "UserWarning: functional_call was passed multiple values for tied weights.
        # This behavior is deprecated and will be an error in future versions"
        # not 100% sure what this is, so far seems to be harmless. TODO investigate
        self.transformer.wte.weight = self.lm_head.weight  # https://paperswithcode.com/method/weight-tying

        # init all weights
        self.apply(self._init_weights)
        # apply special scaled init to the residual projections, per GPT-2 paper
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

        # report number of parameters
        print("number of parameters: %.2fM" % (self.get_num_params() / 1e6,))  # noqa: UP031 (as written)

    def get_num_params(self, non_embedding=True):
        """
        Return the number of parameters in the model.
        For non-embedding count (default), the position embeddings get subtracted.
        The token embeddings would too, except due to the parameter sharing these
        params are actually used as weights in the final layer, so we include them.
        """
        n_params = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n_params -= self.transformer.wpe.weight.numel()
        return n_params

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        device = idx.device
        b, t = idx.size()
        assert t <= self.config.block_size, (
            f"Cannot forward sequence of length {t}, block size is only {self.config.block_size}"
        )
        pos = torch.arange(0, t, dtype=torch.long, device=device)  # shape (t)

        # forward the GPT model itself
        tok_emb = self.transformer.wte(idx)  # token embeddings of shape (b, t, n_embd)
        pos_emb = self.transformer.wpe(pos)  # position embeddings of shape (t, n_embd)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)

        if targets is not None:
            # if we are given some desired targets also calculate the loss
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            # inference-time mini-optimization: only forward the lm_head on the very last position
            logits = self.lm_head(x[:, [-1], :])  # note: using list [-1] to preserve the time dim
            loss = None

        return logits, loss

    def crop_block_size(self, block_size):
        # model surgery to decrease the block size if necessary
        # e.g. we may load the GPT2 pretrained model checkpoint (block size 1024)
        # but want to use a smaller block size for some smaller, simpler model
        assert block_size <= self.config.block_size
        self.config.block_size = block_size
        self.transformer.wpe.weight = nn.Parameter(self.transformer.wpe.weight[:block_size])
        for block in self.transformer.h:
            if hasattr(block.attn, "bias"):
                block.attn.bias = block.attn.bias[:, :, :block_size, :block_size]

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        # start with all of the candidate parameters
        param_dict = {pn: p for pn, p in self.named_parameters()}
        # filter out those that do not require grad
        param_dict = {pn: p for pn, p in param_dict.items() if p.requires_grad}
        # create optim groups. Any parameters that is 2D will be weight decayed, otherwise no.
        # i.e. all weight tensors in matmuls + embeddings decay, all biases and layernorms don't.
        decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
        nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
        optim_groups = [
            {"params": decay_params, "weight_decay": weight_decay},
            {"params": nodecay_params, "weight_decay": 0.0},
        ]
        num_decay_params = sum(p.numel() for p in decay_params)
        num_nodecay_params = sum(p.numel() for p in nodecay_params)
        print(f"num decayed parameter tensors: {len(decay_params)}, with {num_decay_params:,} parameters")
        print(f"num non-decayed parameter tensors: {len(nodecay_params)}, with {num_nodecay_params:,} parameters")
        # Create AdamW optimizer and use the fused version if it is available
        fused_available = "fused" in inspect.signature(torch.optim.AdamW).parameters
        use_fused = fused_available and device_type == "cuda"
        extra_args = dict(fused=True) if use_fused else dict()
        optimizer = torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas, **extra_args)
        print(f"using fused AdamW: {use_fused}")

        return optimizer

    def estimate_mfu(self, fwdbwd_per_iter, dt):
        """estimate model flops utilization (MFU) in units of A100 bfloat16 peak FLOPS"""
        # first estimate the number of flops we do per iteration.
        # see PaLM paper Appendix B as ref: https://arxiv.org/abs/2204.02311
        N = self.get_num_params()
        cfg = self.config
        L, H, Q, T = cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head, cfg.block_size
        flops_per_token = 6 * N + 12 * L * H * Q * T
        flops_per_fwdbwd = flops_per_token * T
        flops_per_iter = flops_per_fwdbwd * fwdbwd_per_iter
        # express our flops throughput as ratio of A100 bfloat16 peak flops
        flops_achieved = flops_per_iter * (1.0 / dt)  # per second
        flops_promised = 312e12  # A100 GPU bfloat16 peak flops is 312 TFLOPS
        mfu = flops_achieved / flops_promised
        return mfu


def char_gpt(
    vocab_size: int, block_size: int = 64, n_layer: int = 2, n_head: int = 2, n_embd: int = 64, dropout: float = 0.0
) -> GPT:
    """train.py's model_args, as a factory the config can name: GPT(GPTConfig(...)) with the
    data's vocabulary and bias off (train.py's default)."""
    return GPT(GPTConfig(block_size, vocab_size, n_layer, n_head, n_embd, dropout, bias=False))
