"""The CUDA paths' logic on a CPU machine: a GPU cannot exist here, so CUDA's answers are
faked (device count, set_device) and what saturate decides from them is checked."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from saturate.components.device import setup_device
from saturate.config.schema import DeviceConfig


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA with `count` visible devices; records the device each call selects."""
    chosen: list[int] = []

    def install(count: int):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "set_device", lambda i: chosen.append(int(getattr(i, "index", i))))
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: "Fake GPU")
        return chosen

    return install


@pytest.mark.parametrize(("visible", "local_rank", "expected"), [(1, 0, 0), (1, 3, 0), (4, 3, 3), (8, 0, 0)])
def test_each_rank_takes_its_gpu_whether_it_sees_one_or_all(fake_cuda, visible, local_rank, expected):
    """One GPU per rank (SLURM --gpus-per-task, Kubernetes): every rank's GPU is cuda:0;
    the node's GPUs shared by its ranks: local rank k takes cuda:k."""
    chosen = fake_cuda(visible)
    device = setup_device(DeviceConfig(type="cuda"), local_rank=local_rank)
    assert device == torch.device("cuda", expected) and chosen == [expected]


def test_an_index_past_the_visible_gpus_is_a_clear_error(fake_cuda):
    fake_cuda(2)
    with pytest.raises(Exception, match=r"device.index=1: device 2 requested but 2 CUDA device\(s\) are visible"):
        setup_device(DeviceConfig(type="cuda", index=1), local_rank=1)


def test_deterministic_on_cuda_warns_instead_of_failing(make_cfg, monkeypatch, caplog):
    """`use_deterministic_algorithms(True)` stops a CUDA run at the first op without a
    deterministic kernel; on CUDA saturate asks torch to warn instead, and says so."""
    import saturate.trainer.run

    calls = []
    monkeypatch.setattr(
        torch, "use_deterministic_algorithms", lambda on, warn_only=False: calls.append((on, warn_only))
    )
    with (
        caplog.at_level(logging.WARNING, logger="saturate"),
        saturate.trainer.run.seeded(  # the seeding step, on a CUDA device
            saturate.config.schema.TrainerConfig(deterministic=True), torch.device("cuda", 0)
        ),
    ):
        pass
    assert calls[0] == (True, True) and "bit-exact results are promised on the CPU only" in caplog.text
    calls.clear()
    with saturate.trainer.run.seeded(saturate.config.schema.TrainerConfig(deterministic=True), torch.device("cpu")):
        pass
    assert calls[0] == (True, False)  # strict on the CPU


@pytest.mark.parametrize(
    ("visible", "devices", "device_type", "expected"),
    [
        (4, "auto", "auto", 4),
        (4, "auto", "cpu", 1),
        (0, "auto", "auto", 1),
        (1, "auto", "cuda", 1),
        (4, 2, "cuda", 2),
        (0, 2, "cpu", 2),
    ],
)
def test_trainer_devices_starts_one_process_per_gpu_by_default(
    fake_cuda, monkeypatch, visible, devices, device_type, expected
):
    from saturate.scale.launch import processes

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    if visible:
        fake_cuda(visible)
    assert processes(devices, device_type) == expected
    monkeypatch.setenv("LOCAL_RANK", "0")  # under torchrun or SLURM the processes exist already
    assert processes(devices, device_type) == 1


def test_more_processes_than_gpus_is_a_clear_error(fake_cuda, monkeypatch):
    from saturate.errors import UserError
    from saturate.scale.launch import processes

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    fake_cuda(2)
    with pytest.raises(
        UserError, match=r"trainer.devices=3: 2 CUDA device\(s\) visible; expected at most 2, or device=cpu"
    ):
        processes(3, "auto")


@pytest.mark.parametrize(
    ("native", "mode", "expected"),
    [(True, "auto", "bf16"), (True, "amp", "bf16"), (False, "auto", "fp16"), (False, "amp", "fp16")],
)
def test_amp_picks_bf16_only_where_the_gpu_has_it_natively(fake_cuda, monkeypatch, native, mode, expected):
    """A pre-Ampere GPU (V100, T4) emulates bf16: torch.cuda.is_bf16_supported() says True
    unless asked for native support; amp must pick fp16 there."""
    from saturate.components.precision import resolve_mode

    fake_cuda(1)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: native or including_emulation)
    assert resolve_mode(mode, torch.device("cuda", 0)) == expected


@pytest.mark.parametrize(("capability", "expected"), [((8, 0), "bf16"), ((7, 5), "fp16")])
def test_amp_decides_on_a_torch_whose_bf16_question_takes_no_keyword(fake_cuda, monkeypatch, capability, expected):
    """torch 2.3 (which pyproject.toml allows) has is_bf16_supported() without
    `including_emulation` and counts emulation: native bf16 is compute capability 8.0 and newer,
    the test torch 2.4 makes itself. Faked: that older signature, and the GPU's capability."""
    from saturate.components.precision import resolve_mode

    fake_cuda(1)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert resolve_mode("auto", torch.device("cuda", 0)) == expected


def test_the_resident_budget_on_a_torch_without_the_memory_fraction_getter(monkeypatch):
    """torch.cuda.get_per_process_memory_fraction exists from torch 2.6 on; before, the budget
    is the device's free memory and the allocator's unused blocks (faked: the older module)."""
    from saturate.data.loader import memory_budget

    gib = 2**30
    monkeypatch.delattr(torch.cuda, "get_per_process_memory_fraction")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 10 * gib)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 30 * gib)
    assert memory_budget(torch.device("cuda", 0)) == 30 * gib


def test_out_of_memory_is_recognised_on_a_torch_without_the_device_agnostic_error(monkeypatch):
    """torch.OutOfMemoryError is torch 2.4's name; torch 2.3 has torch.cuda.OutOfMemoryError
    only (faked: the name removed), and every failed step asks is_oom."""
    from saturate.components.device import is_oom

    cuda_error = torch.cuda.OutOfMemoryError
    monkeypatch.delattr(torch, "OutOfMemoryError")
    assert is_oom(cuda_error("CUDA error: out of memory (injected)")) and not is_oom(ValueError("a bug"))


@pytest.mark.parametrize(
    ("setting", "fixed", "deterministic", "expected"),
    [
        ("auto", True, False, True),
        ("auto", False, False, False),
        (True, False, False, True),
        (False, True, False, False),
        ("auto", True, True, False),
    ],
)
def test_cudnn_autotuning_follows_whether_the_samples_have_fixed_shapes(
    fake_cuda, monkeypatch, setting, fixed, deterministic, expected
):
    """cudnn.benchmark times every convolution algorithm for each new input shape: with
    samples of varying length (a padding collate) every new length is tuned again. auto
    tunes only fixed shapes; true and false are the user's; deterministic mode never tunes."""
    from saturate.components.device import autotune_convolutions

    fake_cuda(1)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)  # put back after the test
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: deterministic)
    cfg = DeviceConfig(type="cuda", cudnn_benchmark=setting)
    device = setup_device(cfg)
    assert autotune_convolutions(cfg, fixed_shapes=fixed, device=device) is expected
    assert torch.backends.cudnn.benchmark is expected


def test_bf16_asked_on_a_gpu_that_only_emulates_it_is_a_clear_error(fake_cuda, monkeypatch):
    from saturate.components.precision import resolve_mode
    from saturate.errors import UserError

    fake_cuda(1)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    with pytest.raises(UserError, match="precision.mode='bf16': Fake GPU has no native bf16 .* use precision=fp16"):
        resolve_mode("bf16", torch.device("cuda", 0))


@pytest.mark.parametrize("native", [True, False])
def test_the_doctor_counts_only_native_bf16_as_support(fake_cuda, monkeypatch, native):
    """The doctor said "bf16 supported" on a GPU that only emulates it (torch's default answer),
    and chose bf16 for its mixed-precision check there."""
    from saturate.diagnostics.doctor import amp_dtype, run_checks

    fake_cuda(1)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: native or including_emulation)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0) if native else (7, 0))
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda i: type("P", (), {"name": "Fake GPU", "total_memory": 2**34, "major": 7, "minor": 0})(),
    )
    rows = {}
    # lazily: the later rows would start workers on a fake GPU
    for c in run_checks(torch.device("cuda", 0), compile_check=False):
        rows[c.name] = c
        if c.name == "tf32":
            break
    assert rows["bf16"].ok is native and ("precision=auto picks fp16" in rows["bf16"].detail) is not native
    assert amp_dtype(torch.device("cuda", 0)) == (torch.bfloat16 if native else torch.float16)


def test_evaluation_runs_the_uncompiled_model_without_autograd(make_cfg, monkeypatch):
    """A compiled model is for training steps: evaluating it would compile it again (eval
    mode, no gradients, a short last batch). torch.compile is replaced by a recording
    wrapper (compiling for real takes minutes on this CPU; the slow tests do it)."""
    import saturate
    from saturate.models import SmallCNN

    calls = {"wrapper": [], "eval": []}

    class Compiled(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, x):
            calls["wrapper"].append(self.training)
            return self.model(x)

    original = SmallCNN.forward

    def forward(self, x):
        if not self.training and len(x) == 32:  # an evaluation batch (the start-up and advice checks take 2)
            calls["eval"].append(torch.is_inference_mode_enabled())
        return original(self, x)

    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: Compiled(model))
    monkeypatch.setattr(SmallCNN, "forward", forward)
    metrics = saturate.train(make_cfg("trainer.compile=true"))
    assert "val/acc" in metrics
    assert calls["wrapper"] and all(calls["wrapper"])  # the compiled wrapper only ever trained
    # validation: the plain model, under inference_mode
    assert calls["eval"] == [
        True,
        True,
    ]


def test_the_resident_budget_counts_the_allocators_cache_and_the_memory_cap(monkeypatch):
    """After the batch search and compile, the caching allocator keeps blocks mem_get_info
    calls used; device.memory_fraction caps what the allocator may take."""
    from saturate.data.loader import memory_budget

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 10 * gib)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 30 * gib)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: 1.0)
    cuda = torch.device("cuda", 0)
    assert memory_budget(cuda) == 30 * gib  # 10 free + 20 held unused by this process
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: 0.25)
    assert memory_budget(cuda) == 10 * gib  # 0.25 x 80 = 20 for the allocator, 10 of them in use


def test_the_batch_search_runs_with_the_resident_datas_room_taken(monkeypatch):
    from saturate.config.schema import LoaderConfig
    from saturate.data import resident
    from saturate.data.base import DataSpec

    spec = DataSpec("cifar", (3, 32, 32), torch.uint8, (), True, 10)
    assert resident.resident_bytes(spec, 60_000) == 60_000 * (3 * 32 * 32 + 8)
    taken, real_empty = [], torch.empty

    def empty(*args, **kwargs):
        if str(kwargs.get("device", "cpu")).startswith("cuda"):
            taken.append(args[0])
            return "device memory"
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(resident, "memory_budget", lambda device: 8 * 2**30)
    cuda = torch.device("cuda", 0)
    with resident.room_for_resident(LoaderConfig(resident=True), spec, 60_000, cuda):
        assert taken == [60_000 * 3080]  # held while the search runs
    with resident.room_for_resident(LoaderConfig(resident=False), spec, 60_000, cuda):
        pass
    # stays in host memory: nothing to keep room for
    big = DataSpec("imagenet", (3, 224, 224), torch.uint8, (), True, 1000)
    with resident.room_for_resident(LoaderConfig(resident=True), big, 1_281_167, cuda):
        pass
    assert len(taken) == 1


def test_host_memory_is_kept_for_reuse_unless_the_user_chose_an_allocator(monkeypatch):
    """glibc's malloc otherwise returns every block over 128 KiB to the OS when freed, and a
    step takes them again: page faults every step (saturate.components.device.keep_host_memory)."""
    import sys

    from saturate.components.device import keep_host_memory

    if sys.platform != "linux":
        pytest.skip("glibc's mallopt")
    for key in [k for k in os.environ if k.startswith("MALLOC_") or k == "LD_PRELOAD"]:
        monkeypatch.delenv(key)
    assert keep_host_memory() is True  # glibc took both settings (mallopt returns 1)
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")
    assert keep_host_memory() is False
    monkeypatch.delenv("LD_PRELOAD")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert keep_host_memory() is False


def test_setup_device_keeps_host_memory_when_asked(monkeypatch):
    from saturate.components import device

    calls = []
    monkeypatch.setattr(device, "keep_host_memory", lambda: calls.append(1) or True)
    setup_device(DeviceConfig(type="cpu"))
    setup_device(DeviceConfig(type="cpu", keep_host_memory=False))
    assert calls == [1]


@pytest.mark.gpu
def test_a_resident_epoch_starts_without_a_host_device_sync():
    """The epoch's permutation reaches the GPU behind the queued steps (pinned, non_blocking),
    not through a pageable copy that waits for the device to drain (issue 16, item 16)."""
    from saturate.config.schema import LoaderConfig
    from saturate.data.base import InMemory
    from saturate.data.loader import PlainPipeline, ResidentLoader

    data = InMemory(torch.randn(1024, 8), torch.randint(0, 10, (1024,)))
    device = torch.device("cuda", 0)
    loader = ResidentLoader(
        data,
        LoaderConfig(batch_size=64, resident=True),
        PlainPipeline(device, non_blocking=True),
        train=True,
    )
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for epoch in range(2):
            x, y = next(iter(loader.epoch(epoch)))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert x.device.type == "cuda" and len(y) == 64


@pytest.mark.parametrize(("visible", "index", "local_rank"), [(4, 1, 0), (4, 1, 2), (1, 0, 3), (8, 2, 5)])
def test_the_process_group_binds_nccl_to_the_gpu_the_rank_trains_on(fake_cuda, monkeypatch, visible, index, local_rank):
    """device.index moves every rank's GPU; NCCL was bound to cuda:LOCAL_RANK before the
    index was applied (a collective on one GPU, the training on another)."""
    import torch.distributed as dist

    from saturate.scale import distributed

    chosen = fake_cuda(visible)
    bound = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed, "rendezvous", lambda rank, size: "store")  # the ranks' meeting: not this test's
    monkeypatch.setattr(dist, "init_process_group", lambda device_id, **given: bound.append(device_id))
    monkeypatch.setattr(distributed.atexit, "register", lambda fn: None)
    monkeypatch.setattr(dist, "get_rank", lambda: local_rank)
    monkeypatch.setattr(dist, "get_world_size", lambda: 8)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    distributed.init_process_group(index)
    trained_on = setup_device(DeviceConfig(type="cuda", index=index), local_rank=local_rank)
    assert bound == [trained_on] and chosen == [trained_on.index, trained_on.index]
