"""`tune=true`: measured trials of the report's own advice, and a preset that reproduces the
fastest. The search's rules are checked on the facts a run reports; whole tunes run through
train.py as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from saturate.config.schema import validate
from saturate.errors import ConfigError
from saturate.tune import COMPUTE, candidates, merged, preset_text, side_order
from tests.conftest import CONF, ROOT, compose_config, run_cli

# what the bottleneck report records of a run (saturate.diagnostics.report.RunFacts), plus the loader's prefetch
FACTS = {
    "device": "cpu",
    "batch_size": 128,
    "num_workers": 0,
    "cpus": 4,
    "resident": False,
    "in_memory": False,
    "placement": "none",
    "persistent_workers": False,
    "pin_memory": False,
    "precision": "fp32",
    "compile": False,
    "channels_last": False,
    "memory_headroom": True,
    "emulated_precision": False,
    "image": True,
    "cpu_util": 40.0,
    "prefetch_factor": 2,
}


def tried(verdict: str, facts: dict, allow=(), cuda=False) -> list[list[str]]:
    """Every candidate the search would consider from a best run with `verdict` and `facts`, in order."""
    return [c for d in side_order(verdict) for c in candidates(d, facts, allow=list(allow), cuda=cuda)]


def keys(options: list[list[str]]) -> list[str]:
    return [o.partition("=")[0] for option in options for o in option]


def test_a_compute_bound_run_is_not_tuned_on_loader_knobs():
    facts = {**FACTS, "num_workers": 2, "in_memory": True}
    options = tried("compute-bound", facts, allow=["batch_size", "precision"], cuda=True)
    assert not any(k.startswith("loader.") and k != "loader.batch_size" for k in keys(options))
    assert set(side_order("compute-bound")) == set(COMPUTE)
    assert (
        ["trainer.channels_last=true"] in options
        and ["trainer.compile=true"] in options
        and ["precision.mode=amp"] in options
    )


def test_an_input_bound_run_tries_the_input_side_first():
    facts = {**FACTS, "placement": "cpu"}
    options = tried("input-bound", facts)
    assert options[0] == ["augmentation.placement=gpu"]  # per-sample augmentation is the usual bottleneck
    workers = [o[0] for o in options if o[0].startswith("loader.num_workers=")]
    # more, in order
    assert workers == [
        "loader.num_workers=1",
        "loader.num_workers=2",
        "loader.num_workers=3",
        "loader.num_workers=4",
    ]
    assert keys(options).index("loader.num_workers") < keys(options).index("trainer.channels_last")
    assert ["trainer.compile=true"] not in options  # no C++ compiler: inductor cannot compile for the CPU
    with_compiler = tried("input-bound", {**facts, "cxx": True})
    assert ["trainer.compile=true"] in with_compiler


def test_in_memory_data_gets_the_resident_loader_and_workers_their_own_options():
    in_memory = tried("input-bound", {**FACTS, "in_memory": True, "num_workers": 2})
    assert ["loader.resident=true", "loader.num_workers=0", "loader.pin_memory=false"] in in_memory
    assert ["loader.persistent_workers=true"] in in_memory and ["loader.prefetch_factor=4"] in in_memory
    resident = tried("input-bound", {**FACTS, "in_memory": True, "resident": True})
    assert not any(k.startswith("loader.") for k in keys(resident))  # nothing left to tune in a resident loader
    # a resident loader has no workers to augment in
    augmented = tried("input-bound", {**FACTS, "in_memory": True, "placement": "cpu"})
    assert not any("loader.resident=true" in option for option in augmented)


def test_a_cpu_saturated_run_tries_fewer_workers():
    options = candidates("num_workers", {**FACTS, "num_workers": 4, "cpu_util": 97.0}, allow=[], cuda=False)
    assert options == [  # on a CPU each with the threads that leave the workers their cores
        ["loader.num_workers=3", "device.threads=1"],
        ["loader.num_workers=2", "device.threads=2"],
        ["loader.num_workers=1", "device.threads=3"],
        ["loader.num_workers=0", "device.threads=auto"],
    ]
    on_gpu = candidates("num_workers", {**FACTS, "num_workers": 4, "cpu_util": 97.0}, allow=[], cuda=True)
    assert on_gpu[0] == ["loader.num_workers=3"]  # the threads only compete with the workers on a CPU run


def test_a_cpu_worker_is_tried_with_the_threads_that_leave_it_its_core():
    """Issue 35: on 2 cores, 1 worker beside torch's 2 intra-op threads measured 0.81x, and no
    trial moved the threads: the worker is tried with 1 thread."""
    options = candidates("num_workers", {**FACTS, "cpus": 2, "num_workers": 0}, allow=[], cuda=False)
    assert options == [["loader.num_workers=1", "device.threads=1"], ["loader.num_workers=2", "device.threads=1"]]


def test_bf16_is_tried_on_a_cpu_only_with_native_kernels_and_a_model_that_takes_it():
    native = {**FACTS, "cpu_bf16": True}
    assert candidates("precision", native, allow=["precision"], cuda=False) == [["precision.mode=amp"]]
    assert candidates("precision", {**FACTS, "cpu_bf16": False}, allow=["precision"], cuda=False) == []
    assert candidates("precision", {**native, "amp_ok": False}, allow=["precision"], cuda=False) == []
    assert candidates("precision", native, allow=[], cuda=False) == []  # it changes the numerics: only when allowed


def test_settings_that_change_the_optimisation_only_when_allowed():
    facts = {**FACTS, "precision": "fp32"}
    assert not any(k in ("precision.mode", "loader.batch_size") for k in keys(tried("compute-bound", facts, cuda=True)))
    allowed = tried("compute-bound", facts, allow=["batch_size", "precision"], cuda=True)
    assert ["loader.batch_size=auto"] in allowed and ["precision.mode=amp"] in allowed
    emulated = candidates(
        "precision", {**facts, "precision": "bf16", "emulated_precision": True}, allow=["precision"], cuda=False
    )
    assert emulated == [["precision.mode=fp32"]]


def test_pinned_memory_and_cudnn_only_on_cuda():
    assert candidates("pin_memory", FACTS, allow=[], cuda=False) == []
    assert candidates("pin_memory", FACTS, allow=[], cuda=True) == [["loader.pin_memory=true"]]
    assert candidates("cudnn", {**FACTS, "tf32": False, "cudnn": True}, allow=[], cuda=True) == [
        ["device.tf32=true", "device.cudnn_benchmark=true"]
    ]
    assert candidates("cudnn", {**FACTS, "tf32": True, "cudnn": True}, allow=[], cuda=True) == []


def test_merged_keeps_one_value_per_key_in_place():
    assert merged(["data=digits", "loader.num_workers=0"], ["loader.num_workers=2", "+x.y=1"]) == [
        "data=digits",
        "loader.num_workers=2",
        "+x.y=1",
    ]


def test_bad_tune_settings_are_named():
    cfg = compose_config(["tune.budget_s=0", "tune.allow=[batch_size,lr]", "tune.extra=[oops]", "tune.trial_s=-1"])
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    text = str(e.value)
    for expected in (
        "tune.budget_s=0: expected a number >= 1.0 or 'auto'",
        "tune.allow[1]='lr': expected one of batch_size, precision",
        "tune.extra[0]='oops': expected overrides",
        "tune.trial_s=-1.0",
    ):
        assert expected in text


def test_a_tune_extra_a_trial_would_not_take_is_named():
    """Unknown keys and where a run starts are refused before any trial (c95, c99)."""
    extra = (
        'tune.extra=["bogus.key=1","hydra.run.dir=/tmp/x trainer.restart=true","+model.extra=2 loader.num_workers=1"]'
    )
    cfg = compose_config([extra])
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    text = str(e.value)
    assert "tune.extra[0]='bogus.key=1': expected overrides of keys the config has (bogus.key is not one" in text
    assert "tune.extra[1]='hydra.run.dir=/tmp/x trainer.restart=true': expected overrides of what a trial" in text
    assert "tune.extra[2]" not in text


def _composed(overrides: list[str], searchpath: Path | None = None) -> dict:
    extra = [f"hydra.searchpath=[file://{searchpath}]"] if searchpath else []
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[*overrides, *extra])
    return OmegaConf.to_container(cfg, resolve=False)


def test_the_preset_reproduces_the_winners_config_exactly(tmp_path):
    start = [
        "experiment=debug",
        "data=synthetic",
        "data.num_train=256",
        "augmentation=cpu",
        "loader.num_workers=0",
        "model.width=8",
        "trainer.max_epochs=3",
    ]
    changes = ["augmentation.placement=gpu", "loader.num_workers=1", "loader.batch_size=48"]
    groups = {"data", "augmentation", "loader", "model", "precision", "device", "optim", "task", "experiment", "sweep"}
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "tuned_t.yaml").write_text(preset_text(start, changes, groups, "# test\n"))
    assert _composed(["experiment=tuned_t"], tmp_path) == _composed(merged(start, changes))
    assert _composed(["experiment=tuned_t"], tmp_path) != _composed(start)  # the changes are in it


def _events(folder: Path) -> EventAccumulator:
    acc = EventAccumulator(str(folder), size_guidance={"tensors": 0})
    acc.Reload()
    return acc


def _has_hparams(tb: Path) -> bool:
    """A trial's HParams session (in its own event files: saturate.loggers.tensorboard)."""
    return "_hparams_/session_start_info" in _events(tb).PluginTagToContent("hparams")


def _cfg_job(args: list[str], cwd: Path) -> str:
    done = run_cli(*args, "--cfg", "job", cwd=cwd, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.slow
def test_tune_keeps_the_resident_loader_for_in_memory_data_and_skips_failing_trials(tmp_path):
    """digits with a worker process: input-bound (the worker only adds copies); the tune
    keeps the resident loader. A candidate that cannot build its model and one that
    diverges are recorded and skipped."""
    start = ["data=digits", "model.width=4", "loader.num_workers=1"]
    preset = tmp_path / "conf" / "experiment" / "tuned_digits.yaml"
    extra = 'tune.extra=["model.width=0","optim.optimizer.lr=1e30"]'
    done = run_cli(
        *start,
        "tune=true",
        "tune.budget_s=60",
        "tune.trial_s=0.5",
        f"tune.preset={preset}",
        extra,
        "hydra.run.dir=tune",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "tune" / "tune.json").read_text())
    # kept only when it measured faster by more than min_gain, which a loaded host may not show
    resident = [r for r in result["results"] if "loader.resident=true" in r["changes"]]  # its trial comes first
    assert resident and resident[0]["status"] == "ok", result
    if "loader.resident=true" in result["changes"]:
        assert result["speedup"] > 1.05, result
    else:
        not_kept = ("slower", "no gain", "undecided", "not held when measured again", "not confirmed")
        assert resident[0]["outcome"] in not_kept, result  # undecided: a difference within its windows' spread
        assert result["speedup"] == 1.0, result
    outcomes = {" ".join(r["changes"]): r for r in result["results"]}
    assert outcomes["model.width=0"]["status"] == "failed" and "failed:" in outcomes["model.width=0"]["outcome"]
    assert outcomes["optim.optimizer.lr=1e30"]["status"] == "diverged"
    assert not any("model.width=0" in c or "lr=1e30" in c for c in result["changes"])
    # the table, in tune.md and in TensorBoard; each trial that trained is a run with an HParams entry
    table = (tmp_path / "tune" / "tune.md").read_text()
    assert "loader.resident=true" in table and "diverged" in table
    kept = bool(result["changes"])
    assert ("Fastest" in table) == kept and ("Nothing measured faster" in table) != kept
    text = _events(tmp_path / "tune").Tensors("tune/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "loader.resident=true" in text
    trials = sorted((tmp_path / "tune" / "trials").iterdir())
    # one HParams row per trial
    assert len(trials) == len(result["results"]) and all(_has_hparams(f) for f in trials)
    # the preset: `experiment=tuned_digits` is the start plus the winner's changes, exactly
    kept_resident = "loader.resident=true" in result["changes"]
    assert yaml.safe_load(preset.read_text())["loader"].get("resident") is (True if kept_resident else None)
    searchpath = f"hydra.searchpath=[file://{preset.parent.parent}]"
    assert _cfg_job([searchpath, "experiment=tuned_digits"], tmp_path) == _cfg_job(
        [searchpath, *merged(start, result["changes"])], tmp_path
    )


@pytest.fixture
def jpeg_folder(tmp_path):
    from saturate.commands.make_image_folder import write_digits

    write_digits(tmp_path / "images", size=64, fmt="jpg")
    return tmp_path / "images"


# per-sample augmentation in the main process on JPEG files, a narrow model: input-bound on any machine
INPUT_BOUND = ["data=image_folder", "data.image_size=32", "model.width=8", "augmentation=cpu", "loader.num_workers=0"]


@pytest.mark.slow
def test_tune_an_input_bound_image_folder_run_then_reuse_it(tmp_path, jpeg_folder):
    args = [
        *INPUT_BOUND,
        f"data.root={jpeg_folder}",
        "tune=true",
        "tune.budget_s=90",
        "tune.trial_s=1.5",
        f"tune.cache={tmp_path / 'cache.json'}",
        f"tune.preset={tmp_path / 'tuned.yaml'}",
    ]
    done = run_cli(*args, "hydra.run.dir=first", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "first" / "tune.json").read_text())
    start = result["results"][0]
    assert start["verdict"] == "input-bound" and start["changes"] == []
    first_tried = " ".join(result["results"][1]["changes"])
    assert first_tried == "augmentation.placement=gpu"  # the report's first advice for per-sample augmentation
    # what is kept depends on what this machine measured (a shared CI host may gain nothing from
    # a worker): a kept change beat the start by more than min_gain, and nothing kept means 1.0x
    kept = [r for r in result["results"] if r["outcome"] == "kept"]
    if result["changes"]:
        assert kept and result["speedup"] > 1.05, result
    else:
        assert result["speedup"] == 1.0, result
        assert not kept or any(r["outcome"] == "not confirmed" for r in result["results"]), result
    assert (tmp_path / "tuned.yaml").is_file()
    assert sum(r["seconds"] for r in result["results"]) < 90
    # the same config on the same machine: the tune is reused, nothing is measured again
    again = run_cli(*args, "hydra.run.dir=second", cwd=tmp_path)
    assert again.returncode == 0 and "reused the tune" in again.stdout + again.stderr
    assert not (tmp_path / "second" / "trials").exists()
    assert json.loads((tmp_path / "second" / "tune.json").read_text())["changes"] == result["changes"]


@pytest.mark.slow
def test_a_compute_bound_run_spends_no_trial_on_the_loader(tmp_path):
    done = run_cli(
        "data=digits",
        "tune=true",
        "tune.budget_s=40",
        "tune.trial_s=1",
        f"tune.preset={tmp_path / 't.yaml'}",
        "tune.cache=",
        "hydra.run.dir=t",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "t" / "tune.json").read_text())
    assert "tune.enabled=true" in (tmp_path / "t" / ".hydra" / "overrides.yaml").read_text()  # how it was started
    assert result["results"][0]["verdict"] == "compute-bound"
    assert len(result["results"]) > 1  # something on the compute side was measured
    assert not any(c.startswith("loader.") for r in result["results"] for c in r["changes"])


@pytest.mark.slow
@pytest.mark.usefixtures("ctrl_c_reaches_us")  # the child must hear Ctrl-C
def test_an_interrupted_tune_keeps_the_best_so_far(tmp_path, jpeg_folder):
    import signal
    import time

    cmd = [
        sys.executable,
        str(ROOT / "train.py"),
        *INPUT_BOUND,
        f"data.root={jpeg_folder}",
        *["tune=true", "tune.trial_s=2", "tune.cache=", f"tune.preset={tmp_path / 't.yaml'}", "hydra.run.dir=t"],
    ]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    trials = tmp_path / "t" / "trials"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (trials.is_dir() and len(list(trials.iterdir())) >= 3):
        time.sleep(0.2)
    started = len(list(trials.iterdir()))
    proc.send_signal(signal.SIGINT)  # during the third trial
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    result = json.loads((tmp_path / "t" / "tune.json").read_text())
    # the trial that heard it is the last: interrupted, or measured when it came after its loop
    assert result["interrupted"] and len(result["results"]) == started
    assert result["results"][-1]["status"] in ("interrupted", "ok")
    assert "Interrupted: the best so far is kept" in (tmp_path / "t" / "tune.md").read_text()
    assert (tmp_path / "t.yaml").is_file()


def test_the_preset_goes_to_the_users_config_dir_else_to_conf_in_the_working_dir(tmp_path, monkeypatch):
    from saturate.config.invocation import Invocation, config_dirs
    from saturate.tune import preset_path

    sources = [
        {"path": "hydra.conf", "schema": "pkg", "provider": "hydra"},
        {"path": str(CONF), "schema": "file", "provider": "main"},
    ]
    user = {"path": str(tmp_path / "conf"), "schema": "file", "provider": "hydra.searchpath in command-line"}
    choices = {"data": "image_folder", "model": "small_cnn", "hydra/launcher": "basic"}
    cfg = compose_config(["tune.enabled=true"])
    invocation = Invocation(choices=choices, config_dirs=config_dirs([*sources, user]))
    assert preset_path(cfg, invocation) == tmp_path / "conf" / "experiment" / "tuned_image_folder_small_cnn.yaml"
    hydra_cfg = Invocation(choices=choices, config_dirs=config_dirs(sources))
    monkeypatch.chdir(tmp_path / "conf" if (tmp_path / "conf").is_dir() else tmp_path)
    here = Path.cwd() / "conf" / "experiment" / "tuned_image_folder_small_cnn.yaml"  # never the package's own
    assert preset_path(cfg, hydra_cfg) == here
    named = compose_config(["tune.enabled=true", "name=my run/v2"])
    assert preset_path(named, hydra_cfg).name == "tuned_my_run_v2.yaml"
    chosen = compose_config([f"tune.preset={tmp_path / 'p'}"])
    assert preset_path(chosen, hydra_cfg) == tmp_path / "p.yaml"


def test_a_trial_stops_once_its_steady_state_is_measured(make_cfg):
    import saturate
    from saturate.trainer.build import UserObjects
    from saturate.tune import Measured
    from tests.conftest import read_metrics

    cfg = make_cfg("trainer.max_epochs=1000", "trainer.log_interval=5")  # 3 steps per epoch: 3,000 steps unless stopped
    measured = Measured(seconds=0.3, steps=10)  # tune's stop rule: a callback
    saturate.train(cfg, objects=UserObjects(callbacks={"measured": measured}))
    done = read_metrics(cfg.run_dir)
    # the first window (warm-up) + at least 10
    assert done["status"] == "completed" and 13 <= done["progress/step"] < 3000
    assert done["stopped_early"] == "tune: the trial's steady state is measured"
    assert done["time/wall_s"] < 60


def test_train_and_fit_refuse_tune_enabled(make_cfg):
    import saturate
    from saturate.errors import UserError

    with pytest.raises(UserError, match=r"tune.enabled=true: tune through the command \(saturate train tune=true"):
        saturate.train(make_cfg("tune.enabled=true"))


def test_the_printed_command_finds_the_preset(tmp_path):
    from saturate.tune import reproduce

    assert reproduce(CONF / "experiment" / "tuned_a.yaml", []) == "python train.py experiment=tuned_a"
    mine = tmp_path / "conf"
    assert reproduce(mine / "experiment" / "tuned_a.yaml", [f"hydra.searchpath=[file://{mine}]"]) == (
        f"python train.py hydra.searchpath=[file://{mine}] experiment=tuned_a"
    )
    elsewhere = tmp_path / "other" / "experiment" / "tuned_a.yaml"  # tune.preset outside the config dirs
    assert reproduce(elsewhere, [f"hydra.searchpath=[file://{mine}]"]) == (
        f"python train.py hydra.searchpath=[file://{mine},file://{tmp_path / 'other'}] experiment=tuned_a"
    )
    assert reproduce(tmp_path / "t.yaml", []).startswith("copy it to <a config dir>/experiment/")


# -- files a tune reads and writes (issue 25, items 7 and 9)


def good_entry() -> dict:
    from saturate.tune import Result

    start = {**Result(0, [], samples_per_s=100.0, outcome="start").__dict__}
    kept = {**Result(1, ["loader.resident=true", "loader.num_workers=0"], samples_per_s=300.0, outcome="kept").__dict__}
    again = [
        {**Result(2, [], samples_per_s=110.0, outcome="again").__dict__},
        {**Result(3, ["loader.resident=true", "loader.num_workers=0"], samples_per_s=290.0, outcome="again").__dict__},
    ]
    return {
        "results": [start, kept, *again],
        "changes": ["loader.resident=true", "loader.num_workers=0"],
        "best": 1,
        "rate": 290.0,
        "speedup": 2.7,
        "confirmed": True,
        "dropped": [],
        "target_runs": None,
    }


TAMPERED = {
    "a change tune never makes": lambda e: e["changes"].append("+model._target_=os.system"),
    "a Hydra override among the changes": lambda e: e["changes"].append("hydra.job.chdir=true"),
    "a tune.extra that is not this config's": lambda e: e["changes"].append("model.width=64"),
    "a best that is no trial": lambda e: e.update(best=9),
    "a best that failed": lambda e: (e["results"][1].update(status="failed"), e.update(best=1)),
    "confirmed without a measured pair": lambda e: [r.update(outcome="kept") for r in e["results"][2:]],
    "a speedup of inf": lambda e: e.update(speedup=float("inf")),
    "results of another shape": lambda e: e["results"][0].pop("verdict"),
    "results that are not a list": lambda e: e.update(results={"0": 1}),
    "changes that are text": lambda e: e.update(changes="loader.resident=true"),
    "dropped changes tune never makes": lambda e: e.update(dropped=["+model._target_=os.system"]),
    "an entry written before dropped changes were kept": lambda e: e.pop("dropped"),
    "an entry written before the seeds to the target": lambda e: e.pop("target_runs"),
    "times to the target that are text": lambda e: e.update(target_runs=runs([0], ["1"], [2])),
    "fewer times than seeds": lambda e: e.update(target_runs=runs([0, 1], [1.0], [2.0, None])),
    "a seed that is not an integer": lambda e: e.update(target_runs=runs([0.5], [1.0], [None])),
    "medians without the runs": lambda e: e.update(to_target_s=[10.0, 8.0]),
    "medians that are not the runs'": lambda e: e.update(target_runs=runs([0], [10.0], [8.0]), to_target_s=[10.0, 2.0]),
    "a candidate tune never makes": lambda e: e.update(
        target_runs=runs([0], [10.0], [8.0], changes=["+model._target_=os.system"]), to_target_s=[10.0, 8.0]
    ),
    "the start with changes": lambda e: e.update(
        target_runs={"seeds": [0], "candidates": [side(["trainer.compile=true"], [1.0])] * 2}, to_target_s=[1.0, 1.0]
    ),
    "a final figure that is text": lambda e: e.update(
        target_runs={"seeds": [0], "candidates": [side([], [1.0], ["x"]), side([], [1.0])]}, to_target_s=[1.0, 1.0]
    ),
}


def side(changes: list[str], times: list, finals: list | None = None) -> dict:
    """A candidate's runs to the target, as tune.json and the cache hold them."""
    return {"changes": changes, "numerics": False, "times": times, "finals": finals or [None] * len(times)}


def runs(seeds: list, start: list, fastest: list, changes: list[str] | None = None) -> dict:
    """The start's and one candidate's runs to the target."""
    return {"seeds": seeds, "candidates": [side([], start), side(changes or ["trainer.compile=true"], fastest)]}


def test_a_tune_cache_entry_is_checked_before_it_is_used():
    from saturate.tune import valid_entry

    assert valid_entry(good_entry(), extra=[])
    target = runs([3, 4], [9.5, None], [7, 8.0])
    assert valid_entry({**good_entry(), "target_runs": target, "to_target_s": [None, 7.5]}, [])  # their medians
    # the user's own tune.extra
    assert valid_entry({**good_entry(), "changes": ["model.width=64"]}, extra=["model.width=64"])
    for name, tamper in TAMPERED.items():
        entry = good_entry()
        tamper(entry)
        assert not valid_entry(entry, extra=[]), name


@pytest.mark.parametrize(
    "content", ["[]", '"a string"', "7", '{"k": 5}', '{"k": []}', "[" * 50_000 + "]" * 50_000, "{ not json"]
)
def test_a_cache_file_of_any_shape_is_measured_again_with_a_warning(tmp_path, caplog, content):
    from saturate.components.batch_size import Cache, valid_choice

    path = tmp_path / "cache.json"
    path.write_text(content)
    cache = Cache(str(path), valid=valid_choice)
    assert cache.get({"k": 1}) is None and cache.get({"k": 5}) is None
    if content.startswith("{") and "not json" not in content:  # an entry of the wrong shape: named as damaged
        assert "is damaged" in caplog.text or cache.get({"x": 0}) is None
    cache.put({"k": 1}, {"batch_size": 64, "trials": []})  # rebuilt
    assert cache.get({"k": 1})["batch_size"] == 64


def test_a_preset_never_overwrites_a_file_tune_did_not_write(tmp_path):
    from saturate.errors import UserError
    from saturate.tune import check_overwritable, preset_text

    check_overwritable(tmp_path / "new.yaml")  # new: fine
    earlier = tmp_path / "tuned_a.yaml"
    earlier.write_text(
        preset_text(["model.width=8"], [], {"model"}, "# Written by saturate's tune on 2026-11-26: ...\n")
    )
    check_overwritable(earlier)  # an earlier tune's preset: replaced
    for victim in (CONF / "config.yaml", tmp_path / "notes.yaml", tmp_path):
        if victim.suffix:
            victim.exists() or victim.write_text("mine: 1\n")
        with pytest.raises(
            UserError, match="exists and is not a preset saturate's tune wrote; it is never overwritten"
        ):
            check_overwritable(victim)


def test_tune_refuses_a_preset_path_that_is_not_its_own_before_any_trial(tmp_path):
    (tmp_path / "config.yaml").write_text("defaults: [base_config]\n")
    done = run_cli("tune=true", f"tune.preset={tmp_path / 'config'}", "hydra.run.dir=t", cwd=tmp_path)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert f"error: tune.preset: {tmp_path / 'config.yaml'} exists and is not a preset" in done.stderr
    assert (tmp_path / "config.yaml").read_text() == "defaults: [base_config]\n" and not (
        tmp_path / "t" / "trials"
    ).exists()


@pytest.mark.slow
@pytest.mark.usefixtures("ctrl_c_reaches_us")  # the child must hear Ctrl-C
def test_an_interrupt_during_the_confirmation_stops_at_once_and_claims_nothing(tmp_path):
    """SIGINT while the start is measured again: no further trial runs, and the speed-up is
    reported as one trial each, not confirmed."""
    import re
    import signal
    import time

    cmd = [
        sys.executable,
        str(ROOT / "train.py"),
        "data=digits",
        "model.width=4",
        "loader.num_workers=1",
        *["tune=true", "tune.budget_s=60", "tune.trial_s=0.5", "tune.cache=", f"tune.preset={tmp_path / 't.yaml'}"],
        "hydra.run.dir=t",
    ]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    trials = tmp_path / "t" / "trials"
    deadline, again = time.monotonic() + 150, []
    while time.monotonic() < deadline and not again and proc.poll() is None:
        again = [p for p in trials.glob("*_start") if not p.name.startswith("00_")] if trials.is_dir() else []
        time.sleep(0.05)
    assert again, "the tune ended before its confirmation: " + proc.communicate()[1][-2000:]
    proc.send_signal(signal.SIGINT)  # while the start is measured again
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    result = json.loads((tmp_path / "t" / "tune.json").read_text())
    assert result["interrupted"] and not result["confirmed"]
    numbers = sorted(int(re.match(r"\d+", p.name).group()) for p in trials.iterdir())
    assert numbers[-1] == int(again[0].name[:2])  # nothing ran after the interrupted trial
    table = (tmp_path / "t" / "tune.md").read_text()
    assert "Interrupted" in table and ("not confirmed" in table or "Nothing measured faster" in table)
    assert "confirmed)" in (tmp_path / "t.yaml").read_text() or not result["changes"]


def test_each_trial_starts_with_a_fresh_compiler_state():
    """Dynamo's recompile limit (8) reached in earlier trials made a later trial's compiled
    model run eager without a word; each trial now starts from a reset."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from saturate.tune import fresh_compile_state

    def step(x):
        return (x * 2).sum()

    compiled = torch.compile(step, backend="eager", dynamic=False)
    fresh_compile_state()
    for n in range(1, 12):  # eleven shapes: past the recompile limit
        compiled(torch.ones(n))
    captured = counters["stats"]["unique_graphs"]
    compiled(torch.ones(40))  # another trial's shape: over the limit it is not compiled
    assert counters["stats"]["unique_graphs"] == captured
    fresh_compile_state()
    compiled(torch.ones(41))
    assert counters["stats"]["unique_graphs"] == captured + 1  # compiled again after the reset


class Scripted:
    """Tuner.trial replaced by a script of samples/s: what each next trial measures."""

    def __init__(self, tuner, rates: list[float]):
        self.tuner, self.rates, self.calls, self.caps = tuner, list(rates), [], []

    def __call__(self, changes, base=None, until=None, seed=None):
        from saturate.tune import Result

        self.calls.append((list(changes), base) if until is None else (list(changes), base, f"to target, seed {seed}"))
        if until is not None:
            self.caps.append(until - time.perf_counter())
        rate = self.rates.pop(0)
        if isinstance(rate, tuple):  # (samples/s, "signal"): a stop signal handed on as this trial's run ends
            rate, self.tuner.stop.requested = rate[0], 2
        result = Result(len(self.tuner.results), changes, samples_per_s=rate, seconds=0.01, seed=seed)
        result.config = merged(self.tuner.changes if base is None else base, changes)
        if until is not None:  # a run to the target: the script's next entry is when it met it (None: never)
            result.to_target_s = self.to_target.pop(0)
            if result.to_target_s == "signal":  # a stop signal just after this run, before the next starts
                self.tuner.stop.requested, result.to_target_s = 15, 12.0
            if result.to_target_s in ("interrupted", "failed"):  # what a real trial sets
                result.status, result.to_target_s = result.to_target_s, None
                result.outcome = result.status if result.status == "interrupted" else "failed: OSError: disk full"
                self.tuner.interrupted = result.status == "interrupted"
        self.tuner.results.append(result)
        return result


def scripted_tuner(rates: list[float]):
    from types import SimpleNamespace

    from saturate.tune import Result, Tuner

    tuner = Tuner.__new__(Tuner)
    tuner.tune = SimpleNamespace(min_gain=0.05, budget_s=1e9, target_seeds=3)
    tuner.target, tuner.search_budget, tuner.to_target_s, tuner.dropped = False, 1e9, None, []
    tuner.budget_s, tuner.target_metric = 1e9, "val/acc"
    tuner.seed, tuner.target_runs = 5, None
    tuner.results, tuner.changes, tuner.interrupted, tuner.stop = [], [], False, None
    tuner.started = 0.0
    tuner.best = Result(0, [], samples_per_s=100.0)
    tuner.results.append(tuner.best)
    tuner.trial = Scripted(tuner, rates)
    return tuner


def test_a_candidate_faster_once_is_measured_again_before_it_is_kept():
    """One trial can be an outlier on a shared machine: the candidate and the best so far are
    measured again back to back, and it is kept only if that pair agrees."""
    outlier = scripted_tuner([150.0, 100.0, 98.0])  # 1.5x once; then the best 100, the candidate 98
    outlier.try_dimension("channels_last", [["trainer.channels_last=true"]])
    assert outlier.changes == [] and outlier.results[1].outcome == "not held when measured again"
    assert [r.outcome for r in outlier.results[2:]] == ["recheck", "recheck"]
    assert outlier.trial.calls[1:] == [([], []), ([], ["trainer.channels_last=true"])]
    real = scripted_tuner([150.0, 100.0, 140.0])
    real.try_dimension("channels_last", [["trainer.channels_last=true"]])
    assert real.changes == ["trainer.channels_last=true"] and real.results[1].outcome == "kept"


def test_a_stop_handed_on_by_the_first_trial_of_a_pair_starts_no_second():
    """A Ctrl-C that reaches a trial once its loop has stopped looking is handed on to tune as
    the trial ends (saturate.loop.faults.StopSignal): the trial counts, but neither the
    recheck's nor the confirmation's second trial runs after it, and nothing is claimed."""
    from types import SimpleNamespace

    recheck = scripted_tuner([150.0, (100.0, "signal"), 140.0])  # faster once; the recheck's first hears it
    recheck.stop = SimpleNamespace(requested=None)
    recheck.try_dimension("channels_last", [["trainer.channels_last=true"]])
    assert len(recheck.trial.calls) == 2 and recheck.changes == [] and recheck.interrupted
    assert recheck.results[1].outcome == "faster once; stopped before measured again"
    confirm = scripted_tuner([(100.0, "signal"), 150.0])  # the confirmation's first (the start again) hears it
    confirm.stop, confirm.changes, confirm.confirmed = SimpleNamespace(requested=None), ["trainer.compile=true"], False
    confirm.best = confirm.results[0].__class__(1, ["trainer.compile=true"], samples_per_s=150.0)
    confirm.results.append(confirm.best)
    confirm.confirm()
    assert len(confirm.trial.calls) == 1 and not confirm.confirmed and confirm.interrupted
    assert confirm.speedup == pytest.approx(1.5)  # one trial each, as the table says: not confirmed
    assert confirm.results[-1].outcome == "again, unpaired"


@pytest.mark.parametrize(
    ("start", "fastest", "kept", "medians"),
    [
        ([10.0, 12.0, 11.0], [8.0, 9.0, None], True, (11.0, 9.0)),  # one seed never met it: the median still wins
        ([10.0, 12.0, 11.0], [12.0, 13.0, 9.0], False, (11.0, 12.0)),  # faster on one seed of three: later
        ([10.0, 12.0, 11.0], [None, 5.0, None], False, (11.0, None)),  # met it with one seed only
        ([None, None, 30.0], [30.0, None, None], True, (None, None)),  # neither at the median: samples/s decide
        ([None, 40.0, None], [20.0, 25.0, None], True, (None, 25.0)),
        ([10.0, 12.0, 11.0], [8.0, "failed", 9.0], True, (11.0, 9.0)),  # a failed run counts as never
    ],
)
def test_the_start_and_the_fastest_are_ranked_by_their_median_time_to_the_target_over_seeds(
    start, fastest, kept, medians
):
    """With a target, the start and the fastest are each trained to it once per seed
    (trainer.seed, +1, +2), alternating: one run each cannot tell a setting from a seed (the
    segmentation example met Dice 0.7 between 24.9 and 52.2 s over five seeds). The fastest is
    dropped when its median is longer, a seed that never met it counting as never."""
    from saturate.tune import Result, _to_target_lines, render

    tuner = scripted_tuner([100.0] + [150.0] * 6)
    tuner.target, tuner.changes = True, ["trainer.compile=true", "precision=bf16"]
    tuner.best = Result(1, ["precision=bf16"], samples_per_s=150.0)  # its row: what it added to compile
    tuner.best.config = tuner.changes
    tuner.results.append(tuner.best)
    tuner.speedup, tuner.rate = 1.5, 150.0
    tuner.trial.to_target = [t for pair in zip(start, fastest, strict=True) for t in pair]
    tuner.to_target()
    both = ["trainer.compile=true", "precision=bf16"]
    assert tuner.trial.calls == [
        ([], side, f"to target, seed {seed}") for seed in (5, 6, 7) for side in ([], both)
    ]  # from the run's own trainer.seed (5 here), the start first in each pair
    assert tuner.to_target_s == list(medians)
    assert tuner.target_runs == {
        "seeds": [5, 6, 7],
        "candidates": [
            {"changes": [], "numerics": False, "times": start, "finals": [None] * 3},
            {
                "changes": both,
                "numerics": True,
                "times": [t if t != "failed" else None for t in fastest],
                "finals": [None] * 3,
            },
        ],
    }
    assert (tuner.changes == both) is kept and (tuner.best is tuner.results[0]) is not kept
    if not kept:  # the dropped fastest's own row says which
        assert tuner.results[1].outcome == ("later to the target" if medians[1] is not None else "target not met")
    assert tuner.speedup == (1.5 if kept else 1.0)
    rows = [r.outcome for r in tuner.results[2:]]
    assert rows[1] == (f"to target: {fastest[0]:.1f} s (seed 5)" if fastest[0] else "to target: not met (seed 5)")
    said = "\n".join(_to_target_lines(tuner))
    assert "with seeds 5, 6, 7 (trainer.seed)" in said
    row = next(line for line in said.splitlines() if line.startswith("| `trainer.compile=true"))
    assert row.startswith("| `trainer.compile=true precision=bf16` | yes | 3 |")  # marked: it changes the numerics
    assert ("kept" in row) is kept
    tuner.confirmed, tuner.searchpath = True, []
    for r in tuner.results:  # what a real trial also reads
        r.data_wait, r.verdict = 0.0, "balanced"
    table = render(tuner, preset=Path("conf/experiment/tuned.yaml"))
    dropped = "the fastest in samples/s, `trainer.compile=true precision=bf16`, " + (
        "met the target later" if medians[1] is not None else "did not meet the target"
    )
    assert ("Keep the starting config" in table and dropped in table) is not kept
    if all(medians) and kept:
        assert f"{medians[0] / medians[1]:.2f}x sooner than the starting config" in said


def test_a_failed_run_to_the_target_keeps_its_error_and_an_interrupt_stops_the_seeds():
    """A run to the target that fails says why in its row (and counts as never); an interrupt
    stops the runs at once, and a seed whose pair was left half done is not counted."""
    from saturate.tune import Result

    tuner = scripted_tuner([100.0] + [150.0] * 6)
    tuner.target, tuner.changes = True, ["precision=bf16"]
    tuner.best = Result(1, ["precision=bf16"], samples_per_s=150.0, config=["precision=bf16"])
    tuner.results.append(tuner.best)
    tuner.speedup, tuner.rate = 1.5, 150.0
    tuner.trial.to_target = [10.0, "failed", 12.0, "interrupted"]
    tuner.to_target()
    assert len(tuner.trial.calls) == 4  # the third seed is never started
    assert tuner.results[3].outcome == "to target: failed: OSError: disk full (seed 5)"
    assert [c["times"] for c in tuner.target_runs["candidates"]] == [[10.0], [None]]
    assert tuner.target_runs["seeds"] == [5]
    assert tuner.to_target_s == [10.0, None] and tuner.changes == [] and tuner.dropped == ["precision=bf16"]


def test_both_runs_of_a_seed_get_the_same_cap_and_a_stop_signal_between_runs_stops_them():
    """The start's and the fastest's run of a seed are capped alike (an equal share of what is
    left as the pair starts), so neither side inherits time the other left; a SIGTERM that
    arrives between two runs (no run's own handler to hear it) stops the runs to the target."""
    from types import SimpleNamespace

    from saturate.tune import Result

    tuner = scripted_tuner([100.0] + [150.0] * 6)
    tuner.target, tuner.changes = True, ["precision=bf16"]
    tuner.best = Result(1, ["precision=bf16"], samples_per_s=150.0, config=["precision=bf16"])
    tuner.results.append(tuner.best)
    tuner.budget_s, tuner.started = 600.0, time.perf_counter()
    tuner.trial.to_target = [5.0, 4.0, 6.0, 4.5, 7.0, 5.5]
    tuner.to_target()
    caps = tuner.trial.caps
    assert len(caps) == 6 and all(abs(a - b) < 1.0 for a, b in zip(caps[::2], caps[1::2], strict=True)), caps
    assert abs(caps[0] - 100.0) < 1.0  # 600 s left for six runs
    stopped = scripted_tuner([100.0] + [150.0] * 6)
    stopped.target, stopped.changes, stopped.stop = True, ["precision=bf16"], SimpleNamespace(requested=None)
    stopped.results.append(Result(1, ["precision=bf16"], samples_per_s=150.0, config=["precision=bf16"]))
    stopped.trial.to_target = [5.0, "signal"]
    stopped.to_target()
    assert len(stopped.trial.calls) == 2 and stopped.interrupted
    assert [c["times"] for c in stopped.target_runs["candidates"]] == [[5.0], [12.0]]
