"""Products ``x [T, in] @ w.T`` with GGUF block-type weights, compiled by numba, float32 activations.

``w [out, in]`` is a :class:`refengine.quant.gguf_blocks.GGUFWeight` (Q8_0, Q4_0, Q4_1,
Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, F16, BF16) kept as stored; its blocks are decoded on the fly,
never the whole matrix. ``x`` float32 ``[T, in]``; the result float32 ``[T, out]``. Entry
point: :func:`linear`. With Q8_0 (Q8_K) activations the block types take
:mod:`refengine.cpu.q8_products` instead. This module also holds the vector types and
intrinsics (``f32x8``, ``f32x16``, ``v16_*``, ``f8_*``, f16 conversions) that the other
CPU kernels share.

Two paths, by the number of rows ``T``:

* **Few rows (decode)**: one fused kernel per type family (:func:`_blocks32_rows` for Q8_0,
  Q4_0, Q4_1, Q5_0, Q5_1; :func:`_k_rows` for Q4_K, Q5_K; :func:`_q6_k_rows`;
  :func:`_half_rows` for F16 and BF16). Tasks own consecutive output rows (``prange``);
  per output row the kernel walks the row's blocks, decodes each block's quants into
  float32 vector registers and multiplies them with the activation rows, one or four at a
  time (the 32-weight block types also eight), folding the block's scale in once per
  block: ``d * sum(q * x)`` plus, for the types with a minimum, ``m * sum(x)`` from the
  activations' block sums. Each weight byte is read once. At one activation row the
  32-weight block kernels take two weight rows per pass and prefetch their quants
  :data:`PREFETCH_BYTES` ahead; each row's sums are computed in the same order as in a batch.
* **Many rows (prefill)**, from :data:`PREFILL_MIN_ROWS` rows and only with
  ``batch_invariant=False`` (:func:`tiled_blas_linear`): each of refengine's BLAS threads
  (:mod:`refengine.cpu.blas`) dequantizes tiles of :data:`TILE_BYTES` of weight rows
  into a float32 buffer of its own and multiplies ``x @ tile.T`` with single-threaded BLAS.

Explicit SIMD: numba runs LLVM's loop vectorizer but not its SLP vectorizer, and LLVM fully
unrolls the short lane loops before the loop vectorizer sees them, which leaves scalar
code. So the kernels use small vector types and intrinsics (:func:`_lane_intrinsics`, one
set per width) for loads, integer decoding, conversions and FMAs: ``vpmovzxbd`` loads of
quants, ``vcvtdq2ps``, ``vfmadd231ps``, accumulators in registers. A 32-weight block (Q6_K:
two 16-weight groups) is two sixteen-lane vectors, :data:`f32x16` and :data:`i32x16`; the
F16/BF16 kernels and the sums use eight lanes, :data:`f32x8`. Each type has its own compiled
function (``_q4_1_rows``, ``_q4_1_linear``, ``_q4_1_dequant`` ...): the family's code is
written once with its ``kind`` passed as a constant, so the other types' branches fold away.

Numerics (float32): every output is computed the same way whatever the tile or the number
of rows on the fused path, so a row's result is the same bits alone or in a batch and on
any number of threads (tested). Per 32-weight block two eight-lane partial products,
``pA = fma(w[16:24], x[16:24], w[0:8] * x[0:8])`` and ``pB`` likewise for weights 8-15 and
24-31, accumulated as ``acc = fma(d, p, acc)`` block after block (Q6_K: per 16-weight group
``acc = fma(d * sc, w * x, acc)``; F16/BF16: ``acc = fma(w, x, acc)``); the two
accumulators added, their lanes summed in one fixed tree (:func:`f8_sum`); the minimum
terms ``sum_b m_b * xsum_b`` (Q4_1, Q5_1, and the K-quants' ``-dmin * m``) as an eight-lane
dot over the blocks, summed the same way, then its tail in order. Lanes 0-7 of a
sixteen-lane partial product are ``pA`` and lanes 8-15 ``pB``, so the sums are those of
eight-lane pairs, bit for bit. The tile path is ``x @ dequantize().T`` up to BLAS's float32
rounding (the dequantized tile is bitwise :meth:`GGUFWeight.dequantize`: no FMA there).

f16 scales are converted by exact bit arithmetic (numba has no float16): the 15 bits below
the sign, shifted into a float32's exponent and mantissa, are ``value * 2**-112`` for
normal and subnormal halves alike, so one multiply by ``2**112`` restores the value;
infinities and NaNs get the all-ones exponent. F16 weights use ``vcvtph2ps`` where the CPU
has F16C (the same values). Both tested against NumPy for all 65536 patterns.
"""

from __future__ import annotations

import sys
import threading

import numpy as np
from numba import njit, prange

from refengine.cpu import blas
from refengine.cpu.numba_support import get_num_threads, parallel_kernel, prefetch, register_kernels, x_block_rows
from refengine.cpu.simd import (bits_as_f32, f16_load, f16_to_f32, f8_add, f8_fma, f8_load, f8_load_bf16, f8_load_f16,
                                f8_store, f8_sum, f8_zero, q16_add, q16_and, q16_bits, q16_load_bytes, q16_or, q16_shl,
                                q16_shr, q16_to_f, v16_add, v16_fma, v16_halves, v16_load, v16_mul, v16_splat,
                                v16_store, v16_zero)

#: From this many activation rows the product dequantizes tiles and multiplies with BLAS
#: (prefill, ``batch_invariant=False`` only); below, the fused kernels (decode). Where the
#: two are level on SmolLM2's shapes (docs/PERFORMANCE.md, "Design notes").
PREFILL_MIN_ROWS = 24
#: The float32 bytes of a dequantized tile (its rows: this over ``in_features * 4``); a
#: smaller tile pays BLAS's per-call set-up (packing ``x``) too often.
TILE_BYTES = 1024 * 1024
#: The fused 32-weight block kernels decode the f16 scales of this many weight rows at a
#: time, in one vector loop (a row's 18 or 48 scales alone would leave a scalar tail each).
CHUNK_ROWS = 8
#: One activation row (decode at batch 1) multiplies two weight rows at a time, and asks for
#: their quants this many bytes ahead (software prefetch).
PREFETCH_BYTES = 4096

_U = np.uintp  # unsigned indices: no negative-index wraparound in the address arithmetic

# ---------------------------------------------------------------------------------------
# Shared pieces of the fused kernels.
#
# numba's own inliner (``inline="always"``) re-runs its passes on the callee at every call
# site, and again inside every inlined caller: the helpers with loops that several sites
# call (the minimum terms, the f16 scale rows) are plain cached functions instead, compiled
# once for every type and inlined by LLVM all the same. ``inline="always"`` stays on the
# type-generic bodies (``kind`` must be a constant for their branches to fold away) and on
# the loop-free pieces of the inner loops.


@njit(cache=True)
def _f16_plane_rows(plane, j0, j1, out):  # pragma: no cover - compiled
    """``out[(j - j0) * n + b] = f16(plane[j, b])`` for rows ``j0 <= j < j1`` of a uint16
    plane ``[rows, n]`` (``out``: float32 ``[>= (j1 - j0) * n + 8]``): the rows' scales in one
    vector loop (consecutive rows are contiguous), so only the last few take the scalar path."""
    flat = plane.reshape(-1)
    base = _U(j0) * _U(plane.shape[1])
    count = (_U(j1) - _U(j0)) * _U(plane.shape[1])
    n8 = count // _U(8) * _U(8)
    for b in range(_U(0), n8, _U(8)):
        f8_store(out, b, f8_load_f16(flat, base + b))
    for b in range(n8, count):
        out[b] = f16_to_f32(flat[base + b])


@njit(cache=True)
def _weighted_sum(a, ao, xs, xo, n):  # pragma: no cover - compiled
    """``sum_b a[ao + b] * xs[xo + b]`` for ``b < n`` (flat arrays): eight lanes, :func:`f8_sum`,
    then the tail in order."""
    ao, xo = _U(ao), _U(xo)
    n8 = _U(n) // _U(8) * _U(8)
    acc = f8_zero()
    for b in range(_U(0), n8, _U(8)):
        acc = f8_fma(f8_load(a, ao + b), f8_load(xs, xo + b), acc)
    s = f8_sum(acc)
    for b in range(n8, _U(n)):
        s += a[ao + b] * xs[xo + b]
    return s


@njit(inline="always")
def _weighted_sum_f16(m, mo, xs, n):  # pragma: no cover - compiled
    """:func:`_weighted_sum` of the f16 plane ``m`` (flat, from
    ``mo``) with ``xs[0 : n]``, each minimum converted as it is read: the same values in the
    same order, so the same bits."""
    mo = _U(mo)
    n8 = _U(n) // _U(8) * _U(8)
    acc = f8_zero()
    for b in range(_U(0), n8, _U(8)):
        acc = f8_fma(f8_load_f16(m, mo + b), f8_load(xs, b), acc)
    s = f8_sum(acc)
    for b in range(n8, _U(n)):
        s += f16_to_f32(m[mo + b]) * xs[b]
    return s


@njit(cache=True, fastmath={"contract"})
def _block_sums(x, xs, group):  # pragma: no cover - compiled
    """``xs[t, g] = sum(x[t, group*g : group*(g+1)])`` for float32 ``x [T, K]`` (``group`` a multiple of 16):
    eight lanes over the group, :func:`f8_sum`. The minimum terms' activation sums."""
    rows, ng = xs.shape
    k = _U(x.shape[1])
    xf = x.reshape(-1)
    xsf = xs.reshape(-1)
    for t in range(_U(rows)):
        for g in range(_U(ng)):
            c = _U(t) * k + _U(g) * _U(group)
            acc = f8_add(f8_load(xf, c), f8_load(xf, c + _U(8)))
            for i in range(_U(16), _U(group), _U(16)):
                acc = f8_add(acc, f8_add(f8_load(xf, c + i), f8_load(xf, c + i + _U(8))))
            xsf[_U(t) * _U(ng) + g] = f8_sum(acc)


# ---------------------------------------------------------------------------------------
# Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: blocks of 32, one f16 scale (and minimum) each.

#: Type codes of the 32-weight block kernels.
Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 = 0, 1, 2, 3, 4


@njit(inline="always")
def _block_dot16(w_lo, w_hi, x, xo, d, acc):  # pragma: no cover - compiled
    """One 32-weight block (decoded ``w_lo``: weights 0-15, ``w_hi``: 16-31) times
    ``x[xo : xo + 32]`` (flat), scaled by ``d`` and added to ``acc``: lane ``l`` is
    ``w[l + 16] * x[l + 16] + w[l] * x[l]`` (lanes 0-7: the eight-lane ``pA``, 8-15: ``pB``)."""
    p = v16_fma(w_hi, v16_load(x, xo + _U(16)), v16_mul(w_lo, v16_load(x, xo)))
    return v16_fma(v16_splat(d), p, acc)


@njit(inline="always")
def _decode32(kind, qs, qh, j, b):  # pragma: no cover - compiled
    """Block ``b`` of row ``j``: its 32 quants as float32 (``q`` for Q8_0, ``q - 8`` Q4_0,
    ``q`` Q4_1, ``q - 16`` Q5_0, ``q`` Q5_1), as two vectors of weights 0-15 and 16-31."""
    if kind == Q8_0:
        base = (_U(j) * _U(qs.shape[1] // 32) + _U(b)) * _U(32)
        return q16_to_f(q16_load_bytes(qs, base)), q16_to_f(q16_load_bytes(qs, base + _U(16)))
    base = (_U(j) * _U(qs.shape[1] // 16) + _U(b)) * _U(16)
    v = q16_load_bytes(qs, base)
    q_lo, q_hi = q16_and(v, 15), q16_shr(v, 4)  # byte i holds weights i and i + 16
    if kind == Q5_0 or kind == Q5_1:
        h = qh[j, b]
        q_lo = q16_or(q_lo, q16_shl(q16_bits(h, 0), 4))
        q_hi = q16_or(q_hi, q16_shl(q16_bits(h, 16), 4))
    if kind == Q4_0:
        q_lo, q_hi = q16_add(q_lo, -8), q16_add(q_hi, -8)
    elif kind == Q5_0:
        q_lo, q_hi = q16_add(q_lo, -16), q16_add(q_hi, -16)
    return q16_to_f(q_lo), q16_to_f(q_hi)


@njit(inline="always")
def _fours_end(start, r1):  # pragma: no cover - compiled
    """Where the groups of four rows from ``start`` end in a block ending at ``r1`` (a last
    group of 2-3 rows counts as four, repeating its last row), and that last row."""
    fours = start + (r1 - start) // _U(4) * _U(4)
    if r1 - fours >= _U(2):
        fours = r1
    return fours, r1 - _U(1)


@njit(inline="always")
def _chunk_scales(d, m, j, j0, j1, sd, sm, with_min, nb):  # pragma: no cover - compiled
    """Row ``j``'s offset into ``sd``, ``sm``; where ``j`` starts a chunk of :data:`CHUNK_ROWS`
    rows (counted from ``j0``), the chunk's f16 scales (and minimums) decoded there first."""
    jc = (_U(j) - _U(j0)) % _U(CHUNK_ROWS)
    if jc == _U(0):
        je = min(_U(j) + _U(CHUNK_ROWS), _U(j1))
        _f16_plane_rows(d, j, je, sd)
        if with_min:
            _f16_plane_rows(m, j, je, sm)
    return jc * nb


@njit(inline="always")
def _store_row(out, t, j, s, with_min, sm, so, xsf, nb):  # pragma: no cover - compiled
    """``out[t, j] = s`` plus, for the types with a minimum, the minimum terms (:func:`_weighted_sum`)."""
    if with_min:
        s += _weighted_sum(sm, so, xsf, t * nb, nb)
    out[t, j] = s


@njit(inline="always")
def _blocks32_many(kind, x, xs, d, m, qh, qs, out, j0, j1, sd, sm):  # pragma: no cover - compiled
    """:func:`_blocks32_rows` for two rows or more: input rows in blocks of about
    :data:`~refengine.cpu.numba_support.X_BLOCK_BYTES`, each block over all the task's
    weight rows (which stay in cache) before the next (a prefill chunk is megabytes:
    streaming all of it for every weight row made the loop wait on the outer caches); in a
    block, groups of eight rows share each decoded block of weights, then groups of four
    (a last group of 2-3 rows repeats its last row), then single rows. Every output is the
    same sum whatever its group."""
    rows, k = x.shape
    nb = _U(d.shape[1])
    kk = _U(k)
    xf, xsf = x.reshape(-1), xs.reshape(-1)
    with_min = kind == Q4_1 or kind == Q5_1
    x_block = x_block_rows(k, 8)
    for r0 in range(_U(0), _U(rows), x_block):
        r1 = min(r0 + x_block, _U(rows))
        eights = r0 + (r1 - r0) // _U(8) * _U(8)  # groups of eight rows first, then of four
        fours, last = _fours_end(eights, r1)
        for j in range(_U(j0), _U(j1)):
            so = _chunk_scales(d, m, j, j0, j1, sd, sm, with_min, nb)  # this row's scales in sd, sm
            for t0 in range(r0, eights, _U(8)):
                a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = v16_zero()
                for b in range(nb):
                    w_lo, w_hi = _decode32(kind, qs, qh, j, b)
                    c, db = b * _U(32), sd[so + b]
                    a0 = _block_dot16(w_lo, w_hi, xf, t0 * kk + c, db, a0)
                    a1 = _block_dot16(w_lo, w_hi, xf, (t0 + _U(1)) * kk + c, db, a1)
                    a2 = _block_dot16(w_lo, w_hi, xf, (t0 + _U(2)) * kk + c, db, a2)
                    a3 = _block_dot16(w_lo, w_hi, xf, (t0 + _U(3)) * kk + c, db, a3)
                    a4 = _block_dot16(w_lo, w_hi, xf, (t0 + _U(4)) * kk + c, db, a4)
                    a5 = _block_dot16(w_lo, w_hi, xf, (t0 + _U(5)) * kk + c, db, a5)
                    a6 = _block_dot16(w_lo, w_hi, xf, (t0 + _U(6)) * kk + c, db, a6)
                    a7 = _block_dot16(w_lo, w_hi, xf, (t0 + _U(7)) * kk + c, db, a7)
                _store_row(out, t0, j, f8_sum(v16_halves(a0)), with_min, sm, so, xsf, nb)
                _store_row(out, t0 + _U(1), j, f8_sum(v16_halves(a1)), with_min, sm, so, xsf, nb)
                _store_row(out, t0 + _U(2), j, f8_sum(v16_halves(a2)), with_min, sm, so, xsf, nb)
                _store_row(out, t0 + _U(3), j, f8_sum(v16_halves(a3)), with_min, sm, so, xsf, nb)
                _store_row(out, t0 + _U(4), j, f8_sum(v16_halves(a4)), with_min, sm, so, xsf, nb)
                _store_row(out, t0 + _U(5), j, f8_sum(v16_halves(a5)), with_min, sm, so, xsf, nb)
                _store_row(out, t0 + _U(6), j, f8_sum(v16_halves(a6)), with_min, sm, so, xsf, nb)
                _store_row(out, t0 + _U(7), j, f8_sum(v16_halves(a7)), with_min, sm, so, xsf, nb)
            for t0 in range(eights, fours, _U(4)):
                t1, t2, t3 = min(t0 + _U(1), last), min(t0 + _U(2), last), min(t0 + _U(3), last)
                a0 = a1 = a2 = a3 = v16_zero()
                for b in range(nb):
                    w_lo, w_hi = _decode32(kind, qs, qh, j, b)
                    c, db = b * _U(32), sd[so + b]
                    a0 = _block_dot16(w_lo, w_hi, xf, t0 * kk + c, db, a0)
                    a1 = _block_dot16(w_lo, w_hi, xf, t1 * kk + c, db, a1)
                    a2 = _block_dot16(w_lo, w_hi, xf, t2 * kk + c, db, a2)
                    a3 = _block_dot16(w_lo, w_hi, xf, t3 * kk + c, db, a3)
                _store_row(out, t3, j, f8_sum(v16_halves(a3)), with_min, sm, so, xsf, nb)
                _store_row(out, t2, j, f8_sum(v16_halves(a2)), with_min, sm, so, xsf, nb)
                _store_row(out, t1, j, f8_sum(v16_halves(a1)), with_min, sm, so, xsf, nb)
                _store_row(out, t0, j, f8_sum(v16_halves(a0)), with_min, sm, so, xsf, nb)
            for t in range(fours, r1):
                a0 = v16_zero()
                for b in range(nb):
                    w_lo, w_hi = _decode32(kind, qs, qh, j, b)
                    a0 = _block_dot16(w_lo, w_hi, xf, t * kk + b * _U(32), sd[so + b], a0)
                _store_row(out, t, j, f8_sum(v16_halves(a0)), with_min, sm, so, xsf, nb)


@njit(inline="always")
def _prefetch_pair(kind, qs, qh, d, m, j):  # pragma: no cover - compiled
    """One activation row's loops over weight rows ``j``, ``j + 1``: ask for their quants
    :data:`PREFETCH_BYTES` ahead, and for the scales (minimums, high bits) of the rows as
    far ahead (two interleaved rows are streams whose jumps from row to row the hardware
    prefetcher does not follow; the scale planes are read in the loop, a few bytes a row)."""
    qrow = _U(qs.shape[1])  # one row's quants, in bytes (one byte each)
    ahead = _U(j) * qrow + _U(PREFETCH_BYTES)
    for o in range(ahead, ahead + _U(2) * qrow, _U(64)):
        prefetch(qs, o)
    nb = _U(d.shape[1])
    row = (_U(j) + _U(PREFETCH_BYTES) // qrow) * nb
    for o in range(row, row + _U(2) * nb, _U(32)):  # 32 f16 per 64-byte line
        prefetch(d, o)
        if kind == Q4_1 or kind == Q5_1:
            prefetch(m, o)
    if kind == Q5_0 or kind == Q5_1:
        for o in range(row, row + _U(2) * nb, _U(16)):
            prefetch(qh, o)


@njit(inline="always")
def _blocks32_rows(kind, x, xs, d, m, qh, qs, out, j0, j1, scratch):  # pragma: no cover - compiled
    """``out[:, j] = x @ w[j]`` for ``j0 <= j < j1``: the fused kernel of the 32-weight block
    types (the task of ``_q8_0_linear`` ... ``_q5_1_linear``; ``kind`` a constant).

    ``x`` float32 ``[T, K]``; ``xs`` float32 ``[T, K/32]`` its block sums (used by the types
    with a minimum); ``d``, ``m`` uint16 ``[N, K/32]`` (``m`` unused without a minimum);
    ``qh`` uint32 ``[N, K/32]`` (Q5 only); ``qs`` the quants plane; ``out`` float32
    ``[T, N]``; ``scratch`` float32 ``[>= 2 * (CHUNK_ROWS * K/32 + 8)]``: the scales (and
    minimums) of :data:`CHUNK_ROWS` rows at a time (unused for one row, whose loop converts
    each scale as it reads it). Two activation rows or more go through
    :func:`_blocks32_many` (blocks of input rows; groups of eight, four, one); a batch of
    one row (decode at batch 1) in a loop of its own over two weight rows at a time, which
    computes each row's sums in the same order, so a row's result is the same bits
    whichever way it ran.
    """
    rows, k = x.shape
    nb = _U(d.shape[1])
    kk = _U(k)
    xf, xsf = x.reshape(-1), xs.reshape(-1)
    half = _U(CHUNK_ROWS) * nb + _U(8)
    sd, sm = scratch[:half], scratch[half:]
    with_min = kind == Q4_1 or kind == Q5_1
    if _U(rows) != _U(1):
        if _U(rows) > _U(1):
            _blocks32_many(kind, x, xs, d, m, qh, qs, out, j0, j1, sd, sm)
        return
    # One activation row (decode at batch 1): weight rows two at a time, sharing the
    # activation loads; two rows' accumulators are two independent FMA chains (one row's
    # chain alone waits on the FMA latency). Each row's sums are the same as in _blocks32_many.
    # The scales converted in the loop (f16_load; no chunk pass), the minimums in the sums
    # (_weighted_sum_f16): the same values in the same order as _blocks32_many's scratch.
    xo = _U(0)
    df, mf = d.reshape(-1), m.reshape(-1)
    for j in range(_U(j0), _U(j1), _U(2)):
        so = _U(j) * nb
        _prefetch_pair(kind, qs, qh, d, m, j)
        if j + _U(1) < _U(j1):
            a0 = a1 = v16_zero()
            so1 = so + nb
            for b in range(nb):
                w_lo, w_hi = _decode32(kind, qs, qh, j, b)
                v_lo, v_hi = _decode32(kind, qs, qh, j + _U(1), b)
                c = xo + b * _U(32)
                a0 = _block_dot16(w_lo, w_hi, xf, c, f16_load(df, so + b), a0)
                a1 = _block_dot16(v_lo, v_hi, xf, c, f16_load(df, so1 + b), a1)
            s0, s1 = f8_sum(v16_halves(a0)), f8_sum(v16_halves(a1))
            if with_min:
                s0 += _weighted_sum_f16(mf, so, xsf, nb)
                s1 += _weighted_sum_f16(mf, so1, xsf, nb)
            out[0, j + _U(1)] = s1
            out[0, j] = s0
        else:
            a0 = v16_zero()
            for b in range(nb):
                w_lo, w_hi = _decode32(kind, qs, qh, j, b)
                a0 = _block_dot16(w_lo, w_hi, xf, xo + b * _U(32), f16_load(df, so + b), a0)
            s0 = f8_sum(v16_halves(a0))
            if with_min:
                s0 += _weighted_sum_f16(mf, so, xsf, nb)
            out[0, j] = s0


@njit(inline="always")
def _blocks32_dequant(kind, d, m, qh, qs, j0, j1, buf):  # pragma: no cover - compiled
    """Rows ``j0 .. j1 - 1`` dequantized into ``buf[:j1 - j0]`` (float32 ``[>= j1 - j0, K]``):
    ``q * d`` (Q8_0, Q4_0, Q5_0 with their offsets) or ``q * d + m`` (Q4_1, Q5_1), rounded
    as :meth:`GGUFWeight.dequantize` (no FMA). Releases the GIL (runs on BLAS threads)."""
    nb = _U(d.shape[1])
    bf = buf.reshape(-1)
    k = _U(buf.shape[1])
    with_min = kind == Q4_1 or kind == Q5_1
    for j in range(_U(j0), _U(j1)):
        o = (j - _U(j0)) * k
        for b in range(nb):
            w_lo, w_hi = _decode32(kind, qs, qh, j, b)
            ds = v16_splat(f16_to_f32(d[j, b]))
            w_lo, w_hi = v16_mul(w_lo, ds), v16_mul(w_hi, ds)
            if with_min:
                ms = v16_splat(f16_to_f32(m[j, b]))
                w_lo, w_hi = v16_add(w_lo, ms), v16_add(w_hi, ms)
            c = o + b * _U(32)
            v16_store(bf, c, w_lo)
            v16_store(bf, c + _U(16), w_hi)


# One compiled version per type (the type a constant, so its branches fold away): task,
# parallel loop, dequantizer.


@njit(cache=True)
def _q8_0_rows(x, xs, d, m, qh, qs, out, j0, j1, scratch):  # pragma: no cover - compiled
    """:func:`_blocks32_rows` for Q8_0."""
    _blocks32_rows(Q8_0, x, xs, d, m, qh, qs, out, j0, j1, scratch)


@parallel_kernel()
def _q8_0_linear(x, xs, d, m, qh, qs, out, block, scratch):  # pragma: no cover - compiled
    """Q8_0: ``out [T, N] = x @ w.T`` in tasks of ``block`` output rows (task ``i`` uses ``scratch[i]``)."""
    n = out.shape[1]
    for blk in prange((n + block - 1) // block):
        _q8_0_rows(x, xs, d, m, qh, qs, out, blk * block, min(blk * block + block, n), scratch[blk])


@njit(cache=True, nogil=True)
def _q8_0_dequant(d, m, qh, qs, j0, j1, buf):  # pragma: no cover - compiled
    """:func:`_blocks32_dequant` for Q8_0 (releases the GIL: runs on BLAS threads)."""
    _blocks32_dequant(Q8_0, d, m, qh, qs, j0, j1, buf)


@njit(cache=True)
def _q4_0_rows(x, xs, d, m, qh, qs, out, j0, j1, scratch):  # pragma: no cover - compiled
    """:func:`_blocks32_rows` for Q4_0."""
    _blocks32_rows(Q4_0, x, xs, d, m, qh, qs, out, j0, j1, scratch)


@parallel_kernel()
def _q4_0_linear(x, xs, d, m, qh, qs, out, block, scratch):  # pragma: no cover - compiled
    """Q4_0: ``out [T, N] = x @ w.T`` in tasks of ``block`` output rows (task ``i`` uses ``scratch[i]``)."""
    n = out.shape[1]
    for blk in prange((n + block - 1) // block):
        _q4_0_rows(x, xs, d, m, qh, qs, out, blk * block, min(blk * block + block, n), scratch[blk])


@njit(cache=True, nogil=True)
def _q4_0_dequant(d, m, qh, qs, j0, j1, buf):  # pragma: no cover - compiled
    """:func:`_blocks32_dequant` for Q4_0 (releases the GIL: runs on BLAS threads)."""
    _blocks32_dequant(Q4_0, d, m, qh, qs, j0, j1, buf)


@njit(cache=True)
def _q4_1_rows(x, xs, d, m, qh, qs, out, j0, j1, scratch):  # pragma: no cover - compiled
    """:func:`_blocks32_rows` for Q4_1."""
    _blocks32_rows(Q4_1, x, xs, d, m, qh, qs, out, j0, j1, scratch)


@parallel_kernel()
def _q4_1_linear(x, xs, d, m, qh, qs, out, block, scratch):  # pragma: no cover - compiled
    """Q4_1: ``out [T, N] = x @ w.T`` in tasks of ``block`` output rows (task ``i`` uses ``scratch[i]``)."""
    n = out.shape[1]
    for blk in prange((n + block - 1) // block):
        _q4_1_rows(x, xs, d, m, qh, qs, out, blk * block, min(blk * block + block, n), scratch[blk])


@njit(cache=True, nogil=True)
def _q4_1_dequant(d, m, qh, qs, j0, j1, buf):  # pragma: no cover - compiled
    """:func:`_blocks32_dequant` for Q4_1 (releases the GIL: runs on BLAS threads)."""
    _blocks32_dequant(Q4_1, d, m, qh, qs, j0, j1, buf)


@njit(cache=True)
def _q5_0_rows(x, xs, d, m, qh, qs, out, j0, j1, scratch):  # pragma: no cover - compiled
    """:func:`_blocks32_rows` for Q5_0."""
    _blocks32_rows(Q5_0, x, xs, d, m, qh, qs, out, j0, j1, scratch)


@parallel_kernel()
def _q5_0_linear(x, xs, d, m, qh, qs, out, block, scratch):  # pragma: no cover - compiled
    """Q5_0: ``out [T, N] = x @ w.T`` in tasks of ``block`` output rows (task ``i`` uses ``scratch[i]``)."""
    n = out.shape[1]
    for blk in prange((n + block - 1) // block):
        _q5_0_rows(x, xs, d, m, qh, qs, out, blk * block, min(blk * block + block, n), scratch[blk])


@njit(cache=True, nogil=True)
def _q5_0_dequant(d, m, qh, qs, j0, j1, buf):  # pragma: no cover - compiled
    """:func:`_blocks32_dequant` for Q5_0 (releases the GIL: runs on BLAS threads)."""
    _blocks32_dequant(Q5_0, d, m, qh, qs, j0, j1, buf)


@njit(cache=True)
def _q5_1_rows(x, xs, d, m, qh, qs, out, j0, j1, scratch):  # pragma: no cover - compiled
    """:func:`_blocks32_rows` for Q5_1."""
    _blocks32_rows(Q5_1, x, xs, d, m, qh, qs, out, j0, j1, scratch)


@parallel_kernel()
def _q5_1_linear(x, xs, d, m, qh, qs, out, block, scratch):  # pragma: no cover - compiled
    """Q5_1: ``out [T, N] = x @ w.T`` in tasks of ``block`` output rows (task ``i`` uses ``scratch[i]``)."""
    n = out.shape[1]
    for blk in prange((n + block - 1) // block):
        _q5_1_rows(x, xs, d, m, qh, qs, out, blk * block, min(blk * block + block, n), scratch[blk])


@njit(cache=True, nogil=True)
def _q5_1_dequant(d, m, qh, qs, j0, j1, buf):  # pragma: no cover - compiled
    """:func:`_blocks32_dequant` for Q5_1 (releases the GIL: runs on BLAS threads)."""
    _blocks32_dequant(Q5_1, d, m, qh, qs, j0, j1, buf)


# ---------------------------------------------------------------------------------------
# Q4_K, Q5_K: superblocks of 256 in eight sub-blocks of 32, a 6-bit scale and minimum each.

Q4_K, Q5_K = 0, 1


@njit(inline="always")
def _k_sub_scales(d, dmin, scales, j, sd, sm):  # pragma: no cover - compiled
    """Row ``j``'s sub-block scales ``sd[8i + s] = d * sc`` and negated minimums
    ``sm[8i + s] = -(dmin * m)`` (ggml's ``get_scale_min_k4``; the products rounded as in
    ``dequantize_row_q4_K``)."""
    nb = _U(d.shape[1])
    for i in range(nb):
        dd, dm = f16_to_f32(d[j, i]), f16_to_f32(dmin[j, i])
        o = i * _U(12)
        for s in range(_U(4)):
            sd[i * _U(8) + s] = dd * np.float32(np.int32(scales[j, o + s] & np.uint8(63)))
            sm[i * _U(8) + s] = -(dm * np.float32(np.int32(scales[j, o + s + _U(4)] & np.uint8(63))))
        for s in range(_U(4), _U(8)):
            packed = scales[j, o + s + _U(4)]  # low four bits of scale (low nibble) and min (high nibble)
            sc = (packed & np.uint8(0x0F)) | ((scales[j, o + s - _U(4)] >> np.uint8(6)) << np.uint8(4))
            mn = (packed >> np.uint8(4)) | ((scales[j, o + s] >> np.uint8(6)) << np.uint8(4))
            sd[i * _U(8) + s] = dd * np.float32(np.int32(sc))
            sm[i * _U(8) + s] = -(dm * np.float32(np.int32(mn)))


@njit(inline="always")
def _decode_k64(kind, qs, qh, j, i, c):  # pragma: no cover - compiled
    """Chunk ``c`` (weights ``64c .. 64c + 63``) of superblock ``i`` of row ``j``: two
    sub-blocks of 32 quants ``0..15`` (Q4_K) or ``0..31`` (Q5_K), as float32 vectors
    ``(e_lo, e_hi)`` (sub-block ``2c``: its weights 0-15, 16-31) and ``(o_lo, o_hi)`` (``2c + 1``).
    Byte ``l`` of the chunk holds weight ``l`` of both sub-blocks (low and high nibble)."""
    base = (_U(j) * _U(qs.shape[1] // 128) + _U(i)) * _U(128) + _U(c) * _U(32)
    va, vb = q16_load_bytes(qs, base), q16_load_bytes(qs, base + _U(16))
    e_lo, e_hi, o_lo, o_hi = q16_and(va, 15), q16_and(vb, 15), q16_shr(va, 4), q16_shr(vb, 4)
    if kind == Q5_K:
        hb = (_U(j) * _U(qh.shape[1] // 32) + _U(i)) * _U(32)
        ha, hz = q16_load_bytes(qh, hb), q16_load_bytes(qh, hb + _U(16))
        se, so = _U(2) * _U(c), _U(2) * _U(c) + _U(1)  # sub-block s takes bit s of qh[l]
        e_lo = q16_or(e_lo, q16_shl(q16_and(q16_shr(ha, se), 1), 4))
        e_hi = q16_or(e_hi, q16_shl(q16_and(q16_shr(hz, se), 1), 4))
        o_lo = q16_or(o_lo, q16_shl(q16_and(q16_shr(ha, so), 1), 4))
        o_hi = q16_or(o_hi, q16_shl(q16_and(q16_shr(hz, so), 1), 4))
    return (q16_to_f(e_lo), q16_to_f(e_hi)), (q16_to_f(o_lo), q16_to_f(o_hi))


@njit(inline="always")
def _k_rows(kind, x, xs, d, dmin, scales, qh, qs, out, j0, j1, scratch):  # pragma: no cover - compiled
    """``out[:, j] = x @ w[j]`` for ``j0 <= j < j1``, Q4_K or Q5_K (the task of
    ``_q4_k_linear``/``_q5_k_linear``; ``kind`` a constant): the sums of
    :func:`_blocks32_rows` over the sub-blocks of 32, their scales ``d * sc`` and minimums
    ``-dmin * m`` decoded per row into ``scratch`` (float32 ``[>= 2 * (K/32 + 8)]``); ``xs``
    the activations' 32-weight sums. Input rows in cache-sized blocks, four at a time (a
    last group of 2-3 repeats its last row), then single rows."""
    rows, k = x.shape
    nsub = _U(d.shape[1]) * _U(8)
    kk = _U(k)
    xf, xsf = x.reshape(-1), xs.reshape(-1)
    sd, sm = scratch[:nsub + _U(8)], scratch[nsub + _U(8):]
    x_block = x_block_rows(k, 4)
    for r0 in range(_U(0), _U(rows), x_block):  # input rows in cache-sized blocks, as _blocks32_many
        r1 = min(r0 + x_block, _U(rows))
        fours, last = _fours_end(r0, r1)
        for j in range(_U(j0), _U(j1)):
            _k_sub_scales(d, dmin, scales, j, sd, sm)
            for t0 in range(r0, fours, _U(4)):
                t1, t2, t3 = min(t0 + _U(1), last), min(t0 + _U(2), last), min(t0 + _U(3), last)
                a0 = a1 = a2 = a3 = v16_zero()
                for s2 in range(_U(0), nsub, _U(2)):
                    ev, od = _decode_k64(kind, qs, qh, j, s2 // _U(8), (s2 % _U(8)) // _U(2))
                    for h in range(_U(2)):
                        w_lo, w_hi = ev if h == 0 else od
                        s = s2 + _U(h)
                        c = s * _U(32)
                        a0 = _block_dot16(w_lo, w_hi, xf, t0 * kk + c, sd[s], a0)
                        a1 = _block_dot16(w_lo, w_hi, xf, t1 * kk + c, sd[s], a1)
                        a2 = _block_dot16(w_lo, w_hi, xf, t2 * kk + c, sd[s], a2)
                        a3 = _block_dot16(w_lo, w_hi, xf, t3 * kk + c, sd[s], a3)
                out[t3, j] = f8_sum(v16_halves(a3)) + _weighted_sum(sm, 0, xsf, t3 * nsub, nsub)
                out[t2, j] = f8_sum(v16_halves(a2)) + _weighted_sum(sm, 0, xsf, t2 * nsub, nsub)
                out[t1, j] = f8_sum(v16_halves(a1)) + _weighted_sum(sm, 0, xsf, t1 * nsub, nsub)
                out[t0, j] = f8_sum(v16_halves(a0)) + _weighted_sum(sm, 0, xsf, t0 * nsub, nsub)
            for t in range(fours, r1):
                a0 = v16_zero()
                for s2 in range(_U(0), nsub, _U(2)):
                    ev, od = _decode_k64(kind, qs, qh, j, s2 // _U(8), (s2 % _U(8)) // _U(2))
                    for h in range(_U(2)):
                        w_lo, w_hi = ev if h == 0 else od
                        s = s2 + _U(h)
                        a0 = _block_dot16(w_lo, w_hi, xf, t * kk + s * _U(32), sd[s], a0)
                out[t, j] = f8_sum(v16_halves(a0)) + _weighted_sum(sm, 0, xsf, t * nsub, nsub)


@njit(inline="always")
def _k_dequant(kind, d, dmin, scales, qh, qs, j0, j1, buf, scratch):  # pragma: no cover - compiled
    """Rows ``j0 .. j1 - 1`` of a Q4_K/Q5_K weight dequantized into ``buf[:j1 - j0]``:
    ``(d * sc) * q - dmin * m`` rounded as :meth:`GGUFWeight.dequantize` (no FMA)."""
    nsub = _U(d.shape[1]) * _U(8)
    bf = buf.reshape(-1)
    k = _U(buf.shape[1])
    sd, sm = scratch[:nsub + _U(8)], scratch[nsub + _U(8):]
    for j in range(_U(j0), _U(j1)):
        _k_sub_scales(d, dmin, scales, j, sd, sm)
        o = (j - _U(j0)) * k
        for s2 in range(_U(0), nsub, _U(2)):
            ev, od = _decode_k64(kind, qs, qh, j, s2 // _U(8), (s2 % _U(8)) // _U(2))
            for h in range(_U(2)):
                w_lo, w_hi = ev if h == 0 else od
                s = s2 + _U(h)
                ds, ms = v16_splat(sd[s]), v16_splat(sm[s])  # sm holds -(dmin * m): adding it subtracts
                c = o + s * _U(32)
                v16_store(bf, c, v16_add(v16_mul(ds, w_lo), ms))
                v16_store(bf, c + _U(16), v16_add(v16_mul(ds, w_hi), ms))


# One compiled version per type (the type a constant, so its branches fold away): task,
# parallel loop, dequantizer.


@njit(cache=True)
def _q4_k_rows(x, xs, d, dmin, scales, qh, qs, out, j0, j1, scratch):  # pragma: no cover - compiled
    """:func:`_k_rows` for Q4_K."""
    _k_rows(Q4_K, x, xs, d, dmin, scales, qh, qs, out, j0, j1, scratch)


@parallel_kernel()
def _q4_k_linear(x, xs, d, dmin, scales, qh, qs, out, block, scratch):  # pragma: no cover - compiled
    """Q4_K: ``out [T, N] = x @ w.T`` in tasks of ``block`` output rows (task ``i`` uses ``scratch[i]``)."""
    n = out.shape[1]
    for blk in prange((n + block - 1) // block):
        _q4_k_rows(x, xs, d, dmin, scales, qh, qs, out, blk * block, min(blk * block + block, n), scratch[blk])


@njit(cache=True, nogil=True)
def _q4_k_dequant(d, dmin, scales, qh, qs, j0, j1, buf, scratch):  # pragma: no cover - compiled
    """:func:`_k_dequant` for Q4_K (releases the GIL: runs on BLAS threads)."""
    _k_dequant(Q4_K, d, dmin, scales, qh, qs, j0, j1, buf, scratch)


@njit(cache=True)
def _q5_k_rows(x, xs, d, dmin, scales, qh, qs, out, j0, j1, scratch):  # pragma: no cover - compiled
    """:func:`_k_rows` for Q5_K."""
    _k_rows(Q5_K, x, xs, d, dmin, scales, qh, qs, out, j0, j1, scratch)


@parallel_kernel()
def _q5_k_linear(x, xs, d, dmin, scales, qh, qs, out, block, scratch):  # pragma: no cover - compiled
    """Q5_K: ``out [T, N] = x @ w.T`` in tasks of ``block`` output rows (task ``i`` uses ``scratch[i]``)."""
    n = out.shape[1]
    for blk in prange((n + block - 1) // block):
        _q5_k_rows(x, xs, d, dmin, scales, qh, qs, out, blk * block, min(blk * block + block, n), scratch[blk])


@njit(cache=True, nogil=True)
def _q5_k_dequant(d, dmin, scales, qh, qs, j0, j1, buf, scratch):  # pragma: no cover - compiled
    """:func:`_k_dequant` for Q5_K (releases the GIL: runs on BLAS threads)."""
    _k_dequant(Q5_K, d, dmin, scales, qh, qs, j0, j1, buf, scratch)


# ---------------------------------------------------------------------------------------
# Q6_K: superblocks of 256, sixteen groups of 16 with an int8 scale each, one f16 d.


@njit(inline="always")
def _q6_scales(d, scales, j, sd):  # pragma: no cover - compiled
    """Row ``j``'s group scales ``sd[16i + g] = d * scales[g]`` (rounded as ``dequantize_row_q6_K``)."""
    nb = _U(d.shape[1])
    for i in range(nb):
        dd = f16_to_f32(d[j, i])
        for g in range(_U(16)):
            sd[i * _U(16) + g] = dd * np.float32(np.int32(scales[j, i * _U(16) + g]))


@njit(inline="always")
def _q6_lanes(ql, lo, qh, ho, shift, hs):  # pragma: no cover - compiled
    """Sixteen Q6_K quants ``0..63``: nibble ``(ql[lo + l] >> shift) & 15`` | ``((qh[ho + l] >> hs) & 3) << 4``."""
    low = q16_and(q16_shr(q16_load_bytes(ql, lo), shift), 15)
    return q16_or(low, q16_shl(q16_and(q16_shr(q16_load_bytes(qh, ho), hs), 3), 4))


@njit(inline="always")
def _decode_q6_32(ql, qh, j, i, half, k):  # pragma: no cover - compiled
    """Quarter ``k`` of half ``half`` of superblock ``i`` of row ``j`` (weights
    ``128 half + 32k .. + 31``): its quants ``q - 32`` as two float32 vectors, its two
    16-weight groups (ggml's ``dequantize_row_q6_K``: low four bits from
    ``ql[64 half + 32 (k % 2) + l]``, low nibble for ``k < 2``; top two bits ``2k, 2k + 1``
    of ``qh[32 half + l]``)."""
    lb = (_U(j) * _U(ql.shape[1] // 128) + _U(i)) * _U(128) + _U(half) * _U(64) + (_U(k) % _U(2)) * _U(32)
    hb = (_U(j) * _U(qh.shape[1] // 64) + _U(i)) * _U(64) + _U(half) * _U(32)
    shift = _U(4) * (_U(k) // _U(2))
    hs = _U(2) * _U(k)
    g0 = _q6_lanes(ql, lb, qh, hb, shift, hs)
    g1 = _q6_lanes(ql, lb + _U(16), qh, hb + _U(16), shift, hs)
    return q16_to_f(q16_add(g0, -32)), q16_to_f(q16_add(g1, -32))


@njit(inline="always")
def _group_dot(w, x, xo, d, acc):  # pragma: no cover - compiled
    """One 16-weight group (decoded ``w``) times ``x[xo : xo + 16]``, scaled by ``d``:
    ``acc = fma(d, w * x, acc)`` (lanes 0-7 and 8-15: the eight-lane pair of accumulators it replaces)."""
    return v16_fma(v16_splat(d), v16_mul(w, v16_load(x, xo)), acc)


@njit(cache=True)
def _q6_k_rows(x, d, ql, qh, scales, out, j0, j1, scratch):  # pragma: no cover - compiled
    """``out[:, j] = x @ w[j]`` for ``j0 <= j < j1``, Q6_K (one task of :func:`_q6_k_linear`):
    per 16-weight group ``acc = fma(d * sc, q * x, acc)`` on a sixteen-lane accumulator;
    input rows in cache-sized blocks, four at a time (a last group of 2-3 repeats its last
    row), then single rows. ``scratch``: float32 ``[>= K/16]``."""
    rows, k = x.shape
    nb = _U(d.shape[1])
    kk = _U(k)
    xf = x.reshape(-1)
    x_block = x_block_rows(k, 4)
    for r0 in range(_U(0), _U(rows), x_block):  # input rows in cache-sized blocks, as _blocks32_many
        r1 = min(r0 + x_block, _U(rows))
        fours, last = _fours_end(r0, r1)
        for j in range(_U(j0), _U(j1)):
            _q6_scales(d, scales, j, scratch)
            for t0 in range(r0, fours, _U(4)):
                t1, t2, t3 = min(t0 + _U(1), last), min(t0 + _U(2), last), min(t0 + _U(3), last)
                a0 = a1 = a2 = a3 = v16_zero()
                for q in range(nb * _U(8)):  # quarters of 32 weights: superblock i, half, k
                    i, half, kq = q // _U(8), (q // _U(4)) % _U(2), q % _U(4)
                    g0, g1 = _decode_q6_32(ql, qh, j, i, half, kq)
                    c, g = q * _U(32), q * _U(2)
                    s0, s1 = scratch[g], scratch[g + _U(1)]
                    a0 = _group_dot(g1, xf, t0 * kk + c + _U(16), s1, _group_dot(g0, xf, t0 * kk + c, s0, a0))
                    a1 = _group_dot(g1, xf, t1 * kk + c + _U(16), s1, _group_dot(g0, xf, t1 * kk + c, s0, a1))
                    a2 = _group_dot(g1, xf, t2 * kk + c + _U(16), s1, _group_dot(g0, xf, t2 * kk + c, s0, a2))
                    a3 = _group_dot(g1, xf, t3 * kk + c + _U(16), s1, _group_dot(g0, xf, t3 * kk + c, s0, a3))
                out[t3, j] = f8_sum(v16_halves(a3))
                out[t2, j] = f8_sum(v16_halves(a2))
                out[t1, j] = f8_sum(v16_halves(a1))
                out[t0, j] = f8_sum(v16_halves(a0))
            for t in range(fours, r1):
                a0 = v16_zero()
                for q in range(nb * _U(8)):
                    i, half, kq = q // _U(8), (q // _U(4)) % _U(2), q % _U(4)
                    g0, g1 = _decode_q6_32(ql, qh, j, i, half, kq)
                    c, g = q * _U(32), q * _U(2)
                    a0 = _group_dot(g0, xf, t * kk + c, scratch[g], a0)
                    a0 = _group_dot(g1, xf, t * kk + c + _U(16), scratch[g + _U(1)], a0)
                out[t, j] = f8_sum(v16_halves(a0))


@parallel_kernel()
def _q6_k_linear(x, d, ql, qh, scales, out, block, scratch):  # pragma: no cover - compiled
    """``out [T, N] = x @ w.T`` for Q6_K: tasks of ``block`` output rows (:func:`_q6_k_rows`)."""
    n = d.shape[0]
    for blk in prange((n + block - 1) // block):
        _q6_k_rows(x, d, ql, qh, scales, out, blk * block, min(blk * block + block, n), scratch[blk])


@njit(cache=True, nogil=True)
def _q6_k_dequant(d, ql, qh, scales, j0, j1, buf, scratch):  # pragma: no cover - compiled
    """Rows ``j0 .. j1 - 1`` of a Q6_K weight dequantized into ``buf[:j1 - j0]``:
    ``(d * sc) * (q - 32)`` rounded as :meth:`GGUFWeight.dequantize`."""
    nb = _U(d.shape[1])
    bf = buf.reshape(-1)
    k = _U(buf.shape[1])
    for j in range(_U(j0), _U(j1)):
        _q6_scales(d, scales, j, scratch)
        o = (j - _U(j0)) * k
        for q in range(nb * _U(8)):
            i, half, kq = q // _U(8), (q // _U(4)) % _U(2), q % _U(4)
            g0, g1 = _decode_q6_32(ql, qh, j, i, half, kq)
            c, g = o + q * _U(32), q * _U(2)
            v16_store(bf, c, v16_mul(v16_splat(scratch[g]), g0))
            v16_store(bf, c + _U(16), v16_mul(v16_splat(scratch[g + _U(1)]), g1))


# ---------------------------------------------------------------------------------------
# F16, BF16: one 16-bit float per weight.

F16, BF16 = 0, 1


@njit(inline="always")
def _load_half(kind, bits, i):  # pragma: no cover - compiled
    return f8_load_f16(bits, i) if kind == F16 else f8_load_bf16(bits, i)


@njit(inline="always")
def _half_scalar(kind, h):  # pragma: no cover - compiled
    if kind == F16:
        return f16_to_f32(h)
    return bits_as_f32(np.uint32(h) << np.uint32(16))


@njit(inline="always")
def _half_rows(kind, x, bits, out, j0, j1):  # pragma: no cover - compiled
    """``out[:, j] = x @ w[j]`` for ``j0 <= j < j1``, F16 or BF16 ``bits`` uint16 ``[N, K]``
    (the task of ``_f16_linear``/``_bf16_linear``; ``kind`` a constant): sixteen weights at
    a time into two eight-lane FMA accumulators, :func:`f8_sum`, then the last ``K % 16``
    products in order. Activation rows four at a time (a last group of 2-3 repeats its last
    row), then single rows."""
    rows, k = x.shape
    kk = _U(k)
    k16 = kk // _U(16) * _U(16)
    xf, bf = x.reshape(-1), bits.reshape(-1)
    fours = _U(rows) // _U(4) * _U(4)
    if _U(rows) - fours >= _U(2):
        fours = _U(rows)
    last = _U(rows - 1)
    for j in range(_U(j0), _U(j1)):
        wo = _U(j) * kk
        for t0 in range(_U(0), fours, _U(4)):
            t1, t2, t3 = min(t0 + _U(1), last), min(t0 + _U(2), last), min(t0 + _U(3), last)
            a0 = b0 = a1 = b1 = a2 = b2 = a3 = b3 = f8_zero()
            for i in range(_U(0), k16, _U(16)):
                w0, w1 = _load_half(kind, bits, wo + i), _load_half(kind, bits, wo + i + _U(8))
                a0 = f8_fma(w0, f8_load(xf, t0 * kk + i), a0)
                b0 = f8_fma(w1, f8_load(xf, t0 * kk + i + _U(8)), b0)
                a1 = f8_fma(w0, f8_load(xf, t1 * kk + i), a1)
                b1 = f8_fma(w1, f8_load(xf, t1 * kk + i + _U(8)), b1)
                a2 = f8_fma(w0, f8_load(xf, t2 * kk + i), a2)
                b2 = f8_fma(w1, f8_load(xf, t2 * kk + i + _U(8)), b2)
                a3 = f8_fma(w0, f8_load(xf, t3 * kk + i), a3)
                b3 = f8_fma(w1, f8_load(xf, t3 * kk + i + _U(8)), b3)
            s0, s1 = f8_sum(f8_add(a0, b0)), f8_sum(f8_add(a1, b1))
            s2, s3 = f8_sum(f8_add(a2, b2)), f8_sum(f8_add(a3, b3))
            for i in range(k16, kk):
                w = _half_scalar(kind, bf[wo + i])
                s0 += w * xf[t0 * kk + i]
                s1 += w * xf[t1 * kk + i]
                s2 += w * xf[t2 * kk + i]
                s3 += w * xf[t3 * kk + i]
            out[t3, j] = s3
            out[t2, j] = s2
            out[t1, j] = s1
            out[t0, j] = s0
        for t in range(fours, _U(rows)):
            a0 = b0 = f8_zero()
            for i in range(_U(0), k16, _U(16)):
                a0 = f8_fma(_load_half(kind, bits, wo + i), f8_load(xf, t * kk + i), a0)
                b0 = f8_fma(_load_half(kind, bits, wo + i + _U(8)), f8_load(xf, t * kk + i + _U(8)), b0)
            s0 = f8_sum(f8_add(a0, b0))
            for i in range(k16, kk):
                s0 += _half_scalar(kind, bf[wo + i]) * xf[t * kk + i]
            out[t, j] = s0


@njit(inline="always")
def _half_dequant(kind, bits, j0, j1, buf):  # pragma: no cover - compiled
    """Rows ``j0 .. j1 - 1`` of F16/BF16 ``bits`` as float32 into ``buf[:j1 - j0]`` (exact)."""
    k = _U(bits.shape[1])
    k8 = k // _U(8) * _U(8)
    bf, wf = buf.reshape(-1), bits.reshape(-1)
    for j in range(_U(j0), _U(j1)):
        o, wo = (j - _U(j0)) * k, _U(j) * k
        for i in range(_U(0), k8, _U(8)):
            f8_store(bf, o + i, _load_half(kind, bits, wo + i))
        for i in range(k8, k):
            bf[o + i] = _half_scalar(kind, wf[wo + i])

# One compiled version per type (the type a constant, so its branches fold away): task,
# parallel loop, dequantizer.


@njit(cache=True)
def _f16_rows(x, bits, out, j0, j1):  # pragma: no cover - compiled
    """:func:`_half_rows` for F16."""
    _half_rows(F16, x, bits, out, j0, j1)


@parallel_kernel()
def _f16_linear(x, bits, out, block):  # pragma: no cover - compiled
    """F16: ``out [T, N] = x @ w.T`` in tasks of ``block`` output rows (task ``i`` uses ``scratch[i]``)."""
    n = out.shape[1]
    for blk in prange((n + block - 1) // block):
        _f16_rows(x, bits, out, blk * block, min(blk * block + block, n))


@njit(cache=True, nogil=True)
def _f16_dequant(bits, j0, j1, buf):  # pragma: no cover - compiled
    """:func:`_half_dequant` for F16 (releases the GIL: runs on BLAS threads)."""
    _half_dequant(F16, bits, j0, j1, buf)


@njit(cache=True)
def _bf16_rows(x, bits, out, j0, j1):  # pragma: no cover - compiled
    """:func:`_half_rows` for BF16."""
    _half_rows(BF16, x, bits, out, j0, j1)


@parallel_kernel()
def _bf16_linear(x, bits, out, block):  # pragma: no cover - compiled
    """BF16: ``out [T, N] = x @ w.T`` in tasks of ``block`` output rows (task ``i`` uses ``scratch[i]``)."""
    n = out.shape[1]
    for blk in prange((n + block - 1) // block):
        _bf16_rows(x, bits, out, blk * block, min(blk * block + block, n))


@njit(cache=True, nogil=True)
def _bf16_dequant(bits, j0, j1, buf):  # pragma: no cover - compiled
    """:func:`_half_dequant` for BF16 (releases the GIL: runs on BLAS threads)."""
    _half_dequant(BF16, bits, j0, j1, buf)


# ---------------------------------------------------------------------------------------
# Dispatch.

_NO_QH = np.zeros((1, 1), dtype=np.uint32)  # stands in for the Q5 high bits of the other types
_NO_QH8 = np.zeros((1, 1), dtype=np.uint8)
BLOCKS32 = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
_K = ("Q4_K", "Q5_K")
#: Per type: its parallel product and its dequantizer.
_KERNELS = {
    "Q8_0": (_q8_0_linear, _q8_0_dequant), "Q4_0": (_q4_0_linear, _q4_0_dequant),
    "Q4_1": (_q4_1_linear, _q4_1_dequant), "Q5_0": (_q5_0_linear, _q5_0_dequant),
    "Q5_1": (_q5_1_linear, _q5_1_dequant), "Q4_K": (_q4_k_linear, _q4_k_dequant),
    "Q5_K": (_q5_k_linear, _q5_k_dequant), "Q6_K": (_q6_k_linear, _q6_k_dequant),
    "F16": (_f16_linear, _f16_dequant), "BF16": (_bf16_linear, _bf16_dequant),
}


def _planes(w) -> tuple:
    """The kernels' plane arguments for ``w`` (placeholders for the planes a type lacks)."""
    p = w.planes
    if w.format in BLOCKS32:
        return p["d"], p.get("m", p["d"]), p.get("qh", _NO_QH), p["qs"]
    if w.format in _K:
        return p["d"], p["dmin"], p["scales"], p.get("qh", _NO_QH8), p["qs"]
    if w.format == "Q6_K":
        return p["d"], p["ql"], p["qh"], p["scales"]
    if w.format in ("F16", "BF16"):
        return (p["bits"],)
    raise ValueError(f"no numba kernel for GGUF type {w.format!r}")  # pragma: no cover - GGUFWeight admits no other


def _scale_scratch(w, *lead) -> np.ndarray:
    """float32 ``[*lead, n]``: room for the decoded scales (and minimums) of
    :data:`CHUNK_ROWS` rows (the 32-weight block types) or one row (the K-quants)."""
    if w.format == "Q6_K":
        n = w.shape[1] // 16
    elif w.format in _K:
        n = 2 * (w.shape[1] // 32 + 8)
    else:
        n = 2 * (CHUNK_ROWS * (w.shape[1] // 32) + 8)
    return np.empty((*lead, n), dtype=np.float32)


def _task_rows(n: int, threads: int) -> int:
    """Output rows per task: a multiple of four, about four tasks per thread (so a core slowed
    by another process does not hold the others up for long)."""
    return max(4, -(-n // (16 * threads)) * 4)


def product_plan(w, name: str, build):
    """What a product of ``w`` needs besides its input, built once and kept on ``w``: the
    compiled function (the parallel or the serial twin), the plane arguments, the task size,
    scratch (:func:`plan_arguments`) and the builder's own buffers.

    Args:
        w: a :class:`refengine.quant.gguf_blocks.GGUFWeight`.
        name: which product's plan (``"fused"``, ``"q8"``).
        build: ``build(w, threads)`` -> the plan, called once per ``name`` and numba thread
            count in each calling thread.
    Returns:
        What ``build`` returned. Plans live in a ``threading.local`` on ``w``: a plan's
        scratch is written by every call, so two threads never share one, and a thread's
        plans go with it. Pickling drops them (:meth:`GGUFWeight.__getstate__`).
    """
    threads = get_num_threads()
    local = w.__dict__.get("_plans")
    if local is None:
        local = w._plans = threading.local()
    plans = local.__dict__  # this thread's
    plan = plans.get((name, threads))
    if plan is None:
        plan = plans[name, threads] = build(w, threads)
    return plan


def plan_arguments(w, pair, threads: int) -> tuple:
    """``(kernel, planes, block, scratch)`` of a product of ``w`` on ``threads`` numba threads:
    ``pair``'s parallel twin from two threads, else its serial one; the plane arguments
    (:func:`_planes`); output rows per task (:func:`_task_rows`); the tasks' float32 scale
    scratch (:func:`_scale_scratch`), None for F16/BF16, whose kernels take none."""
    n = w.shape[0]
    block = _task_rows(n, threads)
    kernel = pair.for_threads(threads)
    scratch = None if w.format in ("F16", "BF16") else _scale_scratch(w, -(-n // block))
    return kernel, _planes(w), block, scratch


def _fused_plan(w, threads: int) -> tuple:
    """:func:`product_plan` builder of :func:`fused_linear`: :func:`plan_arguments` and
    ``xs`` float32 ``[1, in/32]`` (a one-row input's block sums)."""
    return (*plan_arguments(w, _KERNELS[w.format][0], threads), np.empty((1, w.shape[1] // 32), dtype=np.float32))


def fused_linear(x: np.ndarray, w) -> np.ndarray:
    """``x [T, in] @ w.T`` -> float32 ``[T, out]`` by the fused decode kernels, any ``T``
    (:func:`linear` picks them below :data:`PREFILL_MIN_ROWS` rows; F32 weights go to
    :func:`refengine.cpu.layer_ops.matmul_dot`). ``x``: C-contiguous float32 (not checked here)."""
    rows, n = x.shape[0], w.shape[0]
    if w.format == "F32" and rows and n:
        from refengine.cpu.layer_ops import matmul_dot

        return matmul_dot(x, w.planes["w"].T)
    out = np.empty((rows, n), dtype=np.float32)
    if rows == 0 or n == 0:
        return out
    kernel, planes, block, scratch, xs1 = product_plan(w, "fused", _fused_plan)
    if scratch is None:  # F16, BF16
        kernel(x, *planes, out, block)
        return out
    if w.format == "Q6_K":
        kernel(x, *planes, out, block, scratch)
        return out
    xs = xs1 if rows == 1 else np.empty((rows, w.shape[1] // 32), dtype=np.float32)
    _block_sums(x, xs, 32)
    kernel(x, xs, *planes, out, block, scratch)
    return out


def dequantize_rows(w, j0: int, j1: int, buf: np.ndarray) -> np.ndarray:
    """Rows ``j0 .. j1 - 1`` of ``w`` dequantized into ``buf[:j1 - j0]`` (float32
    C-contiguous ``[>= j1 - j0, in]``) by the compiled decoders: bitwise
    :meth:`GGUFWeight.dequantize`. Returns ``buf[:j1 - j0]``. Releases the GIL.

    Raises:
        ValueError: ``0 <= j0 <= j1 <= out_features`` does not hold, or ``buf`` is too small
            or not C-contiguous float32 with ``in_features`` columns.
    """
    n, k = w.shape
    if not 0 <= j0 <= j1 <= n:
        raise ValueError(f"rows {j0}:{j1} outside [0, {n}]")
    ok = buf.dtype == np.float32 and buf.flags.c_contiguous and buf.ndim == 2
    if not ok or buf.shape[1] != k or buf.shape[0] < j1 - j0:
        raise ValueError(f"buf must be C-contiguous float32 [>= {j1 - j0}, {k}], got {buf.dtype} {buf.shape}")
    if w.format == "F32":
        buf[:j1 - j0] = w.planes["w"][j0:j1]
        return buf[:j1 - j0]
    dequant = _KERNELS[w.format][1]
    if w.format in _K or w.format == "Q6_K":
        dequant(*_planes(w), j0, j1, buf, _scale_scratch(w))
    else:
        dequant(*_planes(w), j0, j1, buf)
    return buf[:j1 - j0]


def tiled_blas_linear(x: np.ndarray, w) -> np.ndarray:
    """``x [T, in] @ w.T`` -> float32 ``[T, out]``: tiles of at most :data:`TILE_BYTES` of
    dequantized weight rows (:func:`dequantize_rows`), each multiplied by single-threaded BLAS
    (``np.matmul`` into its columns of the output), the tiles as many per thread
    (:func:`refengine.cpu.blas.balanced_tile_rows`) and dealt round-robin to
    refengine's BLAS threads (:func:`refengine.cpu.blas.get_threads`; the calling thread
    is one of them, each has its own buffer). F32 weights: :func:`refengine.cpu.blas.matmul`.
    ``x``: C-contiguous float32 (not checked here)."""
    rows = x.shape[0]
    n, k = w.shape
    if w.format == "F32":
        return blas.matmul(x, w.planes["w"].T)
    out = np.empty((rows, n), dtype=np.float32)
    if rows == 0 or n == 0:
        return out
    tile = min(n, blas.balanced_tile_rows(n, k, blas.get_threads(), TILE_BYTES, 8))
    starts = list(range(0, n, tile))
    threads = max(1, min(blas.get_threads(), len(starts)))

    def work(part: int) -> None:
        buf = np.empty((tile, k), dtype=np.float32)
        for j0 in starts[part::threads]:
            j1 = min(j0 + tile, n)
            np.matmul(x, dequantize_rows(w, j0, j1, buf).T, out=out[:, j0:j1])

    blas.run_parts(work, threads)
    return out


def linear(x: np.ndarray, w, *, batch_invariant: bool = False) -> np.ndarray:
    """``x [T, in] @ w.T`` -> float32 ``[T, out]`` for a :class:`GGUFWeight` ``w``: the fused
    kernels below :data:`PREFILL_MIN_ROWS` rows, tiles and BLAS from there; with
    ``batch_invariant`` the fused kernels at every row count.

    Raises:
        ValueError: ``x`` not 2-D with ``in_features`` columns.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x must be [T, {w.shape[1]}] for a {w.format} weight {w.shape}, got {x.shape}")
    if x.shape[0] >= PREFILL_MIN_ROWS and not batch_invariant:
        return tiled_blas_linear(x, w)
    return fused_linear(x, w)


register_kernels(sys.modules[__name__])
