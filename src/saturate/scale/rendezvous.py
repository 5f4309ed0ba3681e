"""Where the ranks of a run meet before their process group starts: a TCPStore at
MASTER_ADDR:MASTER_PORT (rank 0's, or torchrun's agent's), built here with torch's public
API so that the wait for the other ranks is said, bounded and interruptible.

torch's own env:// rendezvous waits in C++ for as long as the process group's timeout, with
nothing said, and a stop signal cannot end it (its handler never runs). Here each rank
says whom it waits for and why (the variables that made it a rank of several), then waits
in a loop of short waits: a stop signal ends the process at once (saturate.started), and after
SATURATE_RENDEZVOUS_TIMEOUT_S seconds (default 600, as torchrun waits for its nodes to join)
the ranks that never came are named in one line.
"""

from __future__ import annotations

import math
import os
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from saturate.errors import UserError
from saturate.scale.ranks import origin

TIMEOUT_VARIABLE = "SATURATE_RENDEZVOUS_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 600.0
POLL_S = 0.1  # between two looks at who has come
CONNECT_S = 1.0  # one attempt to reach rank 0's store (C++: no signal handler runs during it)
STORE_TIMEOUT = timedelta(minutes=10)  # the store's own operations, once every rank has come


def timeout_s() -> float:
    """How long a rank waits for the others (SATURATE_RENDEZVOUS_TIMEOUT_S, seconds > 0)."""
    value = os.environ.get(TIMEOUT_VARIABLE)
    if value is None:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise UserError(f"{TIMEOUT_VARIABLE}={value!r} in the environment: expected a number of seconds > 0")
    return seconds


def _address() -> tuple[str, int]:
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    if not host or not port.isdigit() or not 0 < int(port) < 2**16:
        raise UserError(
            f"MASTER_ADDR={host!r} MASTER_PORT={port!r} in the environment ({origin()}): expected rank 0's host and a "
            "port from 1 to 65535, as torchrun sets them"
        )
    return host, int(port)


def rendezvous(rank: int, size: int) -> dist.Store:
    """The store every rank of `size` shares, returned once all of them have come."""
    host, port = _address()
    wait = timeout_s()
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent holds the store
    if not agent:  # torchrun started every rank itself; here the variables were set otherwise: say why we wait
        whom = "rank 0 and the other ranks" if rank else "rank 1" if size == 2 else f"ranks 1 to {size - 1}"
        print(
            f"rank {rank} of {size} ({origin()}): waiting up to {wait:g} s for {whom} at {host}:{port} "
            f"({TIMEOUT_VARIABLE} sets how long; Ctrl-C stops)",
            file=sys.stderr,
            flush=True,
        )
    deadline = time.monotonic() + wait
    store = _store(host, port, rank, size, master=rank == 0 and not agent, deadline=deadline)
    prefix = f"saturate/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/came/"
    store.set(f"{prefix}{rank}", "1")
    everyone = [f"{prefix}{r}" for r in range(size)]
    while not store.check(everyone):
        if time.monotonic() > deadline:
            missing = [str(r) for r, key in enumerate(everyone) if not store.check([key])]
            raise UserError(
                f"{origin()}: rank(s) {', '.join(missing)} of {size} never came to {host}:{port} within {wait:g} s "
                f"({TIMEOUT_VARIABLE}); start every rank (torchrun --nproc_per_node={size}, srun), or unset these "
                "variables to train in one process"
            )
        time.sleep(POLL_S)
    store.set_timeout(STORE_TIMEOUT)
    return store


def _store(host: str, port: int, rank: int, size: int, *, master: bool, deadline: float) -> dist.Store:
    """Rank 0's store (listening at once), or a client of it, tried again every CONNECT_S
    until `deadline`."""
    if master:
        try:
            return dist.TCPStore(
                host, port, size, is_master=True, timeout=STORE_TIMEOUT, wait_for_workers=False, multi_tenant=True
            )
        except (RuntimeError, OSError) as e:
            said = " ".join(str(e).split())[:200]
            raise UserError(f"MASTER_PORT={port}: rank 0 cannot listen at {host}:{port} ({said})") from None
    while True:
        try:
            return dist.TCPStore(host, port, size, is_master=False, timeout=timedelta(seconds=CONNECT_S))
        except (RuntimeError, OSError):  # not listening yet (DistNetworkError, DistStoreError)
            if time.monotonic() > deadline:
                raise UserError(
                    f"{origin()}: rank 0 never came to MASTER_ADDR:MASTER_PORT={host}:{port} within "
                    f"{timeout_s():g} s ({TIMEOUT_VARIABLE}) (rank {rank} of {size} waited for it); start every "
                    "rank, or unset these variables to train in one process"
                ) from None
