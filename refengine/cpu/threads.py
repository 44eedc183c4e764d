"""Thread counts of the CPU engine (BLAS and numba), set once at start and once per step; idle threads' wait.

The engine calls :func:`configure_threads` once at start and :func:`adapt_threads` once
per step; :func:`refengine.cpu.setup_cpu_runtime` calls :func:`use_wait_policy`
before. docs/cpu_runtime.md walks through the choices; in short:

* **Thread count**: the cores this process may run on (``os.sched_getaffinity``, so
  ``taskset``, cpusets and containers count), capped by the cgroup's CPU quota rounded up
  (:func:`cgroup_cpu_quota`: a container limited to 2 CPUs on a 64-core host runs 2
  threads, not 64 that the kernel would throttle in turn), minus the cores other
  processes keep busy.
  A parallel kernel waits for its slowest thread, and a thread sharing its core with
  another process waits for a time slice at each of a decode step's many parallel
  launches. So :func:`adapt_threads` reads, at most every :data:`ADAPT_INTERVAL_S`, how
  much CPU time this process's cores gave other processes (``/proc/stat`` minus our own
  ``os.times``) and uses one thread fewer per core they kept more than
  :data:`BUSY_CORE_SHARE` busy, never fewer than one. An explicit ``num_threads`` turns
  this off.
* **One thread pool per step**: numba's kernels get the thread count in every step, and so
  do refengine's own BLAS threads (:mod:`refengine.cpu.blas`), which split the numba
  backend's large products into one-thread BLAS calls (``library_blas=False``). The BLAS
  library's own pool gets the threads only where it runs the products itself (the NumPy
  backend, all BLAS). Two pools taking turns in one step wait on each other's idle
  threads: after each call an idle thread spins for a while and holds its core.
  OpenBLAS's spin is long and fixed as NumPy loads it, so, whatever was imported first,
  its pool is given no work. numba's spin is long (below), so a step with BLAS products
  (``blas_step``, :func:`refengine.cpu.engine_hooks.is_blas_step`) runs numba's serial twins,
  and no numba thread spins on a core a BLAS thread needs; where the user made the spin
  short (:func:`short_spin`), numba keeps its threads in those steps too.
* **numba's threading layer and wait policy**: OpenMP (GNU libgomp) with idle threads
  spinning :data:`GOMP_SPINCOUNT` rounds (libgomp's own default, set explicitly) before
  they sleep. A decode step launches its parallel loops tens of microseconds apart and the
  steps follow each other a few milliseconds apart (sampler, scheduler); a spinning thread
  picks up the next loop at once, a sleeping one must be woken first, and on a virtual
  machine a sleeping thread's idle vCPU is given back to the host, which may take
  milliseconds to return it; a short spin leaves a tail of slow decode steps
  (docs/PERFORMANCE.md, "Design notes"). With other
  processes running, :func:`adapt_threads` drops to one thread, and a kernel then runs its
  serial twin on the calling thread (no pool, nothing spins).
  The variable is set only while numba loads libgomp, then restored, so OpenMP runtimes
  loaded later keep their defaults and a value the user set (``OMP_WAIT_POLICY`` or
  ``GOMP_SPINCOUNT``) is kept. Without libgomp numba falls back to its ``workqueue``
  layer (threads sleep).
"""

from __future__ import annotations

import math
import os
import sys
import time

from refengine.cpu import blas

#: How long libgomp's idle threads spin before they sleep, in its rounds (see the module docstring).
GOMP_SPINCOUNT = "300000"
#: A spin of at most this many rounds counts as short (:func:`short_spin`): idle numba threads
#: then free their cores within tens of microseconds, soon enough for a BLAS product next.
SHORT_SPINCOUNT = 2000
#: numba threading layers in order of preference (numba wants all three named).
NUMBA_LAYERS = ("omp", "workqueue", "tbb")

#: How often :func:`adapt_threads` re-reads the CPU counters (seconds).
ADAPT_INTERVAL_S = 1.0
#: A core counts as taken when other processes used more than this share of it.
BUSY_CORE_SHARE = 0.25

_requested: int | None = None  # the thread count asked for (fixed), or all usable cores
_adaptive = False
_current: int | None = None
_pools: tuple[int, int] | None = None  # (BLAS threads, numba threads) last set
_library_blas = True  # BLAS products run on the BLAS library's threads (else on refengine.cpu.blas's)
_short_spin = False  # numba's idle threads spin briefly (set by use_wait_policy)
_blas = None  # threadpoolctl's handle on the BLAS libraries
_last_sample: tuple[float, float, float] | None = None  # (wall s, busy s of our cores, own CPU s)


#: Where the cgroup file systems are mounted, and this process's cgroup membership (Linux).
CGROUP_ROOT = "/sys/fs/cgroup"
PROC_SELF_CGROUP = "/proc/self/cgroup"


def usable_cores() -> int:
    """Cores this process may use, at least 1: its CPU affinity mask, at most the cgroup
    CPU quota rounded up (:func:`cgroup_cpu_quota`; a quota of 1.5 CPUs allows 2 threads)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota(CGROUP_ROOT, PROC_SELF_CGROUP)
    if quota is not None:
        cores = min(cores, math.ceil(quota))
    return max(1, cores)


def cpu_quota_from_files(cpu_max: str | None = None, cfs_quota_us: str | None = None,
                         cfs_period_us: str | None = None) -> float | None:
    """The CPU limit one cgroup's files set, in CPUs (quota / period), or None (no limit).

    Args:
        cpu_max: cgroup v2 ``cpu.max`` contents, ``"$MAX $PERIOD"`` (``max``: unlimited).
        cfs_quota_us, cfs_period_us: cgroup v1 ``cpu.cfs_quota_us`` (``-1``: unlimited)
            and ``cpu.cfs_period_us`` contents, used when ``cpu_max`` is None.
    Unreadable contents count as no limit. Source: the kernel's
    Documentation/admin-guide/cgroup-v2.rst ("cpu.max") and scheduler/sched-bwc.rst.
    """
    try:
        if cpu_max is not None:
            fields = cpu_max.split()
            if not fields or fields[0] == "max":
                return None
            quota, period = int(fields[0]), int(fields[1]) if len(fields) > 1 else 100_000
        elif cfs_quota_us is not None and cfs_period_us is not None:
            quota, period = int(cfs_quota_us.strip()), int(cfs_period_us.strip())
        else:
            return None
    except ValueError:
        return None
    if quota <= 0 or period <= 0:
        return None
    return quota / period


def cgroup_cpu_quota(root: str = CGROUP_ROOT, proc_self_cgroup: str = PROC_SELF_CGROUP) -> float | None:
    """This process's CPU quota in CPUs (e.g. 2.0, 1.5), or None when no cgroup limits it.

    Reads the process's cgroup from ``proc_self_cgroup`` (lines ``ID:CONTROLLERS:PATH``:
    ``0::PATH`` for v2; the one listing ``cpu`` for v1) and walks from that cgroup up to
    ``root``, reading v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``
    in ``root/PATH`` (v1: ``root/<controllers>/PATH``, e.g. ``cpu,cpuacct``); the tightest
    limit on the way holds (a parent's quota binds its children). Inside a container the
    path is usually ``/`` (its own cgroup namespace). Missing or unreadable files: no limit.

    Args:
        root: the cgroup mount point (tests pass a directory of fake files).
        proc_self_cgroup: the membership file.
    """
    try:
        with open(proc_self_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    places = []  # (the process's cgroup directory, the mount it walks up to, v2?)
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        mount = root if controllers == "" else os.path.join(root, controllers)
        if controllers == "" or "cpu" in controllers.split(","):
            places.append((os.path.join(mount, path.lstrip("/")), mount, controllers == ""))
    if not places:
        places = [(root, root, True)]
    limits = []
    for start, mount, v2 in places:
        d, stop = os.path.normpath(start), os.path.normpath(mount)
        while True:
            if v2:
                quota = cpu_quota_from_files(cpu_max=_read(os.path.join(d, "cpu.max")))
            else:
                quota = cpu_quota_from_files(cfs_quota_us=_read(os.path.join(d, "cpu.cfs_quota_us")),
                                             cfs_period_us=_read(os.path.join(d, "cpu.cfs_period_us")))
            if quota is not None:
                limits.append(quota)
            if len(d) <= len(stop):
                break
            d = os.path.dirname(d)
    return min(limits) if limits else None


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def configure_threads(num_threads: int | None = None, library_blas: bool = True) -> int:
    """Size the thread pools; return the thread count.

    These are the libraries' own process-wide settings (BLAS through threadpoolctl, numba's
    count for the calling thread): one CPU engine per process uses them as its own. numba's
    count is set now if numba is imported, else at the next :func:`adapt_threads` (the NumPy
    backend never pays numba's import).

    Args:
        num_threads: threads for each pool, fixed; ``None`` = all :func:`usable_cores`,
            adapted each step to the cores other processes leave free (:func:`adapt_threads`).
        library_blas: BLAS products run on the BLAS library's own threads (the NumPy
            backend); False: on refengine's (:mod:`refengine.cpu.blas`, the numba
            backend), and the library stays on one thread.
    Raises:
        ValueError: ``num_threads < 1``.
    """
    global _requested, _adaptive, _last_sample, _current, _library_blas
    if num_threads is not None and int(num_threads) < 1:
        raise ValueError(f"num_threads={num_threads} must be >= 1")
    _adaptive = num_threads is None
    _requested = usable_cores() if num_threads is None else int(num_threads)
    _last_sample = _sample() if _adaptive else None
    _current = _requested
    _library_blas = bool(library_blas)
    _set_pools(_current if _library_blas else 1, _current)
    return _requested


def adapt_threads(blas_step: bool | None = None, library_blas: bool | None = None) -> int:
    """Set this step's thread counts (BLAS and numba); called once per engine step, from the
    thread that runs the model. After :func:`configure_threads` ``(None)``, every
    :data:`ADAPT_INTERVAL_S` seconds, sets the
    thread count to the usable cores minus those other processes kept busy since the last
    look (at least 1). Returns the thread count in use (1 before :func:`configure_threads`).

    ``blas_step``: the step has BLAS products (None: assume so). Then the BLAS library gets
    the threads if it runs them (``library_blas``: the step's layer ops leave their products
    to the library's threads; None: as :func:`configure_threads` was told), else it stays on one and
    :mod:`refengine.cpu.blas` spreads them; numba's kernels get the threads in every
    step, except in a BLAS step while numba's idle threads spin long (:func:`short_spin`
    is False: a spinning numba thread would hold the core that a BLAS thread needs), when
    they run their serial twins. The calling thread's numba count always matches (numba
    keeps one per Python thread). Cost: microseconds, plus one ``/proc/stat`` read per
    interval."""
    global _last_sample, _current
    if _current is None:
        return 1
    if _adaptive and _last_sample is not None and time.monotonic() - _last_sample[0] >= ADAPT_INTERVAL_S:
        sample = _sample()
        if sample is not None:
            wall = sample[0] - _last_sample[0]
            others = max(0.0, (sample[1] - _last_sample[1]) - (sample[2] - _last_sample[2])) / wall
            _last_sample = sample
            taken = int(others + 1.0 - BUSY_CORE_SHARE)  # cores others used more than BUSY_CORE_SHARE of
            _current = max(1, _requested - taken)
    n = _current
    blas_products = blas_step is not False
    library = _library_blas if library_blas is None else library_blas
    _set_pools(n if blas_products and library else 1,
               1 if blas_products and not _short_spin else n, n)
    return n


def short_spin() -> bool:
    """Whether numba's idle threads spin only briefly (at most :data:`SHORT_SPINCOUNT`
    rounds): the user set ``OMP_WAIT_POLICY=passive`` or a short ``GOMP_SPINCOUNT``, or
    numba's layer is one whose threads sleep. False with :data:`GOMP_SPINCOUNT` (long) in
    effect, and when libgomp was loaded before (e.g. by PyTorch) with its default spin."""
    return _short_spin


def max_threads() -> int:
    """The most threads :func:`adapt_threads` may use: what :func:`configure_threads` was
    given, else all usable cores (``refengine bench forward`` measures the machine's limits
    with this many)."""
    return _requested or usable_cores()


def _sample() -> tuple[float, float, float] | None:
    """(monotonic s, busy CPU s of our usable cores, CPU s of this process), or None off Linux."""
    try:
        cpus = os.sched_getaffinity(0)
        busy = 0
        with open("/proc/stat") as f:
            for line in f:
                if not (line.startswith("cpu") and line[3].isdigit()):
                    continue
                name, *fields = line.split()
                if int(name[3:]) in cpus:  # user nice system idle iowait irq softirq steal
                    ticks = [int(v) for v in fields[:8]]
                    busy += sum(ticks) - ticks[3] - ticks[4]
        t = os.times()
        return time.monotonic(), busy / os.sysconf("SC_CLK_TCK"), t.user + t.system
    except (OSError, AttributeError, ValueError):
        return None


def _set_pools(blas_n: int, numba_n: int, own_blas_n: int | None = None) -> None:
    """The BLAS library to ``blas_n`` threads (when it changed); this thread's numba count
    to ``numba_n``; the threads :mod:`refengine.cpu.blas` spreads products over to
    ``own_blas_n`` (default ``numba_n``)."""
    global _blas, _pools
    if _pools is None or _pools[0] != blas_n:
        if _blas is None:
            from threadpoolctl import ThreadpoolController

            _blas = ThreadpoolController().select(user_api="blas")
        _blas.limit(limits=blas_n)
    _pools = (blas_n, numba_n)
    blas.set_threads(numba_n if own_blas_n is None else own_blas_n)
    if "numba" in sys.modules:
        _numba_set(numba_n)


def _numba_set(n: int) -> None:
    import numba

    n = min(n, numba.config.NUMBA_NUM_THREADS)
    if numba.get_num_threads() != n:
        numba.set_num_threads(n)


def use_threads(blas_n: int, numba_n: int) -> None:
    """Set BLAS to ``blas_n`` threads and the calling thread's numba count to ``numba_n``
    (at most numba's pool size) now, whatever :func:`adapt_threads` would choose; the next
    :func:`adapt_threads` call sets them its way again."""
    _set_pools(max(1, int(blas_n)), max(1, int(numba_n)))


def numba_threading_layer() -> str | None:
    """The threading layer numba started (``"omp"``, ``"workqueue"``, ``"tbb"``), or None."""
    import numba

    try:
        return numba.threading_layer()
    except ValueError:  # not started yet
        return None


def use_wait_policy() -> None:
    """Start numba's threading layer with the layers of
    :data:`NUMBA_LAYERS` in that order and libgomp's idle threads spinning
    :data:`GOMP_SPINCOUNT` rounds (module docstring). Called by
    :func:`refengine.cpu.setup_cpu_runtime`; without it numba starts its own default way.
    Imports numba and starts the layer now (a no-op if it is running already)."""
    global _short_spin
    import numba

    if numba_threading_layer() is not None:
        return
    if os.environ.get("NUMBA_THREADING_LAYER") is None and numba.config.THREADING_LAYER == "default":
        numba.config.THREADING_LAYER_PRIORITY = list(NUMBA_LAYERS)
    user_choice = "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ  # the user's choice stands
    gomp_loaded_before = _libgomp_loaded()  # then it read its spin as it loaded, and numba's layer shares it
    wanted = {} if user_choice else {"GOMP_SPINCOUNT": GOMP_SPINCOUNT}
    saved = {k: os.environ.get(k) for k in wanted}
    for k, v in wanted.items():
        os.environ.setdefault(k, v)
    try:
        from refengine.cpu.numba_support import start_thread_pool

        start_thread_pool()  # loads the layer (libgomp reads the environment now)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    # The user's setting holds whoever loaded libgomp; ours only if numba's layer loaded it (else the default).
    ours_short = int(GOMP_SPINCOUNT) <= SHORT_SPINCOUNT and not gomp_loaded_before
    _short_spin = numba_threading_layer() != "omp" or (_user_spin_is_short() if user_choice else ours_short)


def _user_spin_is_short() -> bool:
    """The user's ``OMP_WAIT_POLICY`` / ``GOMP_SPINCOUNT`` make libgomp's idle threads sleep
    at once or spin no longer than :data:`SHORT_SPINCOUNT` rounds (libgomp reads both as it
    loads, so they hold whoever loaded it)."""
    policy = os.environ.get("OMP_WAIT_POLICY", "").strip().lower()
    count = os.environ.get("GOMP_SPINCOUNT", "").strip()
    if count:
        try:
            return int(count) <= SHORT_SPINCOUNT
        except ValueError:  # "infinite" or a suffixed count
            return False
    return policy == "passive"


def _libgomp_loaded() -> bool:
    """Whether a GNU OpenMP runtime is mapped into this process already (Linux; else False)."""
    try:
        with open("/proc/self/maps") as f:
            return any("libgomp" in line for line in f)
    except OSError:
        return False
