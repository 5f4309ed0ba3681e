"""The checkpointer: when a run saves, what it keeps, and resuming from it. Each save is
one file written atomically (saturate.checkpoint.files). `last.pt` is
rewritten at every save; `best.pt` when the monitored metric improves; with top_k > 1 the
k best are also kept as `top-<epoch>-<step>.pt`.

When an epoch's end saves (`Cadence`): every N-th epoch with an integer
trainer.checkpoint_interval; with `auto` (the default) once a bounded stretch of wall time has
passed since the last save, as Lightning's `ModelCheckpoint(train_time_interval=...)`, so that a
run of short epochs is not spent writing files. The last epoch, a stop and a failure always
save. An evaluation whose epoch end saves nothing but improves on the best is held in host
memory and written as best.pt with the next save, so that best.pt does not depend on the
interval.

The saves during training (`checkpoint.background`, on by default) are written by a thread
beside it, as Lightning's AsyncCheckpointIO and torch.distributed.checkpoint's async_save do:
the loop waits only while the state is copied to the host, one save is in flight at a time,
and its files are on disk before the next save, the end of the loop, a stop or an
`on_checkpoint` hook (which reads them). A save that fails in the thread (a full disk) fails
the run at the next save or the end of the loop, with the same message; a stop's own save
logs it and still saves.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from saturate.checkpoint.files import (
    SLOW_SAVE_S,
    Writer,
    gist,
    load,
    newest,
    non_finite,
    rng_state,
    set_rng_state,
    signals_held,
    snapshot,
    write_files,
)
from saturate.checkpoint.resume import (
    Resumed,
    apply_hyperparameters,
    checked_lr_scale,
    configured_hyperparameters,
    flat,
)
from saturate.config.invocation import is_setting_key
from saturate.config.schema import CheckpointConfig
from saturate.errors import CheckpointError

log = logging.getLogger(__name__)

# checkpoint_interval=auto: an epoch's end saves once this much wall time has passed since the last save. A minute
# bounds what a SIGKILL (or a crash that leaves no stop's save) can lose, at about one save a minute: under 5 % of
# the loop for any save the loop waits less than 3 s for (with checkpoint.background, the copy to the host).
AUTO_INTERVAL_S = 60.0
# ...and never more often than this share of the time between saves goes to the loop's wait for one (a model
# whose copy takes 10 s saves every 200 s)
AUTO_SAVE_SHARE = 0.05


class Cadence:
    """Whether an epoch's end saves last.pt: every `every`-th epoch (an integer
    trainer.checkpoint_interval), or with "auto" once AUTO_INTERVAL_S of wall time (`clock`, in
    seconds) has passed since the last save, or the loop's wait for that save over
    AUTO_SAVE_SHARE when that is longer."""

    def __init__(self, interval: int | str, clock: Callable[[], float] = time.monotonic):
        self.every = None if interval == "auto" else int(interval)
        self.clock = clock
        self.saved_at = clock()  # the run's start counts as a save: the first one after a full interval
        self.waited = 0.0

    def due(self, epoch: int) -> bool:
        if self.every is not None:
            return epoch % self.every == 0
        return self.clock() - self.saved_at >= max(AUTO_INTERVAL_S, self.waited / AUTO_SAVE_SHARE)

    def saved(self, waited: float) -> None:
        """A save was made (at an epoch's end, every_n_steps, an evaluation inside the epoch): the
        interval starts again from now."""
        self.saved_at, self.waited = self.clock(), waited


class Checkpointer:
    """Saves and restores a run. `model`: the trained module; `stateful`: the optimizer,
    schedule, scaler, observers and the training order, each with state_dict() and
    load_state_dict(). Each save is given where the loop is (`position`: epoch, step,
    batch_in_epoch) and the run's state (`run`: its `eval_model`, the module evaluated and
    saved as the run's weights, and its `lr_scale`): when a callback keeps an average as
    eval_model, the checkpoint holds both, `model` the weights that scored and `train_model`
    the ones training continues from."""

    def __init__(
        self,
        directory: Path,
        cfg: CheckpointConfig,
        *,
        interval: int | str,
        model,
        stateful: dict[str, Any],
        config: dict,
        fingerprint: dict,
        enabled: bool = True,
        agree: Callable[[bool], bool] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.directory, self.cfg, self.stateful = directory, cfg, stateful
        self.cadence = Cadence(interval, clock)
        # several ranks: whether any rank's flag is set (saturate.scale.distributed.Dist.any), so that rank 0's
        # decision of a time-based save reaches the others
        self.agree = agree
        self.held: dict[str, Any] | None = None  # an improved evaluation not yet written as best.pt (hold)
        self.model, self.config, self.fingerprint, self.enabled = model, config, fingerprint, enabled
        self.pending: dict[str, Any] = {}  # restored once the observers have started (restore_run)
        self.best: float | None = None
        self.best_at: tuple[int, int] | None = None  # (epoch, step) of the best value
        self.saved_step: int | None = None  # of the last checkpoint written (finite weights)
        self.top: list[tuple[float, str]] = []  # (metric, file name) of the kept top-k files
        self.last_path = directory / "last.pt"
        self.writer = Writer()
        # the hyperparameters this run's config gives, before any step (a scheduler may move some,
        # e.g. OneCycleLR's momentum): saved, so that a resume applies only what the config changed
        self.configured = configured_hyperparameters(stateful)
        if enabled:
            directory.mkdir(parents=True, exist_ok=True)

    def due(self, epoch: int, last: bool) -> bool:
        """Whether this epoch's end saves: the last one always; else by the cadence. A time-based
        decision is rank 0's (the others' clocks differ), given to every rank in one small
        collective, so that all take the same path."""
        if last:
            return True
        if self.cadence.every is not None:
            return self.cadence.due(epoch)
        due = self.enabled and self.cadence.due(epoch)
        return self.agree(due) if self.agree is not None else due

    def due_step(self, step: int) -> bool:
        return self.cfg.every_n_steps > 0 and step % self.cfg.every_n_steps == 0

    def _better(self, value: float, than: float | None) -> bool:
        return than is None or (value > than if self.cfg.mode == "max" else value < than)

    def last_good(self) -> str:
        """Where the last checkpoint with finite weights is, in words (a save in flight waited
        for: its step once its files are written)."""
        self.close()
        if self.saved_step is None:
            return f"not saved yet (no checkpoint of this run has finite weights in {self.directory})"
        return f"{self.last_path} (step {self.saved_step})"

    def state_dict(self, position: Any, metrics: dict[str, float] | None = None, run: Any = None) -> dict[str, Any]:
        """The checkpoint of the run at `position` (its epoch, step and batch_in_epoch)."""
        evaluated = run.eval_model if run is not None else self.model
        weights = {"model": evaluated.state_dict()}
        if evaluated is not self.model:
            weights["train_model"] = self.model.state_dict()
        return {
            "metrics": {k: float(v) for k, v in (metrics or {}).items() if isinstance(v, (int, float))},
            **weights,
            **{name: part.state_dict() for name, part in self.stateful.items()},
            "epoch": position.epoch,
            "step": position.step,
            "batch_in_epoch": position.batch_in_epoch,  # with the epoch's seeded order: the next sample
            "best": self.best,
            "top": self.top,
            "lr_scale": float(run.lr_scale) if run is not None else 1.0,
            "rng": rng_state(),
            "optimizer_class": type(self.stateful["optimizer"]).__name__ if "optimizer" in self.stateful else None,
            "configured": self.configured,
            "config": self.config,
            "fingerprint": self.fingerprint,
        }

    def save(self, state: Any, metrics: dict[str, float], run: Any = None, *, background: bool = False) -> float:
        """Save last.pt (and best.pt / a top-k file when `metrics` improve on them); return
        the seconds the caller waited. Stop signals wait for what the caller waits for (the
        state gathered and, in the loop, the files written). `background` (with
        checkpoint.background): the files are written by a thread from a copy of the state;
        `flush` waits for them. A save in the loop (a stop's, a failure's) first waits for the
        one in flight, whose failure is then logged, not raised: the stop's own save goes on."""
        if not self.enabled:
            return 0.0
        with signals_held():
            return self._save(state, metrics, run, background and self.cfg.background)

    def flush(self) -> None:
        """Wait until the save in flight is on disk; a failed one raises its error here."""
        self.writer.wait()

    def close(self) -> None:
        """Wait for the save in flight as the run ends on an error: its own failure is
        logged, not raised over the run's."""
        try:
            self.writer.wait()
        except Exception as e:  # noqa: BLE001 (the run's own error is the one raised)
            log.error("%s", e)

    def _save(self, state: Any, metrics: dict[str, float], run: Any, background: bool) -> float:
        start = time.perf_counter()
        if background:  # the save before this one is on disk: its failure is this run's
            self.flush()
        else:  # a stop's or a failure's save: an earlier write's failure is logged, this save still made
            self.close()
        checkpoint = self.state_dict(state, metrics, run)
        if self._refused(checkpoint, state.step):
            return 0.0
        value = self._monitored(metrics, state.step)
        improved = value is not None and self._better(value, self.best)
        if improved:
            self.best, self.best_at = value, (state.epoch, state.step)
            checkpoint["best"], checkpoint["best_at"] = value, list(self.best_at)
        ranked = (
            value is not None
            and self.cfg.top_k > 1
            and (len(self.top) < self.cfg.top_k or self._better(value, self.top[-1][0]))
        )
        paths = [self.last_path] + ([self.directory / "best.pt"] if improved else [])
        top = f"top-{state.epoch:03d}-{state.step:07d}.pt" if ranked else None
        removed = self._keep_top(value, top) if top and value is not None else []
        paths += [self.directory / top] if top else []
        # a better evaluation held since the last save, unless this one beats it: its own best.pt (checked as
        # it is written, once, not at each evaluation held)
        held = [(self.held, [self.directory / "best.pt"])] if self.held is not None and not improved else []
        if held and self._refused(held[0][0], held[0][0]["step"]):
            held = []
        self.held = None
        written = lambda step=state.step: setattr(self, "saved_step", step)
        if background:
            self.writer.submit(snapshot(checkpoint), paths, removed, written, also=held)
        else:
            write_files(checkpoint, paths, removed, also=held)
            written()
        seconds = time.perf_counter() - start
        self.cadence.saved(seconds)
        if seconds > SLOW_SAVE_S:
            log.warning(
                "checkpoint at step %d took %.1fs (> %.0fs): a preempted run may be killed before it finishes",
                state.step,
                seconds,
                SLOW_SAVE_S,
            )
        return seconds

    def hold(self, state: Any, metrics: dict[str, float], run: Any = None) -> None:
        """An evaluation at an epoch's end that saves nothing (trainer.checkpoint_interval):
        when it improves on the best, the run's state is copied to host memory and written
        as best.pt with the next save (the run's last at the latest, or a stop's), so that
        best.pt holds the best evaluation's weights whatever the interval. A SIGKILL before
        that save loses it with last.pt's progress: the files on disk stay consistent."""
        if not self.enabled:
            return
        value = self._monitored(metrics, state.step)
        if value is None or not self._better(value, self.best):
            return
        checkpoint = self.state_dict(state, metrics, run)
        self.best, self.best_at = value, (state.epoch, state.step)
        checkpoint["best"], checkpoint["best_at"] = value, list(self.best_at)
        fixed = {key: checkpoint.pop(key) for key in ("config", "fingerprint")}  # the run's own: never change
        self.held = {**snapshot(checkpoint), **fixed}

    def _refused(self, checkpoint: dict, step: int) -> bool:
        """Whether the state is not finite: never written, so that the previous file stays the last good one."""
        bad = non_finite(checkpoint["model"]) + non_finite(checkpoint.get("train_model", {}))
        if bad:
            log.error(
                "step %d: not saving a checkpoint: %d tensor(s) of the model hold NaN or inf (%s); the last good "
                "state is %s",
                step,
                len(bad),
                ", ".join(bad[:3]) + (", ..." if len(bad) > 3 else ""),
                self.last_good(),
            )
        return bool(bad)

    def _monitored(self, metrics: dict[str, float], step: int) -> float | None:
        """checkpoint.monitor's value in `metrics`, when finite (a NaN is never "better")."""
        value = metrics.get(self.cfg.monitor)
        if value is not None and not math.isfinite(value):
            what = "checkpoint.monitor: %s is %s at step %d; no best.pt from this evaluation"
            log.warning(what, self.cfg.monitor, value, step)
        return value if value is not None and math.isfinite(value) else None

    def _keep_top(self, value: float, name: str) -> list[Path]:
        """`name` (about to be written) among the k best; the files that drop out, for the
        writer to remove once it is whole."""
        self.top.append((value, name))
        self.top.sort(key=lambda t: t[0], reverse=self.cfg.mode == "max")
        dropped = [self.directory / n for _, n in self.top[self.cfg.top_k :] if n != name]
        del self.top[self.cfg.top_k :]
        return dropped

    def resume(self, spec: str | None) -> Resumed:
        """Restore from `spec` ("auto": the newest complete checkpoint here, else a fresh
        start; a .pt file; or a run dir) and return where to continue."""
        path = self._find(spec)
        if path is None:
            return Resumed()
        ckpt = load(path)
        optimizer, scheduler = self.stateful["optimizer"], self.stateful["scheduler"]
        saved_kind, kind = ckpt.get("optimizer_class"), type(optimizer).__name__
        if saved_kind is not None and saved_kind != kind:
            raise CheckpointError(
                f"trainer.resume: {path} was trained with {saved_kind}, this run's optimizer is {kind}: its state "
                "(momentum, step counts) cannot carry over; resume with the same optim"
            )
        lr_scale = checked_lr_scale(ckpt.get("lr_scale", 1.0), path)
        restore = {"model": (self.model, ckpt.get("train_model", ckpt["model"]))}
        entries = {"order": {}, "task": {}, **ckpt}  # a checkpoint from before loader.order: no order drawn
        restore.update({name: (part, entries[name]) for name, part in self.stateful.items() if name != "observers"})
        for name, (part, saved) in restore.items():
            try:
                part.load_state_dict(saved)
            except (RuntimeError, ValueError, KeyError) as e:
                raise CheckpointError(f"trainer.resume: {path} does not fit this run's {name}: {gist(e)}") from None
        self.pending = {
            "path": path,
            "eval": ckpt["model"] if "train_model" in ckpt else None,
            "observers": ckpt.get("observers", {}),
        }
        assert self.configured is not None, "resume: an optimizer and a schedule are given"
        applied = apply_hyperparameters(optimizer, scheduler, self.configured, ckpt.get("configured"), lr_scale)
        self._warn_changes(ckpt.get("config", {}), ckpt["step"], applied)
        set_rng_state(ckpt["rng"])
        self.best, self.top = ckpt.get("best"), [tuple(t) for t in ckpt.get("top", [])]
        self.best_at = tuple(ckpt["best_at"]) if ckpt.get("best_at") else None
        self.saved_step = ckpt["step"]
        resumed = Resumed(ckpt["epoch"], ckpt["step"], ckpt["batch_in_epoch"], lr_scale, ckpt.get("metrics", {}))
        log.info(
            "resumed from %s: epoch %d, step %d, batch %d of the epoch",
            path,
            resumed.epoch,
            resumed.step,
            resumed.batch_in_epoch,
        )
        return resumed

    def _find(self, spec: str | None) -> Path | None:
        """The checkpoint `spec` names (None: start fresh)."""
        if not spec:
            return None
        path = Path(spec).expanduser()
        if spec == "auto":
            found = newest(self.directory)
            if found is None:
                log.info("trainer.resume=auto: no checkpoint in %s; starting fresh", self.directory)
            return found
        if path.is_dir():
            found = newest(path / "checkpoints") if (path / "checkpoints").is_dir() else newest(path)
            if found is None:
                raise CheckpointError(f"trainer.resume={spec!r}: no checkpoint in {path}")
            return found
        return path

    def restore_run(self, run: Any) -> None:
        """After the observers started (a weight average exists now): the evaluated weights
        (into `run.eval_model`) and the observers' states of the checkpoint resumed from."""
        if not self.pending:
            return
        evaluated, path = run.eval_model, self.pending["path"]
        try:
            # an average: its own weights, or the trained ones when the checkpoint had none
            if evaluated is not self.model:
                saved = self.pending["eval"]
                evaluated.load_state_dict(saved if saved is not None else self.model.state_dict())
            if "observers" in self.stateful:
                self.stateful["observers"].load_state_dict(self.pending["observers"])
        except (RuntimeError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"trainer.resume: {path} does not fit this run's callbacks: {gist(e)}") from None
        self.pending = {}

    def _warn_changes(self, saved: dict, step: int, applied: list[str]) -> None:
        """Every setting that differs from the checkpoint's takes effect from `step` on (the
        run is built from this config); say which, and what became of the optimizer."""
        before, now = flat(saved), flat(self.config)
        changed = [
            f"{k}: {before.get(k)!r} -> {now.get(k)!r}"
            for k in sorted(set(before) | set(now))
            if before.get(k) != now.get(k) and is_setting_key(k)
        ]
        if changed:
            optimizer = (
                f"; optimizer and schedule rebuilt from the new values ({', '.join(applied)})" if applied else ""
            )
            log.warning(
                "resuming with changed settings, applied from step %d (the run will not equal an uninterrupted "
                "one): %s%s",
                step,
                "; ".join(changed),
                optimizer,
            )
