"""`saturate train` and `python train.py`: a user's mistake is answered with one short message.

Hydra prints its own errors with extra lines (the config search path, OmegaConf's
`reference_type=...`, a hint about HYDRA_FULL_ERROR), and an unknown key without the keys
that exist. `run` lets those errors reach it instead and prints each as saturate's other
config errors read: the full key, the value given and what is allowed. A real bug keeps
its whole traceback. Set HYDRA_FULL_ERROR=1 yourself to get Hydra's own handling back.
"""

from __future__ import annotations

import atexit
import errno
import gc
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import yaml
from hydra.errors import CompactHydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError

from saturate.config.dirs import CONF, PROJECT_ENV, use_project_conf
from saturate.config.invocation import SCRIPT, Invocation, from_hydra, refuse_oversized, saved_record
from saturate.config.registration import register
from saturate.config.schema import validate
from saturate.config.secrets import masked
from saturate.config.yaml_bombs import refuse_alias_bombs
from saturate.errors import UserError, printable
from saturate.started import mark_reached, pause_collector, resume_collector

log = logging.getLogger("saturate")
_answering = False  # run_hydra_app() is answering mistakes (the user did not ask for HYDRA_FULL_ERROR)


def train_command(app: str) -> None:
    """The training command, `saturate train` (`app`: TRAIN_COMMAND) or `python train.py`
    (its path): saturate's config groups from the package, a project's own config dir
    (saturate.config.dirs) first on the search path with its folder first on sys.path, so that
    its package imports as `python train.py` beside it would."""
    import hydra

    from saturate.cli import project_first  # here: saturate.cli imports this module

    project_first()
    main = hydra.main(version_base="1.3", config_path=str(CONF), config_name="config")(task)
    run_hydra_app(main, app=app)


def run_hydra_app(main: Callable[[], object], app: str | None = None) -> None:
    """Call a `@hydra.main` function; exit 1 with one message for a user's mistake. `app`: the
    command as resume hints and ranks name it (default: this script). For a single run the
    garbage collector is off until task() has done its imports (saturate.started): a `main`
    that does long work of its own before calling task(), or instead of it, does it without
    the collector."""
    try:
        refuse_oversized(sys.argv[1:])  # before Hydra's parser, which takes hours over a huge value
        refuse_alias_bombs(sys.argv[1:])  # before Hydra's composition, which would expand one
    except UserError as e:
        sys.exit(f"error: {e}")
    if any(arg in ("--help", "-h") for arg in sys.argv[1:]):
        print(help_text(sys.argv[1:]))
        return
    register()
    atexit.unregister(_freeze_at_exit)  # once, however many runs a process starts (a test, a notebook):
    atexit.register(_freeze_at_exit)  # after the handlers registered during this (the last) run
    os.environ[SCRIPT] = app or os.path.abspath(sys.argv[0])  # SLURM jobs inherit it: their resume command names it
    sys.argv[1:] = [shorthand(arg) for arg in sys.argv[1:]]
    single = not {"-m", "--multirun"} & set(sys.argv[1:])
    if single:  # a multirun's parent may wait on a launcher for hours
        pause_collector()  # no collector passes over the start-up's imports (saturate.started)
    mark_reached("main")  # from here to task(): Hydra's work, the start-up's "hydra" span
    try:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            main()
        else:
            _answered(main)
    finally:
        resume_collector()  # when no run reached the end of its imports (--cfg, a mistake in the config)


def _answered(main: Callable[[], object]) -> None:
    """main(), its user's mistakes answered in one line."""
    global _answering
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra re-raises instead of printing
    _answering = True
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C before the run's own handler (importing torch), or a second one
        print(
            "interrupted (Ctrl-C): stopped at once, without a final save (one Ctrl-C during training saves last.pt "
            "at the next step and stops)",
            file=sys.stderr,
        )
        sys.exit(130)
    except CompactHydraException as e:  # UserError, composition and override errors
        from saturate.cli import describe  # here: saturate.cli imports this module

        sys.exit(f"error: {describe(e, sys.argv[1:])}")
    except InterpolationResolutionError as e:  # in Hydra's own keys (hydra.run.dir), resolved outside a composition
        sys.exit(f"error: {_unresolved(e)}")
    except yaml.YAMLError as e:  # a config file Hydra's loader refuses (a python tag, broken YAML)
        sys.exit(f"error: {_unreadable_yaml(e)}")
    except (OSError, ValueError) as e:  # Hydra creating the run dir or its log on a read-only or full disk
        if isinstance(e, ValueError):  # logging's "Unable to configure handler 'file'", from the OSError behind it
            if not isinstance(e.__cause__, OSError) or "configure handler" not in str(e):
                raise
            e = e.__cause__
        if e.errno == errno.ENAMETOOLONG:
            name = printable(str(e.filename or "the run dir"))
            sys.exit(
                f"error: cannot create {name[:120]}{'...' if len(name) > 120 else ''}: a name in it is over the file "
                "system's limit (255 bytes); give a shorter hydra.run.dir or name="
            )
        if e.errno not in (
            errno.EACCES,
            errno.EPERM,
            errno.EROFS,
            errno.ENOSPC,
            errno.EDQUOT,
            errno.ENOTDIR,
            errno.EEXIST,
            errno.EISDIR,
        ):
            raise
        what = printable(e.filename) if e.filename else "the run dir"
        sys.exit(
            f"error: cannot write {what} ({e.strerror}); run from a writable folder or set hydra.run.dir=<writable "
            "folder>"
        )
    finally:  # called in a process that goes on (a test, a notebook): its processes after it answer as before
        os.environ.pop("HYDRA_FULL_ERROR", None)
        _answering = False


def _unresolved(error: InterpolationResolutionError) -> str:
    """`key=<value given>: why it does not resolve`, in one line; a mistake of the user's that a
    resolver found (a rank variable naming the run dir) is that mistake's own line."""
    cause: BaseException | None = error
    while cause is not None and not isinstance(cause, UserError):  # OmegaConf chains its own errors around it
        cause = cause.__cause__ or cause.__context__
    if cause is not None:
        return str(cause)
    key = error.full_key or "the config"
    given = next((a.partition("=")[2] for a in sys.argv[1:] if a.lstrip("+~").partition("=")[0] == key), None)
    why = str(error.msg).splitlines()[0].removeprefix("KeyError raised while resolving interpolation: ")
    return printable(f"{key}{'=' + given if given is not None else ''}: cannot resolve it: {why}")


def _unreadable_yaml(error: yaml.YAMLError) -> str:
    """`<file>, line N: what is wrong`, in one line: a tag that would build a Python object is
    one YAML that Hydra's loader refuses."""
    mark = getattr(error, "problem_mark", None)
    where = f"{mark.name}, line {mark.line + 1}" if mark is not None else "a config file"
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    return printable(f"{where}: not a config saturate reads: {problem}")


def _freeze_at_exit() -> None:
    """Spare the interpreter freeing every object one by one at exit: with torch, dynamo,
    torchmetrics and scipy loaded, hundreds of thousands of them, which keeps a finished run's
    process alive well after its last line. What is already garbage is collected first;
    Python does not promise to finalize objects still alive at exit, and every atexit handler
    still runs."""
    gc.collect()
    gc.freeze()


def help_text(argv: list[str]) -> str:
    """train.py's --help: the template in conf/config.yaml with the config groups and their
    options, read from the config dirs (saturate's conf/ and any hydra.searchpath on the
    command line). Hydra's own --help builds the same list by composing a config per group,
    which is slow to answer; listing the folders takes milliseconds."""
    import string

    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    conf = CONF
    project = use_project_conf()
    dirs = [conf, *([project] if project is not None else [])]
    for override in OverridesParser.create().parse_overrides([a for a in argv if a.startswith("hydra.searchpath=")]):
        given = cast("list[str]", override.value() or [])  # hydra.searchpath's value is a list
        dirs += [Path(str(d).removeprefix("file://")) for d in given if not str(d).startswith("pkg://")]
    groups: dict[str, set[str]] = {}
    for folder in dirs:
        for group in (g for g in folder.glob("*") if g.is_dir() and g.name != "hydra"):
            groups.setdefault(group.name, set()).update(f.stem for f in group.glob("*.yaml"))
    listed = "\n".join(f"{name}: {', '.join(sorted(options))}" for name, options in sorted(groups.items()))
    help_cfg = OmegaConf.create({"hydra": {"help": OmegaConf.load(conf / "saturate.yaml").hydra.help}})
    container = cast("dict[str, Any]", OmegaConf.to_container(help_cfg, resolve=True))  # a DictConfig's is a dict
    template = container["hydra"]["help"]["template"]
    return string.Template(template).safe_substitute(APP_CONFIG_GROUPS=listed)


def shorthand(arg: str) -> str:
    """`tune=true` for tune.enabled=true (tune is a node: tune.budget_s=60 sets its keys)."""
    key, eq, value = arg.partition("=")
    return f"tune.enabled={value}" if eq and key == "tune" and value.lower() in ("true", "false") else arg


def task(cfg: DictConfig):
    """`saturate.train` as train.py's task, in as many processes as `trainer.devices` asks
    for (saturate.scale.launch). In a single run a UserError leaves at once, as a SystemExit, so
    that Hydra adds nothing to its message; in a multirun it is raised as usual: the job is
    recorded as failed and the sweep goes on."""
    mark_reached("task")
    invocation = from_hydra()  # how this run was started, read once; passed down from here
    from saturate.checkpoint.rundir import save_when_claimed

    run_dir = OmegaConf.select(cfg, "run_dir", default=None, throw_on_resolution_failure=False)
    save_when_claimed(run_dir or "", saved_record(cfg))  # .hydra/, once the run dir is this run's
    project = os.environ.get(PROJECT_ENV)
    log.info("config: %s", f"the project config dir {project}, then saturate's" if project else "saturate's")
    assert invocation is not None, "task() is a Hydra app's task: Hydra is running"
    try:
        try:
            _check_launcher(invocation)
            run = validate(cfg)  # every mistake in the config, before the run builds anything; the typed config
        except UserError as e:
            from saturate.checkpoint.rundir import record_failure

            record_failure(cfg.run_dir, e)  # for sweep reports: this job failed, and why
            raise

        from saturate.scale.launch import processes
        from saturate.trainer.run import train
        from saturate.tune import tune

        resume_collector(freeze=True)  # the imports are done: what they built is frozen (saturate.started)

        if run.tune.enabled:
            from saturate.checkpoint.rundir import save_started_if_free

            save_started_if_free(run.run_dir)  # its trials hold their own folders, not this one
            return tune(cfg, invocation)
        count = processes(run.trainer.devices, run.device.type)
        if count > 1:
            return _launched(cfg, count, invocation)
        return train(run, invocation)
    except UserError as e:
        if _answering and not invocation.multirun:
            raise SystemExit(f"error: {masked(str(e))}") from None  # a CI log is a record too
        raise


def _launched(cfg: DictConfig, count: int, invocation: Invocation):
    """The run in `count` processes through torch's elastic launcher; rank 0's metrics."""
    import torch

    from saturate.scale.launch import launch
    from saturate.trainer.run import Metrics

    what = "one per CUDA device" if cfg.device.type != "cpu" and torch.cuda.is_available() else "gloo on the CPU"
    log.info(
        "trainer.devices=%s: %d processes (%s) through torch's elastic launcher; trainer.devices=1 runs one",
        cfg.trainer.devices,
        count,
        what,
    )
    if _answering:  # the processes answer mistakes in one line too (run_hydra_app() set HYDRA_FULL_ERROR for itself)
        os.environ.pop("HYDRA_FULL_ERROR", None)
    assert invocation.output_dir is not None, "Hydra names each job's output dir"
    try:
        metrics = Metrics(launch(count, invocation.command_line(), invocation.output_dir))
    finally:
        if _answering:
            os.environ["HYDRA_FULL_ERROR"] = "1"
    metrics.objective = metrics.get("monitor", metrics.objective)
    return metrics


def _check_launcher(invocation: Invocation) -> None:
    """A launcher named in a single run: Hydra uses launchers in a multirun only, so without -m
    the run would train here (on a login node, for hydra/launcher=slurm)."""
    chosen = invocation.choices.get("hydra/launcher")
    if chosen not in (None, "basic") and not invocation.multirun:
        raise UserError(
            f"hydra/launcher={chosen}: Hydra starts a launcher's jobs in a multirun only; add -m (python train.py -m "
            f"hydra/launcher={chosen} ...: one job, or one per swept value)"
        )
