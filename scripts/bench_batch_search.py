"""What loader.batch_size=auto costs, against one epoch of the same run with the default batch.

    python scripts/bench_batch_search.py                       # digits
    python scripts/bench_batch_search.py data=synthetic data.num_train=50000   # CIFAR-10-sized

Runs, in this process: the batch-size search (no cache) and a one-epoch run at the config's
own batch size; prints the search's trial table, its seconds, and the epoch's seconds
(steps per epoch x the measured step time, start-up excluded).
"""

from __future__ import annotations

import json
import logging
import sys
import tempfile
from pathlib import Path

from hydra import compose, initialize_config_dir

import saturate
from saturate import names
from saturate.components.batch_size import Trial, table
from saturate.config.dirs import CONF

saturate.register()  # the schema and resolvers, before composing conf/


def main() -> None:
    overrides = sys.argv[1:]
    logging.getLogger("saturate").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp, initialize_config_dir(str(CONF), version_base="1.3"):
        quiet = ["trainer.progress=false", "trainer.max_epochs=1"]
        epoch = saturate.train(compose("config", overrides=[*overrides, *quiet, f"run_dir={tmp}/epoch"]))
        searched = ["loader.batch_size=auto", "batch_search.cache=", "trainer.max_steps=1"]
        saturate.train(compose("config", overrides=[*overrides, *quiet, *searched, f"run_dir={tmp}/search"]))
        report = json.loads((Path(tmp) / "search" / "metrics.json").read_text())
    trials = [Trial(**t) for t in report["batch_search"]["trials"]]
    search_s = report["batch_search"]["seconds"]
    epoch_s = epoch[names.STEP] * epoch[names.STEP_MS] / 1000
    print(f"\n{' '.join(overrides) or 'default config'}\n")
    print(table(trials, report["batch_size"]))
    print(
        f"\nsearch: {search_s:.2f} s for {len(trials)} trials; one epoch at the configured batch: {epoch_s:.2f} s "
        f"({int(epoch[names.STEP])} steps x {epoch[names.STEP_MS]:.1f} ms); search / epoch = {search_s / epoch_s:.2f}"
    )


if __name__ == "__main__":
    main()
