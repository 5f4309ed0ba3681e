"""One rank's NCCL check, run by `saturate selftest` through torchrun: the process group
starts on this GPU and an all_reduce there gives the right sum."""

from __future__ import annotations

import torch
import torch.distributed as dist


def main() -> None:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    x = torch.full((1024,), float(dist.get_rank() + 1), device=device)
    dist.all_reduce(x)
    expected = sum(range(1, dist.get_world_size() + 1))
    assert torch.all(x == expected).item(), f"all_reduce gave {x[0].item()}, expected {expected}"
    dist.destroy_process_group()
    print("nccl ok")


if __name__ == "__main__":
    main()
