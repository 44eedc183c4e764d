"""Attention over the paged KV cache in NumPy: the CPU backend and the kernels' twin.

Two paths, one contract (see :mod:`refengine.attention`):

* **Prefill** (a sequence with ``q_len > 1``): the flash algorithm. Query tiles meet key
  tiles one at a time; each query row keeps a running max ``m``, a running softmax sum
  ``l`` and an unnormalised output ``acc`` that are rescaled when the max grows, so the
  ``q_len x seq_len`` score matrix never exists at once. Key tiles wholly after a query
  tile's last position are skipped (causality). Source: Dao 2023, "FlashAttention-2",
  Algorithm 1; Milakov & Gimelshein 2018 for the online softmax.
* **Decode** (``q_len == 1``): per sequence, its keys and values are read through the
  block table (only its own ``seq_len`` positions, so no padding and no mask), then one
  softmax per head. Source: Kwon et al. 2023, "Efficient Memory Management for LLM
  Serving with PagedAttention", §4.

Per-layer options, as keyword arguments of ``forward``: ``sliding_window`` W (a query at
position ``p`` sees keys ``max(0, p - W + 1) ..= p``, W keys including itself: transformers'
rule; key tiles wholly before a query tile's window are skipped, decode reads only the last W
keys) and ``logits_soft_cap`` c (scores ``c * tanh(s / c)`` before the softmax, Gemma 2's
``attn_logit_softcapping``; transformers ``models/gemma2/modeling_gemma2.py``,
``eager_attention_forward``).

int8 caches (``kv_cache_dtype="int8"``): ``write_kv`` quantizes each token's row per KV
head (:func:`refengine.attention.kv_cache.quantize_int8`, LMDeploy's scheme) and both paths read
``q * scale`` through :func:`gather_context`, so prefill and decode see the same values.
fp8 caches (``kv_cache_dtype="fp8_e4m3"`` / ``"fp8_e5m2"``, vLLM's scheme): uint8 codes and
one :class:`refengine.attention.kv_cache.FP8Scale` per layer; ``write_kv`` stores
``float_to_fp8(x / scale)`` and both paths read ``fp8_to_float(code) * scale``. The two
conversions below are the CUDA kernels' (``cuda/common.cuh``) twins, bit for bit.

Grouped-query attention is handled by viewing the query heads as
``[num_kv_heads, group, ...]`` so each KV head is read once for its whole group.

Why a Python loop over sequences and not one padded batch: decode attention is
memory-bound, and a sequence's K/V (a few hundred KB) stay in the CPU cache between the
two matrix products, while a padded ``[B, max_len, ...]`` gather spills to DRAM and reads
every position several times.
"""

from __future__ import annotations

import numpy as np

from refengine.attention import AttentionMetadata
from refengine.attention.kv_cache import FP8Scale, dequantize_int8, quantize_int8

Q_TILE = 128
K_TILE = 256

# fp8 formats: mantissa bits, exponent bias, largest finite value (OCP FP8; PyTorch's
# float8_e4m3fn and float8_e5m2, ml_dtypes' likewise).
FP8_FORMATS = {"fp8_e4m3": (3, 7, 448.0), "fp8_e5m2": (2, 15, 57344.0)}


def float_to_fp8(x: np.ndarray, kv_cache_dtype: str) -> np.ndarray:
    """float32 -> fp8 codes, round to nearest even, saturating (vLLM's ``__NV_SATFINITE``).

    ``|x|`` above the format's largest finite value (infinities included) becomes ``+-max``;
    NaN becomes ``sign | 0x7F`` (E4M3's NaN; a NaN in E5M2 too). Computed on the float32 bits
    exactly as ``float_to_fp8`` in ``cuda/common.cuh``; ml_dtypes' ``float8_e4m3fn`` /
    ``float8_e5m2`` agree on every value in range (they overflow to NaN / inf instead).

    Args:
        x: float32 array, any shape.
        kv_cache_dtype: "fp8_e4m3" or "fp8_e5m2".
    Returns:
        uint8 codes, ``x``'s shape.
    Raises:
        ValueError: another ``kv_cache_dtype``.
    """
    mant, bias, fmax = _fp8_format(kv_cache_dtype)
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    sign = ((bits >> 24) & 0x80).astype(np.uint8)
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    a = np.minimum((bits & 0x7FFFFFFF).view(np.float32), np.float32(fmax))  # saturate (monotonic rounding)
    a = np.where(nan, np.float32(0), a)
    step = np.float32(2.0 ** (1 - bias - mant))  # the subnormal step; smallest normal = step * 2^mant
    sub = np.rint(a * np.float32(1 / step)).astype(np.uint32)  # exact scaling, half to even
    drop = 23 - mant
    u = a.view(np.uint32)
    u = u + np.uint32((1 << (drop - 1)) - 1) + ((u >> drop) & 1)  # round the mantissa, half to even
    normal = (u >> drop) - np.uint32((127 - bias) << mant)
    code = np.where(a < step * np.float32(2 ** mant), sub, normal).astype(np.uint8)
    return np.where(nan, np.uint8(0x7F), code) | sign


def fp8_to_float(code: np.ndarray, kv_cache_dtype: str) -> np.ndarray:
    """fp8 codes (uint8, any shape) -> float32, exactly (``fp8_to_float`` in ``cuda/common.cuh``).

    E4M3: ``S.1111.111`` is NaN, no infinities; E5M2: exponent 31 is infinity (mantissa 0)
    or NaN. Raises ValueError for another ``kv_cache_dtype``.
    """
    return _fp8_table(kv_cache_dtype)[np.asarray(code, dtype=np.uint8)]


def _fp8_format(kv_cache_dtype: str) -> tuple[int, int, float]:
    if kv_cache_dtype not in FP8_FORMATS:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not an fp8 format {tuple(FP8_FORMATS)}")
    return FP8_FORMATS[kv_cache_dtype]


_FP8_TABLES: dict[str, np.ndarray] = {}


def _fp8_table(kv_cache_dtype: str) -> np.ndarray:
    """The 256 values of a format, float32, built from the bit fields."""
    if kv_cache_dtype not in _FP8_TABLES:
        mant, bias, _ = _fp8_format(kv_cache_dtype)
        code = np.arange(256, dtype=np.int64)
        e, m = (code & 0x7F) >> mant, code & ((1 << mant) - 1)
        value = np.where(e == 0, m * 2.0 ** (1 - bias - mant), (1 + m / 2 ** mant) * 2.0 ** (e - bias))
        if kv_cache_dtype == "fp8_e4m3":
            value = np.where((code & 0x7F) == 0x7F, np.nan, value)
        else:
            value = np.where(e == 31, np.where(m == 0, np.inf, np.nan), value)
        _FP8_TABLES[kv_cache_dtype] = np.where(code & 0x80, -value, value).astype(np.float32)
    return _FP8_TABLES[kv_cache_dtype]


class NumpyAttention:
    """The NumPy backend (``attention_backend="numpy"``). float32 in, float32 out."""

    name = "numpy"

    def prepare(self, meta: AttentionMetadata) -> None:
        """Nothing to do: the metadata is already host arrays."""

    def write_kv(self, k_cache: np.ndarray, v_cache: np.ndarray, k: np.ndarray, v: np.ndarray,
                 meta: AttentionMetadata, *, k_scale: np.ndarray | None = None,
                 v_scale: np.ndarray | None = None) -> None:
        """Store ``k, v [T, num_kv_heads, head_dim]`` at ``meta.slot_mapping [T]`` in place.

        With int8 caches, ``k_scale, v_scale [num_blocks, block_size, num_kv_heads]`` float32
        receive each row's scale and the caches its int8 values (:func:`quantize_int8`); with
        fp8 caches (uint8, ``k_scale, v_scale`` :class:`FP8Scale`) the caches receive
        ``float_to_fp8(x / scale)``; float16 caches NumPy's cast (to nearest, ties to even).
        """
        block_size = k_cache.shape[1]
        blocks = meta.slot_mapping // block_size
        offsets = meta.slot_mapping % block_size
        if isinstance(k_scale, FP8Scale):
            k = float_to_fp8(k.astype(np.float32) / np.float32(k_scale.scale), k_scale.kv_cache_dtype)
            v = float_to_fp8(v.astype(np.float32) / np.float32(v_scale.scale), v_scale.kv_cache_dtype)
        elif k_scale is not None:
            k, ks = quantize_int8(k)
            v, vs = quantize_int8(v)
            k_scale[blocks, offsets] = ks
            v_scale[blocks, offsets] = vs
        with np.errstate(over="ignore"):  # a float16 cache: past 65504 is infinity, as documented
            k_cache[blocks, offsets] = k
            v_cache[blocks, offsets] = v

    def forward(self, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, meta: AttentionMetadata,
                scale: float, *, sliding_window: int | None = None, logits_soft_cap: float | None = None,
                k_scale: np.ndarray | None = None, v_scale: np.ndarray | None = None) -> np.ndarray:
        """Attention per the contract.

        Args:
            q: ``[T, num_heads, head_dim]`` float32.
            k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, float32 or
                float16, or int8 with ``k_scale, v_scale [num_blocks, block_size, num_kv_heads]`` float32,
                or uint8 fp8 codes with ``k_scale, v_scale`` :class:`FP8Scale`.
            meta: where each sequence's queries and keys live.
            scale: softmax scale, usually ``1 / sqrt(head_dim)``.
            sliding_window: keys per query (itself included), None for all of them.
            logits_soft_cap: ``c`` of ``c * tanh(scale * q.k / c)``, None for raw scores.
        Returns:
            ``[T, num_heads, head_dim]`` float32.
        """
        out = np.empty(q.shape, dtype=np.float32)
        options = {"sliding_window": sliding_window, "logits_soft_cap": logits_soft_cap}
        q_lens = np.diff(meta.query_start_loc)
        decode = np.flatnonzero(q_lens == 1)
        if decode.size:
            rows = meta.query_start_loc[decode]
            out[rows] = paged_decode(q[rows], k_cache, v_cache, meta.block_tables[decode],
                                     meta.seq_lens[decode], scale, k_scale, v_scale, **options)
        for i in np.flatnonzero(q_lens > 1):
            start, end = int(meta.query_start_loc[i]), int(meta.query_start_loc[i + 1])
            k, v = gather_context(k_cache, v_cache, meta.block_tables[i], int(meta.seq_lens[i]), k_scale, v_scale)
            out[start:end] = flash_prefill(q[start:end], k, v, scale, **options)
        return out


def gather_context(k_cache: np.ndarray, v_cache: np.ndarray, block_table: np.ndarray, seq_len: int,
                   k_scale: np.ndarray | None = None, v_scale: np.ndarray | None = None):
    """Read one sequence's keys and values through its block table.

    Args:
        block_table: ``[max_blocks]`` int32, ``-1`` past the sequence's last block.
        seq_len: context length in tokens.
        k_scale, v_scale: ``[num_blocks, block_size, num_kv_heads]`` float32 for int8 caches,
            :class:`FP8Scale` for fp8 ones.
    Returns:
        ``k, v [seq_len, num_kv_heads, head_dim]`` (copies, in the cache dtype; float32
        ``q * scale`` for int8 caches, ``fp8_to_float(code) * scale`` for fp8 ones).
    """
    block_size = k_cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = block_table[:num_blocks]
    k = k_cache[blocks].reshape(num_blocks * block_size, *k_cache.shape[2:])[:seq_len]
    v = v_cache[blocks].reshape(num_blocks * block_size, *v_cache.shape[2:])[:seq_len]
    if isinstance(k_scale, FP8Scale):
        k = fp8_to_float(k, k_scale.kv_cache_dtype) * np.float32(k_scale.scale)
        v = fp8_to_float(v, v_scale.kv_cache_dtype) * np.float32(v_scale.scale)
    elif k_scale is not None:
        k = dequantize_int8(k, k_scale[blocks].reshape(num_blocks * block_size, -1)[:seq_len])
        v = dequantize_int8(v, v_scale[blocks].reshape(num_blocks * block_size, -1)[:seq_len])
    return k, v


def soft_cap(s: np.ndarray, cap: float | None) -> np.ndarray:
    """``cap * tanh(s / cap)`` in float32 (``s`` itself when ``cap`` is None): scores squashed
    into ``(-cap, cap)``, Gemma 2's attention-logit soft-capping."""
    if cap is None:
        return s
    c = np.float32(cap)
    return np.tanh(s / c) * c


def flash_prefill(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float,
                  q_tile: int = Q_TILE, k_tile: int = K_TILE, *, sliding_window: int | None = None,
                  logits_soft_cap: float | None = None) -> np.ndarray:
    """Causal attention of one sequence's last ``q_len`` positions over its whole context.

    Query row ``j`` sits at position ``p = seq_len - q_len + j`` and sees keys ``0 ..= p``,
    or ``max(0, p - W + 1) ..= p`` with a sliding window ``W``.

    Args:
        q: ``[q_len, num_heads, head_dim]`` float32.
        k, v: ``[seq_len, num_kv_heads, head_dim]``, ``seq_len >= q_len``.
        scale: softmax scale.
        sliding_window: ``W`` (keys per query, itself included), or None.
        logits_soft_cap: ``c`` of :func:`soft_cap`, or None.
    Returns:
        ``[q_len, num_heads, head_dim]`` float32.
    """
    q_len, num_heads, head_dim = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    first_pos = seq_len - q_len
    # [num_kv_heads, group, q_len, head_dim]: one matmul per KV head serves its whole group
    qg = (q.astype(np.float32) * np.float32(scale)).reshape(q_len, num_kv_heads, group, head_dim).transpose(1, 2, 0, 3)
    kt = k.astype(np.float32, copy=False).transpose(1, 2, 0)  # [num_kv_heads, head_dim, seq_len]
    vt = v.astype(np.float32, copy=False).transpose(1, 0, 2)  # [num_kv_heads, seq_len, head_dim]
    out = np.empty((num_kv_heads, group, q_len, head_dim), dtype=np.float32)
    for q0 in range(0, q_len, q_tile):
        q1 = min(q0 + q_tile, q_len)
        qpos = np.arange(first_pos + q0, first_pos + q1)
        qt = qg[:, :, q0:q1]
        m = np.full((num_kv_heads, group, q1 - q0, 1), -np.inf, dtype=np.float32)
        l = np.zeros_like(m)
        acc = np.zeros((num_kv_heads, group, q1 - q0, head_dim), dtype=np.float32)
        last_key = first_pos + q1  # keys at or after this position are masked for the whole tile
        # keys before the first row's window are masked for the whole tile: start at its tile
        first_key = 0 if sliding_window is None else max(0, qpos[0] - sliding_window + 1) // k_tile * k_tile
        for k0 in range(first_key, last_key, k_tile):
            k1 = min(k0 + k_tile, last_key)
            s = soft_cap(np.matmul(qt, kt[:, None, :, k0:k1]), logits_soft_cap)  # [kv, group, q_tile, k_tile]
            keys = np.arange(k0, k1)[None, :]
            if k1 - 1 > qpos[0]:  # the tile crosses the diagonal: mask the future
                s = np.where(keys > qpos[:, None], -np.inf, s)
            if sliding_window is not None and k0 <= qpos[-1] - sliding_window:  # ... and the keys left behind
                s = np.where(keys <= qpos[:, None] - sliding_window, -np.inf, s)
            m_new = np.maximum(m, s.max(axis=-1, keepdims=True))
            # a row whose keys in this tile are all masked (its window starts later) has m_new = -inf
            # until it meets its first key: subtract 0 then, so its p and alpha are 0, not NaN
            m_sub = np.where(m_new == -np.inf, np.float32(0.0), m_new)
            p = np.exp(s - m_sub)
            alpha = np.exp(m - m_sub)
            l = l * alpha + p.sum(axis=-1, keepdims=True)
            acc = acc * alpha + np.matmul(p, vt[:, None, k0:k1])
            m = m_new
        out[:, :, q0:q1] = acc / l
    return out.transpose(2, 0, 1, 3).reshape(q_len, num_heads, head_dim)


def paged_decode(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
                 seq_lens: np.ndarray, scale: float, k_scale: np.ndarray | None = None,
                 v_scale: np.ndarray | None = None, *, sliding_window: int | None = None,
                 logits_soft_cap: float | None = None) -> np.ndarray:
    """One query token per sequence, keys read through the block table.

    Args:
        q: ``[B, num_heads, head_dim]`` float32, the token at position ``seq_lens[b] - 1``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        block_tables: ``[B, max_blocks]`` int32 (``-1`` padding).
        seq_lens: ``[B]`` int32 context lengths (including the query token).
        scale: softmax scale.
        k_scale, v_scale: ``[num_blocks, block_size, num_kv_heads]`` float32 for int8 caches,
            :class:`FP8Scale` for fp8 ones.
        sliding_window: ``W``: only the last ``W`` keys are read; None for all.
        logits_soft_cap: ``c`` of :func:`soft_cap`, or None.
    Returns:
        ``[B, num_heads, head_dim]`` float32.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    qg = (q.astype(np.float32) * np.float32(scale)).reshape(batch, num_kv_heads, group, head_dim)
    out = np.empty((batch, num_kv_heads, group, head_dim), dtype=np.float32)
    for b in range(batch):  # one sequence at a time: its K/V stay in cache between the two products
        k, v = gather_context(k_cache, v_cache, block_tables[b], int(seq_lens[b]), k_scale, v_scale)
        if sliding_window is not None:
            k, v = k[-sliding_window:], v[-sliding_window:]
        s = soft_cap(np.matmul(qg[b], k.astype(np.float32, copy=False).transpose(1, 2, 0)), logits_soft_cap)
        s = np.exp(s - s.max(axis=-1, keepdims=True))
        s /= s.sum(axis=-1, keepdims=True)
        out[b] = np.matmul(s, v.astype(np.float32, copy=False).transpose(1, 0, 2))
    return out.reshape(batch, num_heads, head_dim)
