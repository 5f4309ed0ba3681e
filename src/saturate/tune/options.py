"""What a tune tries: the dimensions in the order a verdict asks for, the overrides each
candidate writes, what a tune may write at all, and override lists merged key by key."""

from __future__ import annotations

import re
from collections.abc import Iterable

INPUT = ("augmentation", "resident", "num_workers", "persistent_workers", "prefetch_factor", "pin_memory")
COMPUTE = ("threads", "channels_last", "compile", "cudnn", "precision", "batch_size")


def side_order(verdict: str) -> tuple[str, ...]:
    """The dimensions to try next, in order, for the best trial's verdict."""
    if verdict == "compute-bound":
        return COMPUTE  # the loader is not what limits this run: its knobs would waste the budget
    if verdict == "oversubscribed":  # more intra-op threads than free cores: the thread count first
        return ("threads", *INPUT, *(d for d in COMPUTE if d != "threads"))
    return INPUT + COMPUTE


def candidates(dimension: str, facts: dict, *, allow: list[str], cuda: bool) -> list[list[str]]:
    """The override sets to try for `dimension`, given the facts of the best run so far
    (saturate.diagnostics.report.RunFacts as a dict); [] when it does not apply. Ordered: a
    dimension with several values stops at the first that does not pay."""
    f = facts
    workers, resident, placement = f["num_workers"], f["resident"], f["placement"]
    if dimension == "augmentation":
        return [["augmentation.placement=gpu"]] if placement == "cpu" else []
    if dimension == "resident":
        fits = f["in_memory"] and not resident and placement != "cpu"  # a resident loader has no workers to augment in
        return [["loader.resident=true", "loader.num_workers=0", "loader.pin_memory=false"]] if fits else []
    if dimension == "num_workers":
        if resident:
            return []
        cpus = f["cpus"]
        counts = sorted({1, 2, 4, 8, max(1, cpus - 1), cpus})
        more = [n for n in counts if workers < n <= cpus]
        if f.get("cpu_util") is not None and f["cpu_util"] >= 90 and workers > 0:  # CPU-saturated: fewer first
            more = [n for n in reversed(counts) if n < workers] + [0]
        if cuda:
            return [[f"loader.num_workers={n}"] for n in more]
        # on a CPU the workers and torch's intra-op threads share the cores: each worker count
        # is tried with the threads that leave it its core (a worker beside as many threads as
        # there are cores slows the step it was meant to feed)
        return [[f"loader.num_workers={n}", f"device.threads={max(1, cpus - n) if n else 'auto'}"] for n in more]
    if dimension == "threads":
        return [] if cuda else [[f"device.threads={n}"] for n in thread_counts(f)]
    if dimension == "persistent_workers":
        return [["loader.persistent_workers=true"]] if workers > 0 and not f["persistent_workers"] else []
    if dimension == "prefetch_factor":
        return [["loader.prefetch_factor=4"]] if workers > 0 and f.get("prefetch_factor", 2) < 4 else []
    if dimension == "pin_memory":
        return [["loader.pin_memory=true"]] if cuda and not resident and not f["pin_memory"] else []
    if dimension == "channels_last":
        fits = f["image"] and not f["channels_last"] and f.get("channels_last_ok", True)
        return [["trainer.channels_last=true"]] if fits else []
    if dimension == "compile":  # on a CPU inductor writes C++: only with a compiler (tens of seconds to compile)
        return [["trainer.compile=true"]] if (cuda or f.get("cxx", False)) and not f["compile"] else []
    if dimension == "cudnn":
        return (
            [["device.tf32=true", "device.cudnn_benchmark=true"]]
            if cuda and not (f.get("tf32", True) and f.get("cudnn", True))
            else []
        )
    if dimension == "precision" and "precision" in allow:
        if f["emulated_precision"]:
            return [["precision.mode=fp32"]]
        native = cuda or f.get("cpu_bf16", False)  # CPU autocast computes in bf16: worth it only with native kernels
        return [["precision.mode=amp"]] if native and f["precision"] == "fp32" and f.get("amp_ok", True) else []
    if dimension == "batch_size" and "batch_size" in allow:
        # the batch-size search, inside the trial; lr scaled as optim.lr_scaling says
        return [["loader.batch_size=auto"]]
    return []


def thread_counts(facts: dict) -> list[int]:
    """The intra-op thread counts a CPU run tries, whatever its verdict: one, half and all of
    the CPUs this process may use, and the cores other processes left free during the run
    (torch's default of one thread per core, beside a process holding one of two cores,
    measured 12x slower than one thread). Those different from the count the run used."""
    cpus = max(1, facts["cpus"])
    counts = {1, max(1, cpus // 2), cpus}
    if facts.get("other_cpu") is not None and facts.get("cores"):
        held = round(facts["other_cpu"] * facts["cores"] / 100)  # cores other processes kept busy
        counts.add(min(cpus, max(1, facts["cores"] - held)))
    return sorted(n for n in counts if n != facts.get("threads"))


# What a tune can change, key by key (the values candidates() writes; a batch size the search
# chose): a tune cache's `changes` are checked against it before they reach a preset, with
# the user's own tune.extra (part of the cache's key) allowed as given.
TUNED = {
    "augmentation.placement": r"gpu",
    "loader.resident": r"true",
    "loader.num_workers": r"\d{1,3}",
    "device.threads": r"[1-9]\d{0,2}|auto",
    "loader.pin_memory": r"true|false",
    "loader.persistent_workers": r"true",
    "loader.prefetch_factor": r"4",
    "loader.batch_size": r"[1-9]\d{0,6}|auto",
    "trainer.channels_last": r"true",
    "trainer.compile": r"true",
    "device.tf32": r"true",
    "device.cudnn_benchmark": r"true",
    "precision.mode": r"amp|fp32",
}


def tunable(change: str, extra: list[str]) -> bool:
    """Whether `change` is an override a tune may write: one of TUNED's, or a part of the
    user's tune.extra."""
    key, eq, value = change.partition("=")
    pattern = TUNED.get(key)
    return bool(eq) and (pattern is not None and re.fullmatch(pattern, value) is not None or change in extra)


def merged(*override_lists: Iterable[str]) -> list[str]:
    """Override lists applied in order, one entry per key (a later value replaces an
    earlier one in place), so Hydra never sees a key twice."""
    out: dict[str, str] = {}
    for overrides in override_lists:
        for o in overrides:
            out[o.lstrip("+~").partition("=")[0]] = o
    return list(out.values())
