"""logger=wandb, offline (no account, no network), tested by the files it writes: the run's
`.wandb` file read back record by record (wandb ships the records' protobuf schema, not a
reader: the format is LevelDB's log format)."""

from __future__ import annotations

import importlib.util
import json
import struct
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(  # find_spec: collecting should not pay for importing wandb
    importlib.util.find_spec("wandb") is None, reason="the wandb extra is not installed (pip install -e '.[wandb]')"
)


def records(path: Path):
    """The protobuf records of a `.wandb` file: a 7-byte header (":W&B", version), then LevelDB's
    log format (32 KiB blocks of chunks: crc32, length, type full/first/middle/last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, buf = 32768, 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail, padded
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        payload = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        buf = payload if kind in (1, 2) else buf + payload
        if kind in (1, 4):  # full or last: a whole record
            record = pb.Record()
            record.ParseFromString(buf)
            yield record


def read_back(run_dir: Path) -> dict:
    """history rows, config and summary of the run's (first) offline directory."""
    offline = sorted((run_dir / "wandb").glob("offline-run-*"))[0]
    (file,) = offline.glob("run-*.wandb")
    out = {"history": [], "config": {}, "summary": {}, "run": None, "files": []}
    deadline = time.monotonic() + 30
    while not any(r.WhichOneof("record_type") == "exit" for r in records(file)):  # wandb-core writes it on its own
        assert time.monotonic() < deadline, f"{file} has no exit record"
        time.sleep(0.1)
    for record in records(file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            out["history"].append(
                {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            )
        elif kind == "run":
            out["run"] = record.run
            out["config"].update({i.key: json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "config":
            out["config"].update({i.key: json.loads(i.value_json) for i in record.config.update})
        elif kind == "summary":
            out["summary"].update(
                {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.summary.update}
            )
        elif kind == "files":
            out["files"] += [f.path for f in record.files.files]
    return out


def test_the_logger_writes_an_offline_run_and_a_resume_keeps_its_id(tmp_path):
    """The logger on its own (no training: the default suite's seconds), as a run calls it; then
    again in the same run dir, as a resumed run."""
    from types import SimpleNamespace

    from saturate.loggers import WandbLogger

    info = {"name": "optim.lr-0.1", "app": "train", "sweep": str(tmp_path / "sweep"), "model": "SmallCNN"}
    run = SimpleNamespace(run_dir=tmp_path / "run", info=info, start_step=0, step=0, metrics={})
    run.run_dir.mkdir()
    (run.run_dir / "report.md").write_text("# the report")
    logger = WandbLogger()
    logger.on_run_start(run)
    for step in (1, 2, 3):
        logger.on_log(run, {"train/loss": 1.0 / step, "progress/step": step}, step)
    logger.on_text(run, "fingerprint", "```yaml\ntorch: 2.13.0\n```", 0)
    logger.on_hparams(run, {"optim.lr": 0.1, "model": "SmallCNN"}, {}, [])
    (run.run_dir / "metrics.json").write_text(json.dumps({"status": "completed", "verdict": "input-bound"}))
    logger.on_run_end(run, {"status": "completed"})
    got = read_back(run.run_dir)
    run_id = (run.run_dir / "wandb" / "run_id").read_text().strip()
    assert got["run"].run_id == run_id and got["run"].project == "train" and got["run"].run_group == "sweep"
    assert [(row["_step"], row["train/loss"]) for row in got["history"]] == [(1, 1.0), (2, 0.5), (3, 1 / 3)]
    assert got["config"]["optim.lr"] == 0.1 and got["config"]["fingerprint"] == "torch: 2.13.0\n"
    assert got["summary"]["saturate/verdict"] == "input-bound" and got["summary"]["saturate/status"] == "completed"
    assert {"completed", "input-bound", "SmallCNN"} <= set(got["run"].tags) and "report.md" in got["files"]
    # resumed at step 3: the same id, a directory of its own (wandb sync joins them)
    run.start_step = 3
    logger.on_run_start(run)
    logger.on_log(run, {"train/loss": 0.25}, 4)
    logger.on_run_end(run, {"status": "completed"})
    attempts = sorted((run.run_dir / "wandb").glob("offline-run-*"))
    # (two attempts in the same second: wandb adds -1 to the second directory's name)
    assert len(attempts) == 2 and all((p / f"run-{run_id}.wandb").is_file() for p in attempts)


@pytest.mark.slow
def test_a_real_run_writes_its_metrics_settings_and_verdict(tracked_run):
    cfg, metrics, _ = tracked_run
    run_dir = Path(cfg.run_dir)
    run_id = (run_dir / "wandb" / "run_id").read_text().strip()
    got = read_back(run_dir)
    assert got["run"].run_id == run_id and got["run"].project == "train"
    losses = {row["_step"]: row["train/loss"] for row in got["history"] if "train/loss" in row}
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]  # every step (log_interval=1), at its step
    accs = [row["val/acc"] for row in got["history"] if "val/acc" in row]
    assert accs[-1] == pytest.approx(metrics["val/acc"])
    # the settings as TensorBoard's HParams session has them; the fingerprint
    assert got["config"]["loader.batch_size"] == 32 and got["config"]["model"] == "SmallCNN"
    assert "torch" in got["config"]["fingerprint"]
    record = json.loads((run_dir / "metrics.json").read_text())
    assert got["summary"]["saturate/status"] == "completed"
    assert got["summary"]["saturate/verdict"] == record["verdict"]
    assert {"completed", record["verdict"]} <= set(got["run"].tags)
    assert "report.md" in got["files"]  # uploaded by `wandb sync` with the run
