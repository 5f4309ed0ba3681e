"""Where metrics go: the observers (the loggers: TensorBoard by default, metrics.csv, a
user's own; and callbacks' `on_log`), the progress bar, and what the HParams tab compares.

Tags are the contract names (`train/loss`, `val/acc`, `perf/samples_per_s`, ...), the same in
every logger and in metrics.json. Loggers exist on rank 0 only (saturate.callbacks.Observers),
so callers never ask which rank they are on.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any

from tqdm import tqdm

from saturate import names
from saturate.config.secrets import masked

log = logging.getLogger(__name__)

PICTURES_EVERY_S = 10.0  # an evaluation's images (previews, confusion matrices): at most this often, and at the end


def _plain(value: Any) -> Any:
    """A value TensorBoard's hparams plugin accepts (number or string). Numbers stay numbers,
    integers too: the HParams tab then sorts them numerically on its axes and offers a range
    filter (as text, 128 sorted before 64), at the price of printing 128 as 128.00. Booleans
    as the text true/false (the tab drew them as 0.0000); anything else as its text."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        return value
    return str(value)


class Tracker:
    """Logs to the observers through the run's `Run` (set with `attach`, before the first
    log), keeps the latest value of every metric, and drives the progress bar."""

    def __init__(self, observers, *, log_interval: int, progress: bool, enabled: bool = True, shown: str = "val/acc"):
        self.observers, self.log_interval, self.enabled = observers, log_interval, enabled
        self.run = None
        self.shown = shown  # the validation metric the progress bar shows
        # disable=None: tqdm turns itself off when stderr is not a terminal (logs, CI)
        self.bar = tqdm(unit="step", dynamic_ncols=True, disable=None if enabled and progress else True)
        self.latest: dict[str, float] = {}
        self.logged: dict[str, tuple[int, float]] = {}  # each metric's last (step, value) logged
        self.counted: dict[str, float] = {}  # the flat counters' last logged values
        self.pictured_at: float | None = None  # when an evaluation's images were last logged

    def attach(self, run, total_steps: int, done: int = 0) -> None:
        self.run = run
        self.bar.reset(total=total_steps)
        self.bar.update(done)

    def due(self, step: int) -> bool:
        return step % self.log_interval == 0

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.latest.update(metrics)
        self.logged.update((k, (step, v)) for k, v in metrics.items())
        if self.run is not None:
            self.run.metrics.update(metrics)
            self.observers.call("on_log", self.run, metrics, step)

    def progress(self, step: int, epoch: int) -> None:
        """Advance the bar to `step` and show the latest loss and throughput."""
        self.bar.update(step - self.bar.n)
        shown: dict[str, object] = {"epoch": epoch}
        for tag, fmt in ((names.TRAIN_LOSS, "{:.4f}"), (self.shown, "{:.4f}"), (names.SAMPLES_PER_S, "{:.0f}")):
            if tag in self.latest:
                shown[tag.split("/")[1]] = fmt.format(self.latest[tag])
        self.bar.set_postfix(shown, refresh=False)

    def changed(self, counts: dict[str, float]) -> dict[str, float]:
        """Of counters that are flat in a healthy run (non-finite steps, micro-batches per
        batch, the fp16 loss scale), those to log: once they leave their healthy value and then
        whenever they change, so a healthy run's TensorBoard has no straight-line cards."""
        healthy = {names.NONFINITE_STEPS: 0, names.MICRO_BATCHES: 1}
        changed = {k: v for k, v in counts.items() if self.counted.get(k, healthy.get(k)) != v}
        self.counted.update(changed)
        return changed

    def pictures_due(self, at_end: bool) -> bool:
        """Whether this evaluation's images (previews, confusion matrices) are logged: at the
        first evaluation, then once PICTURES_EVERY_S have passed since the last, and at the
        run's last (`at_end`). Each costs a PNG encoding and TensorBoard's pure-Python CRC of
        it, tens of milliseconds per picture, which adds up over a run of frequent
        evaluations; the metrics are logged at every evaluation."""
        now = time.perf_counter()
        if self.pictured_at is None or now - self.pictured_at >= PICTURES_EVERY_S or at_end:
            self.pictured_at = now
            return True
        return False

    def epoch_line(
        self,
        epoch: float,
        epochs: int,
        step: int,
        evaluated: dict[str, float],
        inside: int | None,
        started: float,
        max_steps: int = -1,
    ) -> None:
        """One line per epoch in the console and train.log, terminal or not (nohup, a
        scheduler's log, a pipe): where the run is, its losses and metrics, its speed.
        `inside`: the step of an evaluation inside the epoch, when it was not at its end;
        `started`: when the epoch began (perf_counter). A run counted in steps
        (`max_steps` > 0) is placed by its step, and its epochs as a fraction."""
        if not self.enabled:
            return
        figures = [
            f"{k} {v:.4f}"
            for k, v in ((names.TRAIN_LOSS, self.latest.get(names.TRAIN_LOSS)), *evaluated.items())
            if v is not None
        ]
        if inside is not None:
            figures[-1] += f" (evaluated at step {inside})"
        speed = self.latest.get(names.SAMPLES_PER_S)
        where = f"epoch {epoch:.0f}/{epochs}, step {step}" if max_steps <= 0 else f"step {step}/{max_steps}"
        if max_steps > 0:
            where += f" (epoch {epoch:.2f})"
        log.info(
            "%s: %s%s, %.1f s",
            where,
            ", ".join(figures),
            f", {speed:,.0f} samples/s" if speed else "",
            time.perf_counter() - started,
        )

    def text(self, tag: str, text: str, step: int = 0) -> None:
        if self.run is not None:
            self.observers.call("on_text", self.run, tag, text, step)

    def layout(self, charts: dict[str, list[str]]) -> None:
        """The overview TensorBoard's Custom Scalars tab opens with: {chart title: tags}."""
        if self.run is not None:
            self.observers.call("on_layout", self.run, charts)

    def images(self, tag: str, images, step: int) -> None:
        """A grid of images (N, C, H, W) in [0, 1]."""
        if self.run is not None and self.observers.has("on_images"):
            self.observers.call("on_images", self.run, tag, images.detach().float().cpu(), step)

    def matrices(self, matrices: dict, step: int, labels: list[str] | None = None) -> None:
        """Matrix results of an evaluation (confusion matrices) as images: `<split>/<name>`."""
        for key, matrix in matrices.items():
            self.images(key, matrix_image(matrix, labels)[None], step)

    def hparams(self, params: dict[str, Any], metrics: dict[str, float], step: int, varied=(), compared=()) -> None:
        """One HParams entry for this run: `params` as columns, the `compared` metrics' final
        values as what the runs are compared by. The final values of the metrics already
        plotted during training end their curves (a steady-state figure among them); the
        run's other summaries (means, costs, loop time) stay in metrics.json and the report,
        not one-point charts; the test split's are plotted once."""
        finite = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        if self.run is not None:
            chosen = {k: finite[k] for k in compared if k in finite}
            self.observers.call(
                "on_hparams", self.run, {k: _plain(v) for k, v in params.items()}, chosen, sorted(varied)
            )
        # latest: what was logged; a moment's time (an evaluation's, the target's) is not a curve to end
        ended = {k: v for k, v in finite.items() if (k in self.latest and k not in MOMENTS) or k.startswith("test/")}
        self.log({k: v for k, v in ended.items() if self.logged.get(k) != (step, v)}, step)  # not twice at one step

    def close(self) -> None:
        self.bar.close()


def plain(run) -> dict:
    """The run's settings (the checked config, a dataclass) as plain dicts and lists: the values
    the run used. The config check built it with OmegaConf.to_object, which resolved every
    interpolation and made every node plain, so this is what `OmegaConf.to_container(
    OmegaConf.structured(run), resolve=True)` gave (tests/diagnostics/test_tracking.py holds the two
    equal), without the round trip through OmegaConf (tens of times slower), three times a run. One value
    differs, for the better: a text that still reads `${...}` after the check (an escaped
    interpolation) is kept as the run used it, where the round trip resolved it a second time
    (or failed the run)."""
    return dataclasses.asdict(run)


def _select(tree: dict, key: str, default: Any) -> Any:
    """`a.b.0`'s value in plain dicts and lists, else `default` (OmegaConf.select, on them)."""
    node: Any = tree
    for part in key.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return default
    return node


def swept(resolved: dict, invocation) -> dict:
    """The run's overrides that are settings (a multirun's swept values among them) as
    {key: value}, values as the config resolved them (`resolved`: `plain(run)`); group choices
    (`precision=amp`) as the option."""
    columns = {}
    for override in invocation.settings():
        key, _, text = override.lstrip("+~").partition("=")
        value = _select(resolved, key, text)
        columns[key] = text if isinstance(value, (dict, list)) else value
    return columns


def identity(invocation) -> str:
    """A run's settings as one line, what its sweep varies first: the HParams `overrides`
    column, a run's identity at a glance (the Trial ID is its path, which starts with a date
    and is cut there)."""
    given = invocation.settings()
    first = [o for o in given if o.lstrip("+~").partition("=")[0] in invocation.varied]
    return " ".join([*first, *(o for o in given if o not in first)]) or "(none)"


def settings(resolved: dict) -> dict:
    """Every setting of the run (`resolved`: `plain(run)`) as `group.key`: scalars as they are,
    lists as their text, so that each run holds a value for any key another run varies
    (TensorBoard's parallel coordinates leave out a run that lacks one; a plain run lacked the
    width a sweep varied)."""
    import json

    out: dict = {}

    def walk(key: str, node) -> None:
        if isinstance(node, dict):
            for name, value in node.items():
                walk(f"{key}.{name}", value)
        else:
            out[key] = json.dumps(node) if isinstance(node, (list, tuple)) or node is None else node

    for group, node in resolved.items():
        if group not in ("run_dir", "tune", "hydra", "logger"):  # where the run is recorded: not a setting
            walk(group, node)
    return out


MOMENTS = (names.EVAL_AT_S, names.TO_TARGET_S, names.TO_TARGET_STEP)


def hparams_columns(run, invocation, ran: dict[str, Any]) -> dict[str, Any]:
    """The columns of this run in TensorBoard's HParams tab: its overrides on one line, every
    setting, and what ran where the config left a choice (`ran`: the model, data, task,
    precision, batch size and workers the run used)."""
    aug = run.augmentation
    preset = "+".join(x.preset for x in aug.schedule) or aug.preset
    preset = "none" if aug.placement == "none" else ("transforms" if aug.transforms else preset)
    resolved = masked(plain(run))
    return {
        "overrides": identity(invocation),
        **settings(resolved),
        **swept(resolved, invocation),
        **ran,
        "augmentation": aug.placement,
        "augmentation.preset": preset,
        "optim": run.optim.optimizer["_target_"].rsplit(".", 1)[-1],
        "optim.lr": run.optim.optimizer.get("lr", float("nan")),
        "trainer.compile": run.trainer.compile,
        "trainer.channels_last": run.trainer.channels_last,
    }


def review_hint(run_dir, watched: list[str], metrics: dict, sweep_dir: str | None = None) -> str:
    """The TensorBoard command for this run's logdir and a link to Time Series with the learning
    curves pinned first (its groups are ordered by name: cpu/ before train/), unsmoothed for a
    run of few evaluations (the default smoothing, 0.6, draws their last value far from the
    real one). The logdir is a sweep job's sweep dir (its jobs side by side, each named by
    what the sweep varied), else the `outputs` folder above the run (`tensorboard --logdir
    outputs`: every run)."""
    import json
    import urllib.parse
    from pathlib import Path

    parts_of = Path(run_dir).parts
    outputs = len(parts_of) - parts_of[::-1].index("outputs") if "outputs" in parts_of else None
    logdir = Path(sweep_dir) if sweep_dir else Path(*parts_of[:outputs]) if outputs else Path(run_dir)
    if logdir.is_absolute() and logdir.is_relative_to(Path.cwd()):  # as the user would type it, from where they ran
        logdir = logdir.relative_to(Path.cwd())
    pinned = [t for t in dict.fromkeys([names.TRAIN_LOSS, names.VAL_LOSS, *watched]) if t in metrics]
    query = {"pinnedCards": json.dumps([{"plugin": "scalars", "tag": t} for t in pinned], separators=(",", ":"))}
    short = metrics.get(names.EPOCH, 0) < 20
    if short:
        query["smoothing"] = "0"
    return (
        f"tensorboard --logdir {logdir}, then http://localhost:6006/?{urllib.parse.urlencode(query)}#timeseries (loss "
        f"and metrics pinned first{', unsmoothed: a short run' if short else ''}; the Custom Scalars tab is the "
        "overview)"
    )


def matrix_image(matrix, labels: list[str] | None = None, cell: int = 28):
    """A (K, K) matrix in [0, 1] (a normalised confusion matrix: rows the true classes) as an
    RGB image tensor (3, H, W) in [0, 1]: one shaded cell per entry, its value written in it,
    the class names along the edges (PIL's own font: no plotting library needed)."""
    import numpy as np
    import torch
    from PIL import Image, ImageDraw

    k = matrix.shape[0]
    names = [str(label)[:8] for label in (labels or range(k))]
    margin = 7 * max(len(n) for n in names) + 6
    image = Image.new("RGB", (margin + k * cell + 2, margin + k * cell + 2), "white")
    draw = ImageDraw.Draw(image)
    values = torch.nan_to_num(torch.as_tensor(matrix).float()).clamp(0, 1).tolist()
    for i in range(k):
        draw.text((2, margin + i * cell + cell // 3), names[i], fill="black")  # true class (rows)
        draw.text((margin + i * cell + 2, 2), names[i][: cell // 7], fill="black")  # predicted class (columns)
        for j in range(k):
            v = values[i][j]
            shade = int(255 * (1 - v))
            x0, y0 = margin + j * cell, margin + i * cell
            draw.rectangle([x0, y0, x0 + cell - 1, y0 + cell - 1], fill=(shade, shade, 255), outline="grey")
            draw.text(
                (x0 + 3, y0 + cell // 3), f"{v:.2f}"[1:] if v < 1 else "1.0", fill="white" if v > 0.5 else "black"
            )
    return torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255
