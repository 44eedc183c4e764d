"""Layer operations as CPU kernels compiled by numba (:class:`NumbaOps`, the CPU default).

The float32 matrix product, RMSNorm, RoPE, SiLU-and-mul and GELU(tanh)-and-mul, on float32
NumPy arrays. The NumPy versions in :mod:`refengine.ops.layers` (through
:class:`refengine.ops.numpy_ops.NumpyOps`) are the reference; every kernel here is tested
against them (``tests/kernels/test_cpu_kernels.py``). Products with quantized weights go to their
format's kernels (:mod:`refengine.quant`). docs/cpu_runtime.md is the guide.

* **The small-row matrix product** :func:`_matmul_dot`: ``x [T, in]`` times weights kept in
  the checkpoint's ``[out, in]`` layout (every output's weights one contiguous row,
  :meth:`NumbaOps.weight`), as dot products in register tiles: four input rows by one
  weight row while memory-bound (one sequential stream), by four weight rows from
  :data:`DOT_4X4_MIN_ROWS` rows (sixteen sums per eight loads). With batch invariance (the
  engine's default) it serves every row count; without, ``linear`` hands products of
  :data:`BLAS_MIN_ROWS` rows or more to BLAS (:mod:`refengine.cpu.blas`), which reads
  the same arrays as transposed views.
* **RMSNorm, RoPE, SiLU-and-mul, GELU-and-mul**: one compiled loop per call (NumPy would
  dispatch several ufuncs, each making a temporary). On the calling thread at decode sizes
  (a parallel launch costs more than the work), over row blocks in parallel from
  :data:`ELEMENTWISE_PARALLEL_MIN_ROWS` rows.

Numerics (float32 in and out, as the twins):

* ``_matmul_dot`` computes every output the same way, whatever the tile, the number of
  rows in the call or the threads: ``LANES`` (16) partial sums, lane ``l`` adding the
  products of columns ``l, l + 16, ...`` in order with FMA (``fastmath={"contract"}``, no
  reassociation); the lanes summed in one fixed tree (:func:`_fold`); then the last
  ``K % 16`` products in order. So a row's logits are the same bits alone or in any batch
  the kernel serves (tested). The lanes are explicit because a reduction LLVM vectorises
  itself (``reassoc``) is summed in an order that depends on the loop around it.
* RoPE performs the twin's exact operations (no FMA contraction): results are bitwise equal.
* RMSNorm sums squares with ``reassoc`` (vectorised partial sums, like NumPy's pairwise sum).
* SiLU uses :func:`exp_affine` (vectorised, within 2 ulp), NumPy its own SIMD ``exp`` (also ~2 ulp).

``fastmath`` never includes ``nnan``/``ninf``: NaN and inf propagate as in NumPy.
"""

from __future__ import annotations

import math
import sys
from functools import partial
from typing import Callable

import numpy as np
from numba import carray, njit, prange

from refengine.cpu import blas, engine_hooks, setup_cpu_runtime
from refengine.cpu.capture import DecodeCapture, Recordable
from refengine.cpu.lora_products import add_lora
from refengine.cpu.numba_support import (ParallelKernel, get_num_threads, parallel_kernel, prefetch,
                                         register_kernels, stack_f32, x_block_rows)
from refengine.quant import StackedWeight, is_quantized, reference_linear


#: From this many rows ``linear`` hands the product to BLAS, and the step gives BLAS the
#: threads (:func:`refengine.cpu.threads.adapt_threads`); never with batch invariance.
#: Below it :func:`_matmul_dot`'s 4 x 4 tile beats OpenBLAS's GEMM, whose packing pays off
#: only on big products; around it the two are level (``refengine bench forward`` re-measures it).
BLAS_MIN_ROWS = 160
#: From this many rows :func:`_matmul_dot` uses the 4 x 4 register tile (compute-bound), below
#: it the 4 x 1 tile (memory-bound: one weight row streamed at a time); ``refengine bench
#: kernels --sections linear`` compares the two.
DOT_4X4_MIN_ROWS = 5

F32 = np.dtype(np.float32)  # compared by identity first: a dtype compared with a scalar type converts it each time

#: From this many rows RMSNorm, RoPE and SiLU-and-mul run over row blocks in parallel; below,
#: on the calling thread (a parallel launch, waking sleeping threads, costs more than a
#: decode step's elementwise work).
ELEMENTWISE_PARALLEL_MIN_ROWS = 32


_DOT = {"contract", "reassoc"}  # FMA + reassociation of sums (vectorised reductions); never nnan/ninf
_FMA = {"contract"}


LOG2E = np.float32(1.4426950408889634)
LN2_HI = np.float32(0.693359375)  # ln 2 split in two so k * LN2_HI is exact (Cody & Waite 1980)
LN2_LO = np.float32(-2.12194440e-4)


@njit(cache=True, fastmath={"contract"})
def exp_affine(x, a, b, out, scratch):  # pragma: no cover - compiled
    """``out[j] = exp(a * x[j] + b)`` for float32 ``x``, ``out [n]``; ``scratch``: int32 ``[>= 2n]``.

    A loop LLVM vectorises, where calling the C library's ``expf`` per element does not
    (several times faster): ``exp(y) = 2**k * exp(r)`` with ``k = round(y / ln 2)``,
    ``|r| <= ln 2 / 2``, ``exp(r)`` by its degree-6 Taylor polynomial (Horner) and ``2**k``
    built as float32 bits. Within 2 ulp of the true value (as NumPy's ``exp``) on
    [-87, 88.3]; below, ``exp(-87)`` (1.6e-38) instead of smaller or 0; from 88.4 (where
    ``k`` reaches 128), ``inf``, a little before float32's own overflow at 88.72.
    NaN stays NaN. ``out`` may be ``x``: the first loop writes only to ``scratch`` (were it
    to write ``out``, LLVM could not rule out a shifted overlap with ``x`` and would run its
    scalar fallback, several times slower in place).
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
        k = np.floor(y * LOG2E + np.float32(0.5))
        r = y - k * LN2_HI - k * LN2_LO
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


#: Lanes of every dot product's partial sums: one AVX-512 register of float32 (two AVX2 ones).
LANES = 16
_U = np.uintp  # unsigned indices: numba adds no negative-index wraparound, so loads stay vector loads


@njit(fastmath=_FMA, inline="always")
def _lanes():  # pragma: no cover - compiled
    return carray(stack_f32(LANES), (LANES,))


# _fold and _dot_tail are plain cached functions, not numba-inlined (``inline="always"``
# re-runs numba's passes on the callee at each of their twenty call sites): compiled once,
# and LLVM inlines them all the same (no call left in the tiles' code), flags and bits unchanged.
# _lanes must stay numba-inlined: its stack array belongs to the caller's frame.


@njit(cache=True, fastmath=_FMA)
def _fold(acc):  # pragma: no cover - compiled
    """The sum of the ``LANES`` partial sums in a fixed tree: halves added lane-wise (16 -> 8 -> 4 -> 2 -> 1)."""
    for lane in range(_U(8)):
        acc[lane] += acc[lane + _U(8)]
    for lane in range(_U(4)):
        acc[lane] += acc[lane + _U(4)]
    for lane in range(_U(2)):
        acc[lane] += acc[lane + _U(2)]
    return acc[0] + acc[1]


@njit(cache=True, fastmath=_FMA)
def _dot_tail(x, wt, t, j, k_lanes, s):  # pragma: no cover - compiled
    """``s`` plus ``x[t, i] * wt[j, i]`` for the last ``K % LANES`` columns, in order."""
    for i in range(k_lanes, _U(x.shape[1])):
        s += x[t, i] * wt[j, i]
    return s


@njit(fastmath=_FMA, inline="always")
def _store_4(x, wt, out, t, j, k_lanes, acc0, acc1, acc2, acc3):  # pragma: no cover - compiled
    """``out[t, j + c]`` for ``c < 4`` from their partial sums (a repeated row of a last
    group writes the same values again)."""
    out[t, j] = _dot_tail(x, wt, t, j, k_lanes, _fold(acc0))
    out[t, j + _U(1)] = _dot_tail(x, wt, t, j + _U(1), k_lanes, _fold(acc1))
    out[t, j + _U(2)] = _dot_tail(x, wt, t, j + _U(2), k_lanes, _fold(acc2))
    out[t, j + _U(3)] = _dot_tail(x, wt, t, j + _U(3), k_lanes, _fold(acc3))


@njit(cache=True, fastmath=_FMA)
def _dot_rows_4x1(x, wt, out, j0, j1):  # pragma: no cover - compiled
    """``out[:, j] = x @ wt[j]`` for ``j0 <= j < j1``, one weight row at a time (one task of
    :func:`_matmul_dot` when rows are few and the weights stream from memory).

    Four input rows (the last group repeats its last row) share each load of ``wt[j]``;
    one weight row at a time is one sequential stream, what the hardware prefetcher follows best.
    """
    rows, k_dim = x.shape
    k_lanes, last = _U(k_dim // LANES * LANES), _U(rows - 1)
    a, b, c, d = _lanes(), _lanes(), _lanes(), _lanes()
    for j in range(_U(j0), _U(j1)):
        for t0 in range(_U(0), _U(rows), _U(4)):
            t1, t2, t3 = min(t0 + _U(1), last), min(t0 + _U(2), last), min(t0 + _U(3), last)
            for lane in range(_U(LANES)):
                a[lane] = b[lane] = c[lane] = d[lane] = 0.0
            for i in range(_U(0), k_lanes, _U(LANES)):
                for lane in range(_U(LANES)):
                    col = i + lane
                    w = wt[j, col]
                    a[lane] += x[t0, col] * w
                    b[lane] += x[t1, col] * w
                    c[lane] += x[t2, col] * w
                    d[lane] += x[t3, col] * w
            out[t3, j] = _dot_tail(x, wt, t3, j, k_lanes, _fold(d))
            out[t2, j] = _dot_tail(x, wt, t2, j, k_lanes, _fold(c))
            out[t1, j] = _dot_tail(x, wt, t1, j, k_lanes, _fold(b))
            out[t0, j] = _dot_tail(x, wt, t0, j, k_lanes, _fold(a))


@njit(cache=True, fastmath=_FMA)
def _dot_rows_4x4(x, wt, out, j0, j1):  # pragma: no cover - compiled
    """``out[:, j] = x @ wt[j]`` for ``j0 <= j < j1`` in tiles of four input rows by four
    weight rows (one task of :func:`_matmul_dot` when rows are many enough to be compute-bound).

    Sixteen dot products share eight vector loads per step, their partial sums in 16 vector
    registers: the register tile of a GEMM micro-kernel (Goto & van de Geijn 2008), with the
    weight rows used in place, each contiguous (AVX-512 has the 32 registers this needs;
    with AVX2's 16 the tile spills: the same results, slower). Every pass over a tile prefetches the
    next tile's weight rows: four interleaved streams are more than the hardware prefetcher
    follows on its own (4-8 rows run faster with the hint than without), and a hint in every
    pass keeps memory busy while the later passes compute (faster than hints in the first
    pass only, or a tile two ahead; ``refengine bench kernels --sections linear``).
    A last ``(j1 - j0) % 4`` weight rows go through :func:`_dot_rows_4x1`.

    The input rows are taken in blocks of about
    :data:`~refengine.cpu.numba_support.X_BLOCK_BYTES` (a multiple of four
    rows), each block over all the task's weight rows before the next: a long prefill chunk
    is megabytes, and streaming all of it from the outer caches for every four weight rows
    made the tile wait on memory. A block stays in L1 while four weight rows pass it, the
    task's weight rows in L2.
    Blocking changes which outputs are computed together, never how one is summed.
    """
    rows, k_dim = x.shape
    k_lanes = _U(k_dim // LANES * LANES)
    j4 = _U(j0) + _U(j1 - j0) // _U(4) * _U(4)
    x_block = x_block_rows(k_dim, 4)
    a0, a1, a2, a3 = _lanes(), _lanes(), _lanes(), _lanes()
    b0, b1, b2, b3 = _lanes(), _lanes(), _lanes(), _lanes()
    c0, c1, c2, c3 = _lanes(), _lanes(), _lanes(), _lanes()
    d0, d1, d2, d3 = _lanes(), _lanes(), _lanes(), _lanes()
    for r0 in range(_U(0), _U(rows), x_block):
        last = min(r0 + x_block, _U(rows)) - _U(1)
        for j in range(_U(j0), j4, _U(4)):
            for t0 in range(r0, last + _U(1), _U(4)):
                t1, t2, t3 = min(t0 + _U(1), last), min(t0 + _U(2), last), min(t0 + _U(3), last)
                for lane in range(_U(LANES)):
                    a0[lane] = a1[lane] = a2[lane] = a3[lane] = 0.0
                    b0[lane] = b1[lane] = b2[lane] = b3[lane] = 0.0
                    c0[lane] = c1[lane] = c2[lane] = c3[lane] = 0.0
                    d0[lane] = d1[lane] = d2[lane] = d3[lane] = 0.0
                for i in range(_U(0), k_lanes, _U(LANES)):
                    for r in range(_U(4), _U(8)):
                        prefetch(wt, (j + r) * _U(k_dim) + i)
                    for lane in range(_U(LANES)):
                        col = i + lane
                        xa, xb, xc, xd = x[t0, col], x[t1, col], x[t2, col], x[t3, col]
                        w0, w1, w2, w3 = wt[j, col], wt[j + _U(1), col], wt[j + _U(2), col], wt[j + _U(3), col]
                        a0[lane] += xa * w0
                        a1[lane] += xa * w1
                        a2[lane] += xa * w2
                        a3[lane] += xa * w3
                        b0[lane] += xb * w0
                        b1[lane] += xb * w1
                        b2[lane] += xb * w2
                        b3[lane] += xb * w3
                        c0[lane] += xc * w0
                        c1[lane] += xc * w1
                        c2[lane] += xc * w2
                        c3[lane] += xc * w3
                        d0[lane] += xd * w0
                        d1[lane] += xd * w1
                        d2[lane] += xd * w2
                        d3[lane] += xd * w3
                _store_4(x, wt, out, t3, j, k_lanes, d0, d1, d2, d3)
                _store_4(x, wt, out, t2, j, k_lanes, c0, c1, c2, c3)
                _store_4(x, wt, out, t1, j, k_lanes, b0, b1, b2, b3)
                _store_4(x, wt, out, t0, j, k_lanes, a0, a1, a2, a3)
    if j4 < _U(j1):
        _dot_rows_4x1(x, wt, out, np.int64(j4), j1)  # int64 as _matmul_dot passes it: one compiled version


@parallel_kernel()
def _matmul_dot(x, wt, out, block, tile4x4):  # pragma: no cover - compiled
    """``out [T, N] = x [T, K] @ wt.T`` for ``wt [N, K]`` C-contiguous float32 (the checkpoint's
    ``[out, in]`` layout), few rows.

    Tasks own ``block`` consecutive weight rows, so each thread streams a contiguous part
    and every output is summed whole by one task. ``tile4x4`` picks the register tile
    (:func:`_dot_rows_4x4` when compute-bound, else :func:`_dot_rows_4x1`); both compute
    every output with the same operations (see the module docstring).
    """
    n = wt.shape[0]
    for blk in prange((n + block - 1) // block):
        j0, j1 = blk * block, min(blk * block + block, n)
        if tile4x4:
            _dot_rows_4x4(x, wt, out, j0, j1)
        else:
            _dot_rows_4x1(x, wt, out, j0, j1)


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


@njit(cache=True)
def _gelu_tanh_and_mul(x, out, t0, t1):  # pragma: no cover - compiled
    """``out[t, i] = 0.5 g (1 + tanh(c (g + 0.044715 g^3))) * x[t, I + i]`` with ``g = x[t, i]``,
    ``c = sqrt(2 / pi)``, ``x [T, 2I]`` float32, for rows ``t0 .. t1 - 1`` (the twin's order)."""
    inter = x.shape[1] // 2
    c = np.float32(math.sqrt(2.0 / math.pi))
    a, half, one = np.float32(0.044715), np.float32(0.5), np.float32(1.0)
    for t in range(t0, t1):
        for i in range(inter):
            g = x[t, i]
            ot = half * g * (one + np.float32(math.tanh(c * (g + a * g * g * g))))
            out[t, i] = ot * x[t, inter + i]


# The elementwise layers over blocks of ``per`` rows (NumbaOps._over_rows picks the twin and ``per``).
@parallel_kernel()
def rms_norm_blocks(x, weight, eps, out, per):  # pragma: no cover - compiled
    for c in prange((x.shape[0] + per - 1) // per):
        _rms_norm(x, weight, eps, out, c * per, min(x.shape[0], (c + 1) * per))


@njit(cache=True)
def _in_range(positions, n):  # pragma: no cover - compiled
    """Whether every ``positions[i]`` (int, ``[T]``) is in ``[0, n)``: one compiled call
    where ``min()`` and ``max()`` were two NumPy reductions per layer."""
    for i in range(positions.shape[0]):
        if positions[i] < 0 or positions[i] >= n:
            return False
    return True


@parallel_kernel()
def rope_blocks(x, positions, cos, sin, per):  # pragma: no cover - compiled
    for c in prange((x.shape[0] + per - 1) // per):
        _rope_inplace(x, positions, cos, sin, c * per, min(x.shape[0], (c + 1) * per))


@parallel_kernel()
def silu_and_mul_blocks(x, out, per):  # pragma: no cover - compiled
    for c in prange((x.shape[0] + per - 1) // per):
        _silu_and_mul(x, out, c * per, min(x.shape[0], (c + 1) * per))


@parallel_kernel()
def gelu_tanh_and_mul_blocks(x, out, per):  # pragma: no cover - compiled
    for c in prange((x.shape[0] + per - 1) // per):
        _gelu_tanh_and_mul(x, out, c * per, min(x.shape[0], (c + 1) * per))


def _dot_block(n: int, threads: int) -> int:
    """Weight rows per task of :func:`_matmul_dot` for ``n`` outputs on ``threads`` threads:
    a multiple of four, about four tasks per thread."""
    return max(4, -(-n // (16 * threads)) * 4)


def matmul_dot(x: np.ndarray, w: np.ndarray, tile4x4: bool | None = None) -> np.ndarray:
    """``x [T, in] @ w`` -> ``[T, out]`` float32 by :func:`_matmul_dot`, for ``w`` the
    ``[in, out]``-shaped transposed view of C-contiguous float32 ``[out, in]`` rows
    (:meth:`NumbaOps.weight`). ``tile4x4``: the register tile, by default the 4 x 4 one from
    :data:`DOT_4X4_MIN_ROWS` rows. Tasks of a multiple of four weight rows, four per thread
    (a core slowed by another process does not hold the others up for long). ``x`` is cast
    to C-contiguous float32; ``w`` is not checked (:meth:`NumbaOps.linear` sends only such
    weights here; any other layout would be read out of bounds)."""
    rows, n = x.shape[0], w.shape[1]
    out = np.empty((rows, n), dtype=np.float32)
    block = _dot_block(n, get_num_threads())
    wide = rows >= DOT_4X4_MIN_ROWS if tile4x4 is None else tile4x4
    _matmul_dot(np.ascontiguousarray(x, dtype=np.float32), w.T, out, block, wide)
    return out


def _into(out: np.ndarray, product: Callable, *args) -> None:
    """``out[...] = product(*args)``: a bound product whose kernel allocates its own output."""
    np.copyto(out, product(*args))


def _blas_product(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x @ w`` by :func:`refengine.cpu.blas.matmul` in ``w``'s dtype -> float32."""
    return blas.matmul(x.astype(w.dtype, copy=False), w).astype(np.float32, copy=False)


def _check_positions(positions: np.ndarray, n: int) -> None:
    """Raise IndexError unless every position is inside RoPE tables of ``n`` rows (the kernel does not check)."""
    if not _in_range(positions, n):
        raise IndexError(f"positions outside the RoPE tables [0, {n})")


def _take_rows(table: np.ndarray, ids: np.ndarray, out: np.ndarray) -> None:
    np.take(table, ids, axis=0, out=out)


def _select_rows(table, ids: np.ndarray, out: np.ndarray) -> None:
    np.copyto(out, table.select_rows(ids))


class NumbaOps(Recordable):
    """Layer operations compiled by numba (``"numba"``). float32 activations and weights.

    Weights are kept in the checkpoint's ``[out, in]`` layout (:meth:`weight`): each output's
    weights are one contiguous row, the layout a dot-product kernel streams. ``linear`` runs
    :func:`_matmul_dot` below :data:`BLAS_MIN_ROWS` rows and BLAS (``x @ w``, which reads
    the transposed view as fast) from there, or for any other weight layout or dtype, by
    :func:`refengine.cpu.blas.matmul` (row blocks over refengine's own threads, the BLAS
    library on one thread: ``spreads_blas``).

    ``batch_invariant=True``: every float32 product runs :func:`_matmul_dot` whatever the
    rows, and quantized weights their dot kernels (``numba_linear(x, batch_invariant=True)``),
    so each output is summed in one fixed order and a row's results are the same bits in any
    batch, chunk or thread count. BLAS sums in an order that depends on the number of rows
    (its blocking and kernels change with them).

    ``activation_dtype="q8_0"``: products with GGUF Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 weights round
    their input to ggml's Q8_0 blocks, with Q4_K/Q5_K/Q6_K weights to its Q8_K blocks, and
    multiply in integers at every row count (:mod:`refengine.cpu.q8_products`;
    batch-invariant too); other weights as above.

    Every kernel runs through :meth:`Recordable._launch`, so a forward can be recorded and
    replayed (:mod:`refengine.cpu.capture`).
    """

    name = "numba"
    #: Large products are split over refengine's threads (:mod:`refengine.cpu.blas`): the
    #: engine keeps the BLAS library's own pool on one thread (``configure_threads(library_blas=False)``).
    spreads_blas = True
    #: From this many rows the elementwise layers run their parallel kernels (the warm-up compiles them).
    elementwise_parallel_min_rows = ELEMENTWISE_PARALLEL_MIN_ROWS

    def __init__(self, blas_min_rows: int = BLAS_MIN_ROWS, *, batch_invariant: bool = False,
                 activation_dtype: str = "auto"):
        if activation_dtype not in ("auto", "q8_0"):
            raise ValueError(f"activation_dtype={activation_dtype!r} is not one of 'auto', 'q8_0'")
        self.batch_invariant = bool(batch_invariant)
        self.activation_dtype = activation_dtype
        # invariant: the dot kernels at every row count (BLAS's reduction order depends on the rows)
        self.blas_min_rows = sys.maxsize if self.batch_invariant else blas_min_rows

    def device_positions(self, positions: np.ndarray) -> np.ndarray:
        return self._contiguous(positions, np.int64)

    def embedding(self, table, input_ids: np.ndarray) -> np.ndarray:
        """Rows ``input_ids [T]`` of ``table [V, hidden]`` (float32, or a quantized weight's
        dequantized rows) -> ``[T, hidden]`` float32.

        Raises:
            IndexError: an id outside ``[0, V)``.
        """
        ids = self._contiguous(input_ids, np.int64)
        out = np.empty((ids.shape[0], table.shape[1]), dtype=np.float32)
        self._launch(_select_rows if is_quantized(table) else _take_rows, table, ids, out)
        return out

    def setup_runtime(self) -> None:
        """:func:`refengine.cpu.setup_cpu_runtime` (:meth:`refengine.ops.LayerOps.setup_runtime`)."""
        setup_cpu_runtime()

    def prepare_model(self, model, config, *, draft: bool = False) -> None:
        """Thread pools, Q8_0 interleaving, the BLAS prefill switch
        (:func:`refengine.cpu.engine_hooks.prepare_model`; :meth:`refengine.ops.LayerOps.prepare_model`)."""
        engine_hooks.prepare_model(model, config.num_threads, draft=draft)

    def begin_step(self, model, num_rows: int, longest_chunk: int) -> None:
        """This step's thread pools (:func:`refengine.cpu.engine_hooks.begin_step`;
        :meth:`refengine.ops.LayerOps.begin_step`)."""
        engine_hooks.begin_step(model, num_rows, longest_chunk)

    def warm_up(self, model, kv_cache, max_rows: int, max_model_len: int) -> None:
        """Every kernel variant compiled or loaded now (:func:`refengine.cpu.engine_hooks.warm_up`;
        :meth:`refengine.ops.LayerOps.warm_up`)."""
        engine_hooks.warm_up(model, kv_cache, max_rows, max_model_len)

    def weight(self, matrix: np.ndarray) -> np.ndarray:
        """``matrix [out, in]`` -> ``[in, out]``-shaped: the transposed view of its C-contiguous rows."""
        return np.ascontiguousarray(matrix).T

    def linear(self, x: np.ndarray, w) -> np.ndarray:
        """``x [T, in] @ w [in, out]`` -> ``[T, out]`` float32 by the product :meth:`bind_linear`
        picks (see the class docstring); ``w`` may be a :class:`refengine.quant.QuantizedWeight`
        (``[out, in]``), whose format's compiled product dequantizes it on the fly."""
        x = self._contiguous(x)
        out = np.empty((x.shape[0], w.shape[0] if is_quantized(w) else w.shape[1]), dtype=np.float32)
        self._launch(self.bind_linear(x, w, out))
        return out

    def _product(self, x: np.ndarray, w) -> np.ndarray:
        """:meth:`linear` run at once, never recorded (the parts of a stacked weight, inside a recorded call)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty((x.shape[0], w.shape[0] if is_quantized(w) else w.shape[1]), dtype=np.float32)
        self.bind_linear(x, w, out)()
        return out

    def quantized_linear(self, x: np.ndarray, w) -> np.ndarray:
        """``x [T, in]`` C-contiguous float32 times a quantized ``w [out, in]`` -> ``[T, out]``
        float32: the format's numba kernel, else (a format without one) the NumPy twin; a
        :class:`StackedWeight` part by part (float parts are ``[out, in]`` rows, read through
        their transposed view)."""
        if isinstance(w, StackedWeight):
            return np.concatenate([self._product(x, p if is_quantized(p) else np.ascontiguousarray(p, dtype=np.float32).T)
                                   for p in w.parts], axis=1)
        kernel = getattr(w, "numba_linear", None)
        if kernel is None:
            return reference_linear(x, w)
        if self.activation_dtype != "auto" and self.activation_dtype in getattr(w, "activation_dtypes", ()):
            return kernel(x, batch_invariant=self.batch_invariant, activation_dtype=self.activation_dtype)
        return kernel(x, batch_invariant=self.batch_invariant)

    def bind_linear(self, x: np.ndarray, w, out: np.ndarray) -> Callable[[], object]:
        """``out[...] = x @ w`` as a call of no arguments with the buffers ``x [T, in]`` and
        ``out [T, out]`` (C-contiguous float32) bound, for the numba threads of now. The
        product: a GGUF weight's one-row product with Q8_0 activations
        (:meth:`refengine.cpu.q8_products.RowProduct.bind`); the float32 dot kernel below
        :attr:`blas_min_rows` rows; a quantized weight's own kernel (:meth:`quantized_linear`);
        else BLAS.

        Raises:
            ValueError: ``x`` or ``out`` not C-contiguous float32 of those shapes.
        """
        rows = x.shape[0]
        n_in, n_out = (w.shape[1], w.shape[0]) if is_quantized(w) else w.shape  # float weights are [in, out]
        if (x.ndim != 2 or x.shape[1] != n_in or out.shape != (rows, n_out)
                or x.dtype is not F32 or out.dtype is not F32
                or not (x.flags.c_contiguous and out.flags.c_contiguous)):
            raise ValueError(f"bind_linear takes C-contiguous float32 x [T, {n_in}] and out [T, {n_out}], "
                             f"got x {x.dtype} {x.shape} and out {out.dtype} {out.shape} for a weight {w.shape}")
        threads = get_num_threads()
        if is_quantized(w):
            if self.activation_dtype == "q8_0" and rows == 1 and hasattr(w, "row_product"):
                run = w.row_product(threads)
                if run is not None:
                    return run.bind(x, out)
            return partial(_into, out, self.quantized_linear, x, w)
        if 0 < rows < self.blas_min_rows and w.dtype == np.float32 and w.T.flags.c_contiguous:
            return partial(_matmul_dot.for_threads(threads), x, w.T, out, _dot_block(n_out, threads),
                           rows >= DOT_4X4_MIN_ROWS)
        return partial(_into, out, _blas_product, x, w)

    def add_lora(self, y: np.ndarray, x: np.ndarray, rows: np.ndarray, a: np.ndarray, b: np.ndarray,
                 scale: np.ndarray) -> None:
        """One LoRA adapter's product added to its rows of ``y`` by the kernel of
        :mod:`refengine.cpu.lora_products` (batch-invariant: one fixed order per row)."""
        self._launch(add_lora, y, self._contiguous(x), rows, a, b, scale)

    def _over_rows(self, kernel: ParallelKernel, rows: int, *args) -> None:
        """Launch a row-block kernel over ``rows`` rows: in parallel blocks from
        :data:`ELEMENTWISE_PARALLEL_MIN_ROWS` rows when numba has threads, else as one block
        on the calling thread (its serial twin)."""
        threads = get_num_threads() if rows >= ELEMENTWISE_PARALLEL_MIN_ROWS else 1
        if threads > 1:
            self._launch(kernel.parallel, *args, -(-rows // (4 * threads)))  # a few blocks per thread
        else:
            self._launch(kernel.serial, *args, max(rows, 1))

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        """RMSNorm over the last axis of ``x [..., d]`` float32 (any leading shape)."""
        x2 = self._contiguous(x).reshape(-1, x.shape[-1])
        out = np.empty_like(x2)
        self._over_rows(rms_norm_blocks, x2.shape[0], x2, np.ascontiguousarray(weight, dtype=np.float32),
                        float(eps), out)
        return out.reshape(x.shape)

    def rope(self, q: np.ndarray, k: np.ndarray, positions: np.ndarray, rope) -> tuple[np.ndarray, np.ndarray]:
        """Rotate ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` in place (views into the fused qkv
        output are fine) with ``rope.cos``/``rope.sin`` ``[max_pos, D/2]`` float32.

        Raises:
            IndexError: a position outside the tables (checked, since the kernel is not).
        """
        self._launch(_check_positions, positions, rope.cos.shape[0])
        for x in (q, k):
            self._over_rows(rope_blocks, x.shape[0], x, positions, rope.cos, rope.sin)
        return q, k

    def silu_and_mul(self, x: np.ndarray) -> np.ndarray:
        """``silu(x[:, :I]) * x[:, I:]`` -> ``[T, I]`` float32."""
        x = self._contiguous(x)
        out = np.empty((x.shape[0], x.shape[1] // 2), dtype=np.float32)
        self._over_rows(silu_and_mul_blocks, x.shape[0], x, out)
        return out

    def gelu_tanh_and_mul(self, x: np.ndarray) -> np.ndarray:
        """``gelu_tanh(x[:, :I]) * x[:, I:]`` -> ``[T, I]`` float32."""
        x = self._contiguous(x)
        out = np.empty((x.shape[0], x.shape[1] // 2), dtype=np.float32)
        self._over_rows(gelu_tanh_and_mul_blocks, x.shape[0], x, out)
        return out

    def capture_decode(self, model, kv_cache, max_model_len: int | None = None):
        """A :class:`refengine.cpu.capture.DecodeCapture` of ``model``'s batch-1 decode steps,
        or None where they must run the forward (:meth:`refengine.ops.LayerOps.capture_decode`)."""
        return DecodeCapture.for_model(model, kv_cache, max_model_len)


register_kernels(sys.modules[__name__])
