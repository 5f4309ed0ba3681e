"""Resource figures for the run: peak memory of the training device."""

from __future__ import annotations

import resource
import sys

import torch


def peak_memory(device: torch.device):
    """A callable giving the peak memory (MB) since the run started: allocated device memory
    on CUDA, the process's peak resident set on CPU."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return lambda: torch.cuda.max_memory_allocated(device) / 2**20
    scale = 2**20 if sys.platform == "darwin" else 2**10  # ru_maxrss: bytes on macOS, KiB on Linux
    return lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / scale


def device_memory_mb(device: torch.device) -> float:
    """Total memory of the training device: the GPU's, or the host's for the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 2**20
    import psutil

    return psutil.virtual_memory().total / 2**20
