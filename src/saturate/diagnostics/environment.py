"""The run's environment fingerprint: enough about the machine and the settings that decide
speed that two numbers from different machines are never confused. Stored in metrics.json,
TensorBoard text and every checkpoint."""

from __future__ import annotations

import functools
import os
import platform
import subprocess
from pathlib import Path

import torch


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def nvidia_driver() -> str | None:
    """The NVIDIA driver version through NVML, or None without one."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
            return version.decode() if isinstance(version, bytes) else version
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 (no library, no driver, no GPU: all mean "none")
        return None


@functools.cache
def git_commit() -> str | None:
    """The commit of the saturate source in use, with "-dirty" if it has local changes;
    None when it is not a git checkout (an installed wheel)."""
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=True
        )
        dirty = subprocess.run(
            ["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return commit.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def fingerprint(
    device: torch.device, *, precision: str, compile: bool, channels_last: bool, world_size: int = 1
) -> dict:
    cuda = device.type == "cuda"
    return {
        "device": torch.cuda.get_device_name(device) if cuda else f"cpu: {cpu_name()}",
        "device_index": (device.index if device.index is not None else torch.cuda.current_device()) if cuda else None,
        "devices_visible": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
        "driver": nvidia_driver(),
        "torch": str(torch.__version__),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "python": platform.python_version(),
        "os": platform.platform(),
        "precision": precision,
        "tf32": torch.backends.cuda.matmul.allow_tf32 if cuda else False,
        "cudnn_benchmark": torch.backends.cudnn.benchmark if cuda else False,
        "compile": compile,
        "channels_last": channels_last,
        "world_size": world_size,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "git_commit": git_commit(),
    }
