"""MLflow: each run's settings as params, its metrics at their steps, its fingerprint, status
and verdict as tags, report.md and the config as artifacts (`logger=[tensorboard,mlflow]`).

The store needs no server: `sqlite:///<outputs>/mlflow/mlflow.db` (the `outputs` folder
above the run dir, else the sweep or run dir), artifacts beside it; open it with
`mlflow ui --backend-store-uri sqlite:///outputs/mlflow/mlflow.db`. A multirun is one parent
run with one child per job: `SweepParent`, a Hydra callback that the `logger=mlflow` option
adds, makes the store and the parent once, before any job starts (jobs that each made their
own would race to create the database and the parent). A resumed run continues its MLflow
run: the run id is kept in `<run dir>/mlflow.json`.

The tracker never slows or fails the run: every call goes out from one background thread
(metrics coalesced into one batch per send), anything the tracker refuses or cannot take
(a server down, a read-only store, a bad value) is a warning, and the run's end waits for the
thread at most `timeout_s`. mlflow is imported when a run starts, never by `--help`.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import queue
import re
import stat
import threading
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from saturate import files, names
from saturate import record as run_record
from saturate.errors import ConfigError, Problem, is_number, printable

log = logging.getLogger(__name__)

RUN_FILE = "mlflow.json"  # <run dir>/mlflow.json: the MLflow run this run dir continues
PARENT_FILE = "mlflow_parent.json"  # <sweep dir>/mlflow_parent.json: the sweep's parent run
PARENT_ENV = "SATURATE_MLFLOW_PARENT"  # the same, for jobs started by the process that made it
STATUS = {"completed": "FINISHED", "preempted": "KILLED"}  # anything else: FAILED
MAX_KEY, MAX_VALUE = 250, 6000  # MLflow's limits on a key and a param's value
MAX_EXPERIMENT = 500  # and on an experiment's name


def _quiet() -> None:
    """No telemetry from an offline machine; a server that is down fails a call at once instead of
    retrying for minutes (MLflow's default: 7 retries, 120 s each)."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")


def default_uri(folder: str | Path) -> str:
    """The local store for a run or sweep dir: `<outputs>/mlflow/mlflow.db`, where `outputs` is the
    nearest folder of that name above it (Hydra's run and sweep dirs both sit in it), else the dir."""
    folder = Path(folder).absolute()
    root = next((p for p in (folder, *folder.parents) if p.name == "outputs"), folder)
    return f"sqlite:///{root / 'mlflow' / 'mlflow.db'}"


def _artifacts(uri: str) -> str | None:
    """Where a sqlite store's artifacts go: beside the database (MLflow's default is ./mlruns of
    whatever the working directory was)."""
    if not uri.startswith("sqlite:///"):
        return None
    return (Path(uri[len("sqlite:///") :]).parent / "artifacts").as_uri()


class Unusable(Exception):
    """A local store that MLflow could not use, seen before MLflow is handed it."""


SQLITE_HEADER = b"SQLite format 3\x00"  # the first bytes of every SQLite database


def check_sqlite(uri: str) -> None:
    """Unusable when a `sqlite:///` store's path is not a database MLflow can write: a folder
    (MLflow retries making its engine for over a minute before it gives up), a file of other bytes, or
    a read-only file or folder (each write would fail, after MLflow's error and traceback)."""
    if not uri.startswith("sqlite:///"):
        return
    path = Path(uri[len("sqlite:///") :])
    try:
        info = path.stat()
    except (FileNotFoundError, NotADirectoryError):
        info = None
    if info is not None and not stat.S_ISREG(info.st_mode):
        raise Unusable(f"{printable(path)} is {'a folder' if stat.S_ISDIR(info.st_mode) else 'not a file'}, "
                       "not a database")  # fmt: skip
    if info is not None and info.st_size:
        with open(path, "rb") as f:
            if f.read(len(SQLITE_HEADER)) != SQLITE_HEADER:
                raise Unusable(f"{printable(path)} is not a database (not SQLite)")
    for what, where in (("the database", path), ("its folder", path.parent)):
        if where.exists() and not os.access(where, os.W_OK):
            raise Unusable(f"{what} {printable(where)} is read-only")


def open_store(uri: str, experiment: str):
    """(client, experiment id) for `uri`, the store and the experiment made when new."""
    _quiet()
    check_sqlite(uri)
    from mlflow.tracking import MlflowClient

    # MLflow's own records (its engine's retries, its errors with the SQL and a traceback) are not
    # shown: every failure they describe reaches saturate as an exception, said in one warning line
    for name in ("mlflow", "alembic"):  # after the import: mlflow sets its own logger's level when imported
        logging.getLogger(name).setLevel(logging.CRITICAL)

    if uri.startswith("sqlite:///"):
        Path(uri[len("sqlite:///") :]).parent.mkdir(parents=True, exist_ok=True)
    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    if found is not None:
        return client, found.experiment_id
    # the experiment's kind, model training (MLflow 3.17's UI still opens on its GenAI pages: click "Model training")
    tags = {"mlflow.experimentKind": "custom_model_development"}
    return client, client.create_experiment(experiment, artifact_location=_artifacts(uri), tags=tags)


def _key(key: str) -> str:
    """A key MLflow takes: alphanumerics and `_-. :/` only, at most 250 characters."""
    return re.sub(r"[^A-Za-z0-9_\-. :/]", "_", str(key))[:MAX_KEY]


def _text(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value) if isinstance(value, (list, dict)) else str(value)
    return text[:MAX_VALUE]


class Sender:
    """One background thread that makes every call to the tracker, in order: metrics are
    coalesced into one `log_batch` per send; a call that fails is a warning (the first of each
    kind, then counted), never an error; after `max_failures` failures in a row it stops trying."""

    def __init__(self, client, run_id: str, *, max_failures: int = 5):
        self.client, self.run_id, self.max_failures = client, run_id, max_failures
        self.queue: queue.Queue = queue.Queue()
        self.failures, self.in_a_row = 0, 0
        self.warned: set[tuple[str, str]] = set()
        self.thread = threading.Thread(target=self._work, name="saturate-mlflow", daemon=True)
        self.thread.start()

    def metrics(self, metrics: dict[str, float], step: int) -> None:
        stamp = int(time.time() * 1000)
        self.queue.put(("metrics", [(_key(k), float(v), stamp, int(step)) for k, v in metrics.items()]))

    def call(self, what: str, fn, *args, **kwargs) -> None:
        """`fn(*args, **kwargs)` on the thread; `what` names it in a warning."""
        self.queue.put(("call", (what, fn, args, kwargs)))

    def close(self, timeout_s: float) -> bool:
        """Send what is queued, waiting at most `timeout_s`; False if it could not."""
        self.queue.put(None)
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            log.warning("mlflow: the tracker did not take the run's last %d item(s) in %.0f s: left unsent",
                        self.queue.qsize(), timeout_s)  # fmt: skip
            return False
        if self.failures:
            log.warning("mlflow: %d call(s) to the tracker failed in this run (the first of each kind said why)",
                        self.failures)  # fmt: skip
        return True

    def _work(self) -> None:
        while (item := self.queue.get()) is not None:
            if item[0] == "metrics":
                batch = item[1]
                while (
                    not self.queue.empty() and self.queue.queue[0] is not None and self.queue.queue[0][0] == "metrics"
                ):
                    batch += self.queue.get()[1]  # what came meanwhile goes out in the same call
                self._send_metrics(batch)
            else:
                what, fn, args, kwargs = item[1]
                self._try(what, fn, *args, **kwargs)

    def _send_metrics(self, batch: list) -> None:
        from mlflow.entities import Metric

        for start in range(0, len(batch), 1000):  # a server takes at most 1000 metrics per batch
            metrics = [Metric(k, v, t, s) for k, v, t, s in batch[start : start + 1000]]
            if self._try("log metrics", self.client.log_batch, self.run_id, metrics=metrics) == "refused":
                # one value refused: the others one at a time, so that it loses only itself
                for metric in metrics:
                    self._try(f"log {metric.key}", self.client.log_batch, self.run_id, metrics=[metric])

    def _try(self, what: str, fn, *args, **kwargs) -> str:
        """ "sent", "refused" (the tracker said no to a value) or "failed" (it could not be reached,
        or gave up on it before)."""
        if self.in_a_row >= self.max_failures:
            self.failures += 1
            return "failed"
        try:
            fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 (the tracker's trouble is never the run's)
            self.failures += 1
            refused = _refusal(e)
            self.in_a_row = 0 if refused else self.in_a_row + 1  # a refused value says the tracker is there
            kind = type(e).__name__
            if (kind, what) not in self.warned:  # once per kind of failure and call (a bad value's key)
                self.warned.add((kind, what))
                log.warning("mlflow: %s failed (%s: %s); the run goes on", what, kind, " ".join(str(e).split())[:300])
            if self.in_a_row == self.max_failures:
                log.warning("mlflow: %d calls in a row failed; this run sends nothing more", self.max_failures)
            return "refused" if refused else "failed"
        self.in_a_row = 0
        return "sent"


def _refusal(error: Exception) -> bool:
    """Whether the tracker refused a value (MLflow's INVALID_PARAMETER_VALUE, a ValueError), as
    opposed to being unreachable or broken."""
    return getattr(error, "error_code", None) == "INVALID_PARAMETER_VALUE" or isinstance(error, (ValueError, TypeError))


class MLflowLogger:
    """`tracking_uri`: any MLflow URI (default: the local sqlite store above); `experiment`:
    default the Hydra job's name (`train`); `log_checkpoint`: also upload best.pt."""

    def __init__(
        self,
        tracking_uri: str | None = None,
        experiment: str | None = None,
        log_checkpoint: bool = False,
        timeout_s: float = 30.0,
    ):
        problems = [
            Problem(f"logger.mlflow.{key}", value, allowed)
            for key, value, ok, allowed in (
                ("tracking_uri", tracking_uri, tracking_uri is None or _named(tracking_uri), "null or a URI"),
                ("experiment", experiment, experiment is None or _named(experiment, MAX_EXPERIMENT),
                 f"null or a name of at most {MAX_EXPERIMENT} characters"),
                ("log_checkpoint", log_checkpoint, isinstance(log_checkpoint, bool), "true or false"),
                ("timeout_s", timeout_s, is_number(timeout_s, 0, math.inf, open_low=True, open_high=True),
                 "a number > 0 (seconds)"),
            )
            if not ok
        ]  # fmt: skip
        if problems:
            raise ConfigError(problems)
        self.tracking_uri, self.experiment = tracking_uri, experiment
        self.log_checkpoint, self.timeout_s = log_checkpoint, timeout_s
        self.client: Any = None  # an MlflowClient once the run starts
        self.run_id: Any = None
        self.sender: Any = None
        self.params: dict[str, str] = {}
        self.uri: str | None = None

    def on_run_start(self, run) -> None:
        sweep = run.info.get("sweep")
        uri = self.tracking_uri or default_uri(sweep or run.run_dir)
        experiment = self.experiment or run.info.get("app") or "saturate"
        try:
            self.client, experiment_id = open_store(uri, experiment)
            self.run_id = self._continue(run, uri) or self._create(run, experiment_id, uri, sweep)
        except Exception as e:  # noqa: BLE001 (no tracker: the run goes on without it)
            log.warning("mlflow: cannot use the store %s (%s); this run is not tracked there", uri, _why(e))
            self.client = None
            return
        self.sender, self.uri = Sender(self.client, self.run_id), uri

    def _continue(self, run, uri: str) -> str | None:
        """The MLflow run an earlier attempt in this run dir started, reopened (None: none)."""
        saved = run.run_dir / RUN_FILE
        if not saved.is_file():
            return None
        try:
            record = json.loads(saved.read_text())
            if record.get("tracking_uri") != uri:
                raise ValueError(f"it was tracked in {record.get('tracking_uri')}")
            run_id = self.client.get_run(record["run_id"]).info.run_id
            self.client.update_run(run_id, status="RUNNING")
            self.client.set_tag(run_id, "saturate.resumed_from_step", str(run.start_step))
        except Exception as e:  # noqa: BLE001
            log.warning("mlflow: cannot continue the run in %s (%s); a new MLflow run starts", saved, e)
            return None
        return run_id

    def _create(self, run, experiment_id: str, uri: str, sweep: str | None) -> str:
        tags = {
            "saturate.run_dir": str(run.run_dir),
            **{f"saturate.{k}": str(run.info[k]) for k in ("data", "model", "task") if k in run.info},
        }
        parent = _parent(sweep, uri) if sweep else None
        if parent:
            tags["mlflow.parentRunId"] = parent
        if sweep:
            tags["saturate.sweep_dir"] = str(sweep)
        created = self.client.create_run(experiment_id, run_name=run.info.get("name") or run.run_dir.name, tags=tags)
        run_id = created.info.run_id
        files.write_text(run.run_dir / RUN_FILE, json.dumps({"run_id": run_id, "tracking_uri": uri}) + "\n")
        return run_id

    def on_log(self, run, metrics: dict[str, float], step: int) -> None:
        if self.sender is not None:
            self.sender.metrics({k: v for k, v in metrics.items() if _number(v) and k not in HIDDEN}, step)

    def on_text(self, run, tag: str, text: str, step: int) -> None:
        """The fingerprint as a tag, the config as an artifact as TensorBoard shows it; the report is
        uploaded as report.md at the end."""
        if self.sender is None:
            return
        if tag == "fingerprint":
            fingerprint = re.sub(r"^```\w*\n|```$", "", text.strip())  # the YAML, out of its Markdown fence
            self.sender.call(
                "set the fingerprint", self.client.set_tag, self.run_id, "saturate.fingerprint", fingerprint
            )
        elif tag == "config":
            self.sender.call("log the config", self.client.log_text, self.run_id, text, "config.md")

    def on_hparams(self, run, params: dict[str, Any], metrics: dict[str, float], varied: list[str]) -> None:
        """The settings, as TensorBoard's HParams session has them: MLflow's params."""
        self.params = {_key(k): _text(v) for k, v in params.items()}

    def on_run_end(self, run, metrics: dict[str, Any]) -> None:
        if self.sender is None:
            return
        self._send_params()
        record = _record(run.run_dir)
        status = metrics.get("status") or record.get("status") or "failed"
        tags = {"saturate.status": status}
        if record.get("verdict"):
            tags["saturate.verdict"] = str(record["verdict"])
        for key, value in tags.items():
            self.sender.call(f"set {key}", self.client.set_tag, self.run_id, key, value)
        uploads = [run.run_dir / "report.md", run.run_dir / ".hydra" / "config.yaml", run_record.path(run.run_dir)]
        if self.log_checkpoint:
            uploads.append(run.run_dir / "checkpoints" / "best.pt")
        for path in uploads:
            if path.is_file():
                folder = "checkpoints" if path.suffix == ".pt" else None
                self.sender.call(f"upload {path.name}", self.client.log_artifact, self.run_id, str(path), folder)
        self.sender.call("end the run", self.client.set_terminated, self.run_id, STATUS.get(status, "FAILED"))
        if self.sender.close(self.timeout_s) and not self.sender.failures:
            log.info("mlflow: run %s in %s; mlflow ui --backend-store-uri %s", self.run_id, self.uri, self.uri)
        self.sender = None

    def _send_params(self) -> None:
        """The params not yet in the run (a resumed run's are; MLflow refuses a changed value)."""
        if not self.params:
            return
        from mlflow.entities import Param

        def send():
            known = self.client.get_run(self.run_id).data.params
            new = [Param(k, v) for k, v in self.params.items() if k not in known]
            changed = sorted(k for k, v in self.params.items() if k in known and known[k] != v)
            for start in range(0, len(new), 100):  # a server takes at most 100 per batch
                self.client.log_batch(self.run_id, params=new[start : start + 100])
            if changed:
                log.warning("mlflow: kept the first attempt's values of %s (MLflow keeps a param's first value)",
                            ", ".join(changed[:5]))  # fmt: skip

        self.sender.call("log the params", send)


HIDDEN = frozenset({names.STEP})  # the x axis of every chart, not a chart


def _named(value: Any, longest: int | None = None) -> bool:
    return isinstance(value, str) and bool(value.strip()) and (longest is None or len(value) <= longest)


def _why(error: Exception) -> str:
    """An exception in one line: what it says (an Unusable store), else its kind and what it says."""
    text = " ".join(str(error).split())[:300]
    return text if isinstance(error, Unusable) else f"{type(error).__name__}: {text}"


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _record(run_dir: Path) -> dict:
    done = run_record.read(run_dir)  # None: none written, a run that failed early
    return done.entries if done is not None else {}


def _parent(sweep: str, uri: str) -> str | None:
    """The sweep's parent run: the one this process's SweepParent made, or the one written in the
    sweep dir (jobs started elsewhere, as SLURM's are); None (with a warning) when there is none."""
    given = os.environ.get(PARENT_ENV, "")
    if given.startswith(f"{uri}#"):
        return given.split("#", 1)[1]
    try:
        record = json.loads((Path(sweep) / PARENT_FILE).read_text())
        if record["tracking_uri"] == uri:
            return record["run_id"]
    except (OSError, ValueError, KeyError):
        pass
    log.warning("mlflow: no parent run for the sweep %s (hydra.callbacks.mlflow_sweep is not set?): "
                "this job is a run of its own", sweep)  # fmt: skip
    return None


class SweepParent(Callback):
    """A Hydra callback (`hydra.callbacks.mlflow_sweep`, which conf/logger/mlflow.yaml sets):
    before a multirun's first job, the store and the sweep's parent run; when the sweep ends,
    however it ends, the parent ended with the sweep's status. A single run does nothing here.

    Hydra calls on_multirun_end only when the sweep returns; a sweep that raises (a job failed,
    Ctrl-C) does not reach it. So the parent is also ended at the process's exit (atexit), in the
    process that made it, whichever launcher ran the jobs: its status is read from the jobs'
    records in the sweep dir (sweep_status)."""

    def __init__(self):
        self.client: Any = None  # an MlflowClient during a multirun
        self.run_id: str | None = None
        self.sweep: Path | None = None
        self.returned = False  # the sweep reached on_multirun_end

    def on_multirun_start(self, config, **kwargs) -> None:
        from omegaconf import OmegaConf

        node = OmegaConf.select(config, "logger.mlflow")
        if node is None:  # logger=mlflow taken out again on the command line
            return
        sweep = Path(str(config.hydra.sweep.dir)).absolute()
        uri = node.get("tracking_uri") or default_uri(sweep)
        swept = _swept(list(config.hydra.overrides.task))
        try:
            self.client, experiment_id = open_store(uri, node.get("experiment") or config.hydra.job.name)
            tags = {"saturate.sweep_dir": str(sweep), "saturate.role": "sweep"}
            name = " ".join(swept) or sweep.name
            self.run_id = self.client.create_run(experiment_id, run_name=name, tags=tags).info.run_id
            self.sweep, self.returned = sweep, False
            atexit.register(self.end)
            sweep.mkdir(parents=True, exist_ok=True)
            files.write_text(sweep / PARENT_FILE, json.dumps({"run_id": self.run_id, "tracking_uri": uri}) + "\n")
        except Exception as e:  # noqa: BLE001
            log.warning("mlflow: cannot make the sweep's parent run in %s (%s)", uri, _why(e))
            return
        os.environ[PARENT_ENV] = f"{uri}#{self.run_id}"

    def on_multirun_end(self, config, **kwargs) -> None:
        self.returned = True
        self.end()

    def end(self) -> None:
        """The parent ended with the sweep's status (once; nothing when there is none)."""
        if self.run_id is None or self.sweep is None:
            return
        run_id, self.run_id = self.run_id, None
        atexit.unregister(self.end)
        os.environ.pop(PARENT_ENV, None)
        try:
            self.client.set_terminated(run_id, sweep_status(self.sweep, returned=self.returned))
        except Exception as e:  # noqa: BLE001
            log.warning("mlflow: cannot end the sweep's parent run (%s)", _why(e))


def sweep_status(sweep: Path, *, returned: bool) -> str:
    """The status of a sweep's parent run, from its jobs' records: FAILED when a job failed (or
    diverged, or left no record), KILLED when one was stopped (preempted, Ctrl-C), FINISHED when
    every job completed and the sweep returned; a sweep that raised with no job to blame failed."""
    try:
        jobs = [p for p in sweep.iterdir() if re.match(r"\d+(_|$)", p.name) and p.is_dir() and not p.is_symlink()]
    except OSError:
        jobs = []
    statuses = set()
    for job in jobs:  # each job's metrics.json, read as saturate.record reads any record (no link, no FIFO)
        found = run_record.read(job)
        statuses.add(found.status if found is not None else None)
    if statuses - {"completed", "preempted"}:
        return "FAILED"
    if "preempted" in statuses:
        return "KILLED"
    return "FINISHED" if returned else "FAILED"


def _swept(overrides: list[str]) -> list[str]:
    """The sweep's own overrides (`optim.optimizer.lr=0.01,0.02`, `range(...)`), as given: its parent run's name."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception:  # noqa: BLE001 (a name is not worth failing over)
        return []
    return [text for text, o in zip(overrides, parsed, strict=True) if o.is_sweep_override()]
