"""A one-node SLURM cluster on localhost: munged, slurmctld and slurmd from Debian's packages,
started by hand (no systemd, no root) with a minimal slurm.conf in a temporary folder, to try
hydra/launcher=slurm on one machine (docs/scaling.md) and for the slow SLURM tests.

    apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge
    python scripts/local_slurm.py                 # up until Ctrl-C; prints the variables to export
    python scripts/local_slurm.py --print-conf    # the slurm.conf it would write on this machine

As another user than root the daemons run as that user and run that user's jobs only. Its
own munge socket and key (AuthInfo=socket=...) and its own ports: a machine's own munge or
SLURM is neither used nor disturbed. Stopping cancels every job, stops the daemons, ends what
is left of the cluster's processes and removes the folder.

Tuned for tests, not for production: accounting off (sacct fails: job states come from
squeue); KillWait 30 s (the default: time for the ranks to answer SIGTERM and save); a
requeued job eligible again cred_expire (10 s) after it ended instead of 121 s; OverTimeLimit
0. slurmctld checks time limits (and sends --signal) every 30 s (compiled in): a job with
--time=2 --signal=USR2@30 gets the signal 60 to 90 s after it starts.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

MARKER = "SATURATE_SLURM_CLUSTER"  # in every daemon's and job's environment: what teardown may kill
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sinfo", "squeue", "scontrol", "sbatch", "srun", "scancel")
SBIN = ("/usr/sbin", "/sbin", "/usr/local/sbin")  # the daemons are there, often outside a user's PATH
PARTITION = "debug"
FINISHED = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
}


def which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(SBIN))


def unavailable() -> str | None:
    """Why this machine cannot run the cluster, or None."""
    missing = [n for n in (*DAEMONS, *CLIENTS) if which(n) is None]
    if missing:
        return (
            f"SLURM is not installed ({', '.join(missing)} not found); on Debian/Ubuntu: "
            "apt-get install slurmctld slurmd slurm-client munge"
        )
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_hardware() -> dict[str, int]:
    """CPUs and RealMemory (MB) as slurmd itself counts them (`slurmd -C`)."""
    out = subprocess.run([which("slurmd"), "-C"], capture_output=True, text=True, timeout=30).stdout
    found = dict(re.findall(r"(\w+)=(\S+)", out.splitlines()[0] if out else ""))
    cpus = int(found.get("CPUs", os.cpu_count() or 1))
    memory = int(found.get("RealMemory", 1024))
    return {
        "CPUs": cpus,
        "RealMemory": max(1, memory - 256),
    }  # a margin: slurmd drains a node that reports less than this


def slurm_conf(root: Path, host: str, ports: tuple[int, int], cpus: int, memory_mb: int, user: str = "root") -> str:
    """The minimal slurm.conf for one node on localhost, everything under `root`. `user`:
    who runs the daemons (root, or this user: then only this user's jobs can run, which is
    all a test needs). Job ids start at the controller's port x 100: two clusters at once
    (pytest -n 2) give their jobs different ids, so submitit's MASTER_PORT, seeded by the job
    id, differs too (job 3 of both clusters shared one and broke each other's collectives)."""
    return f"""\
ClusterName=saturate-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ports[0]}
SlurmdPort={ports[1]}
FirstJobId={ports[0] * 100}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket,cred_expire=10
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=2
MinJobAge=60
KillWait=30
OverTimeLimit=0
InactiveLimit=0
Waittime=0
MessageTimeout=10
SlurmctldTimeout=10
SlurmdTimeout=30
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN
PartitionName={PARTITION} Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class SlurmCluster:
    root: Path
    conf: Path
    env: dict[str, str]  # os.environ with SLURM_CONF (and PATH with sbin): for sbatch, python train.py -m ..., squeue
    node: str
    cpus: int
    memory_mb: int
    partition: str = PARTITION
    started_s: float = 0.0  # seconds from the first daemon's start until the node was idle
    _procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    # --- commands ---------------------------------------------------------------------------------
    def run(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        """A SLURM client command against this cluster."""
        return subprocess.run(list(args), env=self.env, capture_output=True, text=True, check=check, timeout=timeout)

    def job(self, job: str | int) -> dict[str, str] | None:
        """The job's record (`scontrol show job -o`: JobState, Reason, Restarts, ExitCode,
        RunTime, TimeLimit, EligibleTime, ...), None when slurmctld no longer knows it
        (MinJobAge after its end). An array job's id (`12`) gives its first element's
        record; ask for `12_0`, `12_1` for each."""
        out = self.run("scontrol", "show", "job", "-o", str(job), check=False)
        if out.returncode != 0 or not out.stdout.strip():
            return None
        line = out.stdout.strip().splitlines()[0]
        return dict(re.findall(r"(\S+?)=(\S*)", line))

    def state(self, job: str | int) -> str | None:
        info = self.job(job)
        return info["JobState"] if info else None

    def jobs(self) -> list[dict[str, str]]:
        """Every job slurmctld knows (pending, running, and finished within MinJobAge)."""
        out = self.run("scontrol", "show", "job", "-o", check=False).stdout
        return [dict(re.findall(r"(\S+?)=(\S*)", line)) for line in out.splitlines() if line.startswith("JobId=")]

    def wait_state(self, job: str | int, states, timeout: float = 120, poll: float = 0.5) -> dict[str, str]:
        """Wait until the job is in one of `states` (e.g. {"RUNNING"}, FINISHED); its record."""
        states = {states} if isinstance(states, str) else set(states)
        deadline = time.monotonic() + timeout
        seen = None
        while time.monotonic() < deadline:
            info = self.job(job)
            seen = info["JobState"] if info else None
            if info and seen in states:
                return info
            time.sleep(poll)
        raise TimeoutError(
            f"job {job}: still {seen} after {timeout:.0f} s, waiting for {sorted(states)}\n{self.logs()}"
        )

    def wait_idle(self, timeout: float = 60) -> None:
        """Wait until no job is pending or running (finished ones may still be listed)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(j.get("JobState") in FINISHED for j in self.jobs()):
                return
            time.sleep(0.5)
        raise TimeoutError(
            f"jobs still active after {timeout:.0f} s: {[(j['JobId'], j['JobState']) for j in self.jobs()]}"
        )

    def requeue(self, job: str | int) -> None:
        """`scontrol requeue`: the steps get SIGCONT+SIGTERM, SIGKILL KillWait (30 s) later unless they exit;
        the job is PENDING again (Reason=BeginTime) and eligible cred_expire (10 s) after it
        ended."""
        self.run("scontrol", "requeue", str(job))

    def cancel(self, job: str | int, signal_name: str | None = None) -> None:
        """`scancel` (the steps get SIGCONT+SIGTERM, SIGKILL KillWait later), or with
        `signal_name` only that signal to the steps (`scancel --signal=USR2`), as SLURM
        sends --signal before a time limit."""
        self.run("scancel", *([f"--signal={signal_name}"] if signal_name else []), str(job))

    def logs(self, lines: int = 30) -> str:
        """The last lines of the daemons' logs (for a failure message)."""
        parts = []
        for name in ("slurmctld.log", "slurmd.log", "munged.log"):
            path = self.root / "log" / name
            if path.exists():
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                parts.append(f"--- {path}\n" + "\n".join(tail))
        return "\n".join(parts)

    # --- life cycle -------------------------------------------------------------------------------
    def start(self, timeout: float = 60) -> None:
        t0 = time.monotonic()
        root = self.root
        munge = root / "munge"
        munge.mkdir(mode=0o755)  # munged wants its socket's folders searchable by all, its key private
        key = munge / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o400)
        self._spawn(
            "munged",
            [
                which("munged"),
                "--foreground",
                "--force",
                f"--socket={munge}/munge.socket",
                f"--key-file={key}",
                f"--pid-file={root}/run/munged.pid",
                f"--log-file={root}/log/munged.log",
                f"--seed-file={munge}/munged.seed",
            ],
        )
        self._until(lambda: (munge / "munge.socket").exists(), 10, "munged's socket")
        self._spawn("slurmctld", [which("slurmctld"), "-D", "-c", "-i", "-f", str(self.conf)])
        self._until(
            lambda: self.run("scontrol", "ping", check=False, timeout=10).stdout.count("UP") > 0, timeout, "slurmctld"
        )
        self._spawn("slurmd", [which("slurmd"), "-D", "-f", str(self.conf), "-N", self.node])

        def idle() -> bool:
            out = self.run("sinfo", "-h", "-N", "-o", "%T", check=False, timeout=10).stdout.split()
            return bool(out) and out[0].rstrip("*~#!%$@^-") == "idle"

        self._until(idle, timeout, f"node {self.node} idle")
        self.started_s = time.monotonic() - t0

    def _spawn(self, name: str, argv: list[str]) -> None:
        out = open(self.root / "log" / f"{name}.out", "ab")  # noqa: SIM115 (kept open for the daemon's life)
        self._procs[name] = subprocess.Popen(
            argv, env=self.env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )

    def _until(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self._procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited ({proc.returncode}) while waiting for {what}\n{self._outputs()}\n{self.logs()}"
                    )
            with contextlib.suppress(subprocess.TimeoutExpired):
                if ready():
                    return
            time.sleep(0.1)
        raise RuntimeError(f"{what}: not ready after {timeout:.0f} s\n{self._outputs()}\n{self.logs()}")

    def _outputs(self) -> str:
        parts = []
        for name in self._procs:
            path = self.root / "log" / f"{name}.out"
            text = path.read_text(errors="replace").strip() if path.exists() else ""
            if text:
                parts.append(f"--- {name} (stdout/stderr)\n" + "\n".join(text.splitlines()[-20:]))
        return "\n".join(parts)

    def stop(self) -> None:
        """Cancel every job, stop the daemons, kill what is left of this cluster's processes
        (job steps, tasks) and remove the folder. Safe to call after a failed start."""
        if "slurmctld" in self._procs and self._procs["slurmctld"].poll() is None:
            with contextlib.suppress(Exception):
                self.run("scancel", f"--partition={self.partition}", check=False, timeout=15)
                with contextlib.suppress(TimeoutError):
                    self.wait_idle(timeout=15)
            with contextlib.suppress(Exception):
                self.run("scontrol", "shutdown", check=False, timeout=15)
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self._procs.get(name)
            if proc is None:
                continue
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0 if name == "munged" else 10)  # `scontrol shutdown` stopped the other two
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
        for pid in self._leftovers():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.root, ignore_errors=True)

    def _leftovers(self) -> list[int]:
        """This cluster's processes still alive: slurmstepd (holds a file under the root), its
        job's tasks (the marker in their environment); never this process or its parents."""
        keep = {os.getpid()}
        pid = os.getppid()
        while pid > 1 and pid not in keep:
            keep.add(pid)
            try:
                pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                break
        marker = f"{MARKER}={self.root}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in keep:
                continue
            try:
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
                    continue
                for fd in (entry / "fd").iterdir():
                    if os.readlink(fd).startswith(str(self.root)):
                        found.append(int(entry.name))
                        break
            except OSError:
                continue
        return found


def start_cluster(timeout: float = 60) -> SlurmCluster:
    """Write the config, start the daemons, wait for the node to be idle. The caller stops it."""
    root = Path(tempfile.mkdtemp(prefix="slurm-"))  # short: the munge socket's path must fit in 108 bytes
    root.chmod(0o755)  # munged checks that every folder above its socket is searchable by all
    for sub in ("state", "spool", "run", "log"):
        (root / sub).mkdir()
    host = socket.gethostname().split(".")[0]
    hardware = _node_hardware()
    conf = root / "slurm.conf"
    user = pwd.getpwuid(os.geteuid()).pw_name
    conf.write_text(
        slurm_conf(root, host, (_free_port(), _free_port()), hardware["CPUs"], hardware["RealMemory"], user)
    )
    env = {**os.environ, "SLURM_CONF": str(conf), MARKER: str(root)}
    env["PATH"] = os.pathsep.join([env.get("PATH", ""), *SBIN])
    for inherited in [k for k in env if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) and k != "SLURM_CONF"]:
        del env[inherited]  # this test may itself run inside a SLURM job: its variables would steer sbatch and srun
    cluster = SlurmCluster(
        root=root, conf=conf, env=env, node=host, cpus=hardware["CPUs"], memory_mb=hardware["RealMemory"]
    )
    try:
        cluster.start(timeout)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--print-conf", action="store_true", help="print the slurm.conf for this machine and exit")
    args = parser.parse_args()
    why = unavailable()
    if why:
        raise SystemExit(why)
    if args.print_conf:
        hardware = _node_hardware()
        user = pwd.getpwuid(os.geteuid()).pw_name
        host = socket.gethostname().split(".")[0]
        print(slurm_conf(Path("/tmp/slurm-XXXX"), host, (6817, 6818), hardware["CPUs"], hardware["RealMemory"], user))
        return
    cluster = start_cluster()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        print(
            f"one node ({cluster.node}, {cluster.cpus} CPUs), partition {cluster.partition}: {cluster.started_s:.1f} s"
        )
        print(
            f"export SLURM_CONF={cluster.conf}\nexport PATH=$PATH:{os.pathsep.join(SBIN)}\nCtrl-C stops it", flush=True
        )
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
