"""Check what this machine can do for training, by doing it, and suggest settings.

    saturate check-env [--device auto|cpu|cuda] [--no-compile]

Versions (torch, CUDA, cuDNN), each GPU's name, memory and compute capability, bf16 and
TF32 support, the NVIDIA driver (NVML), torch.compile on a tiny function, a mixed-precision
forward and backward, NCCL and gloo, DataLoader worker start-up, and one real training step
on the chosen device. Exits 0 when that training step works (on CPU-only machines too).
"""

from __future__ import annotations

import argparse
import sys

from saturate.diagnostics.doctor import choose_device, run_checks, suggestions


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="saturate check-env", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile check (it takes seconds)")
    args = parser.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("check_env: --device cuda, but no CUDA device is visible", file=sys.stderr)
        return 1
    device = choose_device(args.device)
    print(f"checking training on {device}\n")
    checks = []
    for check in run_checks(device, compile_check=not args.no_compile):
        checks.append(check)
        print(f"  [{'ok' if check.ok else '--'}] {check.name:<24} {check.detail}", flush=True)
    works = all(c.ok for c in checks if c.required)
    print(f"\n{'a training step works' if works else 'a training step FAILED'} on {device}")
    print("suggested settings: " + "; ".join(suggestions(device, checks)))
    print(
        "every path the configuration can take, run here, and the fast path measured: saturate selftest (README: "
        "Self-test)"
    )
    return 0 if works else 1
