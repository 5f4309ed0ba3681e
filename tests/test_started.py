"""The start-up's imports (saturate.started): torchmetrics without the scipy.signal that only its
SRMRpy shim imports, and a stand-in that gives way to the real module when anything else asks."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("scipy")


def in_fresh_python(code: str, cwd) -> dict:
    """`code` in a new interpreter (this one has imported scipy.signal long ago); its last line
    of output, as JSON."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, cwd=cwd, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_torchmetrics_is_imported_without_scipy_signal_and_scipy_signal_is_real_afterwards(tmp_path):
    seen = in_fresh_python(
        """
        import json, sys
        import gc
        from saturate.started import IMPORTS, _SignalStandIn, import_timed
        import_timed("torch", "torchmetrics")
        deferred = "scipy.signal" not in sys.modules
        left = [o for o in gc.get_objects() if isinstance(o, _SignalStandIn)]
        import torch
        from torchmetrics import MeanSquaredError
        mse = MeanSquaredError()
        mse.update(torch.tensor([1.0, 2.0]), torch.tensor([0.0, 0.0]))
        import scipy.signal
        from scipy.signal import windows
        print(json.dumps({
            "deferred": deferred, "left": len(left), "timed": "torchmetrics" in IMPORTS, "mse": float(mse.compute()),
            "real": hasattr(scipy.signal, "__file__") and scipy.signal is sys.modules["scipy.signal"],
            "hamming": windows.hamming(3).tolist(), "attribute": sys.modules["scipy"].signal is scipy.signal,
        }))
        """,
        tmp_path,
    )
    assert seen["deferred"] and seen["timed"]  # torchmetrics' import did not load scipy.signal, and left nothing there
    assert seen["left"] == 0  # nor anywhere else
    assert seen["mse"] == pytest.approx(2.5)
    assert seen["real"] and seen["attribute"]  # imported after it, the module is the real one
    assert seen["hamming"] == pytest.approx([0.08, 1.0, 0.08])


def test_an_import_that_uses_scipy_signal_gets_the_real_one_through_the_stand_in(tmp_path):
    (tmp_path / "uses_signal_xyz.py").write_text(
        "import scipy.signal\nSAYS_HAMMING = hasattr(scipy.signal, 'hamming')\n"
        "WINDOW = scipy.signal.windows.hamming(3).tolist()\n"
    )
    seen = in_fresh_python(
        """
        import json, sys
        from saturate.started import scipy_signal_stood_in
        import inspect
        with scipy_signal_stood_in():
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

    from saturate.started import scipy_signal_stood_in

    with scipy_signal_stood_in():
        assert sys.modules["scipy.signal"] is scipy.signal
    assert sys.modules["scipy.signal"] is scipy.signal
