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

Each round runs every way for `--steps` steps, starting with a different one each round; a
step's time is the interval between the ends of consecutive steps (its share of everything
the loop does), the first `--warmup` steps of each round left out. The table gives the
median over all rounds, and the median over rounds of each round's ratio to the hand loop
(a paired comparison: shared-machine drift moves both sides of a round alike). With `--fast`
(GPU) the hand loop also uses bf16 autocast, channels_last and torch.compile, saturate
runs `experiment=fast`, and eager vs compiled airbench is timed, compile time apart.
"""

from __future__ import annotations

import argparse
import copy
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
import saturate.run
from saturate.data.base import channel_stats
from saturate.data.synthetic import make_synthetic

CONF = Path(__file__).resolve().parents[1] / "conf"
saturate.register()  # the schema and resolvers, before composing conf/


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def hand_loop(model, x, y, *, batch: int, steps: int, lr: float, fast: bool, compiled=None) -> list[tuple[float, float]]:
    """The bound: tensors already normalised on the device, nothing but the step. `fast`:
    bf16 autocast and torch.compile (or the already compiled `compiled`)."""
    device = x.device
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=5e-4)
    step_model = compiled or (torch.compile(model) if fast else model)
    order = torch.randperm(len(x), device=device)
    ends = [(time.perf_counter(), time.process_time())]
    for i in range(steps):
        index = order[(i * batch) % (len(x) - batch) :][:batch]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=fast):
            loss = F.cross_entropy(step_model(x[index]), y[index])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ends.append((time.perf_counter(), time.process_time()))
    sync(device)
    ends[-1] = (time.perf_counter(), time.process_time())
    return intervals(ends)


def medians(steps: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(w for w, _ in steps), statistics.median(c for _, c in steps)


def intervals(ends: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(wall, CPU) seconds between consecutive step ends. CPU time (all of this process's
    threads) is not inflated by other tenants of a shared machine; wall time is what a user
    waits."""
    return [(b[0] - a[0], b[1] - a[1]) for a, b in zip(ends, ends[1:], strict=False)]


class StepClock:
    """Stands in for saturate's NoProfiler: the engine calls step() once per training step."""

    ends: list[float] = []

    def step(self) -> None:
        StepClock.ends.append((time.perf_counter(), time.process_time()))

    def close(self) -> None:
        pass


def saturate_loop(overrides: list[str], run_dir: str, steps: int) -> list[float]:
    StepClock.ends = []
    saturate.run.NoProfiler = StepClock  # record the end of every step the engine takes
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[*overrides, f"trainer.max_steps={steps}", f"run_dir={run_dir}"])
    saturate.train(cfg)
    return intervals(StepClock.ends)


def lightning_loop(model, x, y, *, batch: int, steps: int, lr: float, fast: bool) -> list[tuple[float, float]] | None:
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
        ends: list[float] = []

        def on_train_batch_end(self, *args):
            self.ends.append((time.perf_counter(), time.process_time()))

    clock = Clock()
    clock.ends = []
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch, shuffle=True, drop_last=True)
    trainer = L.Trainer(max_steps=steps, accelerator=x.device.type, devices=1, logger=False, enable_checkpointing=False,
                        precision="bf16-mixed" if fast else "32-true",
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[clock], num_sanity_val_steps=0)  # fmt: skip
    trainer.fit(Module(), loader)
    return intervals(clock.ends)


def compile_speedup(model, x, y, *, batch: int, steps: int) -> None:
    """Eager vs torch.compile for the same model, both in bf16 autocast (the --fast target),
    the compilation timed apart on a warm-up step."""
    eager_model = copy.deepcopy(model)
    eager = hand_loop(eager_model, x, y, batch=batch, steps=steps, lr=0.1, fast=True, compiled=eager_model)
    compiled_model = copy.deepcopy(model)
    compiled_fn = torch.compile(compiled_model)
    start = time.perf_counter()
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        F.cross_entropy(compiled_fn(x[:batch]), y[:batch]).backward()
    sync(x.device)
    compile_s = time.perf_counter() - start
    compiled = hand_loop(compiled_model, x, y, batch=batch, steps=steps, lr=0.1, fast=True, compiled=compiled_fn)
    e, c = statistics.median(t for t, _ in eager[3:]), statistics.median(t for t, _ in compiled[3:])
    print(f"\ntorch.compile on {type(model).__name__}: eager {1000 * e:.2f} ms/step, compiled {1000 * c:.2f} ms/step, "
          f"speed-up {e / c:.2f}x; compile time {compile_s:.1f} s (not in the step times)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small_cnn", choices=["small_cnn", "resnet18", "airbench"])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--fast", action="store_true", help="GPU fast path: bf16, channels_last, compile; saturate runs experiment=fast")
    parser.add_argument("--verbose", action="store_true", help="print each round's medians")
    parser.add_argument("overrides", nargs="*", help="more overrides for the saturate run, e.g. monitor.enabled=false")
    args = parser.parse_args()
    logging.getLogger("saturate").setLevel(logging.WARNING)
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data = ["data=synthetic", f"data.num_train={args.samples}", "data.num_val=256", f"data.height={args.size}", f"data.width={args.size}"]
    common = [*data, f"model={args.model}", f"loader.batch_size={args.batch}", "trainer.progress=false", "optim.warmup_epochs=0"]
    setting = ["experiment=fast", "augmentation=none"] if args.fast else ["loader=resident", "augmentation=none", "precision=fp32"]
    with tempfile.TemporaryDirectory() as tmp:
        # the same data, model and lr as the saturate run, built from the same option files
        node = OmegaConf.load(CONF / "data" / "synthetic.yaml")
        node.update(num_train=args.samples, num_val=256, height=args.size, width=args.size)
        train_set, _ = make_synthetic(**{k: v for k, v in node.items() if k != "_target_"})
        mean, std = (torch.tensor(v, device=device).view(1, -1, 1, 1) for v in channel_stats(train_set.images))
        x = (train_set.images.to(device).float() / 255 - mean) / std
        y = train_set.labels.to(device)
        if args.fast:
            x = x.contiguous(memory_format=torch.channels_last)
        torch.manual_seed(0)
        model = instantiate(OmegaConf.load(CONF / "model" / f"{args.model}.yaml"), in_channels=3, num_classes=node.num_classes).to(device)
        if args.fast:
            model = model.to(memory_format=torch.channels_last)
        lr = OmegaConf.load(CONF / "optim" / "sgd.yaml").optimizer.lr

        runners = {
            "hand loop": lambda r: hand_loop(copy.deepcopy(model), x, y, batch=args.batch, steps=args.steps, lr=lr, fast=args.fast),
            "saturate": lambda r: saturate_loop([*common, *setting, *args.overrides], f"{tmp}/run{r}", args.steps),
            "lightning": lambda r: lightning_loop(copy.deepcopy(model), x, y, batch=args.batch, steps=args.steps, lr=lr, fast=args.fast),
        }
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in runners}
        per_round: dict[str, list[tuple[float, float]]] = {name: [] for name in runners}  # each round's medians
        names = list(runners)
        for r in range(args.rounds):  # interleaved, and each round starts with the next runner: no one always goes first
            for name in names[r % 3 :] + names[: r % 3]:
                steps = runners[name](r)
                if steps is not None:  # None: lightning is not installed
                    kept = steps[args.warmup :]
                    times[name] += kept
                    per_round[name].append(medians(kept))
                    if args.verbose:
                        print(f"round {r}: {name:<10} median {1000 * per_round[name][-1][0]:.2f} ms wall, "
                              f"{1000 * per_round[name][-1][1]:.2f} ms CPU", flush=True)  # fmt: skip

    where = torch.cuda.get_device_name() if device.type == "cuda" else f"cpu ({platform.machine()}, {os.cpu_count()} CPUs)"
    mode = "experiment=fast" if args.fast else "loader=resident fp32"
    print(f"\n{args.model}, synthetic 3x{args.size}x{args.size}, batch {args.batch}, {mode}; {where}, torch {torch.__version__}; "
          f"median of {args.rounds} rounds x {args.steps - args.warmup} steps\n")  # fmt: skip
    hand = medians(times["hand loop"])
    print("| loop | step ms (wall) | samples/s | vs hand loop (wall) | paired by round (wall) | step ms (CPU) | vs hand loop (CPU) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, t in times.items():
        if not t:
            continue
        wall, cpu = medians(t)
        # within a round the loops ran back to back, so each round's ratio is a paired comparison, robust to drift
        paired = statistics.median(m[0] / h[0] for m, h in zip(per_round[name], per_round["hand loop"], strict=True))
        print(f"| {name} | {1000 * wall:.2f} | {args.batch / wall:,.0f} | {wall / hand[0]:.3f}x | {paired:.3f}x | "
              f"{1000 * cpu:.2f} | {cpu / hand[1]:.3f}x |")  # fmt: skip
    if not times["lightning"]:
        print("\n(lightning is not installed: pip install -e '.[bench]')")
    if args.fast:
        compile_speedup(model, x, y, batch=args.batch, steps=args.steps)


if __name__ == "__main__":
    main()
