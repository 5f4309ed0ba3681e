"""`python ARGV` (a script, `-m MODULE` or `-c CODE`, then arguments) as subprocess.run would start
it, in a new process forked from one that has already imported the heavy third-party modules
(torch, torch._dynamo, torchmetrics, scikit-learn, Hydra, Kornia, TensorBoard): the tests' commands
skip the 5-8 s those imports take on a 2-core CPU, each time.

The child is a process of its own: its own pid, exit status, working directory, environment,
sys.argv and sys.path (the script's folder, then PYTHONPATH's entries), and stdin, stdout and
stderr on the caller's own pipes (passed over a Unix socket), output to a pipe included. The
script runs as `__main__`, and whatever ends it (a SystemExit with a message, an exception's
traceback, Ctrl-C, a normal end) ends the process as Python's exit does: the message or
traceback printed, its threads joined, its atexit handlers run, its globals finalized, its
streams flushed, the same status. Python's teardown of every module after that is skipped
(`_child`): in a forked child it costs more than the rest of a short command, and what the
other modules still hold at exit is not finalized. Past its timeout it is killed with every
process under it. Nothing of saturate is imported before the fork, and the zygote runs no
tensor operation (no thread pool exists to fork).

Each child draws its own random streams (torch's, NumPy's and Python's are reseeded after the
fork; the hash seed, fixed at the zygote's start, is shared). What it cannot be is a process
whose imports are its own: the start-up's import figures, the collector over the imports, and the
environment variables that the interpreter and those imports read once (READ_AT_START) are the zygote's.
Tests of those start a fresh interpreter (conftest's `fresh=True`), and so does a request that
sets such a variable otherwise, or whose path puts first a folder holding a module the zygote
has imported (a fake pynvml: `Zygote.needs_fresh`), and so do the slow tests (`enabled`), whose
end-to-end checks start every command as a user does.

`python tests/zygote.py FD MODULE...` is the zygote: it imports the modules, then serves requests
on the socket FD until the socket closes, each by a waiter forked for it, so that commands run
side by side (`Zygote.popen`, as Popen's do)."""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import NoReturn

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
# environment variables that the interpreter or a preloaded module reads once, at start or import: a request
# that sets one otherwise than the zygote's start did runs in a fresh interpreter (PYTHONPATH: see _path). Not
# TORCHINDUCTOR_*, KMP_* or CUDA_*: torch sets the first two in the test process itself, and reads CUDA_* when
# CUDA starts, in the child.
READ_AT_START = ("PYTHON", "TORCH_", "OMP_", "MKL_", "MPLCONFIGDIR", "LANG", "LC_")
GRACE_S = 5.0  # after a timeout's kill, how long the pipes may stay open (a process outside the family holds them)


def _serve(sock: socket.socket) -> None:
    """The zygote's loop: a request is a JSON object (argv, cwd, env) and four fds: the child's
    stdin, stdout and stderr, and a socket for its answers. Each is handed to a waiter forked
    for it (`_wait_on`), and the zygote takes the next request at once: commands run side by
    side, as Popen's do."""
    own_path = [p for p in sys.path[1:] if p not in _pythonpath(os.environ)]
    sock.send(json.dumps(sorted({name.partition(".")[0] for name in sys.modules})).encode() + b"\n")
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the waiters
    while True:
        message, fds, _, _ = socket.recv_fds(sock, 1 << 20, 4)
        if not message:
            return
        if os.fork() == 0:
            sock.close()
            _wait_on(json.loads(message), fds, own_path)
        for fd in fds:
            os.close(fd)


def _wait_on(request: dict, fds: list[int], own_path: list[str]) -> NoReturn:
    """The waiter: forks the command, and answers its pid, then its exit status (a signal as its
    negative number, as subprocess reports it), a line each, on the request's socket."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # its own child is its to wait for
    *streams, answers = fds
    pid = os.fork()
    if pid == 0:
        os.close(answers)
        status = 1
        try:
            status = _child(request, streams, own_path)
        finally:  # whatever escapes: never Python's teardown, nor the zygote's loop
            os._exit(status)
    for signum in (signal.SIGINT, signal.SIGTERM):  # a Ctrl-C to the test session reaches the command, not this
        signal.signal(signum, signal.SIG_IGN)
    for fd in streams:
        os.close(fd)
    try:
        with socket.socket(fileno=answers) as out:
            out.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            _, status = os.waitpid(pid, 0)
            out.sendall(json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
    finally:  # the caller gone (a timeout) or not: never the zygote's own loop
        os._exit(0)


def _child(request: dict, fds: list[int], own_path: list[str]) -> int:
    """In the forked child: the script run, then what Python 3.11 does at exit before it tears
    its modules down: the uncaught exception or SystemExit's message printed, the threads joined,
    the atexit handlers run, `__main__` dropped and the garbage collected (the script's globals
    finalized, their finalizers still seeing them), the standard streams flushed; the exit
    status is returned for os._exit. The teardown itself is skipped: in a child of the zygote it
    copies every page the imports built (0.6 s of CPU a command here, against 0.06 s for the rest
    of a `pass`). So what other modules still hold at exit is not finalized (a file kept open on
    a module is not flushed); the slow tests, in fresh interpreters, keep the whole of it."""
    import atexit
    import weakref

    interrupted = False
    try:
        _become(request, fds, own_path)
        status = 0
    except SystemExit as e:  # as Python's own handling: None is 0, an int itself, anything else printed and 1
        status = _exit_status(e.code)
    except BaseException as e:  # noqa: BLE001 (whatever the child raised, reported as Python would)
        interrupted = type(e) is KeyboardInterrupt  # Python ends by SIGINT for that class only, not a subclass
        sys.excepthook(type(e), e, e.__traceback__)
        status = 1
    try:
        threading._shutdown()  # Python's exit joins the threads that are not daemons
    except BaseException as e:  # noqa: BLE001 (a Ctrl-C while it waits: Python reports it and goes on)
        _unraisable(e, threading)
    atexit._run_exitfuncs()
    main = weakref.ref(sys.modules.pop("__main__"))
    gc.collect()  # quick here: what the zygote built before the fork is frozen, out of the collector's reach
    if main() is not None:
        main().__dict__.clear()
    for stream in (sys.stdout, sys.stderr):
        if stream is None or getattr(stream, "closed", False):
            continue  # Python flushes only a stream that is there and open
        try:
            stream.flush()
        except Exception as e:  # noqa: BLE001 (a stream closed by the child)
            if stream is sys.stdout:
                _unraisable(e, stream)
            status = 120  # Python's status when it cannot flush them at exit
    if interrupted:  # an uncaught Ctrl-C ends Python by SIGINT itself, as a shell expects
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        status = 128 + signal.SIGINT  # where SIGINT could not end it, as Python's status
    return status


def _unraisable(e: BaseException, where: object) -> None:
    """What Python prints for an error it can only report ("Exception ignored in: ...")."""
    import traceback

    if sys.stderr is not None and not sys.stderr.closed:
        with contextlib.suppress(Exception):
            sys.stderr.write(f"Exception ignored in: {where!r}\n{''.join(traceback.format_exception(e))}")
            sys.stderr.flush()


def _exit_status(code) -> int:
    """SystemExit's code as Python's exit status: None 0, an int (a bool too) its low byte (-1's,
    255, where it does not fit in a C long), anything else printed on stderr and 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return (code if -(2**63) <= code < 2**63 else -1) & 0xFF
    if sys.stderr is not None:
        with contextlib.suppress(Exception):
            sys.stderr.write(f"{code}\n")
    return 1


def _become(request: dict, fds: list[int], own_path: list[str]) -> None:
    """In the forked child: what `python ARGV` in `cwd` with `env` would have been (ARGV: a
    script and its arguments, `-m MODULE ...` or `-c CODE ...`), run in a `__main__` of its own
    that stays for the process's life (threads and atexit handlers see it), as Python's is."""
    import builtins
    import multiprocessing.process
    import random
    import runpy
    import tempfile
    import types

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # what the zygote's start fixed and a new interpreter would not share: its random streams (Python's `random`
    # reseeds itself after a fork; the hash seed cannot change), the temporary folder, the start folder
    # (torch and NumPy where the zygote imported them: one that did not leaves them to the child's own import)
    random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    tempfile.tempdir = None
    multiprocessing.process.ORIGINAL_DIR = os.getcwd()
    first, *rest = request["argv"]
    sys.path[:] = [_path(request["argv"], os.getcwd()), *_pythonpath(request["env"]), *own_path]
    main = sys.modules["__main__"] = types.ModuleType("__main__")  # not the zygote's, with its globals
    main.__dict__.update(__builtins__=builtins, __spec__=None, __loader__=None, __package__=None)
    if first == "-m":
        module, *rest = rest
        sys.argv = ["-m", *rest]  # python -m's own runner: the module's file first, its code in the __main__ above
        runpy._run_module_as_main(module, alter_argv=True)
        return
    if first == "-c":
        code, *rest = rest
        sys.argv = ["-c", *rest]
        exec(compile(code, "<string>", "exec"), main.__dict__)  # noqa: S102 (python -c, as Python runs it)
        return
    sys.argv = [first, *rest]
    try:
        with open(first, "rb") as script:  # compile() reads a coding cookie, as Python does
            source = script.read()
    except OSError as e:
        sys.stderr.write(
            f"{sys.executable}: can't open file {os.path.abspath(first)!r}: [Errno {e.errno}] {e.strerror}\n"
        )
        raise SystemExit(2) from None
    main.__file__, main.__cached__ = first, None
    exec(compile(source, first, "exec"), main.__dict__)  # noqa: S102 (the script, as Python runs it)


def _path(argv: list[str], cwd: str) -> str:
    """sys.path[0] as Python makes it: the script's folder, the working folder for -m, '' for -c."""
    if argv[0] == "-c":
        return ""
    if argv[0] == "-m":
        return cwd
    return str(Path(cwd, argv[0]).resolve().parent)


def _pythonpath(env) -> list[str]:
    return [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


class Zygote:
    """The test process's side: `run(argv, cwd=, env=, timeout=)` as subprocess.run([python,
    *argv], capture_output=True, text=True, ...) would return it, and `popen(argv, cwd=, env=)`
    as subprocess.Popen(..., stdout=PIPE, stderr=PIPE, text=True) would start it. `env`: the
    environment the zygote starts with (the test session's, before any test changes it)."""

    def __init__(self, env: dict, preload: tuple[str, ...] = PRELOAD) -> None:
        self.enabled = True  # conftest's switch: False in the slow tests, which start fresh interpreters
        self._env = dict(env)
        self._preload = preload  # what the zygote imports before it serves (tests of the protocol: a light one)
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen | None = None

    def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._proc = subprocess.Popen(
            [sys.executable, __file__, str(theirs.fileno()), *self._preload],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            env=self._env,
        )
        theirs.close()
        self._sock = ours
        self._loaded = set(_Lines(ours).next(None))  # the zygote's imported modules, by top-level name

    def stop(self) -> None:
        """The zygote ended (the commands it started run on to their own end)."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
        if self._sock is not None:
            self._sock.close()
        self._sock = self._proc = None

    def _ensure(self) -> None:
        if self._sock is None or self._proc.poll() is not None:
            self._start()

    def needs_fresh(self, argv, cwd, env: dict) -> bool:
        """Whether a fresh interpreter would differ from the zygote's child in what it imports:
        an environment variable read at start set otherwise (READ_AT_START), or a folder first on
        its path (PYTHONPATH's, the script's, the working one) that holds a module the zygote has
        imported (a fake pynvml)."""
        changed = {k for k in {*env, *self._env} if env.get(k) != self._env.get(k) and k != "PYTHONPATH"}
        if any(k.startswith(READ_AT_START) for k in changed):
            return True
        with self._lock:
            self._ensure()
        argv = [str(a) for a in argv]
        folders = [f for f in (_path(argv, str(cwd)) or str(cwd), *_pythonpath(env)) if os.path.isdir(f)]
        names = {name.partition(".")[0] for folder in folders for name in os.listdir(folder)}
        return bool(names & self._loaded)

    def _request(self, argv: list[str], cwd, env: dict, stdout: int) -> tuple[_Lines, int | None, int]:
        """Sends a request: its answers' reader, and the read ends of its stdout (None: it goes
        to /dev/null) and stderr."""
        answers, theirs = socket.socketpair()
        stdin = os.open(os.devnull, os.O_RDONLY)
        out_r, out_w = os.pipe() if stdout == subprocess.PIPE else (None, os.open(os.devnull, os.O_WRONLY))
        err_r, err_w = os.pipe()
        try:
            with self._lock:
                self._ensure()
                request = json.dumps({"argv": argv, "cwd": str(cwd), "env": dict(env)}).encode()
                socket.send_fds(self._sock, [request], [stdin, out_w, err_w, theirs.fileno()])
        except BaseException:
            answers.close()
            _close(out_r, err_r)
            raise
        finally:
            theirs.close()
            for fd in (stdin, out_w, err_w):
                os.close(fd)
        return _Lines(answers), out_r, err_r

    def popen(self, argv, *, cwd, env, stdout: int = subprocess.PIPE) -> Child:
        argv = [str(a) for a in argv]
        answers, out_r, err_r = self._request(argv, cwd, env, stdout)
        return Child([sys.executable, *argv], answers, out_r, err_r)

    def run(self, argv, *, cwd, env, timeout: float | None = None) -> subprocess.CompletedProcess:
        argv = [str(a) for a in argv]
        command = [sys.executable, *argv]
        answers, out_r, err_r = self._request(argv, cwd, env, subprocess.PIPE)
        deadline = None if timeout is None else time.monotonic() + timeout
        pid = pipes = None
        try:
            out = err = b""
            try:
                pid = answers.next(deadline)["pid"]
                pipes = _collect(out_r, err_r, pid, deadline)  # closes the read ends
                out, err, late = pipes
                status = None if late else answers.next(deadline)["status"]
            except TimeoutError:
                late = True
            if late:
                said = out.decode(errors="replace"), err.decode(errors="replace")
                raise subprocess.TimeoutExpired(command, timeout, *said)
        except BaseException:  # a timeout among them: the command is not left running
            if pid is None:  # its pid still to come
                with contextlib.suppress(Exception):
                    pid = answers.next(time.monotonic() + GRACE_S)["pid"]
            if pid is not None:
                kill_family(pid)
            if pipes is None:
                _close(out_r, err_r)
            raise
        finally:
            answers.close()
        # decoded as subprocess.run(text=True) does: strictly, so that output which is not text is an error
        return subprocess.CompletedProcess(command, status, out.decode(), err.decode())


class _Lines:
    """JSON lines read from a socket; TimeoutError past a deadline."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self._pending = sock, b""

    def next(self, deadline: float | None) -> dict | list:
        while b"\n" not in self._pending:
            self.sock.settimeout(None if deadline is None else max(0.0, deadline - time.monotonic()))
            try:
                chunk = self.sock.recv(4096)
            except BlockingIOError:
                raise TimeoutError from None
            if not chunk:
                raise RuntimeError("the zygote ended")
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return json.loads(line)

    def close(self) -> None:
        self.sock.close()


class Child:
    """A command started by the zygote: what the tests use of subprocess.Popen(text=True),
    `stdout` and `stderr` as text streams (stdout None where it went to /dev/null)."""

    def __init__(self, args: list[str], answers: _Lines, out_r: int | None, err_r: int) -> None:
        self.args, self.returncode, self._answers = args, None, answers
        self._readers: list[threading.Thread] = []
        self._said: dict[str, str] = {}
        try:
            self.pid = answers.next(time.monotonic() + 60)["pid"]
        except BaseException:
            answers.close()
            _close(out_r, err_r)
            raise
        self.stdout = None if out_r is None else open(out_r, encoding="utf-8")  # noqa: SIM115 (closed by communicate)
        self.stderr = open(err_r, encoding="utf-8")  # noqa: SIM115

    def poll(self) -> int | None:
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            try:
                self.returncode = self._answers.next(None if timeout is None else time.monotonic() + timeout)["status"]
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            self._answers.close()
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:  # as Popen: never a signal to a pid that another process may have by now
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str | None, str]:
        """Both streams read to their end, then the exit status; TimeoutExpired past `timeout`
        (the command left running, as Popen leaves it)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._readers:  # a call after a timeout joins the same readers, as Popen's does
            self._readers = [
                threading.Thread(target=lambda name=name, f=f: self._said.setdefault(name, f.read()), daemon=True)
                for name, f in (("out", self.stdout), ("err", self.stderr))
                if f is not None
            ]
            for reader in self._readers:
                reader.start()
        for reader in self._readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        for f in (self.stdout, self.stderr):
            if f is not None:
                f.close()
        return self._said.get("out"), self._said["err"]


def _collect(out_r: int, err_r: int, pid: int, deadline: float | None) -> tuple[bytes, bytes, bool]:
    """Both pipes read to their end as bytes (a thread each, as subprocess.communicate does);
    past the deadline the child is killed with its family, the pipes get GRACE_S more to close,
    and the third value is True. The read ends are closed here."""
    chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}

    def read(fd: int) -> None:
        while block := os.read(fd, 1 << 16):
            chunks[fd].append(block)

    readers = [threading.Thread(target=read, args=(fd,), daemon=True) for fd in (out_r, err_r)]
    for reader in readers:
        reader.start()
    late = False
    for reader in readers:
        reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if reader.is_alive():
            late = True
            kill_family(pid)
            reader.join(GRACE_S)
    if not any(r.is_alive() for r in readers):  # a reader still blocked keeps its fd: closing it under a read is unsafe
        os.close(out_r)
        os.close(err_r)
    return b"".join(chunks[out_r]), b"".join(chunks[err_r]), late


def _close(*fds: int | None) -> None:
    """The read ends of a command's pipes that were not handed on (None: it had none)."""
    for fd in fds:
        if fd is not None:
            os.close(fd)


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
    for _name in sys.argv[2:]:  # PRELOAD, unless the test process asked for less
        importlib.import_module(_name)
    gc.freeze()  # the collector's passes in a child skip what the imports built: no copy of those pages at each
    _serve(socket.socket(fileno=int(sys.argv[1])))  # the socketpair's other end
