"""Large matrix products as one-thread BLAS calls over row blocks, on threads of refengine's own.

The numba backend keeps the BLAS library (OpenBLAS under NumPy) on one thread, always, and
splits a product with many rows into row blocks, one per thread, each a single-threaded
BLAS call (NumPy releases the GIL around it). Why not let OpenBLAS thread itself:

* OpenBLAS's idle threads spin after each call (``2**OPENBLAS_THREAD_TIMEOUT`` cycles)
  and take the cores from numba's threads in the steps that
  follow. The variable is read once, as NumPy loads OpenBLAS, so a program that imported
  NumPy before refengine could not change it, and neither could any set-up made at run time.
* Two pools then take turns in one step (BLAS products, numba kernels between them), each
  waiting on the other's idle threads.

The threads here wait on a queue (asleep, not spinning) between products, so they cost
the numba kernels nothing; the products they run are large (at least
:data:`MIN_ROWS_PER_THREAD` rows each), so waking them is small beside the work.

Numerics: ``a @ b`` up to float32 rounding, not its bits: OpenBLAS's summation order
depends on how it blocks the rows, so its own threading changes the bits too. Products
that must not depend on the batch go through the numba dot-product kernel instead
(:func:`refengine.cpu.layer_ops.matmul_dot`).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

#: A row block is at least this many rows (smaller products run in one call).
MIN_ROWS_PER_THREAD = 32

_threads = 1
_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_lock = threading.Lock()


def set_threads(n: int) -> None:
    """Spread products over ``n`` threads (the calling thread and ``n - 1`` workers) from now on."""
    global _threads
    _threads = max(1, int(n))


def get_threads() -> int:
    """The thread count :func:`matmul` spreads over."""
    return _threads


def _workers(n: int) -> ThreadPoolExecutor:
    """A pool of at least ``n`` workers. Only the thread that runs the model calls
    :func:`matmul`, so a replaced pool has no other submitter; it finishes what it has."""
    global _pool, _pool_size
    with _lock:
        if _pool is None or _pool_size < n:
            old = _pool
            _pool, _pool_size = ThreadPoolExecutor(max_workers=n, thread_name_prefix="refengine-blas"), n
            if old is not None:
                old.shutdown(wait=False)
        return _pool


def _forget_pool_after_fork() -> None:
    """A forked child has none of the parent's threads: start a fresh pool when needed."""
    global _pool, _pool_size, _lock
    _pool, _pool_size, _lock = None, 0, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_after_fork)


def balanced_tile_rows(n: int, k_dim: int, threads: int, tile_bytes: int, multiple: int = 16) -> int:
    """Weight rows per tile when ``n`` rows of ``k_dim`` float32 columns are cut into tiles of
    about ``tile_bytes`` (or less) and dealt round-robin to ``threads`` threads: the tile count
    a multiple of ``threads``, so each thread gets the same rows (960 rows of 576 in 2 MiB
    tiles on two threads: two of 480, not one of 896 beside one of 64, which left one thread
    idle for most of the product), rounded up to a multiple of ``multiple`` (at least that)."""
    count = max(1, -(-n * k_dim * 4 // tile_bytes))
    count = -(-count // max(1, threads)) * max(1, threads)
    per = -(-n // count)
    return max(multiple, -(-per // multiple) * multiple)


def run_parts(work, n: int) -> None:
    """Call ``work(part)`` for ``part`` in ``0 .. n-1`` at once: part 0 on this thread, the
    others on the pool's workers (each does its own single-threaded BLAS calls). Returns
    when every part is done; re-raises the first part's exception."""
    if n <= 1:
        work(0)
        return
    futures = [_workers(n - 1).submit(work, part) for part in range(1, n)]
    work(0)
    for f in futures:
        f.result()


def matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``a [M, K] @ b [K, N]`` -> ``[M, N]`` (into ``out`` when given: C-contiguous rows),
    by :func:`get_threads` single-threaded BLAS calls over row blocks of ``a``.

    ``np.matmul(a, b, out=out)`` up to float32 rounding (module docstring), its dtype by
    NumPy's rules; one thread is exactly that call.

    Raises:
        ValueError: shapes that do not chain, or an ``out`` of the wrong shape (as ``np.matmul``).
    """
    rows = a.shape[0]
    n = min(_threads, rows // MIN_ROWS_PER_THREAD)
    if n <= 1:
        return np.matmul(a, b, out=out)
    if out is None:
        out = np.empty((rows, b.shape[1]), dtype=np.result_type(a, b))
    bounds = [rows * i // n for i in range(n + 1)]
    pool = _workers(n - 1)
    futures = [pool.submit(np.matmul, a[lo:hi], b, out=out[lo:hi]) for lo, hi in zip(bounds[1:-1], bounds[2:])]
    np.matmul(a[:bounds[1]], b, out=out[:bounds[1]])
    for f in futures:
        f.result()
    return out
