"""Layer operations as CPU kernels compiled by numba: the third sibling of the NumPy twin.

The NumPy versions in :mod:`refengine.layers` (through :class:`refengine.ops.numpy_ops.NumpyOps`)
are the reference; every kernel here is tested against them (``tests/test_cpu_kernels.py``).

Why these kernels exist:

* **The small-row matrix product.** Decode multiplies 1-16 rows by every weight matrix,
  so it is bound by reading the weights from memory. OpenBLAS reads them once at one row
  (GEMV) but its GEMM path costs about 3x that at 2-8 rows, and the tied ``lm_head``
  (``embed.T``, a transposed view) more still. :func:`_matmul_rows` streams the weights
  once, front to back (one contiguous range of weight rows per thread), and applies each
  weight row to every input row while it is in L1 (narrower column blocks, tried for
  8-16 rows, were slower: whole rows keep the prefetcher streaming). From
  :data:`BLAS_MIN_ROWS` rows the product is compute-bound and OpenBLAS's packed GEMM
  wins, so ``linear`` hands over to it.
* **RMSNorm, RoPE, SiLU-and-mul.** At one row NumPy spends its time dispatching 4-7
  temporaries-making ufuncs per call; one loop per call is cheaper. They run on one thread
  at decode sizes (a parallel launch costs more than the work) and over row blocks in
  parallel from :data:`ELEMENTWISE_PARALLEL_MIN_ROWS` rows (prefill).

Numerics (float32 in and out, as the twins):

* ``_matmul_rows`` sums over the inner dimension in a fixed order (groups of four products
  as a tree, the groups in sequence; ``fastmath={"contract"}``: FMA only, no reassociation)
  within each of :func:`refengine.threads.max_threads` ranges, then adds the partial sums:
  a row's result depends neither on how many rows share the call nor on how many threads
  run it (the count adapts to load; the ranges do not). ``_matmul_rows_t`` (dot products over contiguous
  rows) also allows ``reassoc`` so LLVM can vectorise the reduction.
* RoPE performs the twin's exact operations (no FMA contraction): results are bitwise equal.
* RMSNorm sums squares with ``reassoc`` (vectorised partial sums, like NumPy's pairwise sum).
* SiLU uses :func:`exp_affine` (vectorised, within 2 ulp), NumPy its own SIMD ``exp`` (also ~2 ulp).

``fastmath`` never includes ``nnan``/``ninf``: NaN and inf propagate as in NumPy.
"""

from __future__ import annotations

import sys
from types import FunctionType

import numpy as np
from numba import get_num_threads, njit, prange

from refengine import threads as _threads


#: From this many rows ``linear`` hands ``[in, out]`` C-contiguous weights to BLAS, and the step
#: gives BLAS the threads (:func:`refengine.threads.adapt_threads`). Below it the step is
#: numba's: BLAS's product is faster from ~32 rows on its own, but a BLAS step runs the
#: decode attention on one thread. SmolLM2 decode pass at a 512-token context, 2 cores,
#: numba step vs BLAS step: 16 rows 95 vs 131 ms, 32 rows 178 vs 222, 48 rows 246 vs 331,
#: 64 rows 318 vs 417 (``refengine bench forward``).
BLAS_MIN_ROWS = 64
#: The same for the transposed (tied lm_head) layout. Kept equal to :data:`BLAS_MIN_ROWS`: a
#: step of that many rows gives its threads to BLAS and runs numba on one
#: (:func:`refengine.threads.adapt_threads`), where BLAS's product wins (16 rows, 2 cores:
#: 17 against 27 ms).
BLAS_MIN_ROWS_T = BLAS_MIN_ROWS

#: From this many rows RMSNorm, RoPE and SiLU-and-mul run over row blocks in parallel; below,
#: on the calling thread (a parallel launch, ~50 us with sleeping threads, is more than a
#: decode step's elementwise work).
ELEMENTWISE_PARALLEL_MIN_ROWS = 32

_DOT = {"contract", "reassoc"}  # FMA + reassociation of sums (vectorised reductions); never nnan/ninf
_FMA = {"contract"}


class ParallelKernel:
    """One ``prange`` loop compiled twice: spread over numba's threads, and as a plain
    loop on the calling thread, which runs when numba is set to one thread.

    A kernel compiled with ``parallel=True`` holds only its ``prange`` loop and plain calls:
    the loop body is one call to an ``@njit`` task function, and allocations and
    array expressions before or after the loop are calls too (:func:`zeros_f32_3d`). Numba
    turns every ``np.zeros``, slice assignment and array expression in a parallel function
    into a parallel loop of its own, each a thread-pool launch (~40-70 us with passive
    waits): the paged decode kernel's merge, with one small ``np.zeros`` per head, ran
    10x slower on two threads than on one (16 sequences: 7.4 ms against 0.74 ms).

    Why both: a parallel launch hands the work to pool threads even at one thread, and a
    woken thread waits for a core; on a busy machine that wait (milliseconds) dwarfs a
    decode kernel (microseconds). The serial twin is a separate function to numba (its own
    name, so its own on-disk cache entry).
    """

    def __init__(self, py_func, **options):
        self.parallel = njit(cache=True, parallel=True, **options)(py_func)
        name = py_func.__name__ + "_serial"
        serial = FunctionType(py_func.__code__, py_func.__globals__, name, py_func.__defaults__, py_func.__closure__)
        serial.__qualname__ = py_func.__qualname__ + "_serial"
        self.serial = njit(cache=True, **options)(serial)
        self.__doc__ = py_func.__doc__

    def __call__(self, *args):
        return (self.parallel if get_num_threads() > 1 else self.serial)(*args)


def parallel_kernel(**options):
    """Decorator: a :class:`ParallelKernel` compiled with ``njit(cache=True, **options)``."""
    return lambda py_func: ParallelKernel(py_func, **options)


_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)  # ln 2 split in two so k * _LN2_HI is exact (Cody & Waite 1980)
_LN2_LO = np.float32(-2.12194440e-4)


@njit(cache=True, fastmath={"contract"})
def exp_affine(x, a, b, out, scratch):  # pragma: no cover - compiled
    """``out[j] = exp(a * x[j] + b)`` for float32 ``x``, ``out [n]``; ``scratch``: int32 ``[>= 2n]``.

    A loop LLVM vectorises, where calling the C library's ``expf`` per element does not
    (about 3x faster here): ``exp(y) = 2**k * exp(r)`` with ``k = round(y / ln 2)``,
    ``|r| <= ln 2 / 2``, ``exp(r)`` by its degree-6 Taylor polynomial (Horner) and ``2**k``
    built as float32 bits. Within 2 ulp of the true value (as NumPy's ``exp``) on
    [-87, 88.3]; below, ``exp(-87)`` (1.6e-38) instead of smaller or 0; from 88.4 (where
    ``k`` reaches 128), ``inf``, a little before float32's own overflow at 88.72.
    NaN stays NaN. ``out`` may be ``x``: the first loop writes only to ``scratch`` (were it
    to write ``out``, LLVM could not rule out a shifted overlap with ``x`` and would run its
    scalar fallback: 6x slower in place, measured).
    """
    a32, b32 = np.float32(a), np.float32(b)
    n = x.shape[0]
    bits = scratch[:n]
    poly = scratch[n:2 * n].view(np.float32)
    for j in range(n):
        y = a32 * x[j] + b32
        if y < np.float32(-87.0):
            y = np.float32(-87.0)
        if y > np.float32(88.75):
            y = np.float32(88.75)  # k = 128: the exponent bits below make inf
        k = np.floor(y * _LOG2E + np.float32(0.5))
        r = y - k * _LN2_HI - k * _LN2_LO
        p = np.float32(1.0 / 720.0)
        p = p * r + np.float32(1.0 / 120.0)
        p = p * r + np.float32(1.0 / 24.0)
        p = p * r + np.float32(1.0 / 6.0)
        p = p * r + np.float32(0.5)
        p = p * r + np.float32(1.0)
        p = p * r + np.float32(1.0)
        bits[j] = (np.int32(k) + np.int32(127)) << 23  # the float32 2**k: biased exponent, zero mantissa
        poly[j] = p
    two_k = bits.view(np.float32)
    for j in range(n):
        out[j] = poly[j] * two_k[j]


@njit(cache=True, parallel=True)
def _fill_range(out):  # pragma: no cover - compiled
    for i in prange(out.shape[0]):
        out[i] = i


def start_thread_pool() -> None:
    """Run one tiny parallel loop so numba loads its threading layer now
    (:mod:`refengine.threads` sets the environment libgomp reads around this call)."""
    _fill_range(np.empty(64, dtype=np.int64))


@njit(cache=True, fastmath=_FMA)
def _matmul_rows_range(x, w, acc, i0, i1):  # pragma: no cover - compiled
    """``acc [T, N] += x[:, i0:i1] @ w[i0:i1]``: one task of :func:`_matmul_rows`.

    Four weight rows at a time are applied to the input rows, four input rows per pass
    (then two, then one) sharing each weight load; each output element is loaded and stored
    once per four products. Every pass adds the same expression, ``(a0 w0 + a1 w1) + (a2 w2
    + a3 w3)``, so a row's result does not depend on which pass it fell in. Four input rows
    per pass against two: 8 rows 0.53 -> 0.42 ms, 32 rows 1.57 -> 1.03 ms per 576 x 3072
    product read from memory, 2 threads.
    """
    rows, n = x.shape[0], w.shape[1]
    i4 = i0 + (i1 - i0) // 4 * 4
    for i in range(i0, i4, 4):
        w0, w1, w2, w3 = w[i], w[i + 1], w[i + 2], w[i + 3]
        t = 0
        while t + 4 <= rows:
            a0, a1, a2, a3 = x[t, i], x[t, i + 1], x[t, i + 2], x[t, i + 3]
            b0, b1, b2, b3 = x[t + 1, i], x[t + 1, i + 1], x[t + 1, i + 2], x[t + 1, i + 3]
            c0, c1, c2, c3 = x[t + 2, i], x[t + 2, i + 1], x[t + 2, i + 2], x[t + 2, i + 3]
            d0, d1, d2, d3 = x[t + 3, i], x[t + 3, i + 1], x[t + 3, i + 2], x[t + 3, i + 3]
            acc_a, acc_b, acc_c, acc_d = acc[t], acc[t + 1], acc[t + 2], acc[t + 3]
            for j in range(n):
                u0, u1, u2, u3 = w0[j], w1[j], w2[j], w3[j]
                acc_a[j] += (a0 * u0 + a1 * u1) + (a2 * u2 + a3 * u3)
                acc_b[j] += (b0 * u0 + b1 * u1) + (b2 * u2 + b3 * u3)
                acc_c[j] += (c0 * u0 + c1 * u1) + (c2 * u2 + c3 * u3)
                acc_d[j] += (d0 * u0 + d1 * u1) + (d2 * u2 + d3 * u3)
            t += 4
        if t + 2 <= rows:
            a0, a1, a2, a3 = x[t, i], x[t, i + 1], x[t, i + 2], x[t, i + 3]
            b0, b1, b2, b3 = x[t + 1, i], x[t + 1, i + 1], x[t + 1, i + 2], x[t + 1, i + 3]
            acc_a, acc_b = acc[t], acc[t + 1]
            for j in range(n):
                u0, u1, u2, u3 = w0[j], w1[j], w2[j], w3[j]
                acc_a[j] += (a0 * u0 + a1 * u1) + (a2 * u2 + a3 * u3)
                acc_b[j] += (b0 * u0 + b1 * u1) + (b2 * u2 + b3 * u3)
            t += 2
        if t < rows:
            a0, a1, a2, a3 = x[t, i], x[t, i + 1], x[t, i + 2], x[t, i + 3]
            acc_a = acc[t]
            for j in range(n):
                u0, u1, u2, u3 = w0[j], w1[j], w2[j], w3[j]
                acc_a[j] += (a0 * u0 + a1 * u1) + (a2 * u2 + a3 * u3)
    for i in range(i4, i1):
        wi = w[i]
        for t in range(rows):
            acc_t = acc[t]
            xi = x[t, i]
            for j in range(n):
                acc_t[j] += xi * wi[j]


@njit(cache=True)
def zeros_f32_3d(a, b, c):  # pragma: no cover - compiled
    """``np.zeros((a, b, c), float32)`` as a plain call, for parallel kernels (see :class:`ParallelKernel`)."""
    return np.zeros((a, b, c), dtype=np.float32)


@njit(cache=True)
def _sum_partials(partial, out):  # pragma: no cover - compiled
    """``out = partial.sum(axis=0)``, summed in order (``partial [C, T, N]``)."""
    out[:] = partial[0]
    for c in range(1, partial.shape[0]):
        out += partial[c]


@parallel_kernel()
def _matmul_rows(x, w, out, chunks):  # pragma: no cover - compiled
    """``out [T, N] = x [T, K] @ w [K, N]`` for few rows, ``w`` C-contiguous float32.

    The weight rows are split into ``chunks`` contiguous ranges, one task each, so every
    task streams its part of the matrix front to back (the hardware prefetcher's best
    case). Each task sums into its own ``[T, N]`` partial (:func:`_matmul_rows_range`);
    the partials are added at the end.
    """
    k_dim = x.shape[1]
    per = -(-k_dim // chunks)
    per += -per % 4  # whole groups of four weight rows per task
    partial = zeros_f32_3d(chunks, x.shape[0], w.shape[1])
    for c in prange(chunks):
        _matmul_rows_range(x, w, partial[c], min(k_dim, c * per), min(k_dim, (c + 1) * per))
    _sum_partials(partial, out)


@njit(cache=True, fastmath=_DOT)
def _matmul_rows_t_block(x, wt, out, j0, j1):  # pragma: no cover - compiled
    """``out[:, j] = x @ wt[j]`` for ``j0 <= j < j1``: one task of :func:`_matmul_rows_t`.

    Output column ``j`` is the dot product of each input row with the contiguous row
    ``wt[j]``, read from memory once; four input rows at a time share each load of it.
    """
    rows, k_dim = x.shape
    rows4 = rows - rows % 4
    for j in range(j0, j1):
        wj = wt[j]
        for t in range(0, rows4, 4):
            x0, x1, x2, x3 = x[t], x[t + 1], x[t + 2], x[t + 3]
            s0 = s1 = s2 = s3 = np.float32(0.0)
            for i in range(k_dim):
                wi = wj[i]
                s0 += x0[i] * wi
                s1 += x1[i] * wi
                s2 += x2[i] * wi
                s3 += x3[i] * wi
            out[t, j], out[t + 1, j], out[t + 2, j], out[t + 3, j] = s0, s1, s2, s3
        for t in range(rows4, rows):
            xt = x[t]
            s = np.float32(0.0)
            for i in range(k_dim):
                s += xt[i] * wj[i]
            out[t, j] = s


@parallel_kernel()
def _matmul_rows_t(x, wt, out, block):  # pragma: no cover - compiled
    """``out [T, N] = x [T, K] @ wt.T`` for ``wt [N, K]`` C-contiguous float32 (the tied lm_head).

    Tasks own ``block`` consecutive rows of ``wt`` (:func:`_matmul_rows_t_block`), so each
    thread streams a contiguous part.
    """
    n = wt.shape[0]
    for blk in prange((n + block - 1) // block):
        _matmul_rows_t_block(x, wt, out, blk * block, min(blk * block + block, n))


@njit(cache=True, fastmath=_DOT)
def _rms_norm(x, weight, eps, out, t0, t1):  # pragma: no cover - compiled
    """``out[t] = x[t] * (1 / sqrt(mean(x[t]**2) + eps)) * weight`` for rows ``t0 .. t1 - 1`` of ``x [T, d]`` float32."""
    d = x.shape[1]
    eps32 = np.float32(eps)
    for t in range(t0, t1):
        xt = x[t]
        ss = np.float32(0.0)
        for i in range(d):
            ss += xt[i] * xt[i]
        inv = np.float32(1.0) / np.sqrt(ss / np.float32(d) + eps32)
        ot = out[t]
        for i in range(d):
            ot[i] = (xt[i] * inv) * weight[i]


@njit(cache=True)
def _rope_inplace(x, positions, cos, sin, t0, t1):  # pragma: no cover - compiled
    """Rotate rows ``t0 .. t1 - 1`` of ``x [T, H, D]`` in place, HF "rotate half" pairing:
    element ``i`` with ``i + D/2``.

    The twin's operations in the twin's order, no FMA: results equal NumPy's bit for bit.
    """
    heads, head_dim = x.shape[1], x.shape[2]
    half = head_dim // 2
    for t in range(t0, t1):
        c = cos[positions[t]]
        s = sin[positions[t]]
        for h in range(heads):
            xh = x[t, h]
            for i in range(half):
                x1 = xh[i]
                x2 = xh[i + half]
                xh[i] = x1 * c[i] - x2 * s[i]
                xh[i + half] = x2 * c[i] + x1 * s[i]


@njit(cache=True)
def _silu_and_mul(x, out, t0, t1):  # pragma: no cover - compiled
    """``out[t, i] = g / (1 + exp(-g)) * x[t, I + i]`` with ``g = x[t, i]``, ``x [T, 2I]`` float32,
    for rows ``t0 .. t1 - 1``."""
    inter = x.shape[1] // 2
    one = np.float32(1.0)
    scratch = np.empty(2 * inter, dtype=np.int32)
    for t in range(t0, t1):
        gate, up, ot = x[t, :inter], x[t, inter:], out[t]
        exp_affine(gate, -1.0, 0.0, ot, scratch)  # exp(-gate), vectorised
        for i in range(inter):
            ot[i] = gate[i] / (one + ot[i]) * up[i]


# The elementwise layers over blocks of ``per`` rows (NumbaOps._over_rows picks the twin and ``per``).
@parallel_kernel()
def _rms_norm_blocks(x, weight, eps, out, per):  # pragma: no cover - compiled
    for c in prange((x.shape[0] + per - 1) // per):
        _rms_norm(x, weight, eps, out, c * per, min(x.shape[0], (c + 1) * per))


@parallel_kernel()
def _rope_blocks(x, positions, cos, sin, per):  # pragma: no cover - compiled
    for c in prange((x.shape[0] + per - 1) // per):
        _rope_inplace(x, positions, cos, sin, c * per, min(x.shape[0], (c + 1) * per))


@parallel_kernel()
def _silu_and_mul_blocks(x, out, per):  # pragma: no cover - compiled
    for c in prange((x.shape[0] + per - 1) // per):
        _silu_and_mul(x, out, c * per, min(x.shape[0], (c + 1) * per))


class NumbaOps:
    """Layer operations compiled by numba (``"numba"``). float32 activations and weights.

    ``linear`` runs :func:`_matmul_rows` (weights ``[in, out]`` C-contiguous) below
    :data:`BLAS_MIN_ROWS` rows, :func:`_matmul_rows_t` (weights given as the transposed
    view of a C-contiguous ``[out, in]`` array, like the tied lm_head ``embed.T``) below
    :data:`BLAS_MIN_ROWS_T` rows, and BLAS (``x @ w``) otherwise or for any other weight
    layout or dtype.
    """

    name = "numba"

    def __init__(self, blas_min_rows: int = BLAS_MIN_ROWS, blas_min_rows_t: int = BLAS_MIN_ROWS_T):
        self.blas_min_rows = blas_min_rows
        self.blas_min_rows_t = blas_min_rows_t

    def device_positions(self, positions: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(positions, dtype=np.int64)

    def linear(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        """``x [T, in] @ w [in, out]`` -> ``[T, out]`` float32 (see the class docstring)."""
        rows = x.shape[0]
        if rows and w.dtype == np.float32:
            if w.flags.c_contiguous and rows < self.blas_min_rows:
                out = np.empty((rows, w.shape[1]), dtype=np.float32)
                _matmul_rows(np.ascontiguousarray(x, dtype=np.float32), w, out, _threads.max_threads())
                return out
            if w.T.flags.c_contiguous and rows < self.blas_min_rows_t:
                out = np.empty((rows, w.shape[1]), dtype=np.float32)
                _matmul_rows_t(np.ascontiguousarray(x, dtype=np.float32), w.T, out, 64)
                return out
        return (x.astype(w.dtype, copy=False) @ w).astype(np.float32, copy=False)

    @staticmethod
    def _over_rows(kernel: ParallelKernel, rows: int, *args) -> None:
        """Run a row-block kernel over ``rows`` rows: in parallel blocks from
        :data:`ELEMENTWISE_PARALLEL_MIN_ROWS` rows when numba has threads, else as one block
        on the calling thread (its serial twin)."""
        threads = get_num_threads()
        if threads > 1 and rows >= ELEMENTWISE_PARALLEL_MIN_ROWS:
            kernel.parallel(*args, -(-rows // (4 * threads)))  # a few blocks per thread: uneven cores finish together
        else:
            kernel.serial(*args, max(rows, 1))

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        """RMSNorm over the last axis of ``x [..., d]`` float32 (any leading shape)."""
        x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
        out = np.empty_like(x2)
        self._over_rows(_rms_norm_blocks, x2.shape[0], x2, np.ascontiguousarray(weight, dtype=np.float32),
                        float(eps), out)
        return out.reshape(x.shape)

    def rope(self, q: np.ndarray, k: np.ndarray, positions: np.ndarray, rope) -> tuple[np.ndarray, np.ndarray]:
        """Rotate ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` in place (views into the fused qkv
        output are fine) with ``rope.cos``/``rope.sin`` ``[max_pos, D/2]`` float32.

        Raises:
            IndexError: a position outside the tables (checked, since the kernel is not).
        """
        if positions.shape[0] and (positions.min() < 0 or positions.max() >= rope.cos.shape[0]):
            raise IndexError(f"positions outside the RoPE tables [0, {rope.cos.shape[0]})")
        for x in (q, k):
            self._over_rows(_rope_blocks, x.shape[0], x, positions, rope.cos, rope.sin)
        return q, k

    def silu_and_mul(self, x: np.ndarray) -> np.ndarray:
        """``silu(x[:, :I]) * x[:, I:]`` -> ``[T, I]`` float32."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty((x.shape[0], x.shape[1] // 2), dtype=np.float32)
        self._over_rows(_silu_and_mul_blocks, x.shape[0], x, out)
        return out


def _dispatchers():
    """Every compiled function of the numba backend (layer ops and attention), twins included."""
    import refengine.attention.numba_cpu as attention

    for module in (sys.modules[__name__], attention):
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


_threads.configure_numba()  # thread count and wait policy before the first kernel runs
