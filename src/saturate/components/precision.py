"""Mixed precision, decided once: one object with `autocast()` and a GradScaler that is a
no-op unless the run computes in fp16. The training loop never asks which mode it is in."""

from __future__ import annotations

import inspect
import logging
import weakref
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch

from saturate.config.schema import PrecisionConfig
from saturate.errors import UserError

log = logging.getLogger(__name__)

_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Precision:
    name: str  # resolved mode: fp32, bf16 or fp16
    device_type: str
    dtype: torch.dtype | None  # autocast dtype; None: full precision
    scaler: torch.amp.GradScaler  # enabled for fp16 only
    # optimizers whose steps are hooked (not kept alive)
    _watched: weakref.WeakSet = field(default_factory=weakref.WeakSet, repr=False)
    _ran: bool = field(default=False, repr=False)

    def autocast(self) -> AbstractContextManager:
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.dtype is not None)

    def step(self, optimizer: torch.optim.Optimizer, apply: bool) -> bool:
        """Step the optimizer (if `apply`) through the GradScaler and update the loss scale.
        Returns whether the weights may have moved: with fp16, an overflow makes the scaler
        skip the step (and lower the scale). Known from a hook on the optimizer's step, not
        by reading the scale back; a fused optimizer is always called (it skips on the
        device, told the scaler's found_inf), so its overflowing steps count as moved: no
        host read is spent on knowing (the loss scale is logged as train/loss_scale)."""
        if not self.scaler.is_enabled():
            if apply:
                optimizer.step()
            return apply
        if optimizer not in self._watched:  # GradScaler calls optimizer.step() only when the gradients are finite
            optimizer.register_step_post_hook(self._optimizer_stepped)
            self._watched.add(optimizer)
        self._ran = False
        if apply:
            self.scaler.step(optimizer)  # its one host read: whether any gradient overflowed
        self.scaler.update()  # also after a skipped step: it resets the scaler's per-step state
        return self._ran

    def detached(self) -> Precision:
        """The same policy with a GradScaler of its own, in this one's state: for trial steps
        (the batch-size search) whose updates of the loss scale must not reach the run."""
        scaler = torch.amp.GradScaler(self.device_type, enabled=self.scaler.is_enabled())
        if scaler.is_enabled():
            scaler.load_state_dict(self.scaler.state_dict())
        return Precision(self.name, self.device_type, self.dtype, scaler)

    def _optimizer_stepped(self, optimizer, args, kwargs) -> None:
        self._ran = True


def _cuda_bf16(device: torch.device) -> bool:
    """Native bf16 (Ampere and newer). Pre-Ampere GPUs emulate it, far slower than fp16:
    torch's default answer counts emulation, so it is asked for native support only. torch
    2.3 has no such question (the keyword came in 2.4): there native is compute capability
    8.0 and newer, torch 2.4's own test."""
    if device.type != "cuda":
        return False
    if "including_emulation" in inspect.signature(torch.cuda.is_bf16_supported).parameters:
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return torch.cuda.get_device_capability(device)[0] >= 8


def native_bf16(device: torch.device) -> bool:
    """bf16 kernels that are faster than fp32 on `device`: a GPU's own (not emulated), a CPU's
    AVX512-BF16 or AMX."""
    return _cuda_bf16(device) if device.type == "cuda" else not emulated("bf16", device)


def resolve_mode(mode: str, device: torch.device) -> str:
    """auto: bf16 on GPUs that have it, fp16 on older GPUs, fp32 on CPU.
    amp: the same on GPUs, and bf16 on CPU (CPU autocast computes in bf16)."""
    if mode in ("auto", "amp"):
        if device.type == "cuda":
            return "bf16" if _cuda_bf16(device) else "fp16"
        return "bf16" if mode == "amp" else "fp32"
    if mode == "bf16" and device.type == "cuda" and not _cuda_bf16(device):
        raise UserError(
            f"precision.mode='bf16': {torch.cuda.get_device_name(device)} has no native bf16 (only emulated, slower "
            "than fp16); use precision=fp16 or precision=auto"
        )
    return mode


def emulated(name: str, device: torch.device) -> bool:
    """Reduced precision on a CPU without native bf16/fp16 kernels: correct, but slower than fp32."""
    return device.type == "cpu" and name != "fp32" and not torch.ops.mkldnn._is_mkldnn_bf16_supported()


def setup_precision(cfg: PrecisionConfig, device: torch.device) -> Precision:
    name = resolve_mode(cfg.mode, device)
    if emulated(name, device):
        log.warning(
            "precision %s on a CPU without native bf16/fp16 kernels (no AVX512-BF16 or AMX): expect it to be "
            "much slower than fp32 here; precision=auto picks fp32 on CPUs",
            name,
        )
    scaler = torch.amp.GradScaler(device.type, init_scale=cfg.init_scale, enabled=name == "fp16")
    log.info("precision: %s (asked: %s)%s", name, cfg.mode, " with GradScaler" if scaler.is_enabled() else "")
    return Precision(name, device.type, _DTYPES[name], scaler)
