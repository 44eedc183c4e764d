"""Products ``x [T, in] @ w.T`` with int8 and 4-bit group weights, compiled by numba.

``w [out, in]`` in the formats of :mod:`refengine.quant.int8` (per-output-channel int8) and
:mod:`refengine.quant.int4` (4-bit groups: AWQ, GPTQ), dequantized on the fly; ``x``
float32 ``[T, in]``, the result float32 ``[T, out]``. Entry points: :func:`int8_linear`,
:func:`int4_linear`.

Two paths, picked by the number of rows ``T``:

* **Few rows (decode), the dot kernels** :func:`_int8_rows` and :func:`_int4_rows` (every
  row count with ``batch_invariant=True``): at a few rows the product is bound by reading
  the weights from memory, and int8 / int4 read a quarter / an eighth of float32's bytes.
  One weight row is streamed at a time, 32 columns a step: the stored integers are widened
  and converted to float32 in registers (``vpmovsxbd``/``vpmovzxbd`` + ``vcvtdq2ps``) and
  multiplied into :data:`LANES32` float32 partial sums per input row with FMA. Pairs of
  input rows share each converted weight vector; an odd last row runs alone, with the same
  operations; int8 from :data:`INT8_TILE_MIN_ROWS` rows in tiles of four input rows by two
  weight rows (:func:`_int8_rows_4x2`). int8 applies its scale once per output
  (``out = scale[o] * sum x * q``); int4 forms each weight exactly as
  :meth:`refengine.quant.int4.Int4Weight.dequantize` does (``float32(q - z) * s``, one
  rounding) and then accumulates, so both of its paths multiply by the same float32
  weights. Tasks own blocks of weight rows (a multiple of four, about 16 per thread), as
  :func:`refengine.cpu.layer_ops._matmul_dot`.
* **Many rows (prefill), dequantized tiles on BLAS** (``batch_invariant=False`` only): from
  :data:`INT8_BLAS_MIN_ROWS` / :data:`INT4_BLAS_MIN_ROWS` rows, tiles of :data:`TILE_BYTES`
  of weight rows are dequantized to float32 and multiplied by ``x @ tile.T``. int8: each of
  refengine's BLAS threads dequantizes and multiplies its own tiles (:func:`int8_linear`);
  int4: tiles dequantized in parallel, then :func:`refengine.cpu.blas.matmul`.

Numerics: the dot kernels sum every output in one fixed order whatever the number of rows
or the threads (lanes of columns, folded in a fixed tree, then the tail, as
``_matmul_dot``), so a row's result does not depend on its batch; the tile path is
``x @ w'.T`` up to BLAS's float32 rounding. ``fastmath`` is ``{"contract"}`` only: FMA, no
reassociation, NaN and inf propagate.
"""

from __future__ import annotations

import sys

import numpy as np
from numba import carray, njit, prange

from refengine.cpu import blas
from refengine.cpu.layer_ops import LANES
from refengine.cpu.numba_support import get_num_threads, parallel_kernel, register_kernels, stack_f32, x_block_rows
from refengine.cpu.simd import f8_add, f8_load, f8_sum

_U = np.uintp  # unsigned indices: numba adds no negative-index wraparound, so loads stay vector loads
_FMA = {"contract"}

#: From this many rows an int8 product dequantizes tiles and runs BLAS (with
#: ``batch_invariant=False``); below it, the dot kernel (where the two are level:
#: docs/PERFORMANCE.md, "Design notes").
INT8_BLAS_MIN_ROWS = 1024
#: The same switch for int4, whose dot kernel spends more instructions per weight (nibble
#: masks, the zero point, one more multiply), so the tile path wins sooner.
INT4_BLAS_MIN_ROWS = 32
#: From this many rows the int8 dot kernel works in 4 x 2 tiles (:func:`_int8_rows_4x2`),
#: below it in pairs of rows (the tile computes eight outputs at once, wasted at few rows).
INT8_TILE_MIN_ROWS = 12
#: Bytes of float32 weight rows :func:`_int8_rows_4x2` converts at a time and keeps in L2
#: while the input rows pass over them (with an input block, well inside an L2 of 256 KB).
W_BLOCK_BYTES = 64 * 1024
#: Bytes of float32 weights per dequantized tile on the BLAS path: about 900 rows of 576
#: columns, wide enough for BLAS's GEMM and still in L3 between its dequantization and its product.
TILE_BYTES = 2 * 2**20


def _block_rows(n: int) -> int:
    """Weight rows per task: a multiple of four, about 16 tasks per thread."""
    return max(4, -(-n // (16 * get_num_threads())) * 4)


# --- the accumulators ---------------------------------------------------------------------
#: Partial sums per input row: four AVX2 registers of float32 (two AVX-512 ones). At one
#: row (decode) that is four independent FMA chains, enough to hide the FMA latency
#: while the weights stream; two input rows share each converted weight vector (eight
#: registers of sums), a third row takes a one-row pass: the same operations for each row
#: either way, so results do not depend on the batch.
LANES32 = 32


@njit(fastmath=_FMA, inline="always")
def _lanes32():  # pragma: no cover - compiled
    return carray(stack_f32(LANES32), (LANES32,))


@njit(fastmath=_FMA, inline="always")
def _zero32(acc):  # pragma: no cover - compiled
    for lane in range(_U(LANES32)):
        acc[lane] = 0.0


@njit(fastmath=_FMA, inline="always")
def _fold32(acc):  # pragma: no cover - compiled
    """The sum of the 32 partial sums in a fixed tree: the halves added lane-wise, then the
    tree of :func:`~refengine.cpu.layer_ops._fold`, in vector registers (:func:`f8_sum` sums
    eight lanes in that tree): LLVM compiled the loops over the stack array into ~30 scalar
    adds and extracts per output."""
    lo = f8_add(f8_load(acc, _U(0)), f8_load(acc, _U(16)))
    hi = f8_add(f8_load(acc, _U(8)), f8_load(acc, _U(24)))
    return f8_sum(f8_add(lo, hi))


# --- int8 -------------------------------------------------------------------------------

@njit(fastmath=_FMA, inline="always")
def _int8_tail(x, q, t, j, k32, s):  # pragma: no cover - compiled
    """``s`` plus ``x[t, i] * q[j, i]`` for the last ``K % 32`` columns, in order."""
    for i in range(k32, _U(x.shape[1])):
        s += x[t, i] * np.float32(q[j, i])
    return s


@njit(cache=True, fastmath=_FMA)
def _int8_rows(x, q, scales, out, j0, j1):  # pragma: no cover - compiled
    """``out[:, j] = scales[j] * (x @ q[j])`` for ``j0 <= j < j1``; ``x [T, K]`` float32,
    ``q [N, K]`` int8, ``scales [N]`` float32, all C-contiguous.

    One int8 weight row streamed at a time, 32 columns a step, widened and converted to
    float32 in registers, multiplied into 32 lanes of sums per input row (pairs of rows
    share the converted weights; an odd last row runs alone); the scale once at the end.
    From :data:`INT8_TILE_MIN_ROWS` rows, :func:`_int8_rows_4x2` instead (the same sums).
    """
    rows, k_dim = x.shape
    if rows >= INT8_TILE_MIN_ROWS:
        _int8_rows_4x2(x, q, scales, out, j0, j1)
        return
    k32, pairs = _U(k_dim // LANES32 * LANES32), _U(rows // 2 * 2)
    a, b = _lanes32(), _lanes32()
    for j in range(_U(j0), _U(j1)):
        s = scales[j]
        for t0 in range(_U(0), pairs, _U(2)):
            t1 = t0 + _U(1)
            _zero32(a)
            _zero32(b)
            for i in range(_U(0), k32, _U(LANES32)):
                for lane in range(_U(LANES32)):
                    col = i + lane
                    w = np.float32(q[j, col])
                    a[lane] += x[t0, col] * w
                    b[lane] += x[t1, col] * w
            out[t1, j] = _int8_tail(x, q, t1, j, k32, _fold32(b)) * s
            out[t0, j] = _int8_tail(x, q, t0, j, k32, _fold32(a)) * s
        if pairs < _U(rows):
            t0 = pairs
            _zero32(a)
            for i in range(_U(0), k32, _U(LANES32)):
                for lane in range(_U(LANES32)):
                    col = i + lane
                    a[lane] += x[t0, col] * np.float32(q[j, col])
            out[t0, j] = _int8_tail(x, q, t0, j, k32, _fold32(a)) * s


@njit(fastmath=_FMA, inline="always")
def _int8_store(x, q, out, t, j, k32, acc, s):  # pragma: no cover - compiled
    """``out[t, j]`` from its 32 partial sums: folded, the tail, the scale (as :func:`_int8_rows`)."""
    out[t, j] = _int8_tail(x, q, t, j, k32, _fold32(acc)) * s


@njit(cache=True, fastmath=_FMA)
def _int8_rows_4x2(x, q, scales, out, j0, j1):  # pragma: no cover - compiled
    """:func:`_int8_rows` for ``x`` of :data:`INT8_TILE_MIN_ROWS` rows or more (prefill
    chunks), in tiles of four input rows by two weight rows (a last group of rows repeats
    its last row; an odd last weight row pairs with itself).

    Blocked as a GEMM: blocks of :data:`W_BLOCK_BYTES` of weight rows are converted to
    float32 once each (not once per four input rows), and every block of about
    :data:`~refengine.cpu.numba_support.X_BLOCK_BYTES` of input rows passes over the
    block: the weight block in L2, the input block in L1 with the two weight rows that pass
    it. With AVX-512, per 32 columns: 16 FMAs on 12 loads, all float32 (no
    conversions in the loop), the partial sums in 16 of its 32 registers (AVX2 code, with
    16 registers, spills some: the same results). Each output is the same sum in the same order as in the pair loop
    (lanes of 32 columns, :func:`_fold32`, the tail, the scale), so a row's result does not
    depend on its batch.
    """
    rows, k_dim = x.shape
    k32 = _U(k_dim // LANES32 * LANES32)
    x_block = x_block_rows(k_dim, 4)
    acc = (_lanes32(), _lanes32(), _lanes32(), _lanes32(), _lanes32(), _lanes32(), _lanes32(), _lanes32())
    w_block = _U(max(2, W_BLOCK_BYTES // (4 * max(k32, 1)) // 2 * 2))
    wf = np.empty(w_block * k32, dtype=np.float32)
    for s0 in range(_U(j0), _U(j1), w_block):  # a block of weight rows, as float32 (first k32 columns)
        s1 = min(s0 + w_block, _U(j1))
        for j in range(s0, s1):
            o = (j - s0) * k32
            for i in range(k32):
                wf[o + i] = np.float32(q[j, i])
        for r0 in range(_U(0), _U(rows), x_block):  # a block of input rows over the block of weight rows
            last = min(r0 + x_block, _U(rows)) - _U(1)
            for j in range(s0, s1, _U(2)):
                jb = min(j + _U(1), s1 - _U(1))
                _int8_tile_4x2(x, q, scales, out, wf, j, jb, (j - s0) * k32, (jb - s0) * k32, r0, last, k32, acc)


@njit(fastmath=_FMA, inline="always")
def _int8_tile_4x2(x, q, scales, out, wf, j, jb, oa, ob, r0, last, k32, acc):  # pragma: no cover - compiled
    """Weight rows ``j``, ``jb`` (float32 in ``wf`` from ``oa``, ``ob``) times input rows
    ``r0 .. last``, four at a time (:func:`_int8_rows_4x2`); ``acc``: its eight 32-lane
    accumulators."""
    a0, a1, b0, b1, c0, c1, d0, d1 = acc
    sa, sb = scales[j], scales[jb]
    for t0 in range(r0, last + _U(1), _U(4)):
        t1, t2, t3 = min(t0 + _U(1), last), min(t0 + _U(2), last), min(t0 + _U(3), last)
        for lane in range(_U(LANES32)):
            a0[lane] = a1[lane] = b0[lane] = b1[lane] = 0.0
            c0[lane] = c1[lane] = d0[lane] = d1[lane] = 0.0
        for i in range(_U(0), k32, _U(LANES32)):
            for lane in range(_U(LANES32)):
                col = i + lane
                w0, w1 = wf[oa + col], wf[ob + col]
                xa, xb, xc, xd = x[t0, col], x[t1, col], x[t2, col], x[t3, col]
                a0[lane] += xa * w0
                a1[lane] += xa * w1
                b0[lane] += xb * w0
                b1[lane] += xb * w1
                c0[lane] += xc * w0
                c1[lane] += xc * w1
                d0[lane] += xd * w0
                d1[lane] += xd * w1
        _int8_store(x, q, out, t3, jb, k32, d1, sb)
        _int8_store(x, q, out, t3, j, k32, d0, sa)
        _int8_store(x, q, out, t2, jb, k32, c1, sb)
        _int8_store(x, q, out, t2, j, k32, c0, sa)
        _int8_store(x, q, out, t1, jb, k32, b1, sb)
        _int8_store(x, q, out, t1, j, k32, b0, sa)
        _int8_store(x, q, out, t0, jb, k32, a1, sb)
        _int8_store(x, q, out, t0, j, k32, a0, sa)


@parallel_kernel()
def _int8_dot(x, q, scales, out, block):  # pragma: no cover - compiled
    """:func:`_int8_rows` over tasks of ``block`` consecutive weight rows."""
    n = q.shape[0]
    for blk in prange((n + block - 1) // block):
        _int8_rows(x, q, scales, out, blk * block, min(blk * block + block, n))


@njit(cache=True, fastmath=_FMA, nogil=True)
def _int8_dequant_rows(q, scales, out, j0, j1):  # pragma: no cover - compiled
    """``out[r - j0] = q[r] * scales[r]`` (float32) for ``j0 <= r < j1``; without the GIL,
    so each BLAS thread dequantizes its own tile while the others multiply theirs."""
    k_dim = q.shape[1]
    for r in range(j0, j1):
        s = scales[r]
        for i in range(k_dim):
            out[r - j0, i] = np.float32(q[r, i]) * s


def int8_linear(x: np.ndarray, q: np.ndarray, scales: np.ndarray, blas_min_rows: int | None = None) -> np.ndarray:
    """``x [T, K] @ (q * scales[:, None]).T`` -> float32 ``[T, N]``: the dot kernel below
    ``blas_min_rows`` rows, dequantized tiles on BLAS from there.

    The tile path (from ``blas_min_rows`` rows): the weight rows cut into tiles
    (:func:`refengine.cpu.blas.balanced_tile_rows`), dealt round-robin to refengine's BLAS threads
    (:func:`refengine.cpu.blas.get_threads`, the calling thread one of them); each
    thread dequantizes its tile into its own buffer (:func:`_int8_dequant_rows`, no GIL)
    and multiplies all of ``x`` by it with single-threaded BLAS straight into its columns
    of the output. Every weight is dequantized once per call, as
    :func:`refengine.cpu.gguf_products.tiled_blas_linear` does for GGUF blocks. The result
    is ``x @ w'.T`` up to BLAS's float32 rounding, which depends on the number of rows
    (OpenBLAS's blocking): batch-independent rows are the dot kernels' property.

    Args:
        x: float32 ``[T, K]`` (made C-contiguous float32 if it is not).
        q: int8 ``[N, K]``, C-contiguous; scales: float32 ``[N]``.
        blas_min_rows: the dot / tile switch (default :data:`INT8_BLAS_MIN_ROWS`).
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, n = x.shape[0], q.shape[0]
    out = np.empty((rows, n), dtype=np.float32)
    if rows == 0 or n == 0:
        return out
    threshold = INT8_BLAS_MIN_ROWS if blas_min_rows is None else blas_min_rows
    if rows < threshold:
        _int8_dot(x, q, scales, out, _block_rows(n))
        return out
    k_dim = q.shape[1]
    step = blas.balanced_tile_rows(n, k_dim, blas.get_threads(), TILE_BYTES)
    starts = list(range(0, n, step))
    threads = max(1, min(blas.get_threads(), len(starts)))

    def work(part: int) -> None:
        tile = np.empty((min(step, n), k_dim), dtype=np.float32)
        for j0 in starts[part::threads]:
            j1 = min(n, j0 + step)
            _int8_dequant_rows(q, scales, tile, j0, j1)
            np.matmul(x, tile[:j1 - j0].T, out=out[:, j0:j1])

    blas.run_parts(work, threads)
    return out


# --- int4 -------------------------------------------------------------------------------
# The packed row holds byte b = columns 2b (low nibble) and 2b + 1 (high nibble) of the
# stored (group-sorted) column order; the dot kernels read x in "kernel order"
# (:meth:`refengine.quant.int4.Int4Weight.kernel_columns`): within each full run of 32
# columns of a group, the 16 even columns then the 16 odd ones, so that 16 bytes make two
# vectors of 16 weights (low nibbles, high nibbles) against two contiguous runs of x. The
# tile path dequantizes in the stored order (its stores interleave, which LLVM vectorises)
# and reads x in that order.

@njit(fastmath=_FMA, inline="always")
def _int4_group(x, packed, t, j, col0, col1, zf, s, zf16, s16, acc):  # pragma: no cover - compiled
    """Input row ``t``'s products with weight row ``j`` over the full 32-column runs
    ``col0 .. col1`` of one group, into ``acc`` (lane ``l < 16``: the low nibble of byte
    ``l``, lane ``16 + l``: its high nibble)."""
    for col in range(col0, col1, _U(LANES32)):
        byte0 = col // _U(2)
        for lane in range(_U(LANES)):
            v = packed[j, byte0 + lane]
            lo = (np.float32(v & 15) - zf) * s
            hi = (np.float32(v & 240) - zf16) * s16
            acc[lane] += x[t, col + lane] * lo
            acc[lane + _U(LANES)] += x[t, col + _U(LANES) + lane] * hi


@njit(fastmath=_FMA, inline="always")
def _int4_tail(x, packed, t, j, col0, col1, zf, s, acc):  # pragma: no cover - compiled
    """``acc`` plus input row ``t``'s products over a group's last ``len % 32`` columns, in order."""
    for col in range(col0, col1):
        v = packed[j, col // _U(2)]
        w = (np.float32((v >> ((col & _U(1)) * _U(4))) & _U(15)) - zf) * s
        acc += x[t, col] * w
    return acc


@njit(cache=True, fastmath=_FMA)
def _int4_rows(x, packed, scales, zeros, group, out, j0, j1):  # pragma: no cover - compiled
    """``out[:, j] = x @ w[j]`` for ``j0 <= j < j1``, ``w[j, c] = float32(q[j, c] - z[j, g]) * s[j, g]``
    (``g = c // group``); ``x [T, K]`` float32 in kernel order, ``packed [N, K/2]`` uint8,
    ``scales [N, G]`` float32, ``zeros [N, G]`` uint8.

    Group by group: its full runs of 32 columns (16 bytes: 16 low and 16 high nibbles, 32
    lanes), then its last ``len % 32`` columns one by one into a scalar sum. Each weight
    is formed as :meth:`~refengine.quant.int4.Int4Weight.dequantize` forms it, then
    multiplied in; pairs of input rows share the formed weights, an odd last row runs alone.
    """
    rows, k_dim = x.shape
    n_groups = scales.shape[1]
    pairs = _U(rows // 2 * 2)
    a, b = _lanes32(), _lanes32()
    for j in range(_U(j0), _U(j1)):
        for t0 in range(_U(0), _U(rows), _U(2)):
            single = t0 == pairs
            t1 = t0 if single else t0 + _U(1)
            _zero32(a)
            _zero32(b)
            ta = tb = np.float32(0.0)
            for g in range(_U(n_groups)):
                c0 = g * _U(group)
                c1 = min(c0 + _U(group), _U(k_dim))
                full = c0 + (c1 - c0) // _U(LANES32) * _U(LANES32)
                zf = np.float32(zeros[j, g])  # q - z in float32: exact (|q - z| <= 16)
                s = scales[j, g]
                # high nibbles unshifted: (16 q - 16 z) * (s / 16) is the same float32 as (q - z) * s
                zf16, s16 = zf * np.float32(16.0), s * np.float32(0.0625)
                if single:
                    _int4_group(x, packed, t0, j, c0, full, zf, s, zf16, s16, a)
                else:
                    for col in range(c0, full, _U(LANES32)):
                        byte0 = col // _U(2)
                        for lane in range(_U(LANES)):
                            v = packed[j, byte0 + lane]
                            lo = (np.float32(v & 15) - zf) * s
                            hi = (np.float32(v & 240) - zf16) * s16
                            a[lane] += x[t0, col + lane] * lo
                            a[lane + _U(LANES)] += x[t0, col + _U(LANES) + lane] * hi
                            b[lane] += x[t1, col + lane] * lo
                            b[lane + _U(LANES)] += x[t1, col + _U(LANES) + lane] * hi
                ta = _int4_tail(x, packed, t0, j, full, c1, zf, s, ta)
                if not single:
                    tb = _int4_tail(x, packed, t1, j, full, c1, zf, s, tb)
            if not single:
                out[t1, j] = _fold32(b) + tb
            out[t0, j] = _fold32(a) + ta


@njit(fastmath=_FMA, inline="always")
def _int4_consts(scales, zeros, j, g):  # pragma: no cover - compiled
    """Group ``g`` of row ``j``: ``z, s`` and, for the high nibbles read unshifted, ``16 z, s / 16``
    (``(16 q - 16 z) * (s / 16)`` is the same float32 as ``(q - z) * s``; ``q - z`` is exact)."""
    zf, s = np.float32(zeros[j, g]), scales[j, g]
    return zf, s, zf * np.float32(16.0), s * np.float32(0.0625)


@njit(cache=True, fastmath=_FMA)
def _int4_rows32(x, packed, scales, zeros, group, out, j0, j1):  # pragma: no cover - compiled
    """:func:`_int4_rows` for ``group % 32 == 0`` (every AWQ / GPTQ group size), with the
    same operations in the same order: no group holds a partial 32-column run but the
    last, whose ``K % 32`` columns are the tail; the loops over runs carry no per-group tail."""
    rows, k_dim = x.shape
    n_groups = scales.shape[1]
    k32, pairs = _U(k_dim // LANES32 * LANES32), _U(rows // 2 * 2)
    last = _U(n_groups - 1)
    a, b = _lanes32(), _lanes32()
    for j in range(_U(j0), _U(j1)):
        zl, sl, _, _ = _int4_consts(scales, zeros, j, last)
        for t0 in range(_U(0), pairs, _U(2)):
            t1 = t0 + _U(1)
            _zero32(a)
            _zero32(b)
            for g in range(_U(n_groups)):
                zf, s, zf16, s16 = _int4_consts(scales, zeros, j, g)
                for col in range(g * _U(group), min(g * _U(group) + _U(group), k32), _U(LANES32)):
                    byte0 = col // _U(2)
                    for lane in range(_U(LANES)):
                        v = packed[j, byte0 + lane]
                        lo = (np.float32(v & 15) - zf) * s
                        hi = (np.float32(v & 240) - zf16) * s16
                        a[lane] += x[t0, col + lane] * lo
                        a[lane + _U(LANES)] += x[t0, col + _U(LANES) + lane] * hi
                        b[lane] += x[t1, col + lane] * lo
                        b[lane + _U(LANES)] += x[t1, col + _U(LANES) + lane] * hi
            out[t1, j] = _fold32(b) + _int4_tail(x, packed, t1, j, k32, _U(k_dim), zl, sl, np.float32(0.0))
            out[t0, j] = _fold32(a) + _int4_tail(x, packed, t0, j, k32, _U(k_dim), zl, sl, np.float32(0.0))
        if pairs < _U(rows):
            t0 = pairs
            _zero32(a)
            for g in range(_U(n_groups)):
                zf, s, zf16, s16 = _int4_consts(scales, zeros, j, g)
                _int4_group(x, packed, t0, j, g * _U(group), min(g * _U(group) + _U(group), k32),
                            zf, s, zf16, s16, a)
            out[t0, j] = _fold32(a) + _int4_tail(x, packed, t0, j, k32, _U(k_dim), zl, sl, np.float32(0.0))


@parallel_kernel()
def _int4_dot32(x, packed, scales, zeros, group, out, block):  # pragma: no cover - compiled
    """:func:`_int4_rows32` over tasks of ``block`` consecutive weight rows."""
    n = packed.shape[0]
    for blk in prange((n + block - 1) // block):
        _int4_rows32(x, packed, scales, zeros, group, out, blk * block, min(blk * block + block, n))


@parallel_kernel()
def _int4_dot(x, packed, scales, zeros, group, out, block):  # pragma: no cover - compiled
    """:func:`_int4_rows` over tasks of ``block`` consecutive weight rows."""
    n = packed.shape[0]
    for blk in prange((n + block - 1) // block):
        _int4_rows(x, packed, scales, zeros, group, out, blk * block, min(blk * block + block, n))


@njit(cache=True, fastmath=_FMA)
def _int4_dequant_rows(packed, scales, zeros, group, out, j0, r0, r1):  # pragma: no cover - compiled
    """``out[r - j0] = w[r]`` in the stored column order for ``r0 <= r < r1``: each value
    ``float32(q - z) * s``, as the dot kernel forms it (a byte's two columns share a group:
    ``group`` is even). One loop over bytes per group, which LLVM vectorises (interleaved stores)."""
    n_groups = scales.shape[1]
    half = _U(packed.shape[1])
    for r in range(_U(r0), _U(r1)):
        o = r - _U(j0)
        for g in range(_U(n_groups)):
            b0 = g * _U(group // 2)
            b1 = min(b0 + _U(group // 2), half)
            zf, s, zf16, s16 = _int4_consts(scales, zeros, r, g)
            for b in range(b0, b1):
                v = packed[r, b]
                out[o, _U(2) * b] = (np.float32(v & 15) - zf) * s
                out[o, _U(2) * b + _U(1)] = (np.float32(v & 240) - zf16) * s16


@parallel_kernel()
def _int4_dequant(packed, scales, zeros, group, out, j0, j1, per):  # pragma: no cover - compiled
    """Rows ``j0 .. j1 - 1`` dequantized into ``out [j1 - j0, K]`` (stored order), ``per`` rows a task."""
    for c in prange((j1 - j0 + per - 1) // per):
        _int4_dequant_rows(packed, scales, zeros, group, out, j0, j0 + c * per, min(j1, j0 + (c + 1) * per))


def _tile_rows(k_dim: int) -> int:
    """Weight rows per tile on the BLAS path: :data:`TILE_BYTES` of float32, a multiple of 16."""
    return max(16, TILE_BYTES // (4 * max(k_dim, 1)) // 16 * 16)


def int4_uses_blas(rows: int, blas_min_rows: int | None = None) -> bool:
    """Whether an int4 product of ``rows`` rows takes the tile path (from :data:`INT4_BLAS_MIN_ROWS`)."""
    return rows >= (INT4_BLAS_MIN_ROWS if blas_min_rows is None else blas_min_rows)


def int4_linear(x: np.ndarray, packed, scales, zeros, group: int, tiles: bool) -> np.ndarray:
    """``x @ w.T`` -> float32 ``[T, N]`` for an int4 matrix (``packed [N, K/2]`` uint8,
    ``scales [N, G]`` float32, ``zeros [N, G]`` uint8, ``group`` columns a group).

    Args:
        x: float32 ``[T, K]`` C-contiguous: for the dot kernels (``tiles`` False) the input
            gathered into kernel order (:meth:`refengine.quant.int4.Int4Weight.kernel_columns`),
            for the tile path (``tiles`` True, :func:`int4_uses_blas`) in the stored column
            order (``x[:, perm]``), the order the tiles are dequantized in.
    """
    rows, n, k_dim = x.shape[0], packed.shape[0], 2 * packed.shape[1]
    out = np.empty((rows, n), dtype=np.float32)
    if rows == 0 or n == 0:
        return out
    if not tiles:
        kernel = _int4_dot32 if group % LANES32 == 0 else _int4_dot
        kernel(x, packed, scales, zeros, group, out, _block_rows(n))
        return out
    step = _tile_rows(k_dim)
    tile = np.empty((min(step, n), k_dim), dtype=np.float32)
    per = max(1, -(-step // (4 * get_num_threads())))
    for j0 in range(0, n, step):
        j1 = min(n, j0 + step)
        _int4_dequant(packed, scales, zeros, group, tile, j0, j1, per)
        out[:, j0:j1] = blas.matmul(x, tile[:j1 - j0].T)
    return out


register_kernels(sys.modules[__name__])
