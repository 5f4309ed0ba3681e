"""The `saturate` console command: `saturate <command> [...]` dispatched to the command's module
(saturate.commands), and what the commands share: a project's config dir and package first, a
composition error answered in one line, and the checkpoint commands' arguments and config
(saturate eval, saturate export).
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from hydra.errors import CompactHydraException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

# train.py, a project's own scripts and the docs reach these as saturate.cli.<name>
from saturate.commands.train import run_hydra_app, task, train_command
from saturate.config.dirs import project_pythonpath, use_project_conf
from saturate.config.invocation import TRAIN_COMMAND
from saturate.config.registration import register
from saturate.config.schema import REMOVED
from saturate.errors import Problem

if TYPE_CHECKING:
    import argparse

__all__ = [
    "COMMANDS",
    "checkpoint_command",
    "command",
    "describe",
    "project_first",
    "run_hydra_app",
    "task",
    "train_command",
]


def project_first() -> None:
    """A project config dir in the working dir (saturate.config.dirs) first on Hydra's search
    path, and the project's folders (the working dir, or its [tool.saturate] pythonpath) first
    on sys.path, so that its package imports; with no project config dir, nothing is imported
    from the working dir."""
    if use_project_conf() is None:
        return
    for folder in reversed(project_pythonpath(Path.cwd())):
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))


def describe(error: CompactHydraException, argv: list[str]) -> str:
    """The message for a composition error, from the exception Hydra raised."""
    if isinstance(error, MissingConfigException) and error.missing_cfg_file and error.options:
        group, _, option = error.missing_cfg_file.rpartition("/")
        return str(Problem(group, option, "one of " + ", ".join(error.options)))
    if isinstance(error, OverrideParseException):
        return f"{error.override}: {str(error).strip()}"
    cause = error.__cause__
    key = getattr(cause, "full_key", None)  # an OmegaConf error raised before its key was known has none
    if isinstance(cause, OmegaConfBaseException) and key:
        value = _given(key, argv)
        if key in REMOVED:
            return str(Problem(key, value, REMOVED[key]))
        if isinstance(cause, (ConfigKeyError, ConfigAttributeError)):
            return _unknown_key(key, value, _keys(cause))
        said = str(cause.msg).splitlines()[0]  # msg's other lines repeat the key
        if "Cannot merge DictConfig with ListConfig" in said:  # a list given where the node is a mapping
            said = f"expected a mapping, not a list: {{name: value, ...}}, or set one entry with +{key}.<name>=..."
        return f"{key}={value}: {said}"
    return str(error).strip()


def _keys(cause: OmegaConfBaseException) -> list[str]:
    """The keys that exist where the unknown one was asked for: the schema's fields, or the
    keys of the node (a model or data node has no fixed schema)."""
    if dataclasses.is_dataclass(cause.object_type):
        return [f.name for f in dataclasses.fields(cause.object_type)]
    node = getattr(cause, "parent_node", None)
    return [str(k) for k in node.keys()] if isinstance(node, DictConfig) else []


def _unknown_key(key: str, value: str, names: list[str]) -> str:
    if not names:
        return f"{key}={value}: no such key"
    parent = key.rpartition(".")[0]
    close = difflib.get_close_matches(key.rpartition(".")[2], names, n=1)
    hint = f" (did you mean {'.'.join(filter(None, [parent, close[0]]))}?)" if close else ""
    where = f"the keys of {parent}" if parent else "the top-level keys"
    return f"{key}={value}: no such key{hint}; {where} are " + ", ".join(names)


def _given(key: str, argv: list[str]) -> str:
    """The value the command line gave `key` (an override `key=value`, maybe with + or ~)."""
    for arg in argv:
        name, eq, value = arg.partition("=")
        if eq and name.lstrip("+~") == key:
            return value
    return "?"


COMMANDS = {
    "train": "train a model: python train.py's command, from any folder (saturate train --help)",
    "eval": "a checkpoint evaluated on the val or test split",
    "export": "a checkpoint to ONNX, a torch.export program and safetensors, each checked",
    "selftest": "every CUDA path checked on this machine, the fast path measured",
    "init": "a project of your own to start from: a package, a config dir, a README",
    "sweep-report": "a multirun's jobs compared: the fastest setting and why the others were not",
    "compare-runs": "train.py configurations run side by side, their figures compared",
    "make-shards": "an image folder written as WebDataset shards (data=shards)",
    "make-image-folder": "a small image folder of scikit-learn's digits, to try data=image_folder on",
    "monitor-gpu": "every visible GPU's utilisation and memory sampled, with a verdict",
    "check-env": "this machine's device, libraries and settings checked, with advice",
    "selftest-bundle": "what saturate selftest needs on a GPU machine without internet, in one folder",
}
TOOLS = set(COMMANDS) - {"train", "eval", "export", "selftest"}  # saturate.commands.<name>.main(argv)


def usage() -> str:
    from saturate import __version__

    listed = "\n".join(f"  saturate {n:<18} {what}" for n, what in COMMANDS.items())
    return f"saturate {__version__}\nusage: saturate <command> [--help]\n\ncommands:\n{listed}"


def command() -> None:
    """The `saturate` console command: `saturate <command> [...]` (COMMANDS)."""
    name, argv = (sys.argv[1], sys.argv[2:]) if len(sys.argv) > 1 else (None, [])
    if name in ("--help", "-h"):
        print(usage())
        return
    if name == "--version":
        from saturate import __version__

        print(f"saturate {__version__}")
        return
    if name not in COMMANDS:
        sys.exit(usage() if name is None else f"saturate: no command {name!r}\n{usage()}")
    if name == "train":
        sys.argv = [f"{sys.argv[0]} train", *argv]
        train_command(TRAIN_COMMAND)
        return
    if name == "selftest":
        from saturate.selftest import main

        sys.exit(main(argv))
    if name in TOOLS:
        import importlib

        sys.exit(importlib.import_module(f"saturate.commands.{name.replace('-', '_')}").main(argv))
    sys.exit(checkpoint_command(name, argv))


def checkpoint_parser(name: str) -> argparse.ArgumentParser:
    """`saturate eval` and `saturate export`: a checkpoint, flags, and overrides as for train.py
    (each command's own flags: saturate.commands.eval and .export)."""
    import argparse

    p = argparse.ArgumentParser(
        prog=f"saturate {name}",
        description=f"saturate {name} CHECKPOINT [overrides ...]: {COMMANDS[name]}. The config is composed from conf/ "
        "and the overrides as for python train.py (give the ones the run was trained with: model, data, loader ...).",
    )
    p.add_argument("checkpoint", help="a checkpoint file, or a run dir (its checkpoints/best.pt, else last.pt)")
    p.add_argument("overrides", nargs="*", help="key=value and group=option, as for train.py")
    p.add_argument("--out", default=None, help=f"where the results go (default outputs/{name}/<date>/<time>)")
    p.add_argument(
        "--run-saved-config",
        action="store_true",
        help="use the run dir's saved .hydra/config.yaml instead of conf/: this instantiates and runs the classes "
        "that config names (only for run dirs you trust)",
    )
    _checkpoint_module(name).add_arguments(p)
    return p


def checkpoint_command(name: str, argv: list[str]) -> int:
    """Parse, check the flags and --out, compose the config, run `saturate eval` or `saturate
    export`; a user's mistake is one line (exit 1), never a traceback. Nothing is imported
    from a run dir (saturate.commands.after_run): a project's config dir and package come from
    the working dir only when it is no run dir."""
    from datetime import datetime

    from saturate.commands.after_run import code_from_projects_only, is_run_dir, prepared_out

    args = checkpoint_parser(name).parse_intermixed_args(argv)  # overrides before and after flags
    out = Path(args.out or Path("outputs") / name / datetime.now().strftime("%Y-%m-%d/%H-%M-%S-%f")).absolute()
    try:
        module = _checkpoint_module(name)
        module.check(args)
        if not is_run_dir(Path.cwd()):
            project_first()  # a project's config dir and package, as for saturate train in the same folder
        code_from_projects_only()
        with prepared_out(out, exclusive=name == "export"):
            from saturate.trainer.evaluation import find_checkpoint

            path = find_checkpoint(args.checkpoint)
            cfg = _checkpoint_config(args, path, out)
            return module.run_on(cfg, path, args, out)
    except CompactHydraException as e:  # UserError (ConfigError, CheckpointError, ...) and composition errors
        print(f"error: {describe(e, args.overrides)}", file=sys.stderr)
        return 1


def _checkpoint_module(name: str) -> ModuleType:
    """saturate.commands.eval or .export: the command's own flags (`add_arguments`) and what it
    does with the checkpoint and its config (`run_on`)."""
    import importlib

    return importlib.import_module(f"saturate.commands.{name}")


def _checkpoint_config(args: argparse.Namespace, path: Path, out: Path) -> DictConfig:
    """conf/ composed with the overrides, or (--run-saved-config) the run dir's saved config;
    its run_dir is `out`, set after composition (a path is no override: any character goes)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from saturate.api import config_dir

    register()
    hydra_args = [o for o in args.overrides if o.startswith("hydra.")]
    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        if not args.run_saved_config:
            cfg = compose("config", overrides=args.overrides)
        else:
            from saturate.trainer.evaluation import saved_config

            base = compose("config", overrides=hydra_args)
            run_dir = Path(args.checkpoint) if Path(args.checkpoint).is_dir() else path.parent.parent
            cfg = saved_config(run_dir, [o for o in args.overrides if o not in hydra_args], base)
    OmegaConf.update(cfg, "run_dir", str(out).replace("${", "\\${"), merge=False)  # literal, not interpolated
    return cfg
