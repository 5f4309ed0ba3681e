"""What saturate's engine costs: the same model, data and batch size trained three ways,
interleaved, in this one process.

    python scripts/bench_engine.py                       # small_cnn, 3x32x32, batch 128, resident data
    python scripts/bench_engine.py --model airbench --fast --batch 512    # on a GPU: experiment=fast

1. **hand loop**: a minimal hand-written PyTorch loop over in-memory tensors already
   normalised on the device (the compute-only bound): index, forward, backward, step.
2. **saturate**: `saturate.train` with `loader=resident`, no augmentation, the same model,
   optimizer and batch; everything the engine does per step counts (timing, the non-finite
   guard, the LR schedule, metric accumulation, the resource monitor thread).
3. **lightning**: PyTorch Lightning's Trainer over a DataLoader(TensorDataset) of the same
   normalised tensors, when lightning is installed (`pip install -e ".[bench]"`); with
   `--fast`, bf16-mixed and a compiled model, like the others.

Each round runs every way for `--steps` steps, starting with a different one each round. A
round's figure is the time from the end of step `--warmup` to the end of the last step,
divided by the steps between: the device is synchronised at both ends (on a GPU the host
runs ahead of the device, so the interval between two step ends on the host measures
launches, not steps), and everything the loop does in between counts. The data set holds
more samples than the steps take, so no epoch ends (and no evaluation runs) inside the timed
steps. The table gives the median over rounds, and the median over rounds of each round's
ratio to the hand loop (a paired comparison: shared-machine drift moves both sides of a
round alike). Lightning gets whole batches gathered on the device by index, as the other
two loops do (a DataLoader over a TensorDataset would stack device tensors sample by
sample). With `--fast` (GPU) the hand loop also uses bf16 autocast, channels_last and
torch.compile, saturate runs `experiment=fast`, and eager vs compiled airbench is timed,
compile time apart.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

import saturate
from saturate.config.dirs import CONF
from saturate.data.base import channel_stats
from saturate.data.synthetic import make_synthetic

saturate.register()  # the schema and resolvers, before composing conf/


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class Window:
    """The timed steps of one run: the clock starts at the end of step `warmup` and stops at
    the end of step `steps`, the device synchronised at both (host and device agree there)."""

    def __init__(self, device: torch.device, warmup: int, steps: int):
        self.device, self.warmup, self.steps, self.done = device, warmup, steps, 0
        self.start = self.end = None

    def step_done(self) -> None:
        self.done += 1
        if self.done in (self.warmup, self.steps):
            sync(self.device)
            mark = (time.perf_counter(), time.process_time())
            if self.done == self.warmup:
                self.start = mark
            if self.done == self.steps:
                self.end = mark

    def per_step(self) -> tuple[float, float]:
        """(wall, CPU) seconds per timed step. CPU time (all of this process's threads) is not
        inflated by other tenants of a shared machine; wall time is what a user waits."""
        count = self.steps - self.warmup
        return (self.end[0] - self.start[0]) / count, (self.end[1] - self.start[1]) / count


def medians(figures: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(w for w, _ in figures), statistics.median(c for _, c in figures)


def hand_loop(model, x, y, *, batch: int, window: Window, lr: float, fast: bool, compiled=None) -> tuple[float, float]:
    """The bound: tensors already normalised on the device, nothing but the step. `fast`:
    bf16 autocast and torch.compile (or the already compiled `compiled`)."""
    device = x.device
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=5e-4)
    step_model = compiled or (torch.compile(model) if fast else model)
    order = torch.randperm(len(x), device=device)
    for i in range(window.steps):
        index = order[(i * batch) % (len(x) - batch) :][:batch]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=fast):
            loss = F.cross_entropy(step_model(x[index]), y[index])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        window.step_done()
    return window.per_step()


class StepClock:
    """A callback (saturate's public protocol) that marks the end of every training step."""

    window: Window | None = None

    def on_train_batch_end(self, run, loss) -> None:
        StepClock.window.step_done()


def saturate_loop(overrides: list[str], run_dir: str, window: Window) -> tuple[float, float]:
    StepClock.window = window
    clock = [f"+callbacks.clock._target_={__name__}.StepClock"]  # this module, however it was started
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose(
            "config", overrides=[*overrides, *clock, f"trainer.max_steps={window.steps}", f"run_dir={run_dir}"]
        )
    saturate.train(cfg)
    return window.per_step()


class Batches(torch.utils.data.Dataset):
    """Whole batches gathered on the device by index (a BatchSampler's lists of indices)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.as_tensor(indices, device=self.x.device)
        return self.x[index], self.y[index]


def lightning_loop(model, x, y, *, batch: int, window: Window, lr: float, fast: bool) -> tuple[float, float] | None:
    try:
        import lightning as L
    except ImportError:
        return None

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = torch.compile(model) if fast else model

        def training_step(self, batch, _):
            inputs, targets = batch
            return F.cross_entropy(self.model(inputs), targets)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=5e-4)

    class Clock(L.Callback):
        def on_train_batch_end(self, *args):
            window.step_done()

    sampler = torch.utils.data.BatchSampler(torch.utils.data.RandomSampler(range(len(x))), batch, drop_last=True)
    loader = torch.utils.data.DataLoader(Batches(x, y), sampler=sampler, batch_size=None)
    trainer = L.Trainer(
        max_steps=window.steps,
        accelerator=x.device.type,
        devices=1,
        logger=False,
        enable_checkpointing=False,
        precision="bf16-mixed" if fast else "32-true",
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Clock()],
        num_sanity_val_steps=0,
    )
    trainer.fit(Module(), loader)
    return window.per_step()


def compile_speedup(model, x, y, *, batch: int, steps: int, warmup: int) -> dict:
    """Eager vs torch.compile for the same model, both in bf16 autocast (the --fast target),
    the compilation timed apart on a warm-up step."""
    eager_model = copy.deepcopy(model)
    eager, _ = hand_loop(
        eager_model, x, y, batch=batch, window=Window(x.device, warmup, steps), lr=0.1, fast=True, compiled=eager_model
    )
    compiled_model = copy.deepcopy(model)
    compiled_fn = torch.compile(compiled_model)
    start = time.perf_counter()
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        F.cross_entropy(compiled_fn(x[:batch]), y[:batch]).backward()
    sync(x.device)
    compile_s = time.perf_counter() - start
    compiled, _ = hand_loop(
        compiled_model,
        x,
        y,
        batch=batch,
        window=Window(x.device, warmup, steps),
        lr=0.1,
        fast=True,
        compiled=compiled_fn,
    )
    print(
        f"\ntorch.compile on {type(model).__name__}: eager {1000 * eager:.2f} ms/step, compiled {1000 * compiled:.2f} "
        f"ms/step, speed-up {eager / compiled:.2f}x; compile time {compile_s:.1f} s (not in the step times)"
    )
    return {
        "eager_ms": 1000 * eager,
        "compiled_ms": 1000 * compiled,
        "speedup": eager / compiled,
        "compile_s": compile_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small_cnn", choices=["small_cnn", "resnet18", "airbench"])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument(
        "--fast", action="store_true", help="GPU fast path: bf16, channels_last, compile; saturate runs experiment=fast"
    )
    parser.add_argument("--verbose", action="store_true", help="print each round's medians")
    parser.add_argument(
        "--json", default=None, help="also write the table's figures to this file (saturate selftest reads it)"
    )
    parser.add_argument("overrides", nargs="*", help="more overrides for the saturate run, e.g. monitor.enabled=false")
    args = parser.parse_args()
    logging.getLogger("saturate").setLevel(logging.WARNING)
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.warmup < 1 or args.steps <= args.warmup:
        parser.error("--warmup must be at least 1 and less than --steps")
    samples = max(args.samples, args.batch * (args.steps + 1))  # no epoch end inside the timed steps
    data = [
        "data=synthetic",
        f"data.num_train={samples}",
        "data.num_val=256",
        f"data.height={args.size}",
        f"data.width={args.size}",
    ]
    common = [
        *data,
        f"model={args.model}",
        f"loader.batch_size={args.batch}",
        "trainer.progress=false",
        "optim.warmup_epochs=0",
    ]
    setting = (
        ["experiment=fast", "augmentation=none"]
        if args.fast
        else ["loader=resident", "augmentation=none", "precision=fp32"]
    )
    with tempfile.TemporaryDirectory() as tmp:
        # the same data, model and lr as the saturate run, built from the same option files
        node = OmegaConf.load(CONF / "data" / "synthetic.yaml")
        node.update(num_train=samples, num_val=256, height=args.size, width=args.size)
        train_set, _ = make_synthetic(**{k: v for k, v in node.items() if k != "_target_"})
        mean, std = (torch.tensor(v, device=device).view(1, -1, 1, 1) for v in channel_stats(train_set.images))
        x = (train_set.images.to(device).float() / 255 - mean) / std
        y = train_set.labels.to(device)
        if args.fast:
            x = x.contiguous(memory_format=torch.channels_last)
        torch.manual_seed(0)
        model = instantiate(
            OmegaConf.load(CONF / "model" / f"{args.model}.yaml"), in_channels=3, num_classes=node.num_classes
        ).to(device)
        if args.fast:
            model = model.to(memory_format=torch.channels_last)
        lr = OmegaConf.load(CONF / "optim" / "sgd.yaml").optimizer.lr

        def window() -> Window:
            return Window(device, args.warmup, args.steps)

        runners = {
            "hand loop": lambda r: hand_loop(
                copy.deepcopy(model), x, y, batch=args.batch, window=window(), lr=lr, fast=args.fast
            ),
            "saturate": lambda r: saturate_loop([*common, *setting, *args.overrides], f"{tmp}/run{r}", window()),
            "lightning": lambda r: lightning_loop(
                copy.deepcopy(model), x, y, batch=args.batch, window=window(), lr=lr, fast=args.fast
            ),
        }
        # (wall, CPU) s per step, each round
        per_round: dict[str, list[tuple[float, float]]] = {name: [] for name in runners}
        names = list(runners)
        # interleaved, and each round starts with the next runner: no one always goes first
        for r in range(args.rounds):
            for name in names[r % 3 :] + names[: r % 3]:
                per_step = runners[name](r)
                if per_step is not None:  # None: lightning is not installed
                    per_round[name].append(per_step)
                    if args.verbose:
                        print(
                            f"round {r}: {name:<10} {1000 * per_step[0]:.2f} ms wall, {1000 * per_step[1]:.2f} ms "
                            "CPU per step",
                            flush=True,
                        )

    where = (
        torch.cuda.get_device_name() if device.type == "cuda" else f"cpu ({platform.machine()}, {os.cpu_count()} CPUs)"
    )
    mode = "experiment=fast" if args.fast else "loader=resident fp32"
    print(
        f"\n{args.model}, synthetic 3x{args.size}x{args.size}, batch {args.batch}, {mode}; {where}, torch "
        f"{torch.__version__}; median of {args.rounds} rounds of {args.steps - args.warmup} timed steps each\n"
    )
    hand = medians(per_round["hand loop"])
    figures: dict = {
        "device": where,
        "mode": mode,
        "model": args.model,
        "batch": args.batch,
        "rounds": args.rounds,
        "loops": {},
    }
    print(
        "| loop | step ms (wall) | samples/s | vs hand loop (wall) | paired by round (wall) | step ms (CPU) | vs "
        "hand loop (CPU) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, t in per_round.items():
        if not t:
            continue
        wall, cpu = medians(t)
        # within a round the loops ran back to back, so each round's ratio is a paired comparison, robust to drift
        paired = statistics.median(m[0] / h[0] for m, h in zip(per_round[name], per_round["hand loop"], strict=True))
        print(
            f"| {name} | {1000 * wall:.2f} | {args.batch / wall:,.0f} | {wall / hand[0]:.3f}x | {paired:.3f}x | "
            f"{1000 * cpu:.2f} | {cpu / hand[1]:.3f}x |"
        )
        figures["loops"][name] = {
            "step_ms": 1000 * wall,
            "samples_per_s": args.batch / wall,
            "vs_hand": wall / hand[0],
            "paired": paired,
        }
    if not per_round["lightning"]:
        print("\n(lightning is not installed: pip install -e '.[bench]')")
    if args.fast:
        figures["compile"] = compile_speedup(model, x, y, batch=args.batch, steps=args.steps, warmup=args.warmup)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
