"""logger=mlflow as a user sees it in MLflow's own UI, in a real browser (Debian's chromium driven
by Playwright, as tests/diagnostics/test_tensorboard_browser.py): a real 3-job `python train.py -m`
with logger=[tensorboard,mlflow], then `mlflow ui` over the store it made. The runs table lists
the sweep as one parent run whose three jobs unfold under it, each with its final val/acc; the
compare view of the three jobs sets their swept param side by side. Needs the full `mlflow`
(the mlflow-ui extra: mlflow-skinny has no UI), chromium and playwright; skipped, saying which
is missing. SATURATE_SCREENSHOTS=<dir> keeps the screenshots."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import CHROMIUM, run_cli
from tests.diagnostics.test_sweep import QUICK, sweep_dir
from tests.diagnostics.test_tensorboard_browser import shot


def _no_ui() -> str | None:
    """Why `mlflow ui` cannot serve its pages here, or None. find_spec, not an import: collecting
    (every xdist worker does) should not pay for importing mlflow."""
    spec = importlib.util.find_spec("mlflow")
    if spec is None:
        return "mlflow is not installed (pip install -e '.[mlflow-ui]')"
    if not (Path(spec.origin).parent / "server" / "js" / "build" / "index.html").is_file():
        return "mlflow-skinny has no UI (pip install -e '.[mlflow-ui]' installs the full mlflow)"
    return None


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None, reason="no chromium here (apt-get install chromium; DEVELOPERS.md)"),
    pytest.mark.skipif(_no_ui() is not None, reason=str(_no_ui())),
]

SWEEP = "optim.optimizer.lr=0.01,0.02,0.05"  # the parent run's name: the sweep's command line
LRS = ["0.01", "0.02", "0.05"]
JOBS = [f"lr-{lr}" for lr in LRS]  # the children's names: what the sweep varied
NAME = '[role=gridcell][col-id="attributes.`Run Name`"]'


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """(the sqlite store a user's sweep made under outputs/, {job name: its metrics.json})."""
    cwd = tmp_path_factory.mktemp("user")
    done = run_cli("-m", f"optim.optimizer.lr={','.join(LRS)}", "logger=[tensorboard,mlflow]", *QUICK, cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    finals = {
        path.parent.name.split("_", 1)[1]: json.loads(path.read_text())
        for path in sweep_dir(cwd).glob("*_*/metrics.json")
    }
    assert sorted(finals) == JOBS
    return cwd / "outputs" / "mlflow" / "mlflow.db", finals


@contextlib.contextmanager
def mlflow_ui(db: Path):
    """A real `mlflow ui --backend-store-uri sqlite:///<db>` on a free port; yields its address.
    Its log goes to a file beside the store: a pipe nobody reads fills with one line a request
    and stalls the server."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    command = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", f"sqlite:///{db}"]
    # one worker, and no job runner (it starts some ten processes for GenAI scorers): a 2-core machine
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    log = db.parent / "mlflow_ui.log"
    with log.open("w") as out:
        server = subprocess.Popen(
            [*command, "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its uvicorn child goes with it
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if urllib.request.urlopen(f"{url}/health", timeout=2).read() == b"OK":
                    break
            except OSError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


@pytest.fixture(scope="module")
def ui(store):
    with mlflow_ui(store[0]) as url:
        yield url


def runs_table(browser, url: str):
    """The experiment's runs table as a user reaches it: the home page, then the experiment."""
    page = browser.new_page(viewport={"width": 2200, "height": 900})  # wide: the metric columns on screen
    page.goto(url)
    page.get_by_role("link", name="train", exact=True).first.wait_for(timeout=60000)  # the Hydra job's name
    # MLflow 3 opens every experiment on its GenAI pages (traces) until the user switches to model
    # training, whatever the experiment's mlflow.experimentKind tag says (the switch is kept in the
    # browser's local storage: each page here is a new context, a first visit)
    page.get_by_text("Model training", exact=True).click()
    page.get_by_role("link", name="train", exact=True).first.click()
    page.locator(NAME).first.wait_for(timeout=60000)
    return page


def names(page) -> list[str]:
    return [n.strip() for n in page.locator(f"{NAME} a").all_inner_texts()]


def row(page, name: str):
    """The runs table's row of the run called `name` (its pinned name cell: checkbox, name)."""
    return page.get_by_role("row").filter(has=page.get_by_role("link", name=name, exact=True))


def test_the_runs_table_shows_the_sweep_as_one_parent_whose_three_jobs_unfold_with_their_val_acc(store, ui, browser):
    _, finals = store
    page = runs_table(browser, ui)
    assert names(page) == [SWEEP]  # the jobs folded under their parent
    assert "4 matching runs" in page.locator("body").inner_text()
    row(page, SWEEP).locator("button").first.click()  # the parent's expander (+)
    page.locator(f"{NAME} a", has_text=JOBS[0]).wait_for()
    assert names(page)[0] == SWEEP and sorted(names(page)[1:]) == JOBS
    # the final metric, a column a user adds through Columns' search
    page.get_by_role("button", name="Columns", exact=True).click()
    page.get_by_placeholder("Search columns").fill("val/acc")
    page.get_by_text("val/acc", exact=True).last.click()
    page.keyboard.press("Escape")
    page.locator('[col-id="metrics.`val/acc`"][role=columnheader]').wait_for()
    shot(page, "mlflow_runs_table")
    shown = {}
    for job in JOBS:  # the name is in the pinned columns, the metric in the scrolled ones: the same row-id
        run_id = row(page, job).first.get_attribute("row-id")
        cell = page.locator(f'.ag-center-cols-container [row-id="{run_id}"] [col-id="metrics.`val/acc`"]')
        shown[job] = float(cell.inner_text())
    assert shown == pytest.approx({job: finals[job]["val/acc"] for job in JOBS}, abs=1e-6)


def test_compare_sets_the_three_jobs_side_by_side_with_the_swept_param_differing(store, ui, browser):
    page = runs_table(browser, ui)
    row(page, SWEEP).locator("button").first.click()
    for job in JOBS:
        row(page, job).locator("input.ag-checkbox-input").check()
    page.get_by_role("button", name="Compare", exact=True).click()
    page.get_by_text("Comparing 3 Runs from 1 Experiment").wait_for(timeout=60000)
    details = page.get_by_role("row").filter(has_text="Run Name:")
    order = [n.strip() for n in details.get_by_role("cell").all_inner_texts() if n.strip()]
    assert sorted(order) == JOBS
    # Parameters' "Show diff only": what the jobs' settings differ in, nothing else
    switch = page.get_by_label("Parameters - Show diff only")
    switch.click()
    params = page.locator(".du-bois-light-collapse-item", has=switch).locator("tr")
    deadline = time.monotonic() + 30
    while params.count() > 20 and time.monotonic() < deadline:  # some 120 settings, then the few that differ
        page.wait_for_timeout(200)
    table = {}
    for r in params.all():
        table[r.locator("th").inner_text().strip()] = [v.strip() for v in r.locator("td").all_inner_texts()]
    shot(page, "mlflow_compare")
    # optim.lr: the learning rate the run used (optim.optimizer.lr is the config's key)
    assert set(table) == {"optim.lr", "optim.optimizer.lr", "overrides"}, table
    expected = [job.split("-")[1] for job in order]  # each column that run's value
    assert table["optim.lr"] == table["optim.optimizer.lr"] == expected
    assert [o.split()[0] for o in table["overrides"]] == [f"optim.optimizer.lr={lr}" for lr in expected]
