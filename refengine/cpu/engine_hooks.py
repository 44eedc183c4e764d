"""What the CPU wing does around the model's steps: once at engine start (thread pools, Q8_0
weight interleaving, the attention's BLAS prefill switch, the kernel warm-up) and before each
step (thread pools sized for a BLAS or a numba step). :class:`refengine.cpu.layer_ops.NumbaOps`
calls these from its :class:`refengine.ops.LayerOps` hooks; the core loop never does.
"""

from __future__ import annotations

import logging
import time
import weakref

import numpy as np

from refengine.attention import paged_metadata
from refengine.cpu import numba_support
from refengine.cpu.threads import adapt_threads, configure_threads, max_threads, use_threads
from refengine.quant import StackedWeight, compiled_products, is_quantized

logger = logging.getLogger(__name__)

# Rows of the warm-up's prefill chunk: the most rows at which a compiled kernel is chosen in
# place of another (the attention's BLAS prefill at 64; the GGUF tiles, the int4 and int8
# tiles, the parallel elementwise layers and the 4x4 dot below it; a test keeps it so). A
# longer chunk runs the same kernel versions, only for longer: under batch invariance (no
# BLAS) a chunk as long as the warm-up's context was most of an engine's start.
WARM_UP_PREFILL_ROWS = 64


def prepare_model(model, num_threads: int | None, *, draft: bool = False) -> None:
    """Once per loaded ``model`` of numba layer ops (:meth:`refengine.ops.LayerOps.prepare_model`).

    The engine's model (not a ``draft``): the thread pools sized to this process's cores or
    ``num_threads`` (:func:`refengine.cpu.threads.configure_threads`; the BLAS library's own
    pool on one thread: the ops spread large products over refengine's threads). Every model:
    with Q8_0 activations, the products of the GGUF block types (K-quants too) read only their
    interleaved copies (:func:`refengine.cpu.q8_products.interleave_model`), made now over the
    loaded planes and kept alone (one copy of each matrix in memory). Then, for the engine's
    model, when every product runs in numba's kernels (:func:`layer_products_use_blas` False),
    the attention's BLAS prefill is turned off: a chunk's BLAS attention would make its step a
    BLAS step, and numba's threads would sit out the products (:mod:`refengine.cpu.threads`);
    the compiled prefill kernel keeps them.
    """
    if not draft:
        configure_threads(num_threads, library_blas=not model.ops.spreads_blas)
    if model.ops.activation_dtype == "q8_0":
        compiled_products("q8").interleave_model(model)
    if not draft and hasattr(model.attention, "use_blas_prefill") and not layer_products_use_blas(model):
        model.attention.use_blas_prefill = False


def begin_step(model, num_rows: int, longest_chunk: int) -> None:
    """Before each step of numba layer ops (:meth:`refengine.ops.LayerOps.begin_step`): one thread
    pool per step, fewer threads while other processes hold cores
    (:func:`refengine.cpu.threads.adapt_threads`), BLAS's where the step has BLAS products
    (:func:`is_blas_step`)."""
    adapt_threads(blas_step=is_blas_step(model, num_rows, longest_chunk), library_blas=not model.ops.spreads_blas)


def is_blas_step(model, num_rows: int, longest_chunk: int = 0) -> bool:
    """Whether a CPU step of ``num_rows`` flat-batch rows, the longest sequence's chunk
    ``longest_chunk`` rows, has BLAS products (:func:`refengine.cpu.threads.adapt_threads`
    sizes the pools by it): its layer products go to BLAS from the layer ops'
    ``blas_min_rows`` on (always for ops that have none: NumPy) unless every layer matrix
    has a compiled kernel at every row count (:func:`layer_products_use_blas`), or the
    attention backend computes that chunk with BLAS products (its ``blas_prefill_min_rows``)."""
    return ((num_rows >= getattr(model.ops, "blas_min_rows", 0) and layer_products_use_blas(model))
            or longest_chunk >= getattr(model.attention, "blas_prefill_min_rows", float("inf")))


_products_use_blas: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def layer_products_use_blas(model) -> bool:
    """Whether some product of ``model`` can go to BLAS at a large row count: False only
    when its layer ops take every decoder-layer matrix and the ``lm_head`` through a
    compiled kernel at every row count, which is the case of GGUF blocks with
    ``activation_dtype="q8_0"`` where each matrix's type has an integer kernel
    (:mod:`refengine.cpu.q8_products`). Such a step must keep numba's threads: its products
    run there, not in BLAS. Computed once per model."""
    try:
        known = _products_use_blas.get(model)
    except TypeError:  # a model that takes no weak reference: computed each time
        known = None
    if known is not None:
        return known
    uses = True
    if getattr(model.ops, "activation_dtype", "auto") == "q8_0" and getattr(model, "layers", None):
        def matrices(value):
            for part in value.parts if isinstance(value, StackedWeight) else [value]:
                if is_quantized(part) or getattr(part, "ndim", 0) == 2:
                    yield part

        values = [value for layer in model.layers for value in vars(layer).values()]
        values.append(getattr(model, "lm_head", None))
        q8_types = compiled_products("q8").INTEGER_TYPES
        uses = not all(is_quantized(w) and getattr(w, "format", None) in q8_types
                       for value in values if value is not None for w in matrices(value))
    try:
        _products_use_blas[model] = uses
    except TypeError:
        pass
    return uses


def warm_up(model, kv_cache, max_rows: int, max_model_len: int) -> None:
    """Run every compiled CPU kernel variant a step can use once, on the first blocks of the
    (still empty) pool, so numba compiles them now, or loads them from its cache, rather
    than in the middle of the first requests. On a cache miss (the first run after
    installing or changing a kernel) says once how long compiling took.

    The passes: with numba on one thread (the serial twins, which run when other processes
    hold the other cores) a prefill chunk of :data:`WARM_UP_PREFILL_ROWS` rows (or the ops'
    ``blas_min_rows``, where BLAS takes over), a decode row and a 2-row chunk; then the same
    with numba at the engine's most threads (:func:`refengine.cpu.threads.max_threads`: the
    parallel kernels), plus a chunk of the ops' ``elementwise_parallel_min_rows`` rows
    (parallel elementwise layers). The thread counts are set outright, not adapted to the
    load, so the set of variants compiled is the same on a busy machine as on a quiet one. ``max_rows`` (the token budget) and
    ``max_model_len`` bound the passes; the tokens are id 0. Writes K/V into the pool's
    first blocks, which no sequence holds yet.
    """
    context = min(300, max_model_len - 1)
    needed = -(-(context + 1) // kv_cache.block_size)
    if context < 2 or needed > kv_cache.num_blocks:
        return
    block_table = np.arange(needed, dtype=np.int32)[None, :]
    t0 = time.perf_counter()
    misses_before = numba_support.kernel_cache_misses()

    def run(q_len: int, seq_len: int) -> None:
        meta = paged_metadata(np.array([q_len]), np.array([seq_len]), block_table, kv_cache.block_size)
        positions = np.arange(seq_len - q_len, seq_len, dtype=np.int64)
        model.forward(np.zeros(q_len, dtype=np.int64), positions, kv_cache, meta, np.array([q_len - 1]))

    prefill = min(max(model.ops.blas_min_rows, 2), WARM_UP_PREFILL_ROWS, max_rows, context)
    cores = max_threads()
    for numba_threads in sorted({1, cores}):
        use_threads(1, numba_threads)
        run(prefill, prefill)
        run(1, context + 1)
        run(2, context)
    chunk = model.ops.elementwise_parallel_min_rows  # parallel elementwise layers, in a numba step
    if cores > 1 and chunk <= min(max_rows, context):
        run(chunk, context)
    adapt_threads()
    misses = numba_support.kernel_cache_misses() - misses_before
    if misses:
        logger.warning("compiled %d numba CPU kernels in %.1f s on first use; numba caches them (%s), so later "
                       "runs load them in about a second", misses, time.perf_counter() - t0,
                       numba_support.kernel_cache_dirs())
