"""TensorBoard as a user sees it, in a real browser (Debian's chromium driven by Playwright:
`apt-get install chromium` and `pip install playwright`, see DEVELOPERS.md; skipped with the
reason where either is missing), over `tensorboard --logdir outputs` holding a plain run, a
two-key sweep and a one-key sweep. SATURATE_SCREENSHOTS=<dir> keeps the screenshots (the
README's are made so: docs/tensorboard/)."""

from __future__ import annotations

import json
import os
import re
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import CHROMIUM, run_cli
from tests.diagnostics.test_sweep import QUICK, tensorboard

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None, reason="no chromium here (apt-get install chromium; DEVELOPERS.md)"),
]


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    """outputs/ of a user who ran a plain run (read first), a 2x2 sweep and a width sweep."""
    cwd = tmp_path_factory.mktemp("user")
    runs = [
        run_cli(*QUICK, "trainer.max_epochs=2", "hydra.run.dir=outputs/a_plain_run", cwd=cwd),
        run_cli("-m", "loader.batch_size=32,64", "trainer.channels_last=true,false", *QUICK, cwd=cwd),
        run_cli("-m", "model.width=8,16", *QUICK, cwd=cwd),
    ]
    for done in runs:
        assert done.returncode == 0, done.stderr[-2000:]
    hint = re.search(
        r"review: tensorboard --logdir (\S+), then (http://localhost:6006/\S+)", runs[0].stdout + runs[0].stderr
    )
    assert hint and hint[1] == "outputs", runs[0].stdout[-2000:]
    # a sweep job's: its sweep, the jobs side by side under their own names
    sweep = re.search(r"review: tensorboard --logdir (\S+), then", runs[1].stdout + runs[1].stderr)
    assert sweep and re.fullmatch(r"outputs/multirun/[0-9-]+/[0-9-]+", sweep[1]), runs[1].stdout[-2000:]
    return cwd / "outputs", hint[2], cwd / sweep[1]


def shot(page, name: str) -> None:
    if os.environ.get("SATURATE_SCREENSHOTS"):
        Path(os.environ["SATURATE_SCREENSHOTS"]).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(os.environ["SATURATE_SCREENSHOTS"]) / f"{name}.png"))


def hparams_table(browser, url: str, name: str):
    """The HParams tab of the TensorBoard at `url`, once its table is drawn: (the page, the
    text of every grid cell); screenshot `name`."""
    page = browser.new_page(viewport={"width": 1600, "height": 900})
    page.goto(f"{url}/#hparams")
    page.locator("vaadin-grid-cell-content", has_text="Trial ID").wait_for(timeout=30000)
    page.wait_for_timeout(1500)
    shot(page, name)
    return page, [c.strip() for c in page.locator("vaadin-grid-cell-content").all_inner_texts()]


def test_hparams_shows_every_swept_key_whichever_run_is_read_first(logdir, browser):
    outputs, _, _ = logdir
    with tensorboard(outputs) as post:
        page, cells = hparams_table(browser, post.url, "hparams_table")
        header = cells[: cells.index("Trial ID") + 12]
        for key in ("loader.batch_size", "trainer.channels_last", "model.width", "overrides"):  # ticked: they differ
            assert key in header, header
        # booleans read true/false
        assert "true" in cells and "false" in cells and not any(c == "0.0000" for c in cells)
        rows = [c for c in cells if c.startswith("loader.batch_size=")]  # the overrides column, swept values first
        assert sorted(
            r.split(" trainer.max")[0].lower() for r in rows
        ) == [  # (a job's overrides as Hydra writes them: False)
            "loader.batch_size=32 trainer.channels_last=false",
            "loader.batch_size=32 trainer.channels_last=true",
            "loader.batch_size=64 trainer.channels_last=false",
            "loader.batch_size=64 trainer.channels_last=true",
        ]
        # run names carry their overrides, each run once (no `<run>/tb`, no `<run>/tb/hparams`)
        trials = [c for c in cells if c.startswith(("a_plain_run", "multirun/"))]
        assert len(trials) == 7 and any(c.endswith("/0_batch_size-32+channels_last-True") for c in trials), trials
        experiment = post("experiment", {"experimentName": ""})
        types = {h["name"]: h["type"] for h in experiment["hparamInfos"]}
        assert types["loader.batch_size"] == types["model.width"] == "DATA_TYPE_FLOAT64"  # numeric axes, range filters
        page.get_by_text("PARALLEL COORDINATES VIEW").click()
        page.wait_for_timeout(2500)
        shot(page, "hparams_parallel_coordinates")
        lines = page.locator("tf-hparams-parallel-coords-plot g.foreground path").count()
        assert lines == 7  # one line per run: a run lacking a column's value (the plain run's model.width) was left out


def test_the_link_a_run_prints_opens_time_series_on_its_learning_curves(logdir, browser):
    outputs, link, _ = logdir
    with tensorboard(outputs) as post:
        page = browser.new_page(viewport={"width": 1600, "height": 900})
        page.goto(link.replace("http://localhost:6006", post.url))
        page.locator("tb-truncated-path").first.wait_for(timeout=30000)
        page.wait_for_timeout(2000)
        titles = [t.replace("\n", "") for t in page.locator("tb-truncated-path").all_inner_texts()]
        shot(page, "time_series_landing")
        assert titles[:3] == ["train/loss", "val/loss", "val/acc"], titles
        assert "smoothing=0" in page.url  # a short run drawn as it is


def test_a_sweeps_jobs_read_by_what_it_varied_under_the_logdir_it_prints(logdir, browser):
    _, _, sweep = logdir
    jobs = [
        "0_batch_size-32+channels_last-True",
        "1_batch_size-32+channels_last-False",
        "2_batch_size-64+channels_last-True",
        "3_batch_size-64+channels_last-False",
    ]
    with tensorboard(sweep) as post:
        runs = json.loads(urllib.request.urlopen(f"{post.url}/data/runs", timeout=30).read())
        assert sorted(runs) == jobs  # TensorBoard's run list: each job once, by its swept values
        _, cells = hparams_table(browser, post.url, "hparams_sweep")
        assert sorted(c for c in cells if c in jobs) == jobs  # the Trial IDs, whole
