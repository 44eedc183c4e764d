"""What machine a figure came from: its CPU, the commit measured, and its measured limits.

A benchmark figure only describes the machine and the code it was measured on, so every
report names both (:func:`machine_facts`), and the limits that bound a CPU engine are
measured in the same run rather than copied from a data sheet:

* **memory read bandwidth** (:func:`measure_bandwidth`): the best of a few sums over a
  float32 array far larger than any cache, one part per thread, NumPy's SIMD sum in each
  (bytes read per second); a decode step reads every weight once, so this bounds it;
* **compute** (:func:`measure_compute`): the best of a few float32 BLAS products
  ``[n, n] @ [n, n]`` (``2 * n**3`` flops each); a long prefill is bound by it.

``refengine bench forward`` compares each forward pass against these two (the roofline).
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from refengine.cpu.threads import max_threads

#: The checkout refengine was imported from, when it is one (an installed wheel is not).
SOURCE_ROOT = Path(__file__).resolve().parent.parent.parent


def measure_bandwidth(nbytes: int = 512 << 20, repeats: int = 5, num_threads: int | None = None) -> float:
    """Read bandwidth in bytes/s: the best of ``repeats`` sums over ``nbytes`` of float32,
    split in ``num_threads`` parts (default: the engine's thread count,
    :func:`refengine.cpu.threads.max_threads`) summed at once (NumPy releases the GIL
    in the sum). Allocates ``nbytes`` for the call."""
    n = num_threads or max_threads()
    x = np.ones(nbytes // 4, dtype=np.float32)
    parts = np.array_split(x, n)
    with ThreadPoolExecutor(n) as pool:
        def read_all():
            list(pool.map(np.add.reduce, parts))
        read_all()
        best = min(_timed(read_all) for _ in range(repeats))
    return x.nbytes / best


def measure_compute(n: int = 1024, repeats: int = 5) -> float:
    """float32 BLAS throughput in flop/s: the best of ``repeats`` ``[n, n] @ [n, n]`` products,
    on as many threads as BLAS is set to use now."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((n, n), dtype=np.float32), rng.standard_normal((n, n), dtype=np.float32)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(repeats))
    return 2 * n ** 3 / best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def cpu_model() -> str:
    """The CPU's name: ``model name`` in ``/proc/cpuinfo`` (Linux), with its ``cpu family``
    and ``model`` numbers where the name has no model number of its own (a VM's bare "AMD
    EPYC" is a Zen 4 at family 25 and a Zen 5 at family 26, whose kernels run differently);
    else what ``platform`` says, else ``"unknown"``."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if not key.strip() and fields:
                    break  # the first processor's block is enough
                fields.setdefault(key.strip(), " ".join(value.split()))
    except OSError:
        pass
    name = fields.get("model name")
    if name:
        if not any(c.isdigit() for c in name) and "cpu family" in fields and "model" in fields:
            name += f" (family {fields['cpu family']}, model {fields['model']})"
        return name
    return platform.processor() or platform.machine() or "unknown"


def git_commit(root: str | os.PathLike = SOURCE_ROOT) -> str:
    """The commit ``root`` is checked out at: ``git rev-parse --short HEAD``, plus
    ``" + uncommitted changes"`` when ``git status`` lists any change (untracked files
    included), or ``"not a git checkout"`` (no git, or ``root`` is not the top of a work
    tree: an installed wheel inside some other checkout does not borrow its commit).

    A copy of a checkout without its ``.git`` (the tree sent to a remote GPU machine) names
    its commit in the environment variable ``REFENGINE_SOURCE_COMMIT``, taken as given (add
    " + uncommitted changes" to it where the copy has them) where ``root`` is no git checkout.
    """
    found = _checkout_commit(root)
    if found == "not a git checkout":
        return os.environ.get("REFENGINE_SOURCE_COMMIT") or found
    return found


def _checkout_commit(root: str | os.PathLike) -> str:
    """:func:`git_commit` from git alone."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True,
                              timeout=30).stdout.strip()

    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != Path(root).resolve():
            return "not a git checkout"
        commit = git("rev-parse", "--short", "HEAD")
        dirty = bool(git("status", "--porcelain"))
    except (OSError, subprocess.SubprocessError):
        return "not a git checkout"
    return commit + (" + uncommitted changes" if dirty else "")


def machine_facts(*, limits: tuple[float, float] | None = None, probe_bytes: int = 256 << 20,
                  probe_repeats: int = 3) -> dict:
    """Where and on what a figure was measured, now.

    Args:
        limits: ``(bandwidth bytes/s, flop/s)`` already measured in this run (``bench
            forward`` has them); None measures them here, a short version of the probes
            (``probe_bytes`` read, ``probe_repeats`` tries each).
    Returns:
        ``{"date_utc", "commit", "cpu", "cpu_count", "threads", "read_bandwidth_bytes_per_s",
        "float32_flops_per_s"}``; ``threads`` is the engine's thread count (the cores used).
    """
    bandwidth, flops = limits if limits is not None else (
        measure_bandwidth(nbytes=probe_bytes, repeats=probe_repeats), measure_compute(repeats=probe_repeats))
    return {"date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": git_commit(),
            "cpu": cpu_model(), "cpu_count": os.cpu_count(), "threads": max_threads(),
            "read_bandwidth_bytes_per_s": bandwidth, "float32_flops_per_s": flops}
