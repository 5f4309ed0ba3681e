"""loader.batch_size=auto, OOM recovery by micro-batches, LR scaling. CUDA's out-of-memory
cannot happen on a CPU, so it is injected above a size threshold."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

import saturate
from saturate.components.batch_size import Cache, Trial, search
from saturate.components.device import OutOfMemory
from saturate.components.optim import scaled_lr
from saturate.config.schema import OptimConfig
from tests.trainer.test_run import events


def fake_measure(oom_above: int, rate, tried: list[int]):
    def measure(size: int) -> Trial:
        tried.append(size)
        return Trial(size, False) if size > oom_above else Trial(size, True, rate(size))

    return measure


def test_search_doubles_then_bisects_the_memory_limit_and_keeps_a_margin():
    tried: list[int] = []
    chosen, trials = search(
        fake_measure(600, lambda s: 1000 * s / (s + 50), tried), low=16, high=4096, min_gain=0.0, safety=0.9
    )
    assert tried == [16, 32, 64, 128, 256, 512, 1024, 768, 640, 576, 608]
    assert [t.fit for t in trials] == [True] * 6 + [False, False, False, True, False]
    assert chosen == 512  # the fastest of the sizes <= 0.9 x 576


def test_search_stops_growing_when_throughput_stops_improving():
    tried: list[int] = []
    rates = {16: 100.0, 32: 190.0, 64: 300.0, 128: 310.0}
    chosen, _ = search(fake_measure(10**6, lambda s: rates[s], tried), low=16, high=4096, min_gain=0.05, safety=0.9)
    assert tried == [16, 32, 64, 128]  # 128 is only 3% faster than 64: stop
    assert chosen == 64  # within the 5% margin of the best, the smaller wins


def test_one_outlier_measurement_does_not_choose_the_size():
    """Issue 35: under load the search measured 26, 50, 96, 3,609 and 341 samples/s for
    batches of 16 to 256 and chose 128 on the outlier. Each size that fits is measured again
    in interleaved rounds and the median decides; the spread is reported."""
    tried: list[int] = []
    first = {16: 26.0, 32: 50.0, 64: 96.0, 128: 3609.0, 256: 341.0}  # the figures, one outlier
    steady = {16: 30.0, 32: 55.0, 64: 100.0, 128: 180.0, 256: 330.0}

    def rate(size: int) -> float:
        return first[size] if tried.count(size) == 1 else steady[size]

    chosen, trials = search(fake_measure(10**6, rate, tried), low=16, high=256, min_gain=0.05, safety=0.9, repeats=3)
    assert chosen == 256  # one measurement each: 128
    assert tried[:5] == [16, 32, 64, 128, 256]  # the doubling stopped at the bound
    assert [tried.count(s) for s in first] == [3] * 5  # then two interleaved rounds over every size
    assert tried[5:10] == [256, 128, 64, 32, 16] and tried[10:] == [16, 32, 64, 128, 256]
    median_128 = next(t for t in trials if t.size == 128)
    assert median_128.samples_per_s == 180.0 and median_128.spread == pytest.approx((3609 - 180) / 180)
    one, _ = search(fake_measure(10**6, lambda s: first[s], []), low=16, high=256, min_gain=0.05, safety=0.9)
    assert one == 128  # what a single measurement chose


def test_a_size_that_runs_out_of_memory_when_measured_again_is_dropped():
    calls: list[int] = []

    def measure(size: int) -> Trial:
        calls.append(size)
        if size == 64 and calls.count(64) > 1:
            return Trial(size, False)
        return Trial(size, True, float(size))

    chosen, trials = search(measure, low=16, high=64, min_gain=0.0, safety=0.9, repeats=2)
    assert chosen == 32 and [t.size for t in trials if t.fit and t.spread is not None] == [16, 32]


def test_search_respects_the_bounds():
    tried: list[int] = []
    chosen, _ = search(fake_measure(10**6, float, tried), low=24, high=100, min_gain=0.0, safety=0.9)
    assert tried == [24, 48, 96, 100] and chosen == 100


def test_search_fails_clearly_when_even_the_minimum_does_not_fit():
    with pytest.raises(OutOfMemory, match="even batch_search.min=16 runs out of memory"):
        search(fake_measure(8, float, []), low=16, high=64, min_gain=0.0, safety=0.9)


def oom_above(monkeypatch, threshold: int, from_call: int = 0) -> list[int]:
    """The model's forward raises CUDA's out-of-memory error for more than `threshold`
    samples (from the `from_call`-th training forward on); returns the sizes it saw."""
    from saturate.models import SmallCNN

    seen: list[int] = []
    original = SmallCNN.forward

    def forward(self, x):
        if self.training:
            seen.append(len(x))
            if len(x) > threshold and len(seen) > from_call:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return original(self, x)

    monkeypatch.setattr(SmallCNN, "forward", forward)
    return seen


class InitialWeights:
    """A callback that keeps the weights the run starts training from."""

    kept: list[dict] = []

    def on_run_start(self, run) -> None:
        InitialWeights.kept.append({k: v.clone() for k, v in run.model.state_dict().items()})


def test_auto_batch_size_fits_leaves_the_run_as_if_it_had_not_searched_and_caches(
    make_cfg, monkeypatch, tmp_path, caplog
):
    """Out of memory above 300 samples: the search stays below it with its margin; afterwards
    the run starts from the same weights and trains the same steps (the same random draws)
    as a run given that batch size from the start; a second run reuses the cached choice."""
    cache = tmp_path / "cache.json"
    common = [
        "loader.batch_size=auto",
        f"batch_search.cache={cache}",
        "batch_search.min_gain=0",
        "batch_search.steps=1",
        "+callbacks.initial._target_=tests.components.test_batch_size.InitialWeights",
        "trainer.deterministic=true",
    ]
    oom_above(monkeypatch, 300)
    InitialWeights.kept = []
    cfg = make_cfg(*common)
    searched = saturate.train(cfg)
    entry = next(iter(json.loads(cache.read_text()).values()))
    sizes = [t["size"] for t in entry["trials"]]
    assert (
        sizes[:2] == [16, 32]
        and entry["batch_size"] <= 300
        and all(t["size"] <= 300 for t in entry["trials"] if t["fit"])
    )
    # it grew into the injected limit: the margin below the largest that fit
    if any(not t["fit"] for t in entry["trials"]):
        assert entry["batch_size"] <= 0.9 * max(t["size"] for t in entry["trials"] if t["fit"])
    assert entry["key"]["input"] == [1, 8, 8, "torch.uint8"] and entry["key"]["precision"] == "fp32"
    assert events(cfg.run_dir).Tags()["scalars"].count("batch_search/samples_per_s") == 1
    plain = saturate.train(make_cfg(*common[2:], f"loader.batch_size={entry['batch_size']}"))
    first, second = InitialWeights.kept
    assert all(torch.equal(first[k], second[k]) for k in first)  # the search put the weights back
    assert searched["train/loss"] == plain["train/loss"]  # and every random generator

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="saturate"):
        saturate.train(make_cfg(*common))
    assert any(
        f"loader.batch_size=auto: {entry['batch_size']}, reused from {cache}" in r.getMessage() for r in caplog.records
    )
    assert not any("trials in" in r.getMessage() for r in caplog.records)  # nothing searched


def test_a_different_key_searches_again(make_cfg, tmp_path):
    cache = Cache(str(tmp_path / "c.json"))
    cache.put({"model": "a"}, {"batch_size": 64, "trials": [asdict(Trial(64, True, 1.0))]})
    assert cache.get({"model": "a"})["batch_size"] == 64 and cache.get({"model": "b"}) is None


def test_errors_other_than_out_of_memory_propagate_from_the_search(make_cfg, monkeypatch):
    from saturate.models import SmallCNN

    def forward(self, x):
        if self.training:  # the search's trials (the start-up check runs in eval mode)
            raise ValueError("a real bug, not memory")
        return original(self, x)

    original = SmallCNN.forward
    monkeypatch.setattr(SmallCNN, "forward", forward)
    with pytest.raises(ValueError, match="a real bug"):
        saturate.train(make_cfg("loader.batch_size=auto", "batch_search.cache="))


# monitor.costs=false: the start-up cost count's forward passes would be counted by the injected faults
EXACT = [
    "device=cpu",
    "model.norm=group",
    "trainer.max_epochs=2",
    "loader.batch_size=32",
    "trainer.deterministic=true",
    "monitor.costs=false",
]


def final_weights(cfg):
    return torch.load(Path(cfg.run_dir) / "checkpoints/last.pt", weights_only=False)["model"]


def test_out_of_memory_mid_training_halves_the_micro_batch_and_keeps_the_optimisation(make_cfg, monkeypatch, caplog):
    reference = make_cfg(*EXACT)
    saturate.train(reference)
    seen = oom_above(monkeypatch, 16, from_call=2)  # steps 1-2 fit; from step 3 on, 32 samples do not
    cfg = make_cfg(*EXACT)
    with caplog.at_level(logging.WARNING, logger="saturate"):
        metrics = saturate.train(cfg)
    assert seen[:5] == [32, 32, 32, 16, 16]  # step 3 failed at 32, retried as two micro-batches of 16
    assert metrics["train/micro_batches"] == 2
    assert any(
        "out of memory with micro-batches of 32 samples; continuing with 2 micro-batches of 16" in r.getMessage()
        for r in caplog.records
    )
    for key, value in final_weights(reference).items():
        torch.testing.assert_close(final_weights(cfg)[key], value, rtol=1e-5, atol=1e-6)  # the same optimisation
    lrs = [e.value for e in events(cfg.run_dir).Scalars("train/lr")]
    assert lrs == [e.value for e in events(reference.run_dir).Scalars("train/lr")]


def test_out_of_memory_at_one_sample_per_micro_batch_stops_clearly(make_cfg, monkeypatch):
    oom_above(monkeypatch, 0)
    with pytest.raises(OutOfMemory, match="out of memory at step 1 even with micro-batches of 1 sample"):
        saturate.train(make_cfg("loader.batch_size=4", "monitor.costs=false"))


def test_gradient_accumulation_is_the_same_optimisation(make_cfg):
    whole, split = make_cfg(*EXACT), make_cfg(*EXACT, "trainer.accumulate=4")
    saturate.train(whole)
    assert saturate.train(split)["train/micro_batches"] == 4
    for key, value in final_weights(whole).items():
        torch.testing.assert_close(final_weights(split)[key], value, rtol=1e-5, atol=1e-6)


def test_lr_scaling_rules():
    cfg = OptimConfig(base_batch_size=128)
    assert scaled_lr(cfg, 0.1, 512) == 0.1
    cfg.lr_scaling = "linear"
    assert scaled_lr(cfg, 0.1, 512) == pytest.approx(0.4)
    cfg.lr_scaling = "sqrt"  # seed 001: 4x the batch, 2x the LR
    assert scaled_lr(cfg, 0.1, 512) == pytest.approx(0.2)


def test_lr_scaling_applies_to_the_run_with_warmup(make_cfg):
    cfg = make_cfg("optim.lr_scaling=sqrt", "optim.base_batch_size=8", "trainer.max_epochs=3", "optim.warmup_epochs=1")
    saturate.train(cfg)  # batch 32 = 4 x 8: lr 0.1 -> 0.2
    lrs = [e.value for e in events(cfg.run_dir).Scalars("train/lr")]
    assert max(lrs) == pytest.approx(0.2, rel=0.02) and lrs[0] < max(lrs)


def test_the_cache_tells_models_passed_to_fit_apart(tmp_path, caplog):
    """fit's model is not a config node: its class and size are in the cache key, so a
    different model searches again and the same one reuses the choice."""
    from saturate.data.digits import load_digits
    from saturate.models import SmallCNN
    from tests.conftest import TINY

    data = load_digits(val_fraction=0.2, split_seed=0)
    common = [*TINY, "loader.batch_size=auto", f"batch_search.cache={tmp_path / 'cache.json'}", "batch_search.max=64"]
    with caplog.at_level(logging.INFO, logger="saturate"):
        for i, width in enumerate([8, 16, 8]):
            saturate.fit(SmallCNN(1, 10, width=width), *data, overrides=common, run_dir=tmp_path / f"run{i}")
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("loader.batch_size=auto")]
    assert ["reused" in m for m in said] == [False, False, True]


def test_micro_batches_never_outnumber_the_samples(make_cfg, monkeypatch):
    """Out of memory down to one sample per piece: a batch of 100 is split into 100 pieces,
    not 128 of which 28 are empty (an empty piece's loss is NaN: every step would be skipped)."""
    seen = oom_above(monkeypatch, 1)
    metrics = saturate.train(make_cfg("loader.batch_size=100", "trainer.limit_train_batches=2", "monitor.costs=false"))
    assert metrics["train/micro_batches"] == 100 and 0 not in seen
    assert metrics["train/nonfinite_steps"] == 0 and math.isfinite(metrics["train/loss"])


def test_a_short_last_batch_is_not_split_into_empty_pieces(make_cfg):
    """trainer.accumulate=8 and a last batch of 7 (71 digits, the rest held out; batch 8, drop_last=false)."""
    cfg = make_cfg(
        "data.val_fraction=0.96",
        "loader.batch_size=8",
        "trainer.accumulate=8",
        "loader.drop_last=false",
        "trainer.limit_train_batches=-1",
        "trainer.max_steps=-1",
    )
    metrics = saturate.train(cfg)
    assert metrics["progress/step"] == 9 and metrics["train/nonfinite_steps"] == 0  # 8 batches of 8 and one of 7


def test_cublas_and_cudnn_allocation_failures_are_out_of_memory():
    from saturate.components.device import is_oom

    assert is_oom(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))
    assert is_oom(RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"))
    assert is_oom(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_oom(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not is_oom(ValueError("out of memory"))


def test_out_of_memory_in_the_optimizer_step_is_a_clear_error(make_cfg, monkeypatch):
    def step(self, *args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 512.00 MiB (injected)")

    monkeypatch.setattr(torch.optim.SGD, "step", step)
    with pytest.raises(OutOfMemory, match="out of memory at step 1 after the backward pass .* optimizer state"):
        saturate.train(make_cfg())


def test_out_of_memory_preparing_the_batch_on_the_device_is_a_clear_error(make_cfg, monkeypatch):
    from saturate.data.loader import DevicePipeline

    calls, original = [], DevicePipeline.__call__

    def call(self, batch):
        calls.append(len(batch[1]))
        if len(calls) > 1:  # the first is the start-up check's two samples
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB (injected)")
        return original(self, batch)

    monkeypatch.setattr(DevicePipeline, "__call__", call)
    with pytest.raises(OutOfMemory, match="out of memory at step 1 copying the batch to the device"):
        saturate.train(make_cfg("monitor.costs=false"))


def test_the_cached_choice_is_not_reused_under_another_memory_cap_or_residency(make_cfg, tmp_path, caplog):
    cache = tmp_path / "cache.json"
    common = ["loader.batch_size=auto", f"batch_search.cache={cache}", "batch_search.steps=1", "batch_search.max=64"]
    saturate.train(make_cfg(*common))
    for other in (["device.memory_fraction=0.5"], ["loader=resident"]):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="saturate"):
            saturate.train(make_cfg(*common, *other))
        messages = [r.getMessage() for r in caplog.records if r.getMessage().startswith("loader.batch_size=auto")]
        assert messages and "reused" not in messages[0] and "trials" in messages[0], (other, messages)
    assert len(json.loads(cache.read_text())) == 3


def test_under_compile_the_search_graphs_are_dropped_before_the_run(make_cfg, monkeypatch):
    """Every trial size is a new shape for torch.compile (from the second on, a dynamic batch
    dimension the run would keep): they are dropped, and the run compiles for its own size.
    torch.compile itself is stood in for (minutes on this CPU; the slow tests compile)."""
    resets = []
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: model)
    monkeypatch.setattr(torch.compiler, "reset", lambda: resets.append(1))
    saturate.train(
        make_cfg(
            "trainer.compile=true",
            "loader.batch_size=auto",
            "batch_search.cache=",
            "batch_search.steps=1",
            "batch_search.max=32",
        )
    )
    assert resets == [1]
    saturate.train(
        make_cfg(
            "trainer.compile=false",
            "loader.batch_size=auto",
            "batch_search.cache=",
            "batch_search.steps=1",
            "batch_search.max=32",
        )
    )
    assert resets == [1]  # nothing compiled, nothing to drop


def test_a_cache_that_cannot_be_written_is_never_said_to_hold_the_choice(make_cfg, tmp_path, caplog):
    """batch_search.cache names a folder: the search's choice is used, the warning says the
    file cannot be written, and no line claims the choice was cached there."""
    folder = tmp_path / "cache.json"
    folder.mkdir()
    assert Cache(str(folder)).put({"model": "a"}, {"batch_size": 16, "trials": []}) is False
    searched = ["loader.batch_size=auto", f"batch_search.cache={folder}", "batch_search.steps=1", "batch_search.max=32"]
    with caplog.at_level(logging.INFO, logger="saturate"):
        saturate.train(make_cfg(*searched, "trainer.limit_train_batches=1", "trainer.limit_val_batches=1"))
    said = [r.getMessage() for r in caplog.records]
    assert any("cannot write" in m and str(folder) in m for m in said), said
    assert any("loader.batch_size=auto:" in m for m in said) and not any("cached in" in m for m in said), said
