"""Which operators a model runs, for advice that depends on them: a 2-D convolution (what the
channels-last layout changes) and an operator autocast computes in lower precision (what
precision=amp changes). Read from one forward on two samples, after training."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

LOWER = (torch.bfloat16, torch.float16)
CONVOLUTIONS = ("aten.convolution", "aten._convolution", "aten.mkldnn_convolution", "aten.cudnn_convolution")


class Operators(TorchDispatchMode):
    """Records, for the operators run inside it (below autograd and autocast: the ones that
    compute), whether one was a convolution of a 4-D input (N, C, H, W: channels_last applies)
    and whether one computed on a bf16 or fp16 tensor (in an fp32 model: autocast lowered it,
    there is a kernel for it)."""

    def __init__(self):
        super().__init__()
        self.convolves = False
        self.lowered = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        name = str(func.overloadpacket)
        if name in CONVOLUTIONS and tensors and tensors[0].ndim == 4:
            self.convolves = True
        if name != "aten._to_copy" and any(t.dtype in LOWER for t in tensors):
            self.lowered = True
        return func(*args, **kwargs)
