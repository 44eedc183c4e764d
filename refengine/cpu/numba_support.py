"""numba building blocks shared by the CPU kernels: parallel/serial pairs, intrinsics, the kernel registry.

:class:`ParallelKernel` (a ``prange`` loop and its serial twin), two LLVM intrinsics
(``prefetch``, ``stack_f32``), the thread-pool starter and the kernel registry
(:func:`register_kernels`, :func:`kernel_cache_misses`, :func:`kernel_cache_dirs`), and
:func:`share_scope_when_inlining`, which halves the compile time of the kernels built from
``inline="always"`` helpers.

Nothing here imports the rest of refengine: the kernel modules
(:mod:`refengine.cpu.layer_ops`, :mod:`refengine.cpu.attention` and the quantized
products in :mod:`refengine.quant`) import it, and
register themselves with :func:`register_kernels` so that the engine's warm-up can tell how
many kernels numba compiled rather than loaded from its cache.
"""

from __future__ import annotations

import copy
import functools
from types import FunctionType, ModuleType

import numpy as np
from llvmlite import ir
import numba
from numba import njit, prange, types
from numba.core import cgutils
from numba.core import ir as numba_ir
from numba.extending import intrinsic
from numba.np.ufunc import parallel as _parallel


class _ScopeSharingCopy:
    """The ``copy`` module as numba's inliner sees it during one inlining: a deep copy of a
    block of the IR reuses one copy of the block's scope, made once (see
    :func:`share_scope_when_inlining`). Everything else is :mod:`copy`'s."""

    def __init__(self):
        self._scopes: dict[int, tuple] = {}  # id(scope) -> (scope, its copy); keeps the scope alive

    def deepcopy(self, x, memo=None):
        if memo is None and isinstance(x, numba_ir.Block):
            if id(x.scope) not in self._scopes:
                self._scopes[id(x.scope)] = (x.scope, copy.deepcopy(x.scope))
            memo = {id(x.scope): self._scopes[id(x.scope)][1]}
        return copy.deepcopy(x, memo)

    def __getattr__(self, name):
        return getattr(copy, name)


def share_scope_when_inlining() -> bool:
    """Make numba's ``inline="always"`` copy a function's scope once per copy of its IR.

    numba inlines a call by copying the callee's IR (``InlineWorker.inline_ir``, twice per
    call site), one block at a time with ``copy.deepcopy``; every variable refers to the
    function's scope, which holds all its variables, so each block's copy copies the whole
    scope again: quadratic in the callee's size (numba issues #8989 and #9204; numba 0.68
    still does it). The GGUF and Q8 products inline large helpers several times (the row
    groups of :func:`refengine.cpu.gguf_products._blocks32_many`), and spent about half of
    their compile time in those copies (the attention kernels, without such helpers, do not
    change). Here the blocks of one copy share one copy of
    the scope, as the blocks of the original share the original: the inliner's result, and
    so the machine code, are the same (``tests/kernels/test_numba_inliner.py`` compares the
    assembly); only the copying is shorter. Process-wide and idempotent;
    :func:`refengine.cpu.setup_cpu_runtime` calls it.

    Returns:
        Whether the inliner is now patched (False where numba's inliner does not have the
        shape this expects: the compile is then as slow as numba makes it, and as correct).
    """
    try:
        from numba.core import inline_closurecall
    except ImportError:  # pragma: no cover - numba is a dependency
        return False
    worker = getattr(inline_closurecall, "InlineWorker", None)
    inline_ir = getattr(worker, "inline_ir", None)
    if getattr(inline_ir, "shares_scope", False):
        return True
    if inline_ir is None or getattr(inline_closurecall, "copy", None) is not copy:
        return False

    @functools.wraps(inline_ir)
    def shared_scope_inline_ir(*args, **kwargs):
        before = inline_closurecall.copy
        inline_closurecall.copy = _ScopeSharingCopy()  # numba compiles under its global lock
        try:
            return inline_ir(*args, **kwargs)
        finally:
            inline_closurecall.copy = before

    shared_scope_inline_ir.shares_scope = True
    worker.inline_ir = shared_scope_inline_ir
    return True


class ParallelKernel:
    """One ``prange`` loop compiled twice: spread over numba's threads, and as a plain
    loop on the calling thread, which runs when numba is set to one thread.

    A kernel compiled with ``parallel=True`` holds only its ``prange`` loop and plain calls:
    the loop body is one call to an ``@njit`` task function, and allocations and
    array expressions before or after the loop are calls to ``@njit`` functions too. Numba
    turns every ``np.zeros``, slice assignment and array expression in a parallel function
    into a parallel loop of its own, each a thread-pool launch, which costs more than
    small work (the more so with passive waits).

    Why both: a parallel launch hands the work to pool threads even at one thread, and a
    woken thread waits for a core; on a busy machine that wait (milliseconds) dwarfs a
    decode kernel (microseconds). The serial twin is a separate function to numba (its own
    name, so its own on-disk cache entry). A task function that takes the loop index itself
    gets it as ``np.int64(i)``: the index is uint64 in the parallel version and int64 in
    the serial one, and each argument type is a compile of the task function of its own.
    """

    def __init__(self, py_func, **options):
        self.parallel = njit(cache=True, parallel=True, **options)(py_func)
        name = py_func.__name__ + "_serial"
        serial = FunctionType(py_func.__code__, py_func.__globals__, name, py_func.__defaults__, py_func.__closure__)
        serial.__qualname__ = py_func.__qualname__ + "_serial"
        self.serial = njit(cache=True, **options)(serial)
        self.__doc__ = py_func.__doc__

    def for_threads(self, threads: int):
        """The version a call on ``threads`` numba threads runs: parallel from two, else serial."""
        return self.parallel if threads > 1 else self.serial

    def __call__(self, *args):
        return self.for_threads(get_num_threads())(*args)


def get_num_threads() -> int:
    """``numba.get_num_threads()``, without its per-call locks once the pool is up: numba's
    own function takes two locks to check that its threading layer is loaded, and a decode
    step asks hundreds of times (every kernel call picks its parallel or
    serial version and its task size by it). After :func:`start_thread_pool` (or any parallel
    kernel) this reads the layer's count directly (numba's ``_get_num_threads``, the ctypes
    function its public one calls); the public function before that, or where numba lacks it."""
    fast = getattr(_parallel, "_get_num_threads", None) if getattr(_parallel, "_is_initialized", False) else None
    if fast is None:
        return numba.get_num_threads()
    n = fast()
    return n if n > 0 else numba.get_num_threads()  # the public one raises its own error


def parallel_kernel(**options):
    """Decorator: a :class:`ParallelKernel` compiled with ``njit(cache=True, **options)``."""
    return lambda py_func: ParallelKernel(py_func, **options)


@njit(cache=True, parallel=True)
def _fill_range(out):  # pragma: no cover - compiled
    for i in prange(out.shape[0]):
        out[i] = i


def start_thread_pool() -> None:
    """Run one tiny parallel loop so numba loads its threading layer now
    (:mod:`refengine.cpu.threads` sets the environment libgomp reads around this call)."""
    _fill_range(np.empty(64, dtype=np.int64))


@intrinsic
def stack_f32(typingctx, size):
    """``float32*`` to ``size`` (a literal) floats on the stack of the calling kernel.

    Accumulators that live there, indexed by constants once LLVM unrolls the loops over
    them, become vector registers (numba has no fixed-size local array of its own on the CPU;
    ``np.empty`` would be a heap array that LLVM must assume aliases the inputs).
    """
    if not isinstance(size, types.IntegerLiteral):
        return None

    def codegen(context, builder, sig, args):
        return cgutils.alloca_once(builder, context.get_value_type(types.float32), size=size.literal_value)

    return types.CPointer(types.float32)(size), codegen


@intrinsic
def prefetch(typingctx, array, index):
    """Ask the CPU to bring the cache line holding element ``index`` of the C-contiguous
    ``array``, counted flat, into cache (LLVM's ``llvm.prefetch``: read, keep in all
    levels). A hint: it changes no result and cannot fault, even past the array's end.
    For memory read in more interleaved streams than the hardware prefetcher follows, or
    in scattered blocks it cannot predict (the paged KV cache)."""
    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        ptr = builder.gep(ary.data, [args[1]])
        i32 = ir.IntType(32)
        fn = builder.module.declare_intrinsic("llvm.prefetch", [ptr.type],
                                              ir.FunctionType(ir.VoidType(), [ptr.type, i32, i32, i32]))
        builder.call(fn, [ptr, i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return types.void(array, index), codegen


#: Bytes of input rows a multi-row dot kernel keeps in cache while it passes over a task's
#: weight rows (:func:`refengine.cpu.layer_ops._dot_rows_4x4`, the int8, GGUF block and
#: Q8_0-activation kernels): with the few weight rows of a register tile, inside a 32 KB L1
#: (the tiles load from it at every FMA or two; docs/PERFORMANCE.md, "Design notes").
X_BLOCK_BYTES = 24 * 1024


@njit(inline="always")
def x_block_rows(k, multiple):  # pragma: no cover - compiled
    """Input rows of ``k`` float32 columns per block of :data:`X_BLOCK_BYTES`, rounded down
    to a multiple of ``multiple`` (at least one ``multiple``), as an unsigned integer."""
    return np.uintp(max(multiple, X_BLOCK_BYTES // (4 * max(k, 1)) // multiple * multiple))

_KERNEL_MODULES: list[ModuleType] = []


def register_kernels(module: ModuleType) -> None:
    """Count ``module``'s compiled functions (``@njit`` dispatchers and
    :class:`ParallelKernel` pairs) in :func:`kernel_cache_misses` and :func:`kernel_cache_dirs`."""
    if module not in _KERNEL_MODULES:
        _KERNEL_MODULES.append(module)


def _dispatchers():
    """Every compiled function of the registered kernel modules, serial twins included."""
    for module in _KERNEL_MODULES:
        for value in vars(module).values():
            if isinstance(value, ParallelKernel):
                yield value.parallel
                yield value.serial
            elif hasattr(value, "py_func") and hasattr(value, "stats"):
                yield value


def kernel_cache_misses() -> int:
    """How many kernel versions numba compiled (not found in its cache) in this process."""
    return sum(sum(d.stats.cache_misses.values()) for d in _dispatchers())


def kernel_cache_dirs() -> str:
    """Where numba keeps the compiled kernels (``__pycache__`` beside the sources, or
    numba's user-wide cache directory when that is not writable)."""
    return ", ".join(sorted({d.stats.cache_path for d in _dispatchers() if d.stats.cache_path}))
