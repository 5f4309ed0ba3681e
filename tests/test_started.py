"""The start-up's imports (saturate.started): torchmetrics without the scipy.signal that only its
SRMRpy shim imports and the matplotlib that only its plots use, and stand-ins that give way to
the real modules when anything else asks. That train.py's run imports torchmetrics without them:
tests/test_cli.py (the collector's test)."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from tests.conftest import python

pytest.importorskip("scipy")


def in_fresh_python(code: str, cwd) -> dict:
    """`code` in a new interpreter (this one has imported scipy.signal long ago); its last line
    of output, as JSON."""
    done = python("-c", textwrap.dedent(code), cwd=cwd, timeout=120, fresh=True)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_an_import_that_uses_scipy_signal_gets_the_real_one_through_the_stand_in(tmp_path):
    (tmp_path / "uses_signal_xyz.py").write_text(
        "import scipy.signal\nSAYS_HAMMING = hasattr(scipy.signal, 'hamming')\n"
        "WINDOW = scipy.signal.windows.hamming(3).tolist()\n"
    )
    seen = in_fresh_python(
        """
        import json, sys
        from saturate.started import torchmetrics_stood_in
        import inspect
        with torchmetrics_stood_in():
            stood_in = sys.modules["scipy.signal"]
            inspect.getframeinfo(sys._getframe())  # asks every module for its __file__ (torch.library does this)
            asked = sys.modules["scipy.signal"] is stood_in
            import uses_signal_xyz
        import scipy.signal
        print(json.dumps({
            "asked": asked, "window": uses_signal_xyz.WINDOW, "says_hamming": uses_signal_xyz.SAYS_HAMMING,
            "stand_in_gone": scipy.signal is not stood_in and sys.modules["scipy.signal"] is scipy.signal,
        }))
        """,
        tmp_path,
    )
    assert seen["asked"]  # inspect's questions did not load the real module
    assert seen["window"] == pytest.approx([0.08, 1.0, 0.08])  # the stand-in fetched the real module
    assert seen["says_hamming"]  # what torchmetrics' shim asks is answered by the stand-in
    assert seen["stand_in_gone"]


def test_nothing_stands_in_for_a_scipy_signal_already_imported():
    import scipy.signal

    from saturate.started import torchmetrics_stood_in

    with torchmetrics_stood_in():
        assert sys.modules["scipy.signal"] is scipy.signal
    assert sys.modules["scipy.signal"] is scipy.signal


def test_torchmetrics_imported_without_matplotlib_still_plots_with_it(tmp_path):
    pytest.importorskip("matplotlib")  # saturate[report]; dev has it
    seen = in_fresh_python(
        """
        import json, os, sys
        os.environ["MPLBACKEND"] = "Agg"
        from saturate.started import import_timed
        import_timed("torch", "torchmetrics")
        left = sorted(n for n in sys.modules if n.partition(".")[0] == "matplotlib")
        import torch, torchmetrics
        from torchmetrics.utilities import plot
        mse = torchmetrics.MeanSquaredError()
        mse.update(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 3.0]))
        fig, ax = mse.plot()  # pyplot imported now, its style context entered around the plot
        import matplotlib, matplotlib.axes, matplotlib.pyplot as plt
        _, axes = plt.subplots(1, 3)
        print(json.dumps({
            "left": left,
            "figure": isinstance(fig, plt.Figure), "axes": isinstance(ax, plot._AX_TYPE),
            "real": isinstance(ax, matplotlib.axes.Axes),
            "not_axes": isinstance(object(), plot._AX_TYPE), "subclass": issubclass(type(ax), plot._AX_TYPE),
            "one_kept": plot.trim_axs(ax, 1) is ax, "two_of_three": len(plot.trim_axs(axes, 2)),
            "real_pyplot": sys.modules["matplotlib.pyplot"] is plt and type(plt).__name__ == "module",
            "forwards": plot.plt.subplots is plt.subplots,
            "version": plot.matplotlib.__version__ == matplotlib.__version__,
        }))
        """,
        tmp_path,
    )
    assert seen.pop("left") == []  # neither the real matplotlib nor a stand-in is in sys.modules after the import
    assert seen == {
        "figure": True,
        "axes": True,
        "real": True,
        "not_axes": False,
        "subclass": True,
        "one_kept": True,
        "two_of_three": 2,
        "real_pyplot": True,
        "forwards": True,
        "version": True,
    }


def test_what_a_block_takes_from_the_stand_ins_works_as_the_real_modules(tmp_path):
    """A name taken while they stand, a submodule imported then, the style of pyplot."""
    pytest.importorskip("matplotlib")
    seen = in_fresh_python(
        """
        import json, os, sys
        os.environ["MPLBACKEND"] = "Agg"
        from saturate.started import torchmetrics_stood_in
        with torchmetrics_stood_in():
            from matplotlib.pyplot import Figure
            import matplotlib.pyplot as plt
            import scipy.signal.windows, matplotlib.cm  # a submodule's import asks for the package's __path__
        import matplotlib.figure
        print(json.dumps({
            "figure": type(Figure(figsize=(2, 2))) is matplotlib.figure.Figure,
            "style": plt.style.available == sys.modules["matplotlib.style"].available,
            "window": scipy.signal.windows.hamming(3).tolist(),
            "cm": matplotlib.cm is sys.modules["matplotlib.cm"],
        }))
        """,
        tmp_path,
    )
    assert seen.pop("window") == pytest.approx([0.08, 1.0, 0.08])
    assert seen == {"figure": True, "style": True, "cm": True}


def test_with_scienceplots_installed_torchmetrics_gets_the_real_matplotlib(tmp_path):
    """torchmetrics' plot module imports scienceplots when it is installed, which styles
    matplotlib as it loads: no stand-in for matplotlib then."""
    pytest.importorskip("matplotlib")  # saturate[report]; dev has it
    (tmp_path / "scienceplots").mkdir()
    (tmp_path / "scienceplots" / "__init__.py").write_text(
        "import matplotlib.pyplot as plt\nSTYLES = plt.style.available\n"
    )
    (tmp_path / "scienceplots-2.1.1.dist-info").mkdir()
    (tmp_path / "scienceplots-2.1.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: scienceplots\nVersion: 2.1.1\n"
    )
    seen = in_fresh_python(
        """
        import json, os, sys
        os.environ["MPLBACKEND"] = "Agg"
        from saturate.started import import_timed
        import_timed("torch", "torchmetrics")
        import matplotlib.pyplot as plt
        print(json.dumps({"scienceplots": "scienceplots" in sys.modules, "real": type(plt).__name__ == "module"}))
        """,
        tmp_path,
    )
    assert seen == {"scienceplots": True, "real": True}


def test_nothing_stands_in_for_a_matplotlib_already_imported(tmp_path):
    pytest.importorskip("matplotlib")  # saturate[report]; dev has it
    seen = in_fresh_python(
        """
        import json, sys
        import matplotlib
        from saturate.started import torchmetrics_stood_in
        with torchmetrics_stood_in():
            same = sys.modules["matplotlib"] is matplotlib and "matplotlib.pyplot" not in sys.modules
        print(json.dumps({"same": same, "after": sys.modules["matplotlib"] is matplotlib}))
        """,
        tmp_path,
    )
    assert seen == {"same": True, "after": True}
