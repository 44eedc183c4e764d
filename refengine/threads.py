"""How many threads BLAS and the numba kernels use, set once per engine on the CPU.

(Draft; filled in with measurements.)
"""

from __future__ import annotations

import os
import sys


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity mask, so a ``taskset`` or container
    limit counts), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def configure_threads(num_threads: int | None = None) -> int:
    """Size the BLAS and numba thread pools; return the thread count used.

    Args:
        num_threads: threads for each pool; ``None`` = :func:`usable_cores`.
    Raises:
        ValueError: ``num_threads < 1``.
    """
    n = usable_cores() if num_threads is None else int(num_threads)
    if n < 1:
        raise ValueError(f"num_threads={num_threads} must be >= 1")
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=n, user_api="blas")
    if "numba" in sys.modules:
        import numba

        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    return n
