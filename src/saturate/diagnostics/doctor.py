"""The environment doctor behind saturate check-env: what this machine can do for
training, checked by doing it, and the settings it suggests."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from saturate.components.precision import native_bf16
from saturate.diagnostics.environment import cpu_name, nvidia_driver


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    required: bool = False  # the exit status depends on these


def _attempt(name: str, fn, required: bool = False) -> Check:
    start = time.perf_counter()
    try:
        detail = fn()
        return Check(
            name,
            True,
            f"{detail} ({time.perf_counter() - start:.1f}s)" if detail else f"ok ({time.perf_counter() - start:.1f}s)",
            required,
        )
    except Exception as e:  # noqa: BLE001 (a check that cannot run says why)
        return Check(
            name, False, f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}", required
        )


def choose_device(asked: str) -> torch.device:
    if asked == "cuda" or (asked == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", 0)
    return torch.device("cpu")


def amp_dtype(device: torch.device) -> torch.dtype:
    if device.type == "cuda":
        return torch.bfloat16 if native_bf16(device) else torch.float16
    return torch.bfloat16


def run_checks(device: torch.device, *, compile_check: bool = True) -> Iterator[Check]:
    yield Check(
        "versions",
        True,
        f"torch {torch.__version__}, CUDA {torch.version.cuda or '-'}, "
        f"cuDNN {torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else '-'}",
    )
    yield Check("cpu", True, f"{cpu_name()}, {torch.get_num_threads()} torch threads")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            yield Check(
                f"cuda:{i}", True, f"{p.name}, {p.total_memory / 2**30:.1f} GiB, compute capability {p.major}.{p.minor}"
            )
    else:
        yield Check("cuda", False, "no CUDA device visible")
    driver = nvidia_driver()
    yield Check(
        "nvml",
        driver is not None,
        f"driver {driver}" if driver else "NVML unavailable (no NVIDIA driver): no GPU monitoring",
    )
    cuda = device.type == "cuda"
    bf16 = native_bf16(device)  # torch.cuda.is_bf16_supported() alone counts a pre-Ampere GPU's emulation
    yield Check(
        "bf16",
        bf16,
        "supported"
        if bf16
        else "no native bf16 kernels here (emulated at best): bf16 would be slow"
        + ("; precision=auto picks fp16" if cuda and not bf16 else ""),
    )
    tf32 = cuda and torch.cuda.get_device_capability(device)[0] >= 8
    yield Check("tf32", tf32, "supported (Ampere or newer)" if tf32 else "not available (needs an Ampere or newer GPU)")
    if compile_check:
        yield _attempt("torch.compile", lambda: _compile(device))
    yield _attempt("mixed precision", lambda: _autocast(device))
    import torch.distributed as dist

    yield Check(
        "nccl",
        dist.is_nccl_available(),
        "available" if dist.is_nccl_available() else "not available (multi-GPU DDP needs it)",
    )
    yield Check("gloo", dist.is_gloo_available(), "available" if dist.is_gloo_available() else "not available")
    yield _attempt("dataloader workers", _workers)
    yield _attempt(f"training step on {device}", lambda: _train_step(device), required=True)


def _compile(device: torch.device) -> str:
    fn = torch.compile(lambda x: torch.sin(x) * 2 + 1)
    x = torch.randn(64, device=device)
    torch.testing.assert_close(fn(x), torch.sin(x) * 2 + 1)
    return "compiles and runs"


def _autocast(device: torch.device) -> str:
    dtype = amp_dtype(device)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.LazyLinear(10)
    ).to(device)
    with torch.autocast(device.type, dtype=dtype):
        loss = model(torch.randn(4, 3, 16, 16, device=device)).float().square().mean()
    loss.backward()
    return f"{dtype} autocast forward and backward"


def _workers() -> str:
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(torch.arange(64.0)), batch_size=8, num_workers=2)
    assert sum(len(b[0]) for b in loader) == 64
    return "2 worker processes started and delivered"


def _train_step(device: torch.device) -> str:
    from saturate.models import SmallCNN

    model = SmallCNN(3, 10).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 3, 32, 32, device=device), torch.randint(0, 10, (32,), device=device)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    value = loss.item()
    assert torch.isfinite(torch.tensor(value)), "non-finite loss"
    return f"small_cnn forward, backward and SGD step, loss {value:.3f}"


def suggestions(device: torch.device, checks: list[Check]) -> list[str]:
    ok = {c.name: c.ok for c in checks}
    if device.type == "cuda":
        out = ["precision=amp" if ok.get("bf16") or ok.get("mixed precision") else "precision=fp32"]
        if ok.get("torch.compile"):
            out.append("trainer.compile=true")
        out += [
            "trainer.channels_last=true",
            "loader=fast (or loader=resident when the data fits on the GPU)",
            "augmentation=gpu",
        ]
        if ok.get("tf32"):
            out.append("device.tf32=true (the default)")
        return out
    out = ["precision=auto (fp32 here)" if not ok.get("bf16") else "precision=amp"]
    out += ["augmentation=gpu (batched on the CPU beats per-sample workers)"]  # in-memory data: resident already
    return out
