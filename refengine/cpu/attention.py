"""The CPU default attention backend (:class:`NumbaAttention`): paged decode, flash and BLAS prefill in numba.

The same contract (:mod:`refengine.attention`) and the same two algorithms as the NumPy
twin (:mod:`refengine.attention.numpy_ref`), written as loops over the cache layout
``[num_blocks, block_size, num_kv_heads, head_dim]``:

* **Paged decode** (``q_len == 1``; every row in batch-invariant mode): K and V are read in place through the block table
  (no gather copy). One task per (partition of a sequence's context, KV head), block by
  block: while a block's key rows of that head are in L1 every query head of its GQA group
  scores them (sixteen positions' dot products summed at once, :func:`v16_sums16`); then
  one softmax per query head, then one pass over the values. Long contexts are split into partitions of
  :data:`DECODE_PARTITION` tokens so one sequence still feeds every core; each partition
  keeps its max, sum and unnormalised output, merged afterwards (Dao et al. 2023,
  "Flash-Decoding"; vLLM's PagedAttention v2; Kwon et al. 2023 §4).
* **Flash prefill** (``q_len > 1``, not in batch-invariant mode): one task per (sequence, KV head, query tile); key tiles
  are copied from their blocks into a small transposed scratch tile (eight keys at a time
  by 8 x 8 register transposes, :func:`_transpose_keys`), and each query row
  keeps a running max, sum and output rescaled as the max grows (Dao 2023,
  "FlashAttention-2", Algorithm 1). Key tiles wholly after a query tile are skipped and
  each row stops at its own position (causality).

* **Long prefill chunks** (at least :data:`BLAS_PREFILL_MIN_ROWS` query rows): per KV head
  and tile of :data:`BLAS_PREFILL_Q_TILE` query rows, the scores ``Q K^T`` of the whole
  group over every key the tile may see are one BLAS product, a compiled row kernel
  (:func:`_causal_softmax`) masks the future and normalises in place, and ``P V`` is a
  second BLAS product. The two products are the attention's flops and BLAS does them at
  its packed-GEMM rate; the softmax is one vectorised pass. The score tile
  (``group x BLAS_PREFILL_Q_TILE x context`` float32) replaces the online softmax: it is
  bounded by the tile, not by the prompt. Not in batch-invariant mode (below), and not
  when ``use_blas_prefill`` is off.

int8 caches (``kv_cache_dtype="int8"``): :func:`_write_kv_int8` quantizes each token's row
per KV head as the twin does (:func:`refengine.attention.kv_cache.quantize_int8`, bitwise equal);
the prefill kernels dequantize ``q * scale`` into their float32 key/value tiles (the twin's
values exactly), and decode multiplies each score ``q . k_int8`` by its key scale and each
probability by its value scale (the same products up to float32 rounding). The scales are
optional arguments: numba compiles the float32 path without them (``is None`` branches
are pruned at compile time).

float16 caches (``kv_cache_dtype="float16"``): numba has no float16, so the kernels take
the caches' uint16 bit patterns; :func:`_write_kv_f16` rounds as NumPy does
(:func:`refengine.cpu.simd.f32_to_f16`) and every read converts exactly
(``vcvtph2ps`` with F16C: ``_kv16``, ``_kv8``, ``_kv1``), so the float32 arithmetic, and
its bits, are those over the cache's float32 copy.

Per-layer options (keywords of ``forward``, as in the twin): ``sliding_window`` W (the query at
position ``p`` sees keys ``max(0, p - W + 1) ..= p``, transformers' rule) and ``logits_soft_cap``
c (scores ``c * tanh(s / c)`` before the softmax, Gemma 2). With a window the work is
proportional to it, not to the context: decode partitions cover only the last W positions
(built per window by :class:`_Plan`, shared by the layers of a step), flash prefill starts at
the key tile of its first row's window and each row reads only its own window, and the BLAS
path scores only keys from its tile's first window start. The cap is applied to the scaled
scores before the max and ``exp`` by :func:`_soft_cap` (vectorised ``tanh``). The window is
always an int to the kernels (:data:`_NO_WINDOW` for none) and the cap always a float
(:data:`_NO_CAP` for none, a branch per row or tile): one compiled version of each kernel
serves every window and cap, where ``None`` would make numba compile a second one.

Decode rows and prefill sequences of one batch go to their kernels (one parallel launch
each per layer, plus the BLAS products of long chunks).

**Batch-invariant mode** (``NumbaAttention(batch_invariant=True)``, the engine's default with
this backend): every query row, prefill rows included, is a decode row of the paged decode
kernel, its context the keys up to its own position, and no chunk takes the flash or BLAS
path. A row's partitions then depend only on its position (``DECODE_PARTITION`` tokens
from its window start), each is summed in one order (``_decode_partition``), and they are
merged in order (``_merge_partitions``). So the same row gives the same bits alone, in any
batch, in a chunk of any size, decoded or prefilled, on any number of threads; how a step's
rows are grouped into launches (:data:`DECODE_PARTS_PER_LAUNCH`) changes no sum. One
kernel for every row, because the flash kernel sums in another order (online softmax over
key tiles) and the BLAS path in BLAS's, which depends on the chunk. The cost: a prefill row
reads its keys itself, where a flash tile shares them among its rows.

Numerics: float32 throughout, as the twin; ``fastmath={"contract", "reassoc"}`` lets LLVM
fuse multiply-adds and vectorise the dot products' sums (never ``nnan``/``ninf``: a NaN
read from outside a sequence's blocks shows in the output). The paged decode kernel writes
its sums as explicit sixteen-lane operations and takes ``contract`` only, so every sum keeps
its written order. Softmax weights use a vectorised ``exp``
(:func:`refengine.cpu.layer_ops.exp_affine`, within 2 ulp).
"""

from __future__ import annotations

import math
import sys
from functools import partial

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from refengine.attention import AttentionMetadata
from refengine.attention.numpy_ref import gather_context
from refengine.cpu import blas
from refengine.cpu.capture import Recordable
from refengine.cpu.layer_ops import F32, LN2_HI, LN2_LO, LOG2E, exp_affine
from refengine.cpu.numba_support import parallel_kernel, prefetch, register_kernels
from refengine.cpu.simd import (f16_to_f32, f32_to_f16, f8_load, f8_load_f16, f8_store, f8_sum, f8_transpose8,
                                q16_load_bytes, q16_to_f, v16_add, v16_fma, v16_halves, v16_load, v16_load_f16, v16_mul,
                                v16_splat, v16_store, v16_sums16, v16_zero)

#: Context tokens per decode task (a multiple of the block size is used).
DECODE_PARTITION = 128
#: Decode batches whose contexts add up to fewer tokens than this run on the calling thread:
#: their work is less than a parallel launch costs (waking spinning or sleeping threads).
SERIAL_DECODE_MAX_TOKENS = 256
#: Decode partitions per launch of :func:`paged_decode_kernel` (its scratch is about 2.4 KB per
#: partition at SmolLM2's 9 heads of 64): a long prefill chunk in batch-invariant mode is
#: thousands of decode rows, each of up to ``context / DECODE_PARTITION`` partitions.
DECODE_PARTS_PER_LAUNCH = 2048
#: Query rows per prefill task.
PREFILL_Q_TILE = 32
#: Key positions per prefill key tile (transposed K and V scratch tiles of 32 KB each at head_dim 64).
PREFILL_K_TILE = 128
#: Prefill chunks with at least this many query rows use BLAS products for ``Q K^T`` and ``P V``
#: (never in batch-invariant mode).
BLAS_PREFILL_MIN_ROWS = 64
#: Query rows per BLAS prefill tile: smaller tiles compute fewer scores above the diagonal,
#: larger ones make bigger products (docs/PERFORMANCE.md, "Design notes").
BLAS_PREFILL_Q_TILE = 128
#: Score rows per task of :func:`_causal_softmax`.
SOFTMAX_ROWS_PER_TASK = 32

#: The kernels' window when there is none: larger than any context (``p - W + 1`` stays far from overflow in int64).
_NO_WINDOW = 1 << 40
#: The kernels' soft-cap when there is none (a cap is positive).
_NO_CAP = 0.0

_FM = {"contract", "reassoc"}
#: The paged decode kernel's flags: its sums are written as explicit vector operations, and
#: without ``reassoc`` every scalar sum is kept in its written order, whatever LLVM makes
#: of the code around it (its serial and parallel versions give the same bits).
_CONTRACT = {"contract"}
_U = np.uintp  # unsigned indices: no negative-index wraparound in the inner loops


@njit(cache=True, fastmath={"contract"})
def _exp_and_sum(s, n, m, scratch):  # pragma: no cover - compiled
    """``s[j] = exp(s[j] - m)`` for ``j < n`` (vectorised, :func:`exp_affine`; ``scratch`` int32
    ``[>= 2n]``); returns their float32 sum (sixteen lanes in order, :func:`f8_sum` of
    :func:`v16_halves`, then the rest in order)."""
    head = s[:n]
    exp_affine(head, 1.0, -m, head, scratch)
    n16 = _U(n) // _U(16) * _U(16)
    acc = v16_zero()
    for j in range(_U(0), n16, _U(16)):  # sixteen running sums (one serial chain waits on the add latency)
        acc = v16_add(acc, v16_load(s, j))
    total = f8_sum(v16_halves(acc))
    for j in range(n16, _U(n)):
        total += s[j]
    return total


#: ``tanh`` argument (doubled) from which float32 ``tanh`` is 1: ``2 * 20``, clamped so ``2**k`` stays finite.
_TANH_2X_MAX = np.float32(40.0)


@njit(cache=True, fastmath={"contract"})
def _soft_cap(s, n, a, cap, scratch):  # pragma: no cover - compiled
    """In place ``s[j] = cap * tanh(a * s[j] / cap)`` for ``j < n`` (float32 ``s``; ``a, cap > 0``;
    ``scratch`` int32 ``[>= 2n]``): Gemma 2's attention-logit soft-cap.

    Vectorised (the C library's ``tanhf`` is a scalar call per score): with ``x = |a s / cap|``,
    ``tanh(x) = E / (E + 2)`` for ``E = expm1(2x)``, which has no cancellation near 0 (unlike
    ``1 - 2 / (exp(2x) + 1)``); ``expm1(y) = 2**k expm1(r) + (2**k - 1)`` with ``k = round(y / ln 2)``,
    ``|r| <= ln 2 / 2`` and ``expm1(r)`` by its degree-7 Taylor polynomial (remainder below
    2e-8 relative), ``2**k`` built as float32 bits as in :func:`exp_affine`. Within a few ulp
    of ``np.tanh`` (tested); NaN stays NaN.
    """
    c = np.float32(cap)
    two_x = np.float32(2.0 * a / cap)
    bits = scratch[:n]
    em1 = scratch[n:2 * n].view(np.float32)
    for j in range(n):  # writes only scratch, so LLVM vectorises it (see exp_affine)
        y = abs(s[j]) * two_x
        if y > _TANH_2X_MAX:
            y = _TANH_2X_MAX
        k = np.floor(y * LOG2E + np.float32(0.5))
        r = y - k * LN2_HI - k * LN2_LO
        p = np.float32(1.0 / 5040.0)
        p = p * r + np.float32(1.0 / 720.0)
        p = p * r + np.float32(1.0 / 120.0)
        p = p * r + np.float32(1.0 / 24.0)
        p = p * r + np.float32(1.0 / 6.0)
        p = p * r + np.float32(0.5)
        p = p * r + np.float32(1.0)
        bits[j] = (np.int32(k) + np.int32(127)) << 23
        em1[j] = p * r
    two_k = bits.view(np.float32)
    for j in range(n):
        e = two_k[j] * em1[j] + (two_k[j] - np.float32(1.0))
        t = c * (e / (e + np.float32(2.0)))
        s[j] = t if s[j] >= 0 else -t


@njit(cache=True)
def _prefix_max(s, n):  # pragma: no cover - compiled
    """``max(s[:n])`` for ``n >= 1``, as four running maxima (independent compares, no serial chain)."""
    m0 = m1 = m2 = m3 = s[0]
    n4 = n - n % 4
    for j in range(0, n4, 4):
        m0 = max(m0, s[j])
        m1 = max(m1, s[j + 1])
        m2 = max(m2, s[j + 2])
        m3 = max(m3, s[j + 3])
    for j in range(n4, n):
        m0 = max(m0, s[j])
    return max(max(m0, m1), max(m2, m3))


@njit(inline="always")
def _slot(slot_mapping, t, cache):  # pragma: no cover - compiled
    """Token ``t``'s ``(block, offset)`` in ``cache`` from ``slot_mapping``.

    Raises:
        IndexError: the slot lies outside the cache.
    """
    block_size = cache.shape[1]
    slot = slot_mapping[t]
    block = slot // block_size
    if slot < 0 or block >= cache.shape[0]:
        raise IndexError("slot_mapping entry outside the KV cache")
    return block, slot % block_size


@njit(cache=True)
def _write_kv(k_cache, v_cache, k, v, slot_mapping):  # pragma: no cover - compiled
    """``k_cache[slot // bs, slot % bs] = k[t]`` (and ``v``) for each token ``t``."""
    num_kv, head_dim = k_cache.shape[2], k_cache.shape[3]
    for t in range(slot_mapping.shape[0]):
        block, off = _slot(slot_mapping, t, k_cache)
        for h in range(num_kv):  # explicit loops: numba's broadcasting slice assignment takes seconds to compile
            for d in range(head_dim):
                k_cache[block, off, h, d] = k[t, h, d]
                v_cache[block, off, h, d] = v[t, h, d]


def kernel_views(k_cache: np.ndarray, v_cache: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The caches as the kernels take them: float16 as its uint16 bit patterns (numba has no
    float16), every other dtype as it is."""
    if k_cache.dtype == np.float16:
        return k_cache.view(np.uint16), v_cache.view(np.uint16)
    return k_cache, v_cache


@njit(cache=True)
def _write_kv_f16(k_cache, v_cache, k, v, slot_mapping):  # pragma: no cover - compiled
    """:func:`_write_kv` into float16 caches, given as their uint16 bit patterns: each value
    rounded to nearest, ties to even (:func:`f32_to_f16`: NumPy's ``astype(np.float16)``
    bit for bit)."""
    num_kv, head_dim = k_cache.shape[2], k_cache.shape[3]
    for t in range(slot_mapping.shape[0]):
        block, off = _slot(slot_mapping, t, k_cache)
        for h in range(num_kv):
            for d in range(head_dim):
                k_cache[block, off, h, d] = f32_to_f16(k[t, h, d])
                v_cache[block, off, h, d] = f32_to_f16(v[t, h, d])


@njit(cache=True)
def _write_kv_int8(k_cache, v_cache, k_scale, v_scale, k, v, slot_mapping):  # pragma: no cover - compiled
    """:func:`_write_kv` into int8 caches: each row ``k[t, h]`` (and ``v``) is stored as
    ``round(x / scale)`` clipped to [-127, 127] with ``scale = max|x| / 127`` in ``k_scale[block, off, h]``
    (scale 0: zeros). No fastmath: the division and rounding match :func:`quantize_int8` bitwise."""
    num_kv, head_dim = k_cache.shape[2], k_cache.shape[3]
    for t in range(slot_mapping.shape[0]):
        block, off = _slot(slot_mapping, t, k_cache)
        for h in range(num_kv):
            k_scale[block, off, h] = _quantize_row(k[t, h], k_cache[block, off, h], head_dim)
            v_scale[block, off, h] = _quantize_row(v[t, h], v_cache[block, off, h], head_dim)


def cache_writer(k_cache: np.ndarray, v_cache: np.ndarray, k_scale, v_scale) -> tuple:
    """The cache-write kernel for these caches and the cache arguments it takes before
    ``(k, v, slot_mapping)``: :func:`_write_kv_f16` over the bit patterns of float16 caches,
    :func:`_write_kv_int8` with the scales of int8 ones, :func:`_write_kv` otherwise."""
    if k_cache.dtype == np.float16:
        return _write_kv_f16, kernel_views(k_cache, v_cache)
    if k_scale is None:
        return _write_kv, (k_cache, v_cache)
    return _write_kv_int8, (k_cache, v_cache, k_scale, v_scale)


@njit(cache=True, inline="always")
def _quantize_row(x, out, n):  # pragma: no cover - compiled
    """``out[:n] = clip(rint(x / scale), -127, 127)`` int8; returns ``scale = max|x| / 127`` float32."""
    amax = np.float32(0.0)
    for d in range(n):
        amax = max(amax, abs(x[d]))
    scale = amax / np.float32(127.0)
    safe = scale if scale > 0 else np.float32(1.0)
    for d in range(n):
        out[d] = np.int8(min(max(np.rint(x[d] / safe), np.float32(-127.0)), np.float32(127.0)))
    return scale


def _kv16(cache, i):  # pragma: no cover - replaced by its overload in compiled code
    """Sixteen elements of the flat cache from index ``i`` as float32 lanes."""


@overload(_kv16, inline="always")
def _kv16_impl(cache, i):
    if cache.dtype == types.float32:
        return lambda cache, i: v16_load(cache, i)
    if cache.dtype == types.uint16:  # float16 bit patterns: exact
        return lambda cache, i: v16_load_f16(cache, i)
    return lambda cache, i: q16_to_f(q16_load_bytes(cache, i))  # int8: exact


def _kv8(cache, i):  # pragma: no cover - replaced by its overload in compiled code
    """Eight elements of the flat cache from index ``i`` as float32 lanes (float32 or float16 caches)."""


@overload(_kv8, inline="always")
def _kv8_impl(cache, i):
    if cache.dtype == types.float32:
        return lambda cache, i: f8_load(cache, i)
    if cache.dtype == types.uint16:
        return lambda cache, i: f8_load_f16(cache, i)
    return None


def _kv1(cache, i):  # pragma: no cover - replaced by its overload in compiled code
    """Element ``i`` of the flat cache as float32 (float16 caches hold uint16 bit patterns)."""


@overload(_kv1)
def _kv1_impl(cache, i):
    if cache.dtype == types.uint16:
        return lambda cache, i: f16_to_f32(cache[i])
    return lambda cache, i: np.float32(cache[i])


# numba's own inliner (``inline="always"``) re-runs its passes on the callee at every call
# site, and again inside every inlined caller: the dot of 64 dimensions (seventeen sites) and
# the prefetch loop (four) are plain cached functions instead, compiled once per cache type
# and inlined by LLVM all the same. The block loops stay numba-inlined: LLVM keeps them as
# calls when they are functions of their own.


@njit(cache=True)
def _dot64(q0, q1, q2, q3, kf, kb):  # pragma: no cover - compiled
    """The lane partials of ``q . k[kb : kb + 64]`` (``q`` as four vectors, ``kf`` the flat cache)."""
    t = v16_mul(q0, _kv16(kf, kb))
    t = v16_fma(q1, _kv16(kf, kb + _U(16)), t)
    t = v16_fma(q2, _kv16(kf, kb + _U(32)), t)
    return v16_fma(q3, _kv16(kf, kb + _U(48)), t)


@njit(inline="always")
def _block_scores(qg, qb, kf, kb, kv_row, n_pos, dims, scores, sb):  # pragma: no cover - compiled
    """``scores[sb + i] += q . k_i`` for the ``n_pos`` consecutive positions of one block
    (key row ``i`` at ``kb + i * kv_row`` of the flat cache, ``q`` at ``qg[qb:]``): 64
    dimensions at a time (``q`` in four registers), each dot's lanes summed by
    :func:`f8_sum` of :func:`v16_halves`, sixteen positions at once by :func:`v16_sums16`
    (the same bits); then a rest of 16 dimensions at a time, then single ones."""
    d64, d16 = dims // _U(64) * _U(64), dims // _U(16) * _U(16)
    n16 = n_pos // _U(16) * _U(16)
    for c in range(_U(0), d64, _U(64)):
        q0, q1 = v16_load(qg, qb + c), v16_load(qg, qb + c + _U(16))
        q2, q3 = v16_load(qg, qb + c + _U(32)), v16_load(qg, qb + c + _U(48))
        for i in range(_U(0), n16, _U(16)):
            k0 = kb + i * kv_row + c
            sums = v16_sums16(
                _dot64(q0, q1, q2, q3, kf, k0), _dot64(q0, q1, q2, q3, kf, k0 + kv_row),
                _dot64(q0, q1, q2, q3, kf, k0 + _U(2) * kv_row), _dot64(q0, q1, q2, q3, kf, k0 + _U(3) * kv_row),
                _dot64(q0, q1, q2, q3, kf, k0 + _U(4) * kv_row), _dot64(q0, q1, q2, q3, kf, k0 + _U(5) * kv_row),
                _dot64(q0, q1, q2, q3, kf, k0 + _U(6) * kv_row), _dot64(q0, q1, q2, q3, kf, k0 + _U(7) * kv_row),
                _dot64(q0, q1, q2, q3, kf, k0 + _U(8) * kv_row), _dot64(q0, q1, q2, q3, kf, k0 + _U(9) * kv_row),
                _dot64(q0, q1, q2, q3, kf, k0 + _U(10) * kv_row), _dot64(q0, q1, q2, q3, kf, k0 + _U(11) * kv_row),
                _dot64(q0, q1, q2, q3, kf, k0 + _U(12) * kv_row), _dot64(q0, q1, q2, q3, kf, k0 + _U(13) * kv_row),
                _dot64(q0, q1, q2, q3, kf, k0 + _U(14) * kv_row), _dot64(q0, q1, q2, q3, kf, k0 + _U(15) * kv_row))
            v16_store(scores, sb + i, v16_add(v16_load(scores, sb + i), sums))
        for i in range(n16, n_pos):
            scores[sb + i] += f8_sum(v16_halves(_dot64(q0, q1, q2, q3, kf, kb + i * kv_row + c)))
    for c in range(d64, d16, _U(16)):
        qc = v16_load(qg, qb + c)
        for i in range(n_pos):
            scores[sb + i] += f8_sum(v16_halves(v16_mul(qc, _kv16(kf, kb + i * kv_row + c))))
    for i in range(n_pos):
        for d in range(d16, dims):
            scores[sb + i] += qg[qb + d] * _kv1(kf, kb + i * kv_row + d)


@njit(inline="always")
def _block_values(scores, sb, vf, vb, kv_row, n_pos, dims, v_scale, block, off, h, acc,
                  ob):  # pragma: no cover - compiled
    """``acc[ob : ob + dims] += sum_i p_i * v_i`` over ``n_pos`` consecutive positions of one
    block (value row ``i`` at ``vb + i * kv_row``, ``p_i = scores[sb + i]``, times
    ``v_scale[block, off + i, h]`` for int8 caches): 64 dimensions at a time in four
    registers, then 16, then single ones; positions in order."""
    d64, d16 = dims // _U(64) * _U(64), dims // _U(16) * _U(16)
    for c in range(_U(0), d64, _U(64)):
        a0, a1 = v16_load(acc, ob + c), v16_load(acc, ob + c + _U(16))
        a2, a3 = v16_load(acc, ob + c + _U(32)), v16_load(acc, ob + c + _U(48))
        for i in range(n_pos):
            pj = scores[sb + i]
            if v_scale is not None:
                pj *= v_scale[block, off + i, h]
            pv, v0 = v16_splat(pj), vb + i * kv_row + c
            a0 = v16_fma(pv, _kv16(vf, v0), a0)
            a1 = v16_fma(pv, _kv16(vf, v0 + _U(16)), a1)
            a2 = v16_fma(pv, _kv16(vf, v0 + _U(32)), a2)
            a3 = v16_fma(pv, _kv16(vf, v0 + _U(48)), a3)
        v16_store(acc, ob + c, a0)
        v16_store(acc, ob + c + _U(16), a1)
        v16_store(acc, ob + c + _U(32), a2)
        v16_store(acc, ob + c + _U(48), a3)
    for c in range(d64, d16, _U(16)):
        a0 = v16_load(acc, ob + c)
        for i in range(n_pos):
            pj = scores[sb + i]
            if v_scale is not None:
                pj *= v_scale[block, off + i, h]
            a0 = v16_fma(v16_splat(pj), _kv16(vf, vb + i * kv_row + c), a0)
        v16_store(acc, ob + c, a0)
    for d in range(d16, dims):
        a = acc[ob + d]
        for i in range(n_pos):
            pj = scores[sb + i]
            if v_scale is not None:
                pj *= v_scale[block, off + i, h]
            a += pj * _kv1(vf, vb + i * kv_row + d)
        acc[ob + d] = a


@njit(inline="always")
def _block_span(block_tables, seq, b, end_block, start, end, block_size):  # pragma: no cover - compiled
    """Block ``b`` of a partition ``start .. end - 1`` of sequence ``seq``'s context: its
    cache block, the next one's (itself for the last), the partition's first slot in it,
    that position's index in the partition, and how many of the partition's positions it holds."""
    block, ahead = _U(block_tables[seq, b]), _U(block_tables[seq, min(b + 1, end_block - 1)])
    p0, p1 = max(start, b * block_size), min(end, (b + 1) * block_size)
    return block, ahead, _U(p0 - b * block_size), _U(p0 - start), _U(p1 - p0)


@njit(cache=True, fastmath=_CONTRACT)
def _decode_partition(p, q, k_cache, v_cache, k_scale, v_scale, block_tables, seqs, rows, part_seq, part_start,
                      part_end, scale32, cap, part_max, part_sum, part_acc):  # pragma: no cover - compiled
    """Partition ``p`` of :func:`paged_decode_kernel`: its scores, their max and exp-sum, and the
    unnormalised output, into ``part_max[p]``, ``part_sum[p]``, ``part_acc[p]``.

    Scores by :func:`_block_scores`, then one softmax per query head, then ``P V`` by
    :func:`_block_values` into ``part_acc``, block by block: each query head scores a
    block's positions sixteen at a time and sums its values there while the block is in L1;
    the block and the next one are prefetched first (each head reads a stride of every row).
    (A second order, position by position with every query head at each, reading the cache
    in address order, gave the same bits; measured side by side it was 1.3-1.6x slower for
    decode rows too, one or eight sequences, float32 and float16 caches, on an AMD EPYC
    Zen 5, and was removed.)

    The cache is indexed flat with unsigned indices (no row views: each costs two atomic
    reference-count updates; no negative-index checks); blocks are scattered, so the
    hardware prefetcher cannot run ahead across them (hence the hints).

    int8 caches (``k_scale``/``v_scale`` given): score = ``k_scale * (q . k_int8)``, and each
    probability is multiplied by its value row's scale before ``P V``. ``cap`` (float;
    :data:`_NO_CAP` for none): the scaled scores are soft-capped before their max.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv
    seq, row = seqs[part_seq[p]], rows[part_seq[p]]
    start, end = part_start[p], part_end[p]
    n = end - start
    dims, nn, bsz = _U(head_dim), _U(n), _U(block_size)
    kv_row = _U(num_kv) * dims  # from one position's rows to the next
    qs = np.empty(num_heads * head_dim, dtype=np.float32)  # the queries, scaled
    for i in range(num_heads):
        for d in range(head_dim):
            qs[i * head_dim + d] = q[row, i, d] * scale32
    scores = np.zeros(num_heads * n, dtype=np.float32)  # row i: query head i
    scratch = np.empty(2 * n, dtype=np.int32)
    kf, vf = k_cache.reshape(-1), v_cache.reshape(-1)
    first_block, end_block = start // block_size, (end + block_size - 1) // block_size
    for b in range(first_block, end_block):
        block, ahead, off, j, n_pos = _block_span(block_tables, seq, b, end_block, start, end, block_size)
        _prefetch_row(k_cache, (block * bsz + off) * kv_row, n_pos * kv_row)
        _prefetch_row(k_cache, (ahead * bsz + off) * kv_row, n_pos * kv_row)
        for i in range(_U(num_heads)):
            kb = (block * bsz + off) * kv_row + i // _U(group) * dims
            _block_scores(qs, i * dims, kf, kb, kv_row, n_pos, dims, scores, i * nn + j)
        if k_scale is not None:
            for i in range(_U(num_heads)):
                for t in range(n_pos):
                    scores[i * nn + j + t] *= k_scale[block, off + t, i // _U(group)]
    for i in range(num_heads):
        sc = scores[i * n:(i + 1) * n]
        if cap > 0.0:
            _soft_cap(sc, n, 1.0, cap, scratch)
        m = _prefix_max(sc, n)
        part_max[p, i // group, i % group] = m
        part_sum[p, i // group, i % group] = _exp_and_sum(sc, n, m, scratch)
    acc = part_acc.reshape(-1)
    ob = _U(p) * _U(num_heads) * dims
    for i in range(_U(num_heads) * dims):
        acc[ob + i] = 0.0
    for b in range(first_block, end_block):
        block, ahead, off, j, n_pos = _block_span(block_tables, seq, b, end_block, start, end, block_size)
        _prefetch_row(v_cache, (block * bsz + off) * kv_row, n_pos * kv_row)
        _prefetch_row(v_cache, (ahead * bsz + off) * kv_row, n_pos * kv_row)
        for i in range(_U(num_heads)):
            h = i // _U(group)
            vb = (block * bsz + off) * kv_row + h * dims
            _block_values(scores, i * nn + j, vf, vb, kv_row, n_pos, dims, v_scale, block, off, h, acc,
                          ob + i * dims)


@njit(cache=True)
def _prefetch_row(cache, first, length):  # pragma: no cover - compiled
    """Prefetch ``length`` elements of ``cache`` from flat element ``first``, one hint per
    64-byte line (16 float32, 32 float16 or 64 int8 elements)."""
    for i in range(_U(0), length, _U(64 // cache.itemsize)):
        prefetch(cache, first + i)


@parallel_kernel(fastmath=_CONTRACT)
def paged_decode_kernel(q, k_cache, v_cache, k_scale, v_scale, block_tables, seqs, rows, part_seq, part_start, part_end,
                  scale, cap, out):  # pragma: no cover - compiled
    """Decode attention for the batch sequences ``seqs`` whose query rows are ``rows``.

    Args:
        q: ``[T, H, D]`` float32.
        k_scale, v_scale: ``[num_blocks, block_size, KVH]`` float32 for int8 caches, else None.
        block_tables: ``[B, max_blocks]`` int32, the batch's block tables.
        seqs, rows: ``[n]`` int32: decode sequence ``d`` is batch sequence ``seqs[d]``, its
            query is row ``rows[d]``.
        part_seq, part_start, part_end: ``[P]`` int32: partition ``p`` covers context positions
            ``part_start[p] : part_end[p]`` of decode sequence ``part_seq[p]``; the partitions
            of one sequence are consecutive and cover the positions it attends to (its whole
            context, or the last ``W`` positions with a sliding window).
        cap: ``logits_soft_cap`` (float), or :data:`_NO_CAP`.
        out: ``[T, H, D]`` float32; the rows ``rows`` are written.
    """
    num_parts = part_seq.shape[0]
    part_max, part_sum, part_acc = _decode_scratch(num_parts, k_cache.shape[2], q.shape[1], q.shape[2])
    scale32 = np.float32(scale)
    for p in prange(num_parts):
        # int64 in both versions (prange's index is uint64 in the parallel one): one compiled task function
        _decode_partition(np.int64(p), q, k_cache, v_cache, k_scale, v_scale, block_tables, seqs, rows, part_seq,
                          part_start, part_end, scale32, cap, part_max, part_sum, part_acc)
    _merge_partitions(part_seq, rows, part_max, part_sum, part_acc, out)


@njit(cache=True)
def _decode_scratch(num_parts, num_kv, num_heads, head_dim):  # pragma: no cover - compiled
    """Per-partition max, exp-sum and output of :func:`paged_decode_kernel`."""
    group = num_heads // num_kv
    return (np.empty((num_parts, num_kv, group), dtype=np.float32),
            np.empty((num_parts, num_kv, group), dtype=np.float32),
            np.empty((num_parts, num_kv, group, head_dim), dtype=np.float32))


@njit(cache=True, fastmath=_FM)
def _merge_partitions(part_seq, rows, part_max, part_sum, part_acc, out):  # pragma: no cover - compiled
    """Merge each sequence's partitions into its output row: rescale to the common max, normalise once."""
    num_parts, num_kv, group, head_dim = part_acc.shape
    o = np.empty(head_dim, dtype=np.float32)
    first = 0
    while first < num_parts:
        last = first
        while last + 1 < num_parts and part_seq[last + 1] == part_seq[first]:
            last += 1
        row = rows[part_seq[first]]
        for h in range(num_kv):
            for g in range(group):
                m = part_max[first, h, g]
                for p in range(first + 1, last + 1):
                    m = max(m, part_max[p, h, g])
                total = np.float32(0.0)
                o[:] = 0.0
                for p in range(first, last + 1):
                    w = np.float32(math.exp(part_max[p, h, g] - m))
                    total += part_sum[p, h, g] * w
                    for d in range(head_dim):
                        o[d] += part_acc[p, h, g, d] * w
                inv = np.float32(1.0) / total
                for d in range(head_dim):
                    out[row, h * group + g, d] = o[d] * inv
        first = last + 1


def _transpose_keys(kf, first, row, count, dims, ktf, j0, k_tile):  # pragma: no cover - compiled
    """``kt[d, j0 + i] = kf[first + i * row + d]`` for ``i < count``, ``d < dims`` (``ktf``: the
    key tile ``kt [dims, k_tile]`` flat): ``count`` key rows of the cache into the tile's
    columns. Eight keys at a time by 8 x 8 register transposes (:func:`f8_transpose8`: eight
    row loads, eight column stores) where ``dims`` is a multiple of eight; element by element
    otherwise and for the last ``count % 8`` keys. A copy: the tile holds the same values.
    (float32 and float16 caches; int8 ones are dequantized into the tiles by the caller.)"""
    i8 = count // _U(8) * _U(8) if dims % _U(8) == _U(0) else _U(0)
    for i in range(_U(0), i8, _U(8)):
        src = first + i * row
        for d in range(_U(0), dims, _U(8)):
            c0, c1, c2, c3, c4, c5, c6, c7 = f8_transpose8(
                _kv8(kf, src + d), _kv8(kf, src + row + d), _kv8(kf, src + _U(2) * row + d),
                _kv8(kf, src + _U(3) * row + d), _kv8(kf, src + _U(4) * row + d),
                _kv8(kf, src + _U(5) * row + d), _kv8(kf, src + _U(6) * row + d),
                _kv8(kf, src + _U(7) * row + d))
            dst = d * k_tile + j0 + i
            f8_store(ktf, dst, c0)
            f8_store(ktf, dst + k_tile, c1)
            f8_store(ktf, dst + _U(2) * k_tile, c2)
            f8_store(ktf, dst + _U(3) * k_tile, c3)
            f8_store(ktf, dst + _U(4) * k_tile, c4)
            f8_store(ktf, dst + _U(5) * k_tile, c5)
            f8_store(ktf, dst + _U(6) * k_tile, c6)
            f8_store(ktf, dst + _U(7) * k_tile, c7)
    _key_columns(kf, first, row, i8, count, dims, ktf, j0, k_tile)


@njit(inline="always")
def _key_columns(kf, first, row, i0, count, dims, ktf, j0, k_tile):  # pragma: no cover - compiled
    """:func:`_transpose_keys` element by element, for keys ``i0 .. count - 1``: contiguous
    stores, strided loads."""
    for d in range(dims):
        for i in range(i0, count):
            ktf[d * k_tile + j0 + i] = _kv1(kf, first + i * row + d)


@overload(_transpose_keys, inline="always")
def _transpose_keys_impl(kf, first, row, count, dims, ktf, j0, k_tile):
    # an overload: numba types both branches of the caller's ``k_scale is None``, and the
    # vector loads exist for float32 and float16 only; an int8 cache (never reached) gets the plain copy
    if kf.dtype in (types.float32, types.uint16):
        return _transpose_keys

    def plain(kf, first, row, count, dims, ktf, j0, k_tile):
        _key_columns(kf, first, row, _U(0), count, dims, ktf, j0, k_tile)

    return plain


@njit(cache=True, fastmath=_FM)
def _prefill_task(task, q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, query_start_loc, tile_seq,
                  tile_q0, scale32, window, cap, q_tile, k_tile, out):  # pragma: no cover - compiled
    """Task ``task`` of :func:`_flash_prefill`: one query tile of one sequence, one KV head
    (int8 caches: the key/value tiles hold ``q * scale``).

    Key tiles start at the tile boundary (a multiple of ``k_tile`` positions) at or before
    the first row's window start (keys before it are outside every row's window) and end
    after the last row; in each tile, row ``r`` scores only its own keys
    ``j0 .. j1 - 1`` (window start to its position), into ``s[0 : j1 - j0]``. A row with no
    key in a tile skips it (its running max stays -inf until its first key: no NaN)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv
    d4 = head_dim - head_dim % 4
    tile, h = task // num_kv, task % num_kv
    seq = tile_seq[tile]
    first_row = query_start_loc[seq]
    q_len = query_start_loc[seq + 1] - first_row
    first_pos = seq_lens[seq] - q_len  # position of the sequence's first query row
    q0 = tile_q0[tile]
    n_rows = min(q_tile, q_len - q0)
    qs = np.empty((n_rows, group, head_dim), dtype=np.float32)
    for r in range(n_rows):
        for g in range(group):
            qs[r, g] = q[first_row + q0 + r, h * group + g] * scale32
    row_max = np.full((n_rows, group), -np.inf, dtype=np.float32)
    row_sum = np.zeros((n_rows, group), dtype=np.float32)
    acc = np.zeros((n_rows, group, head_dim), dtype=np.float32)
    kt = np.empty((head_dim, k_tile), dtype=np.float32)  # keys transposed: scores vectorise over keys
    vt = np.empty((k_tile, head_dim), dtype=np.float32)
    s = np.empty(k_tile, dtype=np.float32)
    scratch = np.empty(2 * k_tile, dtype=np.int32)
    end_key = first_pos + q0 + n_rows  # keys at or after this are in every row's future
    # the caches read flat with unsigned indices: a row view per key costs two atomic
    # reference-count updates, and signed indices a negative-index check per element
    kf, vf = k_cache.reshape(-1), v_cache.reshape(-1)
    dims = _U(head_dim)
    ktf, vtf = kt.reshape(-1), vt.reshape(-1)
    # keys before the window start of the first row are behind every row's window; the tiles
    # start at a multiple of k_tile so a row meets the same tiles whatever its chunk
    first_key = max(0, first_pos + q0 - window + 1) // k_tile * k_tile
    for k0 in range(first_key, end_key, k_tile):
        n_keys = min(k_tile, end_key - k0)
        for b in range(k0 // block_size, (k0 + n_keys + block_size - 1) // block_size):
            block = _U(block_tables[seq, b])
            lo, hi = max(k0, b * block_size), min(k0 + n_keys, (b + 1) * block_size)  # this block's keys
            b_off, t_off = _U(lo - b * block_size), _U(lo - k0)  # key lo's slot in the block, column in the tile
            count = _U(hi - lo)
            first = ((block * _U(block_size) + b_off) * _U(num_kv) + _U(h)) * dims  # key lo's row in kf, vf
            row = _U(num_kv) * dims  # from one position's row to the next
            if k_scale is None:
                for i in range(count):
                    for d in range(dims):
                        vt[t_off + i, d] = _kv1(vf, first + i * row + d)
                _transpose_keys(kf, first, row, count, dims, ktf, t_off, _U(k_tile))
            else:  # dequantize into the tiles
                for i in range(count):
                    ks, vs = k_scale[block, b_off + i, h], v_scale[block, b_off + i, h]
                    for d in range(dims):
                        kt[d, t_off + i] = kf[first + i * row + d] * ks
                        vt[t_off + i, d] = vf[first + i * row + d] * vs
        for r in range(n_rows):
            pos = first_pos + q0 + r
            j0 = max(0, pos - window + 1 - k0)  # this row's keys in the tile: j0 .. j1 - 1
            j1 = min(n_keys, pos - k0 + 1)
            n_valid = j1 - j0
            if n_valid <= 0:
                continue
            for g in range(group):
                qr = qs[r, g]
                s[:n_valid] = 0.0
                for d in range(0, d4, 4):  # four dims per pass: one load/store of s per four FMAs
                    x0, x1, x2, x3 = qr[d], qr[d + 1], qr[d + 2], qr[d + 3]
                    # flat offsets into the tile, not row views (each view costs reference-count updates)
                    ko0 = _U(d) * _U(k_tile) + _U(j0)
                    ko1, ko2, ko3 = ko0 + _U(k_tile), ko0 + _U(2 * k_tile), ko0 + _U(3 * k_tile)
                    for j in range(_U(n_valid)):
                        s[j] += x0 * ktf[ko0 + j] + x1 * ktf[ko1 + j] + x2 * ktf[ko2 + j] + x3 * ktf[ko3 + j]
                for d in range(d4, head_dim):
                    qd = qr[d]
                    for j in range(n_valid):
                        s[j] += qd * kt[d, j0 + j]
                if cap > 0.0:
                    _soft_cap(s, n_valid, 1.0, cap, scratch)
                m_old = row_max[r, g]
                m_new = max(m_old, _prefix_max(s, n_valid))
                alpha = np.float32(math.exp(m_old - m_new))  # 0 on the first tile (m_old = -inf)
                row_sum[r, g] = row_sum[r, g] * alpha + _exp_and_sum(s, n_valid, m_new, scratch)
                row_max[r, g] = m_new
                a = acc[r, g]
                for d in range(head_dim):
                    a[d] *= alpha
                j4 = n_valid - n_valid % 4
                for j in range(0, j4, 4):  # four keys per pass: one load/store of acc per four FMAs
                    p0, p1, p2, p3 = s[j], s[j + 1], s[j + 2], s[j + 3]
                    vo0 = _U(j0 + j) * dims  # value rows by flat offsets, as the keys above
                    vo1, vo2, vo3 = vo0 + dims, vo0 + _U(2) * dims, vo0 + _U(3) * dims
                    for d in range(dims):
                        a[d] += p0 * vtf[vo0 + d] + p1 * vtf[vo1 + d] + p2 * vtf[vo2 + d] + p3 * vtf[vo3 + d]
                for j in range(j4, n_valid):
                    pj = s[j]
                    vo0 = _U(j0 + j) * dims
                    for d in range(dims):
                        a[d] += pj * vtf[vo0 + d]
    for r in range(n_rows):
        for g in range(group):
            inv = np.float32(1.0) / row_sum[r, g]
            o = out[first_row + q0 + r, h * group + g]
            for d in range(head_dim):
                o[d] = acc[r, g, d] * inv


@parallel_kernel(fastmath=_FM)
def _flash_prefill(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, query_start_loc, tile_seq,
                   tile_q0, scale, window, cap, q_tile, k_tile, out):  # pragma: no cover - compiled
    """Causal flash attention for the query tiles listed by ``tile_seq``/``tile_q0``.

    Args:
        q: ``[T, H, D]`` float32.
        k_scale, v_scale: ``[num_blocks, block_size, KVH]`` float32 for int8 caches, else None.
        query_start_loc, seq_lens, block_tables: the batch's metadata (int32).
        tile_seq, tile_q0: ``[n]`` int32: tile ``i`` is query rows ``tile_q0[i] : tile_q0[i] + q_tile``
            (clipped to the sequence) of sequence ``tile_seq[i]``, counted from its first row.
        window: keys per query (int; :data:`_NO_WINDOW` for none).
        cap: ``logits_soft_cap`` (float), or :data:`_NO_CAP`.
        out: ``[T, H, D]`` float32, the tiles' rows are written.
    """
    num_kv = k_cache.shape[2]
    scale32 = np.float32(scale)
    for task in prange(tile_seq.shape[0] * num_kv):
        # int64 in both versions (prange's index is uint64 in the parallel one): one compiled task function
        _prefill_task(np.int64(task), q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, query_start_loc,
                      tile_seq, tile_q0, scale32, window, cap, q_tile, k_tile, out)


@njit(cache=True, fastmath=_FM)
def _softmax_rows(s, first_pos, group, scale32, window, cap, r0, r1):  # pragma: no cover - compiled
    """Rows ``r0 .. r1 - 1`` of :func:`_causal_softmax`."""
    n_keys = s.shape[1]
    scratch = np.empty(2 * n_keys, dtype=np.int32)
    for i in range(r0, r1):
        row = s[i]
        pos = first_pos + i // group
        j0, j1 = max(0, pos - window + 1), min(n_keys, pos + 1)  # keys j0 ..= this row's position
        n = j1 - j0
        for j in range(j0):  # behind the window
            row[j] = 0.0
        head = row[j0:j1]
        if cap <= 0.0:  # no cap (_NO_CAP)
            m = _prefix_max(head, n)
            exp_affine(head, scale32, -scale32 * m, head, scratch)  # exp(scale * (s - max))
        else:  # the cap needs the scaled scores: scale, cap, then exp(s - max)
            _soft_cap(head, n, scale32, cap, scratch)
            m = _prefix_max(head, n)
            exp_affine(head, 1.0, -m, head, scratch)
        total = np.float32(0.0)
        for j in range(n):
            total += head[j]
        inv = np.float32(1.0) / total
        for j in range(n):
            head[j] *= inv
        for j in range(j1, n_keys):  # the future
            row[j] = 0.0


@parallel_kernel()
def _causal_softmax(s, first_pos, group, scale, window, cap, rows_per_task):  # pragma: no cover - compiled
    """In place: row ``i`` of ``s [R, K]`` float32 (raw scores ``q . k`` over keys ``0 .. K - 1``,
    row ``i`` the query at key position ``p = first_pos + i // group``) becomes the softmax of
    ``scale * s[i, j0:p + 1]`` (soft-capped first when ``cap`` is not :data:`_NO_CAP`), ``j0 = max(0, p - window + 1)``,
    and 0 elsewhere (behind the window and the future)."""
    scale32 = np.float32(scale)
    num_rows = s.shape[0]
    for t in prange((num_rows + rows_per_task - 1) // rows_per_task):
        _softmax_rows(s, first_pos, group, scale32, window, cap, t * rows_per_task,
                      min(num_rows, (t + 1) * rows_per_task))


def decode_partition_tokens(block_size: int) -> int:
    """Context tokens per decode partition for caches of ``block_size`` tokens per block:
    :data:`DECODE_PARTITION` rounded down to whole blocks, at least one block."""
    return max(block_size, DECODE_PARTITION // block_size * block_size)


class _DecodeParts:
    """Decode partitions of a step for one window (the arguments of :func:`paged_decode_kernel`).

    Attributes:
        seq, start, end: ``[P]`` int32: partition ``p`` is context positions ``start[p] : end[p]``
            of decode sequence ``seq[p]``; a sequence's partitions are consecutive, of
            ``part`` tokens from ``max(0, seq_len - W)`` (the last may be shorter).
        launches: ``(a, b, tokens)``: partitions ``a : b`` (whole sequences) make one launch,
            reading ``tokens`` context tokens (the serial-or-parallel choice).
        launch_args: per launch, ``(tokens, seq[a:b], start[a:b], end[a:b])``, sliced once for
            every layer's call.
        tokens: context tokens read in all.
    """

    def __init__(self, lens: np.ndarray, window: int | None, part: int):
        first = np.zeros_like(lens) if window is None else np.maximum(lens - window, 0)
        counts = -(-(lens - first) // part)  # partitions per decode sequence
        self.seq = np.repeat(np.arange(lens.size), counts).astype(np.int32)
        firsts = np.cumsum(counts) - counts  # index of each sequence's first partition
        offset = np.repeat(firsts, counts)
        self.start = (first[self.seq] + (np.arange(self.seq.size) - offset) * part).astype(np.int32)
        self.end = np.minimum(self.start + part, lens[self.seq]).astype(np.int32)
        # launches of whole sequences, about DECODE_PARTS_PER_LAUNCH partitions each (the
        # kernel's scratch stays small); with each launch's context tokens (serial or parallel)
        new = np.flatnonzero(np.diff(firsts // DECODE_PARTS_PER_LAUNCH)) + 1
        edges = [0, *firsts[new].tolist(), self.seq.size]
        tokens = np.concatenate([[0], np.cumsum(self.end - self.start)])
        self.launches = [(a, b, int(tokens[b] - tokens[a])) for a, b in zip(edges[:-1], edges[1:]) if b > a]
        self.launch_args = [(t, self.seq[a:b], self.start[a:b], self.end[a:b]) for a, b, t in self.launches]
        self.tokens = int(tokens[-1])


class _Plan:
    """Per-step work lists derived from the metadata (built once in ``prepare``); decode
    partitions per sliding window, built at the first layer that uses it (:meth:`decode_parts`)."""

    def __init__(self, meta: AttentionMetadata, block_size: int, batch_invariant: bool = False,
                 blas_min_rows: int | None = None):
        qsl = np.ascontiguousarray(meta.query_start_loc, dtype=np.int32)
        seq_lens = np.ascontiguousarray(meta.seq_lens, dtype=np.int32)
        self.meta = meta
        self.block_size = block_size
        self.batch_invariant, self.blas_min_rows = batch_invariant, blas_min_rows
        self.query_start_loc, self.seq_lens = qsl, seq_lens
        self.block_tables = np.ascontiguousarray(meta.block_tables, dtype=np.int32)
        self.slot_mapping = np.ascontiguousarray(meta.slot_mapping, dtype=np.int32)
        q_lens = np.diff(qsl)
        if (q_lens < 1).any() or (q_lens > seq_lens).any():
            raise ValueError("each sequence needs 1 <= q_len <= seq_len")
        # every block a sequence reads must exist: checked here, once, since the kernels do not
        blocks_needed = -(-seq_lens // block_size)
        if blocks_needed.max(initial=0) > self.block_tables.shape[1]:
            raise ValueError("block_tables has fewer columns than seq_lens needs")
        used = np.arange(self.block_tables.shape[1])[None, :] < blocks_needed[:, None]
        ids = self.block_tables[used]
        self.min_block = int(ids.min(initial=0))
        self.max_block = int(ids.max(initial=-1))
        self.min_slot = int(self.slot_mapping.min(initial=0))
        self.max_slot = int(self.slot_mapping.max(initial=-1))

        if batch_invariant:
            # every query row, prefill rows too, is a decode row of the paged decode kernel: its
            # context is its own position's keys, partitioned by its own length (one algorithm per row)
            self.decode_seqs = np.repeat(np.arange(q_lens.size, dtype=np.int32), q_lens)
            self.decode_rows = np.arange(int(qsl[-1]), dtype=np.int32)
        else:
            self.decode_seqs = np.flatnonzero(q_lens == 1).astype(np.int32)
            self.decode_rows = qsl[self.decode_seqs]
        # a decode row's context: its sequence's length less the rows after it in its chunk
        self._decode_lens = (seq_lens[self.decode_seqs] - (qsl[self.decode_seqs + 1] - 1 - self.decode_rows)
                             ).astype(np.int64)
        self._part = decode_partition_tokens(block_size)
        self._decode_parts: dict[int | None, _DecodeParts] = {}
        self._windows: set[int | None] = set()  # every window asked for (decode_parts)
        self.max_seq_len = int(seq_lens.max(initial=0))

        prefill = np.flatnonzero(q_lens > 1) if not batch_invariant else np.zeros(0, np.int64)
        to_blas = q_lens >= (BLAS_PREFILL_MIN_ROWS if blas_min_rows is None else blas_min_rows)
        self.blas_prefill = [int(i) for i in prefill if to_blas[i]]
        tiles = [(int(i), q0) for i in prefill if not to_blas[i]
                 for q0 in range(0, int(q_lens[i]), PREFILL_Q_TILE)]
        self.tile_seq = np.array([t[0] for t in tiles], dtype=np.int32)
        self.tile_q0 = np.array([t[1] for t in tiles], dtype=np.int32)

    def decode_parts(self, window: int | None) -> _DecodeParts:
        """The decode partitions for ``window`` (None: whole contexts), cached for the step's
        other layers; a window at least every context is the same work as none."""
        self._windows.add(window)
        if window is not None and window >= self.max_seq_len:
            window = None
        parts = self._decode_parts.get(window)
        if parts is None:
            parts = self._decode_parts[window] = _DecodeParts(self._decode_lens, window, self._part)
        return parts


    def check(self, num_blocks: int, block_size: int) -> None:
        """Raise unless every block id the step reads and every slot it writes is inside a
        cache of ``num_blocks`` blocks of ``block_size`` slots.

        Raises:
            ValueError: a block id outside the cache.
            IndexError: a slot outside the cache.
        """
        if self.min_block < 0 or self.max_block >= num_blocks:
            raise ValueError(f"block ids {self.min_block}..{self.max_block} outside the cache's {num_blocks} blocks")
        slots = num_blocks * block_size
        if self.min_slot < 0 or self.max_slot >= slots:
            raise IndexError(f"slot_mapping entries {self.min_slot}..{self.max_slot} outside the KV cache's "
                             f"{slots} slots")

    def _arrays(self) -> list[np.ndarray]:
        """Every array a kernel launch of this step reads, in a fixed order (windows sorted, None first)."""
        arrays = [self.query_start_loc, self.seq_lens, self.block_tables, self.slot_mapping, self.decode_seqs,
                  self.decode_rows, self.tile_seq, self.tile_q0]
        for window in sorted(self._windows, key=lambda w: -1 if w is None else w):
            parts = self.decode_parts(window)
            arrays += [parts.seq, parts.start, parts.end]
        return arrays

    def _shape(self) -> tuple:
        """What the launches of a step depend on besides the arrays' values: their shapes, which
        windows share partitions, each launch's partitions and serial-or-parallel choice, the
        BLAS-prefill sequences."""
        windows = sorted(self._windows, key=lambda w: -1 if w is None else w)
        parts = [self.decode_parts(w) for w in windows]
        launches = tuple(tuple((a, b, t < SERIAL_DECODE_MAX_TOKENS) for a, b, t in p.launches) for p in parts)
        shared = tuple(tuple(p is q for q in parts) for p in parts)
        return tuple(a.shape for a in self._arrays()), launches, shared, tuple(self.blas_prefill)

    def refill(self, meta: AttentionMetadata, num_blocks: int) -> bool:
        """This plan's arrays rewritten in place for ``meta`` (a recorded step's metadata with
        new values), when its launches keep their shape: True; False when they would not
        (the step must be recorded again).

        Raises:
            the errors of :meth:`check`, and ValueError for inconsistent metadata.
        """
        fresh = _Plan(meta, self.block_size, self.batch_invariant, self.blas_min_rows)
        fresh._windows = set(self._windows)
        fresh.check(num_blocks, self.block_size)
        if fresh._shape() != self._shape():
            return False
        for mine, new in zip(self._arrays(), fresh._arrays(), strict=True):
            if mine is not new:
                np.copyto(mine, new)
        self.min_block, self.max_block, self.min_slot, self.max_slot = (fresh.min_block, fresh.max_block,
                                                                        fresh.min_slot, fresh.max_slot)
        return True


# dtypes the checks compare with (dtype objects: comparing a dtype with a scalar type converts the type each time)
_FLOAT_CACHES = (F32, np.dtype(np.float16))
_INT8_CACHES = (np.dtype(np.int8),)


class NumbaAttention(Recordable):
    """The numba backend (``attention_backend="numba"``). float32 queries; float32 or float16
    caches (``kv_cache_dtype="float16"``: values rounded to nearest on write, read exactly,
    so attention over them gives the same bits as over their float32 copy), or int8 caches
    with float32 ``k_scale``/``v_scale`` (``kv_cache_dtype="int8"``).

    Raises (from ``write_kv``/``forward``):
        TypeError: a dtype other than these.
        ValueError: inconsistent metadata or scale shapes, or block ids outside the cache.
    """

    name = "numba"

    def __init__(self, *, batch_invariant: bool = False):
        self.batch_invariant = bool(batch_invariant)
        #: Whether long chunks may use BLAS products (off: the compiled prefill kernel for every
        #: chunk; the engine turns it off when no layer product uses BLAS, so a step keeps numba's threads).
        self.use_blas_prefill = True
        self._plan: _Plan | None = None
        self._scores = np.empty(0, dtype=np.float32)  # the BLAS prefill's score tiles, kept between calls

    @property
    def blas_prefill_min_rows(self) -> int:
        """Chunks of at least this many rows use BLAS products (the model runner then gives BLAS
        the threads): :data:`BLAS_PREFILL_MIN_ROWS`, or none (``sys.maxsize``) in
        batch-invariant mode or without :attr:`use_blas_prefill`."""
        return BLAS_PREFILL_MIN_ROWS if self.use_blas_prefill and not self.batch_invariant else sys.maxsize

    def prepare(self, meta: AttentionMetadata) -> None:
        """Start a step: its work lists (decode partitions, prefill tiles) are built at the
        first layer's call, when the cache's block size is known, and reused by the others."""
        self._plan = None

    def _plan_for(self, meta: AttentionMetadata, k_cache: np.ndarray) -> _Plan:
        """The step's plan for a cache like ``k_cache``, its block ids and slots checked;
        while recording, a replay first refills it for the new step's metadata (or asks for a
        new recording: :meth:`_Plan.refill`)."""
        plan = self._plan
        if plan is None or plan.meta is not meta or plan.block_size != k_cache.shape[1]:
            plan = self._plan = _Plan(meta, k_cache.shape[1], self.batch_invariant, self.blas_prefill_min_rows)
            plan.check(k_cache.shape[0], k_cache.shape[1])
            if self.tape is not None:
                self.tape.checks.append(partial(plan.refill, meta, k_cache.shape[0]))
        return plan

    @staticmethod
    def _check(k_cache: np.ndarray, v_cache: np.ndarray, k_scale, v_scale, *arrays: np.ndarray) -> None:
        cache_dtypes = _FLOAT_CACHES if k_scale is None else _INT8_CACHES
        if k_cache.dtype not in cache_dtypes or v_cache.dtype != k_cache.dtype:
            names = " or ".join(np.dtype(d).name for d in cache_dtypes)
            raise TypeError(f"the numba attention backend takes {names} "
                            f"caches {'with' if k_scale is not None else 'without'} scales (k and v alike), "
                            f"got k_cache {k_cache.dtype} and v_cache {v_cache.dtype}")
        for a in arrays:
            if a.dtype is not F32 and a.dtype != F32:
                raise TypeError(f"the numba attention backend takes float32 arrays, got {a.dtype}")
        if k_cache.shape != v_cache.shape or k_cache.ndim != 4:
            raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} must be equal 4-d shapes")
        if (k_scale is None) != (v_scale is None):
            raise ValueError("k_scale and v_scale go together: give both or neither")
        if k_scale is not None:
            for a in (k_scale, v_scale):
                if a.dtype != np.float32 or a.shape != k_cache.shape[:3]:
                    raise ValueError(f"k_scale/v_scale must be float32 of shape {k_cache.shape[:3]}, "
                                     f"got {a.dtype} {a.shape}")

    def write_kv(self, k_cache: np.ndarray, v_cache: np.ndarray, k: np.ndarray, v: np.ndarray,
                 meta: AttentionMetadata, *, k_scale: np.ndarray | None = None,
                 v_scale: np.ndarray | None = None) -> None:
        """Store ``k, v [T, num_kv_heads, head_dim]`` float32 at ``meta.slot_mapping [T]`` in place
        (float16 caches: rounded to nearest, as NumPy's ``astype``; int8 caches: quantized,
        each row's scale into ``k_scale``/``v_scale``
        ``[num_blocks, block_size, num_kv_heads]`` float32).

        Raises:
            IndexError: a slot outside the cache.
        """
        self._check(k_cache, v_cache, k_scale, v_scale, k, v)
        plan = self._plan_for(meta, k_cache)
        kernel, caches = cache_writer(k_cache, v_cache, k_scale, v_scale)
        self._launch(kernel, *caches, k, v, plan.slot_mapping)

    def forward(self, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, meta: AttentionMetadata,
                scale: float, out: np.ndarray | None = None, *, sliding_window: int | None = None,
                logits_soft_cap: float | None = None, k_scale: np.ndarray | None = None,
                v_scale: np.ndarray | None = None) -> np.ndarray:
        """Attention per the contract.

        Args:
            q: ``[T, num_heads, head_dim]`` float32.
            k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` float32 or
                float16, or int8 with ``k_scale, v_scale [num_blocks, block_size, num_kv_heads]`` float32.
            meta: where each sequence's queries and keys live.
            scale: softmax scale (> 0), usually ``1 / sqrt(head_dim)``.
            out: optional ``[T, num_heads, head_dim]`` float32 C-contiguous array to write
                (tests pass one poisoned with NaN: every row must be overwritten).
            sliding_window: ``W``, keys per query (itself included), or None for all.
            logits_soft_cap: ``c`` of ``c * tanh(scale * q.k / c)``, or None.
        Returns:
            ``[T, num_heads, head_dim]`` float32 (``out`` when given).
        Raises:
            ValueError: ``sliding_window < 1`` or ``logits_soft_cap`` not a positive finite number
                (and the errors of the class docstring).
        """
        self._check(k_cache, v_cache, k_scale, v_scale, q)
        if sliding_window is not None:
            if int(sliding_window) != sliding_window or sliding_window < 1:
                raise ValueError(f"sliding_window must be an int >= 1 or None, got {sliding_window!r}")
            sliding_window = int(sliding_window)  # a Python int: numba compiles no other specialisation
        if logits_soft_cap is not None:
            logits_soft_cap = float(logits_soft_cap)
            if not (0.0 < logits_soft_cap < math.inf):
                raise ValueError(f"logits_soft_cap must be a positive finite number or None, got {logits_soft_cap}")
        plan = self._plan_for(meta, k_cache)
        if q.shape[1] % k_cache.shape[2]:
            raise ValueError(f"num_heads {q.shape[1]} is not a multiple of num_kv_heads {k_cache.shape[2]}")
        q = self._contiguous(q)
        if out is None:
            out = np.empty(q.shape, dtype=np.float32)
        elif out.shape != q.shape or out.dtype != np.float32 or not out.flags.c_contiguous:
            raise ValueError(f"out must be a C-contiguous float32 array of shape {q.shape}")
        window = _NO_WINDOW if sliding_window is None else sliding_window
        cap = _NO_CAP if logits_soft_cap is None else logits_soft_cap
        kc, vc = kernel_views(k_cache, v_cache)
        if plan.decode_seqs.shape[0]:
            parts = plan.decode_parts(sliding_window)
            scale = float(scale)
            for tokens, seq, start, end in parts.launch_args:
                decode = paged_decode_kernel.serial if tokens < SERIAL_DECODE_MAX_TOKENS else paged_decode_kernel
                self._launch(decode, q, kc, vc, k_scale, v_scale, plan.block_tables, plan.decode_seqs,
                             plan.decode_rows, seq, start, end, scale, cap, out)
        if plan.tile_seq.shape[0]:
            self._launch(_flash_prefill, q, kc, vc, k_scale, v_scale, plan.block_tables, plan.seq_lens,
                         plan.query_start_loc, plan.tile_seq, plan.tile_q0, float(scale), window, cap,
                         PREFILL_Q_TILE, PREFILL_K_TILE, out)
        for i in plan.blas_prefill:
            self._launch(self._blas_prefill, q, k_cache, v_cache, k_scale, v_scale, plan, i, scale, window,
                         cap, out)
        return out

    def _blas_prefill(self, q, k_cache, v_cache, k_scale, v_scale, plan: _Plan, i: int, scale: float, window: int,
                      cap: float, out: np.ndarray) -> None:
        """Sequence ``i``'s chunk by BLAS tiles (module docstring): for each KV head and tile of
        query rows, ``S = Q K^T`` over the keys from the window start of the tile's first row
        to the tile's last position, the masked softmax in place, ``O = S V``. Only the blocks
        from the chunk's first window start on are gathered. The score tiles live in one
        buffer kept between calls: a fresh multi-MB array per tile costs a page fault per
        4 KB on first write (about as long as the product itself at a 1024-token chunk)."""
        start, end = int(plan.query_start_loc[i]), int(plan.query_start_loc[i + 1])
        seq_len = int(plan.seq_lens[i])
        first_pos = seq_len - (end - start)
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv = k_cache.shape[2]
        group = num_heads // num_kv
        block_size = k_cache.shape[1]
        first_block = max(0, first_pos - window + 1) // block_size  # blocks before are behind every row's window
        base = first_block * block_size  # the position of key row 0 of k, v
        k, v = gather_context(k_cache, v_cache, plan.block_tables[i, first_block:], seq_len - base, k_scale,
                              v_scale)  # [seq_len - base, num_kv, D]
        k, v = k.astype(np.float32, copy=False), v.astype(np.float32, copy=False)
        need = min(end - start, BLAS_PREFILL_Q_TILE) * group * min(seq_len - base, BLAS_PREFILL_Q_TILE + window)
        if self._scores.size < need:
            self._scores = np.empty(need, dtype=np.float32)
        for h in range(num_kv):
            kh, vh = np.ascontiguousarray(k[:, h]), np.ascontiguousarray(v[:, h])
            heads = slice(h * group, (h + 1) * group)
            for q0 in range(start, end, BLAS_PREFILL_Q_TILE):
                q1 = min(end, q0 + BLAS_PREFILL_Q_TILE)
                tile_pos = first_pos + (q0 - start)  # the tile's first row
                k0 = max(base, tile_pos - window + 1) - base  # keys before are behind every row's window
                k1 = first_pos + (q1 - start) - base  # keys after the tile's last row are in every row's future
                qt = q[q0:q1, heads].reshape((q1 - q0) * group, head_dim)  # row (r, g) = r * group + g
                scores = self._scores[:qt.shape[0] * (k1 - k0)].reshape(qt.shape[0], k1 - k0)
                blas.matmul(qt, kh[k0:k1].T, out=scores)
                _causal_softmax(scores, tile_pos - base - k0, group, float(scale), window, cap,
                                SOFTMAX_ROWS_PER_TASK)
                out[q0:q1, heads] = blas.matmul(scores, vh[k0:k1]).reshape(q1 - q0, group, head_dim)


register_kernels(sys.modules[__name__])
