"""`python ARGV` (a script, `-m MODULE` or `-c CODE`, then arguments) as subprocess.run would start
it, in a new process forked from one that has already imported the heavy third-party modules
(torch, torch._dynamo, torchmetrics, scikit-learn, Hydra, Kornia, TensorBoard): the tests' commands
skip the 5-8 s those imports take on a 2-core CPU, each time.

The child is a process of its own: its own pid, exit status, working directory, environment,
sys.argv and sys.path (the script's folder, then PYTHONPATH's entries), and stdin, stdout and
stderr on the caller's own pipes (passed over a Unix socket), output to a pipe included. The
script runs as `__main__`, and whatever ends it (a SystemExit with a message, an exception's
traceback, a normal end) ends the process through the interpreter's own exit: its atexit
handlers, its threads joined, its streams flushed. Past its timeout it is killed with every
process under it. Nothing of saturate is imported before the fork, and the zygote runs no tensor
operation (no thread pool exists to fork).

What it cannot be is a process whose imports are its own: the start-up's import figures, the
collector over the imports, and environment variables that those imports read (PYTHONPATH
aside) are the zygote's. Tests of those start a fresh interpreter (conftest's `fresh=True`), and
so does a PYTHONPATH folder that holds a module the zygote has imported (a fake pynvml:
`Zygote.shadowed`), and so do the slow tests (`enabled`), whose end-to-end checks start every
command as a user does.

`python tests/zygote.py FD` is the zygote: it serves requests on the socket FD, one at a time,
until the socket closes."""

from __future__ import annotations

import gc
import importlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

PRELOAD = (
    "torch",
    "torch._dynamo",
    "torchmetrics",
    "sklearn.datasets",
    "sklearn.model_selection",
    "hydra",
    "hydra.main",
    "omegaconf",
    "kornia",
    "torch.utils.tensorboard",
    "tqdm",
    "psutil",
)


def _serve(sock: socket.socket) -> None:
    """The zygote's loop: a request is a JSON object (script, args, cwd, env) and the three fds
    of the child's stdin, stdout and stderr; the answers, a line each, are the child's pid and
    then its exit status (a signal as its negative number, as subprocess reports it)."""
    own_path = [p for p in sys.path[1:] if p not in _pythonpath(os.environ)]
    sock.send(json.dumps(sorted({name.partition(".")[0] for name in sys.modules})).encode() + b"\n")
    while True:
        message, fds, _, _ = socket.recv_fds(sock, 1 << 20, 3)
        if not message:
            return
        request = json.loads(message)
        pid = os.fork()
        if pid == 0:
            sock.close()
            _become(request, fds, own_path)
            return  # the script has run; the interpreter's exit ends the child
        for fd in fds:
            os.close(fd)
        sock.send(json.dumps({"pid": pid}).encode() + b"\n")
        _, status = os.waitpid(pid, 0)
        sock.send(json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode() + b"\n")


def _become(request: dict, fds: list[int], own_path: list[str]) -> None:
    """In the forked child: what `python ARGV` in `cwd` with `env` would have been (ARGV: a
    script and its arguments, `-m MODULE ...` or `-c CODE ...`)."""
    import runpy
    import types

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    first, *rest = request["argv"]
    if first == "-m":
        module, *rest = rest
        sys.argv = ["-m", *rest]  # run_module puts the module's file first, as python -m does
        sys.path[:] = [os.getcwd(), *_pythonpath(request["env"]), *own_path]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    elif first == "-c":
        code, *rest = rest
        sys.argv = ["-c", *rest]
        sys.path[:] = ["", *_pythonpath(request["env"]), *own_path]
        main = sys.modules["__main__"] = types.ModuleType("__main__")
        exec(compile(code, "<string>", "exec"), main.__dict__)
    else:
        sys.argv = [first, *rest]
        sys.path[:] = [str(Path(first).resolve().parent), *_pythonpath(request["env"]), *own_path]
        runpy.run_path(first, run_name="__main__")


def _pythonpath(env) -> list[str]:
    return [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


class Zygote:
    """The test process's side: `run(argv, cwd=, env=, timeout=)` as subprocess.run([python,
    *argv], capture_output=True, text=True, ...) would return it."""

    def __init__(self) -> None:
        self.enabled = True  # conftest's switch: False in the slow tests, which start fresh interpreters
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen | None = None

    def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._proc = subprocess.Popen(
            [sys.executable, __file__, str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
        theirs.close()
        self._sock, self._pending = ours, b""
        self._loaded = set(self._answer(None))  # the zygote's imported modules, by top-level name

    def _answer(self, deadline: float | None) -> dict:
        """The zygote's next line; TimeoutError past the deadline (the line stays to be read)."""
        while b"\n" not in self._pending:
            self._sock.settimeout(None if deadline is None else max(0.01, deadline - time.monotonic()))
            chunk = self._sock.recv(4096)
            if not chunk:
                raise RuntimeError("the zygote ended")
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return json.loads(line)

    def shadowed(self, env: dict) -> bool:
        """Whether a PYTHONPATH folder in `env` holds a module the zygote has imported (a fake
        pynvml): a fresh interpreter would import that one, the zygote's child would not."""
        folders = [f for f in _pythonpath(env) if os.path.isdir(f)]
        if not folders:
            return False
        with self._lock:
            self._ensure()
        names = {Path(name).stem for folder in folders for name in os.listdir(folder)}
        return bool(names & self._loaded)

    def _ensure(self) -> None:
        if self._sock is None or self._proc.poll() is not None:
            self._start()

    def run(self, argv, *, cwd, env, timeout: float | None = None) -> subprocess.CompletedProcess:
        with self._lock:
            self._ensure()
            stdin = os.open(os.devnull, os.O_RDONLY)
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            request = {"argv": [str(a) for a in argv], "cwd": str(cwd), "env": dict(env)}
            socket.send_fds(self._sock, [json.dumps(request).encode()], [stdin, out_w, err_w])
            for fd in (stdin, out_w, err_w):
                os.close(fd)
            deadline = None if timeout is None else time.monotonic() + timeout
            pid = self._answer(deadline)["pid"]
            with open(out_r, encoding="utf-8") as out, open(err_r, encoding="utf-8") as err:
                stdout, stderr, late = _collect(out, err, pid, deadline)
            try:
                status = self._answer(deadline)["status"]
            except TimeoutError:
                kill_family(pid)
                self._answer(None)  # its status, once the zygote has it
                late = True
            command = [sys.executable, *map(str, argv)]
            if late:
                raise subprocess.TimeoutExpired(command, timeout, stdout, stderr)
            return subprocess.CompletedProcess(command, status, stdout, stderr)


def _collect(out, err, pid: int, deadline: float | None) -> tuple[str, str, bool]:
    """Both pipes read to their end (a thread each, as subprocess.communicate does); past the
    deadline the child is killed, so that its pipes close, and the third value is True."""
    texts = {}
    readers = [
        threading.Thread(target=lambda f=f, k=k: texts.__setitem__(k, f.read()))
        for k, f in (("out", out), ("err", err))
    ]
    for reader in readers:
        reader.start()
    late = False
    for reader in readers:
        reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if reader.is_alive():
            late = True
            kill_family(pid)
            reader.join()
    return texts.get("out", ""), texts.get("err", ""), late


def kill_family(pid: int) -> None:
    """The child and every process under it (a run's workers, a self-test's checks): one left
    running would measure into the tests after it."""
    import psutil

    try:
        family = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for process in family:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


if __name__ == "__main__":
    for _name in PRELOAD:
        importlib.import_module(_name)
    gc.freeze()  # the collector's passes in a child skip what the imports built: no copy of those pages at each
    _serve(socket.socket(fileno=int(sys.argv[1])))  # the socketpair's other end
