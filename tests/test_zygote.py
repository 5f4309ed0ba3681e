"""tests/zygote.py: a command started from the zygote is what a fresh `python ARGV` would be, in
everything the tests read of it (a probe run both ways), and a timeout kills it with its children."""

from __future__ import annotations

import json
import subprocess
import time

import psutil
import pytest

from tests.conftest import ZYGOTE, python

PROBE = """
import json, os, stat, sys
print(json.dumps({
    "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "name": __name__,
    "env": os.environ.get("ZYGOTE_PROBE"), "pythonpath": [p for p in sys.path if p.endswith("extra")],
    "stdin": sys.stdin.read(), "stdout_is_a_pipe": stat.S_ISFIFO(os.fstat(1).st_mode),
    "fatal": os.environ.get("ZYGOTE_FATAL"),
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


def test_a_pythonpath_folder_that_shadows_a_loaded_module_is_seen(tmp_path):
    (tmp_path / "psutil.py").write_text("")  # the zygote imported the real one
    assert ZYGOTE.shadowed({"PYTHONPATH": str(tmp_path)})
    assert not ZYGOTE.shadowed({"PYTHONPATH": str(tmp_path / "absent")})
    done = python("-c", "import psutil; print(psutil.__file__)", env={"PYTHONPATH": str(tmp_path)})
    assert done.stdout.strip() == str(tmp_path / "psutil.py")  # a fresh interpreter's answer


@pytest.mark.parametrize("fresh", [False, True])
def test_past_its_timeout_the_command_is_killed_with_its_children(tmp_path, fresh):
    pid_file = tmp_path / "grandchild.pid"
    code = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True)\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(60)\n"
    )
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        python("-c", code, timeout=3, fresh=fresh)
    assert time.monotonic() - start < 20
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while psutil.pid_exists(grandchild) and psutil.Process(grandchild).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the grandchild outlived the timeout"
        time.sleep(0.05)
    assert python("-c", "print('after')").stdout == "after\n"  # the zygote serves on
