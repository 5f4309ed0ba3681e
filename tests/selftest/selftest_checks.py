"""Checks of a user's own (`saturate selftest --checks tests.selftest.selftest_checks`) that misbehave
in every way a check can, for tests/selftest/test_selftest.py: one hangs (with a child process of its
own), one raises, one kills its interpreter, one is skipped, one passes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from saturate.selftest.base import Skip, check


@check("user-passes", "a check that passes")
def passes(ctx):
    # the runner counted the GPUs: a check's process imports torch only if the check does
    return f"fine ({'torch imported' if 'torch' in sys.modules else 'no torch'})"


@check("user-hangs", "a check that never answers, with a process of its own", timeout_s=4)
def hangs(ctx):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    (ctx.work / "hung-child.pid").write_text(str(child.pid))
    time.sleep(120)


@check("user-raises", "a check with a bug")
def raises(ctx):
    raise ValueError("the model's head has 7 outputs\nsecond line")


@check("user-dies", "a check whose interpreter dies")
def dies(ctx):
    print("about to die", flush=True)
    os._exit(3)


@check("user-skips", "a check with no meaning here")
def skips(ctx):
    raise Skip("needs a TPU")
