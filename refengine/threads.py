"""How many threads BLAS and the numba kernels use, and how idle threads wait.

The engine calls :func:`configure_threads` once at start on the CPU and
:func:`adapt_threads` once per step. Choices, and why:

* **Thread count**: the cores this process may run on (``os.sched_getaffinity``, so
  ``taskset``, cpusets and containers count), **minus the cores other processes keep
  busy**. A parallel kernel waits for its slowest thread, and a thread sharing a core with
  another process waits for a time slice, at each of a decode step's ~150 parallel
  launches. So :func:`adapt_threads` reads, at most every :data:`ADAPT_INTERVAL_S`, how
  much CPU time this process's cores gave other processes (``/proc/stat`` minus our own
  ``os.times``) and uses one thread fewer per core they kept more than
  :data:`BUSY_CORE_SHARE` busy, never fewer than one. An explicit ``num_threads`` turns
  this off.
* **BLAS's threads only in BLAS steps; numba's in every step**: a step with BLAS products
  (``blas_step``: at least :data:`refengine.ops.numba_ops.BLAS_MIN_ROWS` rows, or a prefill
  chunk long enough for the attention's BLAS products,
  :func:`refengine.model_runner.is_blas_step`) gives BLAS the threads; any other step gives
  BLAS one. numba keeps the thread count in both: in a BLAS step its kernels (the
  decode attention of the batch's decode rows, the causal softmax, the elementwise layers)
  run between BLAS calls. The model calls one kernel at a time, so the pools never work
  together, but an idle pool's threads *wait* (spin) for a while after each call and take
  the core from the other pool's threads; so both pools spin only briefly (below). With
  the earlier spins (OpenBLAS ~0.1 s, libgomp ~1 ms), both pools at 2 threads made a
  512-token prefill take 3.2 s against 0.8 s, so numba was cut to one thread in BLAS
  steps; with the short spins, numba at full strength beside BLAS is the faster choice
  (``refengine bench throughput``, two alternating pairs: 157 / 162 against 152 / 155
  output tok/s; a 1024-token prefill 1.63 against 1.69 s).
* **numba's threading layer and wait policy**: OpenMP (GNU libgomp) with idle threads
  spinning :data:`GOMP_SPINCOUNT` rounds (tens of microseconds) before they sleep. A decode
  step launches ~150 parallel loops a few tens of microseconds apart; a sleeping thread
  takes ~40-50 us to wake on this VM (``OMP_WAIT_POLICY=PASSIVE``), a spinning one ~1.5
  us: 1-row decode 33 against 24 ms. 2,000 rounds keep that (1-row decode 21.4 ms at both
  2,000 and 100,000) without holding a core while BLAS runs: at 100,000 (about a
  millisecond) numba's threads, spinning after each kernel of a BLAS step, took the core
  from BLAS's (1024-token prefill 2.75 against 1.63 s, ``refengine bench forward``).
  With other processes running, spinning threads steal their time slices;
  :func:`adapt_threads` then drops to one thread (no pool at all).
  The variable is set only while numba loads libgomp, then restored, so OpenMP runtimes
  loaded later (PyTorch's) keep their defaults; a value the user set (``OMP_WAIT_POLICY``
  or ``GOMP_SPINCOUNT``) is kept. Without libgomp numba falls back to its ``workqueue``
  layer (threads sleep).

OpenBLAS's own idle threads spin after each call for ``2**OPENBLAS_THREAD_TIMEOUT``
cycles (default 2**28, ~0.1 s), so the first numba step after a BLAS step lost its second
core to them: a 1-row decode right after a 256-token prefill took 52-120 ms against 24 ms.
OpenBLAS reads the variable once, when NumPy loads it, so ``import refengine`` sets it to
its minimum, 4 (threads sleep almost at once), when NumPy is not loaded yet and the user
has not set it: then no penalty, and prefill unchanged (512 tokens: 782 vs 781 ms). A
program that imports NumPy before refengine keeps OpenBLAS's default.
"""

from __future__ import annotations

import os
import sys
import time

#: How long libgomp's idle threads spin before they sleep, in its rounds (see the module docstring).
GOMP_SPINCOUNT = "2000"
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
_numba_started = False  # numba's threading layer is running (started by _start_numba_layer)
_blas = None  # threadpoolctl's handle on the BLAS libraries
_last_sample: tuple[float, float, float] | None = None  # (wall s, busy s of our cores, own CPU s)


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def configure_threads(num_threads: int | None = None) -> int:
    """Size the BLAS and numba thread pools; return the thread count.

    numba is configured now if it is imported, else when :mod:`refengine.ops.numba_ops`
    is first imported (so the NumPy backend never pays numba's import).

    Args:
        num_threads: threads for each pool, fixed; ``None`` = all :func:`usable_cores`,
            adapted each step to the cores other processes leave free (:func:`adapt_threads`).
    Raises:
        ValueError: ``num_threads < 1``.
    """
    global _requested, _adaptive, _last_sample, _current
    if num_threads is not None and int(num_threads) < 1:
        raise ValueError(f"num_threads={num_threads} must be >= 1")
    _adaptive = num_threads is None
    _requested = usable_cores() if num_threads is None else int(num_threads)
    _last_sample = _sample() if _adaptive else None
    _current = _requested
    _set_pools(_current, _current)
    return _requested


def adapt_threads(blas_step: bool | None = None) -> int:
    """Call once per engine step, from the thread that runs the model. After
    :func:`configure_threads` ``(None)``, every :data:`ADAPT_INTERVAL_S` seconds, sets the
    thread count to the usable cores minus those other processes kept busy since the last
    look (at least 1). numba gets that count; BLAS gets it when ``blas_step`` is True or
    None, one thread when False (a numba step: module docstring). Always makes the calling
    thread's numba count match (numba keeps one per Python thread). Returns the thread
    count in use (1 before :func:`configure_threads`).
    Cost: ~1 us, plus one ``/proc/stat`` read (~0.1 ms) per interval, plus ~20 us when
    the pools change."""
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
    _set_pools(1 if blas_step is False else n, n)
    return n


def current_threads() -> int | None:
    """The thread count last set (None before :func:`configure_threads`)."""
    return _current


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


def _set_pools(blas_n: int, numba_n: int) -> None:
    """BLAS to ``blas_n`` threads (when it changed), this thread's numba count to ``numba_n``."""
    global _blas, _pools
    if _pools is None or _pools[0] != blas_n:
        if _blas is None:
            from threadpoolctl import ThreadpoolController

            _blas = ThreadpoolController().select(user_api="blas")
        _blas.limit(limits=blas_n)
    _pools = (blas_n, numba_n)
    if "numba" in sys.modules:
        _numba_set(numba_n)


def _numba_set(n: int) -> None:
    import numba

    if not _numba_started:
        _start_numba_layer()  # set_num_threads would start it, without the wait policy
    n = min(n, numba.config.NUMBA_NUM_THREADS)
    if numba.get_num_threads() != n:
        numba.set_num_threads(n)


def configure_numba() -> int:
    """Start numba's threading layer (see the module docstring) and give it the current
    thread count (all usable cores if :func:`configure_threads` was not called); returns it."""
    import numba

    _start_numba_layer()
    n = min(_current or usable_cores(), numba.config.NUMBA_NUM_THREADS)
    numba.set_num_threads(n)
    return n


def numba_threading_layer() -> str | None:
    """The threading layer numba started (``"omp"``, ``"workqueue"``, ``"tbb"``), or None."""
    import numba

    try:
        return numba.threading_layer()
    except ValueError:  # not started yet
        return None


def _start_numba_layer() -> None:
    global _numba_started
    import numba

    if numba_threading_layer() is not None:
        _numba_started = True
        return
    if os.environ.get("NUMBA_THREADING_LAYER") is None and numba.config.THREADING_LAYER == "default":
        numba.config.THREADING_LAYER_PRIORITY = list(NUMBA_LAYERS)
    wanted = {"GOMP_SPINCOUNT": GOMP_SPINCOUNT}
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:  # the user's choice stands
        wanted = {}
    saved = {k: os.environ.get(k) for k in wanted}
    for k, v in wanted.items():
        os.environ.setdefault(k, v)
    try:
        from refengine.ops.numba_ops import start_thread_pool

        start_thread_pool()  # loads the layer (libgomp reads the environment now)
        _numba_started = True
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
