"""What loader.batch_size=auto costs, against one epoch of the same run with the default batch.

    python scripts/bench_batch_search.py                       # digits
    python scripts/bench_batch_search.py data=synthetic data.num_train=50000   # CIFAR-10-sized

Runs, in this process: the batch-size search (no cache) and a one-epoch run at the config's
own batch size; prints the search's trial table, its seconds, and the epoch's seconds
(steps per epoch x the measured step time, start-up excluded).
"""

from __future__ import annotations

import logging
import sys
import tempfile
import time
from pathlib import Path

from hydra import compose, initialize_config_dir

import saturate
from saturate.batch_size import table

CONF = Path(__file__).resolve().parents[1] / "conf"


def main() -> None:
    overrides = sys.argv[1:]
    logging.getLogger("saturate").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp, initialize_config_dir(str(CONF), version_base="1.3"):
        quiet = ["trainer.progress=false", "trainer.max_epochs=1"]
        epoch = saturate.train(compose("config", overrides=[*overrides, *quiet, f"run_dir={tmp}/epoch"]))
        run = saturate.config.validate(compose("config", overrides=[*overrides, f"run_dir={tmp}/search", "batch_search.cache="]))
        device = saturate.device.setup_device(run.device)
        train_set, _, info = saturate.data.build_datasets(run.data)
        precision = saturate.precision.setup_precision(run.precision, device)
        d = saturate.distributed.Dist()
        models = saturate.run._setup_model(run.model, info, device, run.trainer, precision, d, batch_size=run.batch_search.min)
        start = time.perf_counter()
        chosen, trials = saturate.run._auto_batch_size(run, models, precision, train_set, info, device, d)
        search_s = time.perf_counter() - start
    epoch_s = epoch["progress/step"] * epoch["perf/step_ms"] / 1000
    print(f"\n{' '.join(overrides) or 'default config'}: {len(train_set)} training samples\n")
    print(table(trials, chosen))
    print(f"\nsearch: {search_s:.2f} s for {len(trials)} trials; one epoch at batch {run.loader.batch_size}: {epoch_s:.2f} s "
          f"({int(epoch['progress/step'])} steps x {epoch['perf/step_ms']:.1f} ms); search / epoch = {search_s / epoch_s:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
