"""A project of your own to start from: a package with a data module and a model, a config dir
that makes them the project's defaults, and a README of a few lines.

    saturate init [DIR] [--package NAME] [--force]

It trains at once (`cd DIR && saturate train`) on scikit-learn's handwritten digits, which
ship with scikit-learn (nothing is downloaded), read as a table of 64 pixel values: the shape
most users' own data has (rows of features, a label). The comments in each file say where
your own data and model go. It is what lightning-hydra-template is forked for, without
forking saturate: saturate stays an installed dependency.
"""

from __future__ import annotations

import argparse
import keyword
import re
import sys
from pathlib import Path

DATA = '''"""Your data: a function that returns (train, val) datasets, or (train, val, test).

saturate calls it with the keys of conf/data/{data}.yaml. Each sample is (input, target); the
input here is a float vector, the target a class index. Put your own reading here: files,
a database, arrays; keep the split fixed (a seed) so that runs compare.
"""

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch.utils.data import TensorDataset


def load(val_fraction: float = 0.2, seed: int = 0):
    x, y = load_digits(return_X_y=True)  # 1,797 rows of 64 features, 10 classes (ships with scikit-learn)
    order = np.random.default_rng(seed).permutation(len(y))
    x, y = x[order] / 16.0, y[order]
    n_val = int(len(y) * val_fraction)
    as_tensors = lambda a, b: TensorDataset(torch.tensor(a, dtype=torch.float32), torch.tensor(b))  # noqa: E731
    return as_tensors(x[n_val:], y[n_val:]), as_tensors(x[:n_val], y[:n_val])
'''

MODEL = '''"""Your model: a torch.nn.Module.

saturate builds it from conf/model/{model}.yaml and passes the arguments it names that the
data decides (in_features, num_classes, input_shape, in_channels, num_outputs).
"""

from torch import nn


class Net(nn.Module):
    def __init__(self, in_features: int, num_classes: int, hidden: int = 64):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))

    def forward(self, x):
        return self.layers(x)
'''

CONFIG = """# This project's defaults: saturate's own config (every group's default), with this project's
# data and model chosen. `saturate train` run in this folder reads it (./conf is found by
# convention); anything here or on the command line can be overridden as usual.
defaults:
  - saturate
  - override data: {data}
  - override model: {model}
  - _self_

trainer:
  max_epochs: 10
"""

DATA_NODE = """# conf/data/{data}.yaml: data={data} (the default in conf/config.yaml). _target_ is your function; the
# other keys are its arguments. Add options beside it (conf/data/other.yaml) and choose with data=other.
_target_: {package}.data.load
val_fraction: 0.2
seed: 0
"""

MODEL_NODE = """# conf/model/{model}.yaml: model={model}. The data-derived arguments (in_features, num_classes) are
# filled in by saturate; the keys here are the rest.
_target_: {package}.model.Net
hidden: 64
"""

EXPERIMENT = """# @package _global_
# saturate train experiment=quick: two epochs, to check that everything runs.
trainer:
  max_epochs: 2
"""

README = """# {name}

Trains `{package}.model.Net` on `{package}.data.load` with [saturate](https://pypi.org/project/saturate/):

```bash
saturate train                       # this project's defaults (conf/config.yaml)
saturate train experiment=quick      # two epochs
saturate train -m model.hidden=32,128 && saturate sweep-report outputs/multirun/<date>/<time>
```

Your data goes in `{package}/data.py`, your model in `{package}/model.py`; their keys in
`conf/data/` and `conf/model/`. Runs land in `outputs/`; `tensorboard --logdir outputs` shows them.
"""


def files(package: str, name: str) -> dict[str, str]:
    """What `init` writes, relative to the project's folder."""
    keys = {"package": package, "name": name, "data": f"{package}_data", "model": f"{package}_net"}
    return {
        "README.md": README.format(**keys),
        f"{package}/__init__.py": "",
        f"{package}/data.py": DATA.format(**keys),
        f"{package}/model.py": MODEL.format(**keys),
        "conf/config.yaml": CONFIG.format(**keys),
        f"conf/data/{keys['data']}.yaml": DATA_NODE.format(**keys),
        f"conf/model/{keys['model']}.yaml": MODEL_NODE.format(**keys),
        "conf/experiment/quick.yaml": EXPERIMENT,
    }


def package_name(folder: Path) -> str:
    """A Python package name from the folder's name (`my-project` -> my_project)."""
    name = re.sub(r"\W", "_", folder.resolve().name.lower()).strip("_") or "my_project"
    name = name if not name[0].isdigit() else f"project_{name}"
    return f"{name}_project" if keyword.iskeyword(name) or name in ("saturate", "torch", "conf") else name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="saturate init", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("folder", nargs="?", type=Path, default=Path("."), help="where (default: here)")
    parser.add_argument("--package", default=None, help="the package's name (default: from the folder's name)")
    parser.add_argument("--force", action="store_true", help="write into a folder that is not empty")
    args = parser.parse_args(argv)
    folder: Path = args.folder
    if folder.exists() and not folder.is_dir():
        print(f"error: {folder} is a file; expected a folder (new or empty)", file=sys.stderr)
        return 1
    if folder.is_dir() and any(folder.iterdir()) and not args.force:
        print(f"error: {folder} is not empty; give a new or empty folder, or --force to add to it", file=sys.stderr)
        return 1
    package = args.package or package_name(folder)
    if not package.isidentifier() or keyword.iskeyword(package):
        print(f"error: --package={package!r}: expected a Python identifier (letters, digits, _)", file=sys.stderr)
        return 1
    written = files(package, folder.resolve().name)
    clashes = [rel for rel in written if (folder / rel).exists()]
    if clashes:
        print(f"error: {folder / clashes[0]} exists; init writes no file over another", file=sys.stderr)
        return 1
    for rel, text in written.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(text)
    where = "" if folder.resolve() == Path.cwd().resolve() else f"cd {folder} && "
    print(f"wrote a project in {folder.resolve()} (package {package}); train it: {where}saturate train")
    return 0
