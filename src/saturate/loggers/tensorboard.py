"""TensorBoard event files under `<run dir>/tb`: every metric as a scalar, texts (the report,
the config), image grids, the Custom Scalars overview and the HParams entry."""

from __future__ import annotations

import re
from typing import Any


class TensorBoardLogger:
    """A run resumed at step N first drops the events an earlier attempt wrote after N
    (TensorBoard's purge_step), so its curves do not fork."""

    def __init__(self, subdir: str = "tb"):
        self.subdir, self.writer = subdir, None

    def on_run_start(self, run) -> None:
        from torch.utils.tensorboard import SummaryWriter  # imported here: slow, and rank 0 only

        self.writer = SummaryWriter(str(run.run_dir / self.subdir), purge_step=run.start_step + 1 if run.start_step else None)

    def on_log(self, run, metrics: dict[str, float], step: int) -> None:
        for tag, value in metrics.items():
            self.writer.add_scalar(tag, value, step)

    def on_text(self, run, tag: str, text: str, step: int) -> None:
        self.writer.add_text(tag, text, step)

    def on_images(self, run, tag: str, images, step: int) -> None:
        self.writer.add_images(tag, images, step)

    def on_layout(self, run, charts: dict[str, list[str]]) -> None:
        """The Custom Scalars tab: one chart per entry, each plotting the exact tags listed."""
        exact = {title: ["Multiline", [f"^{re.escape(tag)}$" for tag in tags]] for title, tags in charts.items()}
        self.writer.add_custom_scalars({"saturate": exact})

    def on_hparams(self, run, params: dict[str, Any], metrics: dict[str, float], varied: list[str]) -> None:
        """The experiment (columns in the order given, metrics too) and this run's session.
        TensorBoard sorts the columns by (not differs, name) and ticks the first few: the
        `varied` ones are marked as differing, so a sweep's keys come first."""
        from tensorboard.plugins.hparams import plugin_data_pb2
        from torch.utils.tensorboard.summary import hparams

        experiment, session_start, session_end = hparams(params, metrics)
        stored = experiment.value[0].metadata.plugin_data
        data = plugin_data_pb2.HParamsPluginData.FromString(stored.content)
        for info in data.experiment.hparam_infos:
            info.differs = info.name in varied
        stored.content = data.SerializeToString()
        for summary in (experiment, session_start, session_end):
            self.writer.file_writer.add_summary(summary)

    def on_run_end(self, run, metrics: dict[str, Any]) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
