"""The start-up's imports (saturate.started): torchmetrics without the scipy.signal that only its
SRMRpy shim imports, and a stand-in that gives way to the real module when anything else asks.
That train.py's run imports torchmetrics without it: tests/test_cli.py (the collector's test)."""

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
