"""Attention over the paged KV cache as CPU kernels compiled by numba.

The same contract (:mod:`refengine.attention`) and the same two algorithms as the NumPy
twin (:mod:`refengine.attention.numpy_ref`), written as loops over the cache layout
``[num_blocks, block_size, num_kv_heads, head_dim]``:

* **Paged decode** (``q_len == 1``): K and V are read in place through the block table
  (no gather copy). One task per (sequence, partition of its context): each key row is
  read once for its whole GQA group, and a position's rows for all KV heads (contiguous
  in the cache) are read together; scores go to a scratch row per query head, then one
  softmax, then one pass over the values. Long contexts are split into partitions of
  :data:`DECODE_PARTITION` tokens so one sequence still feeds every core; each partition
  keeps its max, sum and unnormalised output, merged afterwards (Dao et al. 2023,
  "Flash-Decoding"; vLLM's PagedAttention v2; Kwon et al. 2023 §4).
* **Flash prefill** (``q_len > 1``): one task per (sequence, KV head, query tile); key tiles
  are copied from their blocks into a small transposed scratch tile, and each query row
  keeps a running max, sum and output rescaled as the max grows (Dao 2023,
  "FlashAttention-2", Algorithm 1). Key tiles wholly after a query tile are skipped and
  each row stops at its own position (causality).

* **Long prefill chunks** (at least :data:`BLAS_PREFILL_MIN_ROWS` query rows): per KV head
  and tile of :data:`BLAS_PREFILL_Q_TILE` query rows, the scores ``Q K^T`` of the whole
  group over every key the tile may see are one BLAS product, a compiled row kernel
  (:func:`_causal_softmax`) masks the future and normalises in place, and ``P V`` is a
  second BLAS product. The two products are the attention's flops and BLAS does them at
  its packed-GEMM rate; the softmax is one vectorised pass. The score tile
  (``group x 128 x context`` float32, 12 MB at 8k tokens for SmolLM2) replaces the online
  softmax: it is bounded by the tile, not by the prompt. At a 512-token prompt this is
  several times faster than the flash kernel or the NumPy twin (``refengine bench kernels``
  times the backend against the twin).

int8 caches (``kv_cache_dtype="int8"``): :func:`_write_kv_int8` quantizes each token's row
per KV head as the twin does (:func:`refengine.kv_cache.quantize_int8`, bitwise equal);
the prefill kernels dequantize ``q * scale`` into their float32 key/value tiles (the twin's
values exactly), and decode multiplies each score ``q . k_int8`` by its key scale and each
probability by its value scale (the same products up to float32 rounding). The scales are
optional arguments: numba compiles the float32 path without them (``is None`` branches
are pruned at compile time).

Decode rows and prefill sequences of one batch go to their kernels (one parallel launch
each per layer, plus the BLAS products of long chunks).

Numerics: float32 throughout, as the twin; ``fastmath={"contract", "reassoc"}`` lets LLVM
fuse multiply-adds and vectorise the dot products' sums (never ``nnan``/``ninf``: a NaN
read from outside a sequence's blocks shows in the output). Softmax weights use a
vectorised ``exp`` (:func:`refengine.ops.numba_ops.exp_affine`, within 2 ulp).
"""

from __future__ import annotations

import math
import sys

import numpy as np
from numba import njit, prange

from refengine.attention import AttentionMetadata
from refengine.attention.numpy_ref import gather_context
from refengine.ops.numba_ops import exp_affine
from refengine.runtime import blas
from refengine.runtime.numba_support import parallel_kernel, prefetch, register_kernels

#: Context tokens per decode task (a multiple of the block size is used).
DECODE_PARTITION = 128
#: Decode batches whose contexts add up to fewer tokens than this run on the calling thread:
#: their work is less than a parallel launch costs (waking spinning or sleeping threads).
SERIAL_DECODE_MAX_TOKENS = 256
#: Query rows per prefill task.
PREFILL_Q_TILE = 32
#: Key positions per prefill key tile (transposed K and V scratch tiles of 32 KB each at head_dim 64).
PREFILL_K_TILE = 128
#: Prefill chunks with at least this many query rows use BLAS products for ``Q K^T`` and ``P V``.
BLAS_PREFILL_MIN_ROWS = 64
#: Query rows per BLAS prefill tile: smaller tiles compute fewer scores above the diagonal,
#: larger ones make bigger products. Measured side by side on one layer, 64 to 512 rows,
#: several short prompts and one long one: 128 is the fastest at both (64 about level,
#: larger tiles slower: the scores above the diagonal cost more than the bigger products gain).
BLAS_PREFILL_Q_TILE = 128
#: Score rows per task of :func:`_causal_softmax`.
SOFTMAX_ROWS_PER_TASK = 32

_FM = {"contract", "reassoc"}
_U = np.uintp  # unsigned indices: no negative-index wraparound in the inner loops


@njit(cache=True, fastmath={"contract"})
def _exp_and_sum(s, n, m, scratch):  # pragma: no cover - compiled
    """``s[j] = exp(s[j] - m)`` for ``j < n`` (vectorised, :func:`exp_affine`; ``scratch`` int32
    ``[>= 2n]``); returns their float32 sum."""
    head = s[:n]
    exp_affine(head, 1.0, -m, head, scratch)
    total = np.float32(0.0)
    for j in range(n):
        total += head[j]
    return total


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


@njit(cache=True)
def _write_kv(k_cache, v_cache, k, v, slot_mapping):  # pragma: no cover - compiled
    """``k_cache[slot // bs, slot % bs] = k[t]`` (and ``v``) for each token ``t``."""
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    for t in range(slot_mapping.shape[0]):
        slot = slot_mapping[t]
        block = slot // block_size
        if slot < 0 or block >= num_blocks:
            raise IndexError("slot_mapping entry outside the KV cache")
        off = slot % block_size
        k_cache[block, off] = k[t]
        v_cache[block, off] = v[t]


@njit(cache=True)
def _write_kv_int8(k_cache, v_cache, k_scale, v_scale, k, v, slot_mapping):  # pragma: no cover - compiled
    """:func:`_write_kv` into int8 caches: each row ``k[t, h]`` (and ``v``) is stored as
    ``round(x / scale)`` clipped to [-127, 127] with ``scale = max|x| / 127`` in ``k_scale[block, off, h]``
    (scale 0: zeros). No fastmath: the division and rounding match :func:`quantize_int8` bitwise."""
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    num_kv, head_dim = k_cache.shape[2], k_cache.shape[3]
    for t in range(slot_mapping.shape[0]):
        slot = slot_mapping[t]
        block = slot // block_size
        if slot < 0 or block >= num_blocks:
            raise IndexError("slot_mapping entry outside the KV cache")
        off = slot % block_size
        for h in range(num_kv):
            k_scale[block, off, h] = _quantize_row(k[t, h], k_cache[block, off, h], head_dim)
            v_scale[block, off, h] = _quantize_row(v[t, h], v_cache[block, off, h], head_dim)


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


@njit(cache=True, fastmath=_FM)
def _decode_partition(p, q, k_cache, v_cache, k_scale, v_scale, block_tables, seqs, rows, part_seq, part_start,
                      part_end, scale32, part_max, part_sum, part_acc):  # pragma: no cover - compiled
    """Partition ``p`` of :func:`_paged_decode`: its scores, their max and exp-sum, and the
    unnormalised output, into ``part_max[p]``, ``part_sum[p]``, ``part_acc[p]``.

    The cache is indexed in place with unsigned indices (no row views: each view costs two
    atomic reference-count updates; no negative-index checks). While one block is read,
    the same rows of the sequence's next block are prefetched: blocks are scattered, so the
    hardware prefetcher cannot run ahead across them (measured faster with the hint, side by
    side, at a few and at dozens of sequences).

    int8 caches (``k_scale``/``v_scale`` given): score = ``k_scale * (q . k_int8)``, and each
    probability is multiplied by its value row's scale before ``P V``.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv
    seq, row = seqs[part_seq[p]], rows[part_seq[p]]
    start, end = part_start[p], part_end[p]
    n = end - start
    qg = np.empty((num_kv, group, head_dim), dtype=np.float32)
    for h in range(num_kv):
        for g in range(group):
            for d in range(head_dim):
                qg[h, g, d] = q[row, h * group + g, d] * scale32
    scores = np.empty((num_kv, group, n), dtype=np.float32)
    scratch = np.empty(2 * n, dtype=np.int32)
    kv_row, dims = _U(num_kv * head_dim), _U(head_dim)
    first_block, end_block = start // block_size, (end + block_size - 1) // block_size
    for b in range(first_block, end_block):
        block, ahead = _U(block_tables[seq, b]), _U(block_tables[seq, min(b + 1, end_block - 1)])
        for pos in range(max(start, b * block_size), min(end, (b + 1) * block_size)):
            off, j = _U(pos - b * block_size), _U(pos - start)
            _prefetch_row(k_cache, (ahead * _U(block_size) + off) * kv_row, kv_row)
            for h in range(_U(num_kv)):  # a position's keys for all heads are contiguous
                for g in range(_U(group)):  # each key row is read for the whole GQA group
                    s = np.float32(0.0)
                    for d in range(dims):
                        s += qg[h, g, d] * k_cache[block, off, h, d]
                    if k_scale is not None:
                        s *= k_scale[block, off, h]
                    scores[h, g, j] = s
    for h in range(num_kv):
        for g in range(group):
            m = _prefix_max(scores[h, g], n)
            part_max[p, h, g] = m
            part_sum[p, h, g] = _exp_and_sum(scores[h, g], n, m, scratch)
    # P V one position at a time, all heads of its (contiguous) value rows, into a local
    # accumulator, written to part_acc once: measured faster than four positions per head into
    # part_acc, as the value rows are read in the cache's own order
    acc = np.zeros((num_kv, group, head_dim), dtype=np.float32)
    for b in range(first_block, end_block):
        block, ahead = _U(block_tables[seq, b]), _U(block_tables[seq, min(b + 1, end_block - 1)])
        for pos in range(max(start, b * block_size), min(end, (b + 1) * block_size)):
            off, j = _U(pos - b * block_size), _U(pos - start)
            _prefetch_row(v_cache, (ahead * _U(block_size) + off) * kv_row, kv_row)
            for h in range(_U(num_kv)):
                for g in range(_U(group)):
                    pj = scores[h, g, j]
                    if v_scale is not None:
                        pj *= v_scale[block, off, h]
                    for d in range(dims):
                        acc[h, g, d] += pj * v_cache[block, off, h, d]
    part_acc[p] = acc


@njit(cache=True, inline="always")
def _prefetch_row(cache, first, length):  # pragma: no cover - compiled
    """Prefetch ``length`` float32 of ``cache`` from flat element ``first``, a line (16 floats) at a time."""
    for i in range(_U(0), length, _U(16)):
        prefetch(cache, first + i)


@parallel_kernel(fastmath=_FM)
def _paged_decode(q, k_cache, v_cache, k_scale, v_scale, block_tables, seqs, rows, part_seq, part_start, part_end,
                  scale, out):  # pragma: no cover - compiled
    """Decode attention for the batch sequences ``seqs`` whose query rows are ``rows``.

    Args:
        q: ``[T, H, D]`` float32.
        k_scale, v_scale: ``[num_blocks, block_size, KVH]`` float32 for int8 caches, else None.
        block_tables: ``[B, max_blocks]`` int32, the batch's block tables.
        seqs, rows: ``[n]`` int32: decode sequence ``d`` is batch sequence ``seqs[d]``, its
            query is row ``rows[d]``.
        part_seq, part_start, part_end: ``[P]`` int32: partition ``p`` covers context positions
            ``part_start[p] : part_end[p]`` of decode sequence ``part_seq[p]``; the partitions
            of one sequence are consecutive and start at 0.
        out: ``[T, H, D]`` float32; the rows ``rows`` are written.
    """
    num_parts = part_seq.shape[0]
    part_max, part_sum, part_acc = _decode_scratch(num_parts, k_cache.shape[2], q.shape[1], q.shape[2])
    scale32 = np.float32(scale)
    for p in prange(num_parts):
        _decode_partition(p, q, k_cache, v_cache, k_scale, v_scale, block_tables, seqs, rows, part_seq, part_start,
                          part_end, scale32, part_max, part_sum, part_acc)
    _merge_partitions(part_seq, rows, part_max, part_sum, part_acc, out)


@njit(cache=True)
def _decode_scratch(num_parts, num_kv, num_heads, head_dim):  # pragma: no cover - compiled
    """Per-partition max, exp-sum and output of :func:`_paged_decode`."""
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


@njit(cache=True, fastmath=_FM)
def _prefill_task(task, q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, query_start_loc, tile_seq,
                  tile_q0, scale32, q_tile, k_tile, out):  # pragma: no cover - compiled
    """Task ``task`` of :func:`_flash_prefill`: one query tile of one sequence, one KV head
    (int8 caches: the key/value tiles hold ``q * scale``)."""
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
    for k0 in range(0, end_key, k_tile):
        n_keys = min(k_tile, end_key - k0)
        for b in range(k0 // block_size, (k0 + n_keys + block_size - 1) // block_size):
            block = block_tables[seq, b]
            for pos in range(max(k0, b * block_size), min(k0 + n_keys, (b + 1) * block_size)):
                krow = k_cache[block, pos - b * block_size, h]
                if k_scale is None:
                    vt[pos - k0] = v_cache[block, pos - b * block_size, h]
                    for d in range(head_dim):
                        kt[d, pos - k0] = krow[d]
                else:  # dequantize into the tiles
                    vrow = v_cache[block, pos - b * block_size, h]
                    ks, vs = k_scale[block, pos - b * block_size, h], v_scale[block, pos - b * block_size, h]
                    for d in range(head_dim):
                        kt[d, pos - k0] = krow[d] * ks
                        vt[pos - k0, d] = vrow[d] * vs
        for r in range(n_rows):
            n_valid = min(n_keys, first_pos + q0 + r - k0 + 1)  # keys k0 ..= this row's position
            if n_valid <= 0:
                continue
            for g in range(group):
                qr = qs[r, g]
                s[:n_valid] = 0.0
                for d in range(0, d4, 4):  # four dims per pass: one load/store of s per four FMAs
                    x0, x1, x2, x3 = qr[d], qr[d + 1], qr[d + 2], qr[d + 3]
                    kr0, kr1, kr2, kr3 = kt[d], kt[d + 1], kt[d + 2], kt[d + 3]
                    for j in range(n_valid):
                        s[j] += x0 * kr0[j] + x1 * kr1[j] + x2 * kr2[j] + x3 * kr3[j]
                for d in range(d4, head_dim):
                    qd = qr[d]
                    for j in range(n_valid):
                        s[j] += qd * kt[d, j]
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
                    v0, v1, v2, v3 = vt[j], vt[j + 1], vt[j + 2], vt[j + 3]
                    for d in range(head_dim):
                        a[d] += p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d]
                for j in range(j4, n_valid):
                    pj = s[j]
                    vj = vt[j]
                    for d in range(head_dim):
                        a[d] += pj * vj[d]
    for r in range(n_rows):
        for g in range(group):
            inv = np.float32(1.0) / row_sum[r, g]
            o = out[first_row + q0 + r, h * group + g]
            for d in range(head_dim):
                o[d] = acc[r, g, d] * inv


@parallel_kernel(fastmath=_FM)
def _flash_prefill(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, query_start_loc, tile_seq,
                   tile_q0, scale, q_tile, k_tile, out):  # pragma: no cover - compiled
    """Causal flash attention for the query tiles listed by ``tile_seq``/``tile_q0``.

    Args:
        q: ``[T, H, D]`` float32.
        k_scale, v_scale: ``[num_blocks, block_size, KVH]`` float32 for int8 caches, else None.
        query_start_loc, seq_lens, block_tables: the batch's metadata (int32).
        tile_seq, tile_q0: ``[n]`` int32: tile ``i`` is query rows ``tile_q0[i] : tile_q0[i] + q_tile``
            (clipped to the sequence) of sequence ``tile_seq[i]``, counted from its first row.
        out: ``[T, H, D]`` float32, the tiles' rows are written.
    """
    num_kv = k_cache.shape[2]
    scale32 = np.float32(scale)
    for task in prange(tile_seq.shape[0] * num_kv):
        _prefill_task(task, q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, query_start_loc, tile_seq,
                      tile_q0, scale32, q_tile, k_tile, out)


@njit(cache=True, fastmath=_FM)
def _softmax_rows(s, first_pos, group, scale32, r0, r1):  # pragma: no cover - compiled
    """Rows ``r0 .. r1 - 1`` of :func:`_causal_softmax`."""
    n_keys = s.shape[1]
    scratch = np.empty(2 * n_keys, dtype=np.int32)
    for i in range(r0, r1):
        row = s[i]
        n = min(n_keys, first_pos + i // group + 1)  # keys 0 ..= this row's position
        m = _prefix_max(row, n)
        head = row[:n]
        exp_affine(head, scale32, -scale32 * m, head, scratch)  # exp(scale * (s - max))
        total = np.float32(0.0)
        for j in range(n):
            total += head[j]
        inv = np.float32(1.0) / total
        for j in range(n):
            head[j] *= inv
        for j in range(n, n_keys):
            row[j] = 0.0


@parallel_kernel()
def _causal_softmax(s, first_pos, group, scale, rows_per_task):  # pragma: no cover - compiled
    """In place: row ``i`` of ``s [R, K]`` float32 (raw scores ``q . k``, row ``i`` the query at
    position ``first_pos + i // group``) becomes ``softmax(scale * s[i, :n])`` with
    ``n = position + 1`` keys, and 0 from key ``n`` on (the future)."""
    scale32 = np.float32(scale)
    num_rows = s.shape[0]
    for t in prange((num_rows + rows_per_task - 1) // rows_per_task):
        _softmax_rows(s, first_pos, group, scale32, t * rows_per_task, min(num_rows, (t + 1) * rows_per_task))


class _Plan:
    """Per-step work lists derived from the metadata (built once in ``prepare``)."""

    def __init__(self, meta: AttentionMetadata, block_size: int):
        qsl = np.ascontiguousarray(meta.query_start_loc, dtype=np.int32)
        seq_lens = np.ascontiguousarray(meta.seq_lens, dtype=np.int32)
        self.meta = meta
        self.block_size = block_size
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

        decode = np.flatnonzero(q_lens == 1).astype(np.int32)
        self.decode_seqs = decode
        self.decode_rows = qsl[decode]
        part = max(block_size, DECODE_PARTITION // block_size * block_size)
        lens = seq_lens[decode].astype(np.int64)
        counts = -(-lens // part)  # partitions per decode sequence
        self.part_seq = np.repeat(np.arange(decode.size), counts).astype(np.int32)
        first = np.repeat(np.cumsum(counts) - counts, counts)  # index of each sequence's first partition
        self.part_start = ((np.arange(self.part_seq.size) - first) * part).astype(np.int32)
        self.part_end = np.minimum(self.part_start + part, lens[self.part_seq]).astype(np.int32)
        self.decode_tokens = int(lens.sum())

        prefill = np.flatnonzero(q_lens > 1)
        to_blas = q_lens >= BLAS_PREFILL_MIN_ROWS
        self.blas_prefill = [int(i) for i in prefill if to_blas[i]]
        tiles = [(int(i), q0) for i in prefill if not to_blas[i]
                 for q0 in range(0, int(q_lens[i]), PREFILL_Q_TILE)]
        self.tile_seq = np.array([t[0] for t in tiles], dtype=np.int32)
        self.tile_q0 = np.array([t[1] for t in tiles], dtype=np.int32)


class NumbaAttention:
    """The numba backend (``attention_backend="numba"``). float32 queries; float32 caches, or
    int8 caches with float32 ``k_scale``/``v_scale`` (``kv_cache_dtype="int8"``).

    Raises (from ``write_kv``/``forward``):
        TypeError: a dtype other than these.
        ValueError: inconsistent metadata or scale shapes, or block ids outside the cache.
    """

    name = "numba"
    #: Chunks of at least this many rows use BLAS products (the model runner then gives BLAS the threads).
    blas_prefill_min_rows = BLAS_PREFILL_MIN_ROWS

    def __init__(self):
        self._plan: _Plan | None = None
        self._scores = np.empty(0, dtype=np.float32)  # the BLAS prefill's score tiles, kept between calls

    def prepare(self, meta: AttentionMetadata) -> None:
        """Start a step: its work lists (decode partitions, prefill tiles) are built at the
        first layer's call, when the cache's block size is known, and reused by the others."""
        self._plan = None

    def _plan_for(self, meta: AttentionMetadata, block_size: int) -> _Plan:
        plan = self._plan
        if plan is None or plan.meta is not meta or plan.block_size != block_size:
            plan = self._plan = _Plan(meta, block_size)
        return plan

    @staticmethod
    def _check(k_cache: np.ndarray, v_cache: np.ndarray, k_scale, v_scale, *arrays: np.ndarray) -> None:
        cache_dtype = np.float32 if k_scale is None else np.int8
        for a in (k_cache, v_cache):
            if a.dtype != cache_dtype:
                raise TypeError(f"the numba attention backend takes {np.dtype(cache_dtype)} caches "
                                f"{'with' if k_scale is not None else 'without'} scales, got {a.dtype}")
        for a in arrays:
            if a.dtype != np.float32:
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
        (int8 caches: quantized, each row's scale into ``k_scale``/``v_scale``
        ``[num_blocks, block_size, num_kv_heads]`` float32).

        Raises:
            IndexError: a slot outside the cache.
        """
        self._check(k_cache, v_cache, k_scale, v_scale, k, v)
        plan = self._plan_for(meta, k_cache.shape[1])
        if k_scale is None:
            _write_kv(k_cache, v_cache, k, v, plan.slot_mapping)
        else:
            _write_kv_int8(k_cache, v_cache, k_scale, v_scale, k, v, plan.slot_mapping)

    def forward(self, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, meta: AttentionMetadata,
                scale: float, out: np.ndarray | None = None, *, k_scale: np.ndarray | None = None,
                v_scale: np.ndarray | None = None) -> np.ndarray:
        """Attention per the contract.

        Args:
            q: ``[T, num_heads, head_dim]`` float32.
            k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` float32, or
                int8 with ``k_scale, v_scale [num_blocks, block_size, num_kv_heads]`` float32.
            meta: where each sequence's queries and keys live.
            scale: softmax scale, usually ``1 / sqrt(head_dim)``.
            out: optional ``[T, num_heads, head_dim]`` float32 C-contiguous array to write
                (tests pass one poisoned with NaN: every row must be overwritten).
        Returns:
            ``[T, num_heads, head_dim]`` float32 (``out`` when given).
        """
        self._check(k_cache, v_cache, k_scale, v_scale, q)
        plan = self._plan_for(meta, k_cache.shape[1])
        if plan.min_block < 0 or plan.max_block >= k_cache.shape[0]:
            raise ValueError(f"block ids {plan.min_block}..{plan.max_block} outside the cache's "
                             f"{k_cache.shape[0]} blocks")
        if q.shape[1] % k_cache.shape[2]:
            raise ValueError(f"num_heads {q.shape[1]} is not a multiple of num_kv_heads {k_cache.shape[2]}")
        q = np.ascontiguousarray(q)
        if out is None:
            out = np.empty(q.shape, dtype=np.float32)
        elif out.shape != q.shape or out.dtype != np.float32 or not out.flags.c_contiguous:
            raise ValueError(f"out must be a C-contiguous float32 array of shape {q.shape}")
        if plan.part_seq.shape[0]:
            decode = _paged_decode.serial if plan.decode_tokens < SERIAL_DECODE_MAX_TOKENS else _paged_decode
            decode(q, k_cache, v_cache, k_scale, v_scale, plan.block_tables, plan.decode_seqs, plan.decode_rows,
                   plan.part_seq, plan.part_start, plan.part_end, float(scale), out)
        if plan.tile_seq.shape[0]:
            _flash_prefill(q, k_cache, v_cache, k_scale, v_scale, plan.block_tables, plan.seq_lens,
                           plan.query_start_loc, plan.tile_seq, plan.tile_q0, float(scale), PREFILL_Q_TILE,
                           PREFILL_K_TILE, out)
        for i in plan.blas_prefill:
            self._blas_prefill(q, k_cache, v_cache, k_scale, v_scale, plan, i, scale, out)
        return out

    def _blas_prefill(self, q, k_cache, v_cache, k_scale, v_scale, plan: _Plan, i: int, scale: float,
                      out: np.ndarray) -> None:
        """Sequence ``i``'s chunk by BLAS tiles (module docstring): for each KV head and tile of
        query rows, ``S = Q K^T`` over the keys up to the tile's last position, the causal
        softmax in place, ``O = S V``. The score tiles live in one buffer kept between calls:
        a fresh multi-MB array per tile costs a page fault per 4 KB on first write (about as
        long as the product itself at a 1024-token chunk)."""
        start, end = int(plan.query_start_loc[i]), int(plan.query_start_loc[i + 1])
        seq_len = int(plan.seq_lens[i])
        first_pos = seq_len - (end - start)
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv = k_cache.shape[2]
        group = num_heads // num_kv
        k, v = gather_context(k_cache, v_cache, plan.block_tables[i], seq_len, k_scale, v_scale)  # [seq_len, num_kv, D]
        need = min(end - start, BLAS_PREFILL_Q_TILE) * group * seq_len
        if self._scores.size < need:
            self._scores = np.empty(need, dtype=np.float32)
        for h in range(num_kv):
            kh, vh = np.ascontiguousarray(k[:, h]), np.ascontiguousarray(v[:, h])
            heads = slice(h * group, (h + 1) * group)
            for q0 in range(start, end, BLAS_PREFILL_Q_TILE):
                q1 = min(end, q0 + BLAS_PREFILL_Q_TILE)
                n_keys = first_pos + (q1 - start)  # keys after the tile's last row are in every row's future
                qt = q[q0:q1, heads].reshape((q1 - q0) * group, head_dim)  # row (r, g) = r * group + g
                scores = self._scores[:qt.shape[0] * n_keys].reshape(qt.shape[0], n_keys)
                blas.matmul(qt, kh[:n_keys].T, out=scores)
                _causal_softmax(scores, first_pos + (q0 - start), group, float(scale), SOFTMAX_ROWS_PER_TASK)
                out[q0:q1, heads] = blas.matmul(scores, vh[:n_keys]).reshape(q1 - q0, group, head_dim)


register_kernels(sys.modules[__name__])
