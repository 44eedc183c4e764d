"""The CPU wing: everything compiled with numba, and the CPU runtime's process-wide settings.

The engine reaches it only through the interfaces the model calls: the numba layer ops
(:class:`~refengine.cpu.layer_ops.NumbaOps`, a :class:`refengine.ops.LayerOps` whose hooks run
:mod:`~refengine.cpu.engine_hooks`) and the numba attention
(:class:`~refengine.cpu.attention.NumbaAttention`), which :mod:`~refengine.cpu.backends`
registers by name. The products of the weight formats: :mod:`~refengine.cpu.gguf_products`,
:mod:`~refengine.cpu.q8_products`, :mod:`~refengine.cpu.int_products`, over the vector helpers
of :mod:`~refengine.cpu.simd`. The captured decode step: :mod:`~refengine.cpu.capture`.

Importing refengine changes nothing in the process: no environment variable, no thread
pool, no allocator setting. :func:`setup_cpu_runtime` makes the settings that make the CPU
engine fast; the ``refengine`` command, ``refengine serve`` and :class:`refengine.LLM` call
it, and a program embedding :class:`refengine.LLMEngine` may call it or skip it (results are
the same either way, only the speed differs). It works whatever the process imported
before it (NumPy, torch): every setting is made at run time, none through a variable that a
library reads only as it loads.

The runtime modules (they import nothing else of refengine):

* :mod:`~refengine.cpu.threads`: how many threads BLAS and numba use, per step;
  numba's threading layer and its idle threads' wait.
* :mod:`~refengine.cpu.malloc`: glibc malloc thresholds.
* :mod:`~refengine.cpu.numba_support`: parallel/serial kernel pairs, LLVM intrinsics,
  the kernel registry that the warm-up counts compiles with.
* :mod:`~refengine.cpu.blas`: large matrix products as one-thread BLAS calls over
  refengine's own threads (the numba backend's).
"""

from __future__ import annotations

from refengine.cpu import malloc, threads

_done = False


def setup_cpu_runtime() -> dict:
    """Make the CPU engine's process-wide settings; idempotent.

    * glibc keeps freed activation buffers in the heap (:func:`malloc.keep_freed_memory`);
    * numba's threading layer starts now, as :func:`threads.use_wait_policy` describes
      (OpenMP, idle threads spinning libgomp's default count); this imports numba;
    * numba's inliner copies less (:func:`numba_support.share_scope_when_inlining`): the
      GGUF and Q8 products compile in about half the time, to the same machine code.

    Thread counts are not set here: each engine sizes them at start and per step
    (:func:`threads.configure_threads`, :func:`threads.adapt_threads`).

    Returns:
        ``{"keep_freed_memory": bool}``: whether glibc's thresholds are in effect (False off
        glibc, or when the user set glibc's own malloc variables).
    """
    global _done
    applied = malloc.keep_freed_memory()
    threads.use_wait_policy()
    from refengine.cpu import numba_support  # imports numba, as the line above does

    numba_support.share_scope_when_inlining()
    _done = True
    return {"keep_freed_memory": applied}


def is_set_up() -> bool:
    """Whether :func:`setup_cpu_runtime` has run in this process."""
    return _done
