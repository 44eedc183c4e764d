"""Layer operations as CPU kernels compiled by numba: the third sibling of the NumPy twin.

The NumPy versions in :mod:`refengine.layers` (through :class:`refengine.ops.numpy_ops.NumpyOps`)
are the reference; every kernel here is tested against them (``tests/test_cpu_kernels.py``).

Why these kernels exist:

* **The small-row matrix product.** Decode multiplies 1-16 rows by every weight matrix,
  so it is bound by reading the weights from memory. OpenBLAS reads them once at one row
  (GEMV) but its GEMM path costs about 3x that at 2-8 rows, and the tied ``lm_head``
  (``embed.T``, a transposed view) more still. :func:`_matmul_rows` walks the weights
  once, in column blocks (one block per task, in parallel), and applies each weight row
  segment to every input row while it is in L1. Above :data:`BLAS_MIN_ROWS` rows the
  product is compute-bound and OpenBLAS's packed GEMM wins, so ``linear`` hands over to it.
* **RMSNorm, RoPE, SiLU-and-mul.** At one row NumPy spends its time dispatching 4-7
  temporaries-making ufuncs per call; one loop per call is cheaper. They run on one thread:
  at decode sizes a parallel launch costs more than the work.

Numerics (float32 in and out, as the twins):

* ``_matmul_rows`` sums over the inner dimension in order, four products per fused chain
  (``fastmath={"contract"}``: FMA only, no reassociation), so a row's result does not
  depend on how many rows share the call. ``_matmul_rows_t`` (dot products over contiguous
  rows) also allows ``reassoc`` so LLVM can vectorise the reduction.
* RoPE performs the twin's exact operations (no FMA contraction): results are bitwise equal.
* RMSNorm sums squares with ``reassoc`` (vectorised partial sums, like NumPy's pairwise sum).
* SiLU uses the C library's ``expf``; NumPy its own SIMD ``exp`` (both within 1-2 ulp).

``fastmath`` never includes ``nnan``/``ninf``: NaN and inf propagate as in NumPy.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from refengine.layers import silu_and_mul

#: At or above this many rows ``linear`` uses BLAS (compute-bound; OpenBLAS's packed GEMM wins).
#: Measured with ``benchmarks/bench_cpu_kernels.py`` on 2 Zen 4 cores (SmolLM2 shapes).
BLAS_MIN_ROWS = 24
#: Rows above which ``silu_and_mul`` uses NumPy (its SIMD ``exp`` beats a scalar ``expf`` loop).
NUMPY_SILU_MIN_ROWS = 64

_DOT = {"contract", "reassoc"}  # FMA + reassociation of sums (vectorised reductions); never nnan/ninf
_FMA = {"contract"}


@njit(cache=True, parallel=True, fastmath=_FMA)
def _matmul_rows(x, w, out, cols):  # pragma: no cover - compiled
    """``out [T, N] = x [T, K] @ w [K, N]`` for few rows, ``w`` C-contiguous float32.

    Task ``b`` owns output columns ``b*cols : (b+1)*cols`` and reads that slice of every
    weight row once, applying it to all ``T`` rows (the accumulator, ``T x cols`` float32,
    stays in L1).
    """
    rows, k_dim = x.shape
    n = w.shape[1]
    k4 = k_dim - k_dim % 4
    for blk in prange((n + cols - 1) // cols):
        j0 = blk * cols
        width = min(cols, n - j0)
        acc = np.zeros((rows, width), dtype=np.float32)
        for i in range(0, k4, 4):  # four weight rows per pass: one load/store of acc per four FMAs
            w0 = w[i, j0:j0 + width]
            w1 = w[i + 1, j0:j0 + width]
            w2 = w[i + 2, j0:j0 + width]
            w3 = w[i + 3, j0:j0 + width]
            for t in range(rows):
                a = acc[t]
                x0, x1, x2, x3 = x[t, i], x[t, i + 1], x[t, i + 2], x[t, i + 3]
                for j in range(width):
                    a[j] += x0 * w0[j] + x1 * w1[j] + x2 * w2[j] + x3 * w3[j]
        for i in range(k4, k_dim):
            wi = w[i, j0:j0 + width]
            for t in range(rows):
                a = acc[t]
                xi = x[t, i]
                for j in range(width):
                    a[j] += xi * wi[j]
        out[:, j0:j0 + width] = acc


@njit(cache=True, parallel=True, fastmath=_DOT)
def _matmul_rows_t(x, wt, out, block):  # pragma: no cover - compiled
    """``out [T, N] = x [T, K] @ wt.T`` for ``wt [N, K]`` C-contiguous float32 (the tied lm_head).

    Output column ``j`` is the dot product of each input row with the contiguous row
    ``wt[j]``, read from memory once and from L1 for the other rows.
    """
    rows, k_dim = x.shape
    n = wt.shape[0]
    for blk in prange((n + block - 1) // block):
        for j in range(blk * block, min(blk * block + block, n)):
            wj = wt[j]
            for t in range(rows):
                xt = x[t]
                s = np.float32(0.0)
                for i in range(k_dim):
                    s += xt[i] * wj[i]
                out[t, j] = s


@njit(cache=True, fastmath=_DOT)
def _rms_norm(x, weight, eps, out):  # pragma: no cover - compiled
    """``out[t] = x[t] * (1 / sqrt(mean(x[t]**2) + eps)) * weight`` for ``x [T, d]`` float32."""
    rows, d = x.shape
    eps32 = np.float32(eps)
    for t in range(rows):
        xt = x[t]
        ss = np.float32(0.0)
        for i in range(d):
            ss += xt[i] * xt[i]
        inv = np.float32(1.0) / np.sqrt(ss / np.float32(d) + eps32)
        ot = out[t]
        for i in range(d):
            ot[i] = (xt[i] * inv) * weight[i]


@njit(cache=True)
def _rope_inplace(x, positions, cos, sin):  # pragma: no cover - compiled
    """Rotate ``x [T, H, D]`` in place, HF "rotate half" pairing: element ``i`` with ``i + D/2``.

    The twin's operations in the twin's order, no FMA: results equal NumPy's bit for bit.
    """
    tokens, heads, head_dim = x.shape
    half = head_dim // 2
    for t in range(tokens):
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
def _silu_and_mul(x, out):  # pragma: no cover - compiled
    """``out[t, i] = g / (1 + exp(-g)) * x[t, I + i]`` with ``g = x[t, i]``, ``x [T, 2I]`` float32."""
    rows, two_i = x.shape
    inter = two_i // 2
    one = np.float32(1.0)
    for t in range(rows):
        xt = x[t]
        ot = out[t]
        for i in range(inter):
            g = xt[i]
            ot[i] = g / (one + math.exp(-g)) * xt[inter + i]


def column_block(n: int, threads: int, granule: int = 16, max_cols: int = 512) -> int:
    """Columns per task of :func:`_matmul_rows`: the fewest equal tasks, a multiple of
    ``threads``, of at most ``max_cols`` columns (so the accumulator stays in L1), rounded
    up to ``granule`` columns (one AVX-512 vector of float32)."""
    units = -(-n // granule)
    tasks = threads
    while -(-units // tasks) * granule > max_cols:
        tasks += threads
    return -(-units // tasks) * granule


class NumbaOps:
    """Layer operations compiled by numba (``"numba"``). float32 activations and weights.

    ``linear`` runs :func:`_matmul_rows` (weights ``[in, out]`` C-contiguous) or
    :func:`_matmul_rows_t` (weights given as the transposed view of a C-contiguous
    ``[out, in]`` array, like the tied lm_head ``embed.T``) below :data:`BLAS_MIN_ROWS`
    rows, and BLAS (``x @ w``) otherwise or for any other weight layout or dtype.
    """

    name = "numba"

    def __init__(self, blas_min_rows: int = BLAS_MIN_ROWS):
        from numba import get_num_threads

        self.blas_min_rows = blas_min_rows
        self._threads = get_num_threads()
        self._cols: dict[int, int] = {}

    def device_positions(self, positions: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(positions, dtype=np.int64)

    def linear(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        """``x [T, in] @ w [in, out]`` -> ``[T, out]`` float32 (see the class docstring)."""
        rows = x.shape[0]
        if rows >= self.blas_min_rows or rows == 0 or w.dtype != np.float32:
            return (x.astype(w.dtype, copy=False) @ w).astype(np.float32, copy=False)
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty((rows, w.shape[1]), dtype=np.float32)
        if w.flags.c_contiguous:
            n = w.shape[1]
            cols = self._cols.get(n)
            if cols is None:
                cols = self._cols[n] = column_block(n, self._threads)
            _matmul_rows(x, w, out, cols)
        elif w.T.flags.c_contiguous:
            _matmul_rows_t(x, w.T, out, 64)
        else:
            return x @ w
        return out

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        """RMSNorm over the last axis of ``x [..., d]`` float32 (any leading shape)."""
        x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
        out = np.empty_like(x2)
        _rms_norm(x2, np.ascontiguousarray(weight, dtype=np.float32), float(eps), out)
        return out.reshape(x.shape)

    def rope(self, q: np.ndarray, k: np.ndarray, positions: np.ndarray, rope) -> tuple[np.ndarray, np.ndarray]:
        """Rotate ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` in place (views into the fused qkv
        output are fine) with ``rope.cos``/``rope.sin`` ``[max_pos, D/2]`` float32.

        Raises:
            IndexError: a position outside the tables (checked, since the kernel is not).
        """
        if positions.shape[0] and (positions.min() < 0 or positions.max() >= rope.cos.shape[0]):
            raise IndexError(f"positions outside the RoPE tables [0, {rope.cos.shape[0]})")
        _rope_inplace(q, positions, rope.cos, rope.sin)
        _rope_inplace(k, positions, rope.cos, rope.sin)
        return q, k

    def silu_and_mul(self, x: np.ndarray) -> np.ndarray:
        """``silu(x[:, :I]) * x[:, I:]`` -> ``[T, I]`` float32; NumPy above
        :data:`NUMPY_SILU_MIN_ROWS` rows."""
        if x.shape[0] > NUMPY_SILU_MIN_ROWS:
            return silu_and_mul(x)
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty((x.shape[0], x.shape[1] // 2), dtype=np.float32)
        _silu_and_mul(x, out)
        return out
