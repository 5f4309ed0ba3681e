"""tests/zygote.py: a command started from the zygote is what a fresh `python ARGV` would be, in
everything the tests read of it (a probe run both ways), and a timeout kills it with its children."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.conftest import ROOT, ZYGOTE, popen, python
from tests.zygote import Child, Zygote

PROBE = """
import json, os, stat, sys
print(json.dumps({
    "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "name": __name__,
    "env": os.environ.get("ZYGOTE_PROBE"), "pythonpath": [p for p in sys.path if p.endswith("extra")],
    "stdin": sys.stdin.read(), "stdout_is_a_pipe": stat.S_ISFIFO(os.fstat(1).st_mode),
    "fatal": os.environ.get("ZYGOTE_FATAL"), "globals": sorted(k for k in globals() if not k.startswith("__")),
}))
sys.stderr.write("to stderr\\n")
fatal = os.environ.get("ZYGOTE_FATAL")
if fatal == "message":
    raise SystemExit("error: a clear message")
if fatal == "exception":
    raise ValueError("a bug")
"""


def both(*argv, **kwargs) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    return python(*argv, **kwargs), python(*argv, fresh=True, **kwargs)


@pytest.mark.parametrize("form", ["script", "-c", "-m"])
@pytest.mark.parametrize("fatal", ["", "message", "exception"])
def test_a_command_from_the_zygote_is_what_a_fresh_interpreter_gives(tmp_path, form, fatal):
    (tmp_path / "extra").mkdir()
    (tmp_path / "probe_mod.py").write_text(PROBE)
    argv = {"script": [tmp_path / "probe_mod.py"], "-c": ["-c", PROBE], "-m": ["-m", "probe_mod"]}[form]
    env = {"ZYGOTE_PROBE": "given", "ZYGOTE_FATAL": fatal, "PYTHONPATH": str(tmp_path / "extra")}
    forked, fresh = both(*argv, "an argument", cwd=tmp_path, env=env)
    assert forked.returncode == fresh.returncode == {"": 0, "message": 1, "exception": 1}[fatal]
    assert json.loads(forked.stdout) == json.loads(fresh.stdout)
    seen = json.loads(forked.stdout)
    assert seen["stdout_is_a_pipe"] and seen["stdin"] == ""
    assert seen["argv"][1:] == ["an argument"] and seen["name"] == "__main__" and seen["env"] == "given"
    assert seen["cwd"] == str(tmp_path) and seen["pythonpath"] == [str(tmp_path / "extra")]
    if fatal == "exception":  # the traceback's last line, as Python prints it
        assert forked.stderr.splitlines()[-1] == fresh.stderr.splitlines()[-1] == "ValueError: a bug"
    else:
        assert forked.stderr == fresh.stderr


def test_a_folder_or_a_variable_that_a_fresh_interpreter_would_import_otherwise_goes_fresh(tmp_path):
    (tmp_path / "psutil.py").write_text("")  # the zygote imported the real one
    (tmp_path / "elsewhere").mkdir()
    assert ZYGOTE.needs_fresh(["-c", "pass"], tmp_path / "elsewhere", {**os.environ, "PYTHONPATH": str(tmp_path)})
    assert ZYGOTE.needs_fresh([tmp_path / "script.py"], tmp_path / "elsewhere", dict(os.environ))  # its folder
    assert ZYGOTE.needs_fresh(["-m", "mod"], tmp_path, dict(os.environ))  # the working folder
    assert ZYGOTE.needs_fresh(["-c", "pass"], tmp_path / "elsewhere", {**os.environ, "PYTHONHASHSEED": "1"})
    assert not ZYGOTE.needs_fresh(["-c", "pass"], tmp_path / "elsewhere", {**os.environ, "HYDRA_FULL_ERROR": "1"})
    # what torch itself sets in this process as tests run (a DataLoader's workers, inductor): not a reason
    torch_sets = {"TORCHINDUCTOR_CACHE_DIR": "/tmp/x", "KMP_DUPLICATE_LIB_OK": "True", "KMP_INIT_AT_FORK": "FALSE"}
    assert not ZYGOTE.needs_fresh(["-c", "pass"], tmp_path / "elsewhere", {**os.environ, **torch_sets})
    done = python("-c", "import psutil; print(psutil.__file__)", env={"PYTHONPATH": str(tmp_path)})
    assert done.stdout.strip() == str(tmp_path / "psutil.py")  # a fresh interpreter's answer


LATE = """
import atexit, os, pickle, sys, threading, time
class Point:
    pass
def late():
    time.sleep(0.2)
    print("late:", len(pickle.dumps(Point())) > 0, flush=True)
atexit.register(lambda: print("at exit:", os.path.basename(sys.argv[0]), flush=True))
threading.Thread(target=late).start()
"""


@pytest.mark.parametrize("form", ["script", "-m"])
def test_the_main_module_outlives_the_scripts_last_line(tmp_path, form):
    """A thread still running, and an atexit handler, see the script's own __main__ (a class
    defined there pickles) and argv, as in a fresh interpreter."""
    (tmp_path / "late_mod.py").write_text(LATE)
    argv = {"script": [tmp_path / "late_mod.py"], "-m": ["-m", "late_mod"]}[form]
    forked, fresh = both(*argv, cwd=tmp_path)
    assert forked.stdout == fresh.stdout == "late: True\nat exit: late_mod.py\n", forked.stderr
    assert forked.returncode == fresh.returncode == 0


ENDINGS = {
    # the script's globals are finalized at its end: a file it left open is flushed and closed
    "a-file-left-open": ("log = open('left-open.txt', 'w')\nlog.write('kept')\nprint('no newline', end='')", 0),
    "an-exit-status": ("import sys\nprint('out')\nsys.exit(300)", 300 & 0xFF),
    "an-exit-with-an-object": ("raise SystemExit(['not', 'a', 'number'])", 1),
    # an uncaught Ctrl-C: Python prints it, then ends by SIGINT (-2 to subprocess); a subclass of it does not
    "ctrl-c": ("import signal\nsignal.signal(signal.SIGINT, signal.default_int_handler)\nraise KeyboardInterrupt", -2),
    "a-subclass-of-ctrl-c": ("class Stop(KeyboardInterrupt):\n    pass\nraise Stop", 1),
    "an-exit-status-past-a-c-long": ("raise SystemExit(2**70)", 255),
    # finalizers of the script's objects still see its globals
    "a-finalizer-that-reads-a-global": (
        "import os\nclass Late:\n    def __del__(self):\n        print('finalized:', os.sep)\nkeep = Late()",
        0,
    ),
    "stdout-closed-by-the-script": ("import sys\nprint('before')\nsys.stdout.close()", 0),
}


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_a_command_ends_as_a_fresh_interpreter_ends(tmp_path, ending):
    """The zygote's child skips the interpreter's teardown of its modules (tests/zygote.py's
    `_child`): what a script sees of its ending is still a fresh interpreter's."""
    code, status = ENDINGS[ending]
    outputs = []
    for fresh in (False, True):
        (tmp_path / "left-open.txt").unlink(missing_ok=True)
        done = python("-c", code, cwd=tmp_path, fresh=fresh)
        left = tmp_path / "left-open.txt"
        kept = left.read_text() if left.exists() else None
        outputs.append((done.returncode, done.stdout, done.stderr.splitlines()[-1:], kept))
    assert outputs[0] == outputs[1]
    assert outputs[0][0] == status


def test_a_missing_script_output_that_is_not_text_and_fresh_random_streams(tmp_path):
    missing = both(tmp_path / "absent.py", cwd=tmp_path)
    assert missing[0].returncode == missing[1].returncode == 2 and missing[0].stderr == missing[1].stderr
    for fresh in (False, True):  # as subprocess.run(text=True): bytes that are not UTF-8 are an error, not ""
        with pytest.raises(UnicodeDecodeError):
            python("-c", "import sys; sys.stderr.buffer.write(b'Traceback \\xff')", fresh=fresh)
    seeds = [
        python("-c", "import torch, numpy; print(torch.initial_seed(), numpy.random.randint(1 << 30))").stdout
        for _ in range(2)
    ]
    assert seeds[0] != seeds[1]  # each child draws its own, as each new interpreter does


SIDE_BY_SIDE = """
import os, sys, time
mine, theirs = sys.argv[1:]
open(mine, "w").close()
deadline = time.monotonic() + 30
while not os.path.exists(theirs):
    assert time.monotonic() < deadline, "the other command did not run beside this one"
    time.sleep(0.01)
print("met")
"""


def test_commands_started_together_run_side_by_side(tmp_path):
    """Each waits for a file that the other writes: served one at a time, neither would end."""
    a, b = tmp_path / "a", tmp_path / "b"
    procs = [popen("-c", SIDE_BY_SIDE, a, b, cwd=tmp_path), popen("-c", SIDE_BY_SIDE, b, a, cwd=tmp_path)]
    assert all(isinstance(p, Child) for p in procs)  # from the zygote
    assert [p.communicate(timeout=60) for p in procs] == [("met\n", "")] * 2
    assert [p.returncode for p in procs] == [0, 0]


WAITS = "import sys, time\nprint('ready', flush=True)\nsys.stderr.write('on stderr\\n')\ntime.sleep(60)"


def test_a_started_command_is_handled_as_popens_is(tmp_path):
    """What the tests do with a command they started: read a line of it, poll it, wait on it
    past a timeout, signal it, then read the rest and its status. The zygote's and Popen's."""
    seen = []
    for proc in (popen("-c", WAITS, cwd=tmp_path), subprocess.Popen([sys.executable, "-c", WAITS], **POPEN)):
        line, running = proc.stdout.readline(), proc.poll()
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.2)
        proc.send_signal(signal.SIGTERM)
        seen.append((line, running, proc.communicate(timeout=30), proc.returncode))
    assert isinstance(proc, subprocess.Popen)
    assert seen[0] == seen[1] == ("ready\n", None, ("", "on stderr\n"), -signal.SIGTERM)


POPEN = {"stdin": subprocess.DEVNULL, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}


def test_communicate_after_a_timeout_gives_the_whole_output(tmp_path):
    """Popen's idiom: communicate past a timeout, then again (after a kill, or to wait more)."""
    code = "import time\nprint('early', flush=True)\ntime.sleep(0.5)\nprint('late')"
    seen = []
    for start in (
        lambda: popen("-c", code, cwd=tmp_path),
        lambda: subprocess.Popen([sys.executable, "-c", code], **POPEN),
    ):
        proc = start()  # one after the other: the second must not have ended while the first was read
        with pytest.raises(subprocess.TimeoutExpired):
            proc.communicate(timeout=0.05)
        seen.append((proc.communicate(timeout=30), proc.returncode))
    assert seen[0] == seen[1] == (("early\nlate\n", ""), 0)


@pytest.fixture(scope="module")
def light():
    """A zygote of this module's own that imports nothing heavy: the timeouts below restart the
    zygote they time out on, and restarting the shared one would import torch and the rest again
    (8-10 s of CPU each) for the tests after these."""
    zygote = Zygote(dict(os.environ), preload=("json",))
    yield lambda *argv, timeout=240: zygote.run(argv, cwd=ROOT, env=dict(os.environ), timeout=timeout)
    zygote.stop()


@pytest.mark.parametrize("fresh", [False, True])
def test_past_its_timeout_the_command_is_killed_with_its_children(tmp_path, fresh, request):
    run = functools.partial(python, fresh=True) if fresh else request.getfixturevalue("light")  # a light zygote
    pid_file = tmp_path / "grandchild.pid"
    code = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True)\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(60)\n"
    )
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run("-c", code, timeout=3)
    assert time.monotonic() - start < 20
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while psutil.pid_exists(grandchild) and psutil.Process(grandchild).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the grandchild outlived the timeout"
        time.sleep(0.05)
    if not fresh:  # the zygote serves on
        assert run("-c", "print('after')").stdout == "after\n"


def test_a_timeout_before_the_answer_leaves_the_next_command_its_own_status(light):
    """A timeout between a request and its status (here before the pid came back) must not
    leave that request's answers to be read as the next one's."""
    with pytest.raises(subprocess.TimeoutExpired):
        light("-c", "raise SystemExit(5)", timeout=0.0001)
    assert [light("-c", f"raise SystemExit({n})").returncode for n in (0, 7, 3)] == [0, 7, 3]
