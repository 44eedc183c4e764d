"""The KV cache tensors: per layer, ``k_cache`` and ``v_cache`` of shape
``[num_blocks, block_size, num_kv_heads, head_dim]`` (the attention contract's layout,
:mod:`refengine.attention`), in the model's dtype or quantized (float16, int8 with a scale per
token and KV head, fp8 with a scale per layer); on the CPU the pool lies in huge pages.

:func:`huge_page_zeros` allocates the CPU pool in transparent huge pages (2 MB) where the
kernel grants them only on request (``/sys/kernel/mm/transparent_hugepage/enabled`` set to
``madvise``, a common distribution default): decode attention reads each sequence's blocks
scattered over the pool, and with 4 KB pages nearly every block costs TLB misses. Each
array's first :data:`SMALL_PAGE_PREFIX` bytes stay in 4 KB pages, though: the pool is one
array per layer for keys and one for values, a short run touches only the first blocks of
each, and in 2 MB pages the first touch would make a whole 2 MB resident per array (120 MB
for SmolLM2's 30 layers where a 640-token run writes 30 MB). Past the prefix, a partly
used 2 MB page wastes at most a quarter of what that array already holds.

Which blocks a sequence holds is the block manager's business (:mod:`refengine.core.block_manager`).
"""

from __future__ import annotations

import mmap
from typing import Any, NamedTuple

import numpy as np


#: Transparent huge page size on x86-64 and arm64 Linux.
HUGE_PAGE = 2 << 20
#: The first bytes of a :func:`huge_page_zeros` array, kept in 4 KB pages (module docstring).
SMALL_PAGE_PREFIX = 4 * HUGE_PAGE


def huge_page_zeros(shape: tuple[int, ...], dtype) -> np.ndarray:
    """``np.zeros(shape, dtype)`` in an anonymous mapping aligned to :data:`HUGE_PAGE`, advised
    ``MADV_HUGEPAGE`` past its first :data:`SMALL_PAGE_PREFIX` bytes: the kernel backs that
    part with 2 MB pages as it is first touched (still lazily: untouched memory costs
    nothing), the prefix with 4 KB pages. Falls back to ``np.zeros`` where ``madvise``
    or ``MADV_HUGEPAGE`` does not exist. The array keeps the mapping alive.

    Raises:
        OSError: the mapping cannot be made (address space or overcommit limits), as ``mmap``.
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return np.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = np.frombuffer(region, dtype=np.uint8)
    start = -raw.ctypes.data % HUGE_PAGE
    advised = start + SMALL_PAGE_PREFIX  # the array's first bytes stay in 4 KB pages
    if advised < start + nbytes:
        try:
            region.madvise(mmap.MADV_HUGEPAGE, advised, start + nbytes - advised)
        except OSError:  # THP disabled, or an old kernel
            pass
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def cdiv(a: int, b: int) -> int:
    """Ceiling division: blocks needed for ``a`` tokens at ``b`` tokens per block."""
    return -(-a // b)


#: ``kv_cache_dtype`` values (vLLM's names): "auto" stores K/V in the activation dtype;
#: "float16" stores IEEE half values (llama.cpp's default ``f16`` cache; rounded to nearest
#: on write, read exactly); "int8" stores int8 values and a float32 scale per token and KV
#: head (LMDeploy's scheme); "fp8_e4m3" / "fp8_e5m2" store one fp8 byte per value and one
#: float scale per layer (vLLM's).
KV_CACHE_DTYPES = ("auto", "float16", "int8", "fp8_e4m3", "fp8_e5m2")
FP8_KV_CACHE_DTYPES = ("fp8_e4m3", "fp8_e5m2")
INT8_MAX = 127


class FP8Scale(NamedTuple):
    """The per-layer scale of an fp8 KV cache (vLLM's ``k_scale`` / ``v_scale``): the cache
    holds ``fp8(x / scale)`` and is read as ``float(fp8) * scale``.

    Attributes:
        kv_cache_dtype: "fp8_e4m3" or "fp8_e5m2" (the byte's format).
        scale: a finite float > 0; 1.0 unless the checkpoint gives one (vLLM's default).
    """

    kv_cache_dtype: str
    scale: float


def quantize_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 quantization over the last axis (LMDeploy's KV int8 scheme, per token
    and KV head): ``scale = max|x| / 127``, ``q = round(x / scale)`` clipped to [-127, 127]
    (round half to even); a row of zeros has scale 0 and ``q = 0``.

    Args:
        x: ``[..., head_dim]`` float32 (a K or V row per token and KV head).
    Returns:
        ``q [..., head_dim]`` int8 and ``scale [...]`` float32, so ``q * scale`` is within
        ``scale / 2`` of ``x`` (:func:`dequantize_int8`).
    """
    x = np.asarray(x, dtype=np.float32)
    scale = np.abs(x).max(axis=-1) / np.float32(INT8_MAX)
    safe = np.where(scale > 0, scale, np.float32(1.0))[..., None]  # scale 0: x is all zeros, q = 0
    q = np.clip(np.rint(x / safe), -INT8_MAX, INT8_MAX).astype(np.int8)
    return q, scale.astype(np.float32, copy=False)


def dequantize_int8(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """``q [..., head_dim]`` int8, ``scale [...]`` float32 -> ``q * scale`` float32."""
    return q.astype(np.float32) * scale[..., None]


class LayerKVCache(NamedTuple):
    """One layer's share of a :class:`KVCache`: what an attention backend's ``write_kv``
    and ``forward`` take.

    Attributes:
        k, v: ``[num_blocks, block_size, num_kv_heads, head_dim]`` in the cache dtype.
        k_scale, v_scale: ``[num_blocks, block_size, num_kv_heads]`` float32 per-token
            scales with an int8 cache, an :class:`FP8Scale` with an fp8 one, else None.
        dtype: the dtype K/V are written in and queries read in (the activation dtype).
    """

    k: Any
    v: Any
    k_scale: Any
    v_scale: Any
    dtype: Any


class KVCache:
    """Per-layer key and value pools.

    ``k[layer]`` and ``v[layer]`` have shape ``[num_blocks, block_size, num_kv_heads, head_dim]``
    (the attention contract's layout). On the CPU the pool is allocated lazily by the OS
    (zero pages), so untouched blocks cost no memory, in 2 MB pages where the kernel grants
    them (:func:`refengine.attention.kv_cache.huge_page_zeros`).

    With ``kv_cache_dtype="int8"`` the pools hold int8 values and ``k_scale[layer]``,
    ``v_scale[layer]`` (``[num_blocks, block_size, num_kv_heads]`` float32) the scale of each
    token's row per KV head (:func:`quantize_int8`); a block id indexes both, so whatever
    moves or shares a block (prefix caching, preemption) carries its scales. With "fp8_e4m3"
    / "fp8_e5m2" the pools hold uint8 fp8 codes and the scale lists one :class:`FP8Scale`
    per layer (scale 1.0; ``k_scales`` / ``v_scales``: one float per layer from a checkpoint's
    ``k_scale`` / ``v_scale`` tensors). With "float16" the pools are float16 (half the bytes
    of float32, no scales). With "auto" and "float16" the scale lists hold None.

    Args:
        dtype: the activation dtype (and, with "auto", the pools' dtype).
        kv_cache_dtype: one of :data:`KV_CACHE_DTYPES`.
        k_scales, v_scales: fp8 only: one scale per layer (finite float32 > 0), default 1.0 each.
    Raises:
        ValueError: an unknown ``kv_cache_dtype``, or bad ``k_scales`` / ``v_scales``.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype=np.float32, xp=np, kv_cache_dtype: str = "auto", k_scales=None, v_scales=None):
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not one of {KV_CACHE_DTYPES}")
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        zeros = huge_page_zeros if xp is np else xp.zeros
        quantized = kv_cache_dtype == "int8"
        fp8 = kv_cache_dtype in FP8_KV_CACHE_DTYPES
        store = np.int8 if quantized else np.uint8 if fp8 else np.float16 if kv_cache_dtype == "float16" else dtype
        self.k = [zeros(shape, store) for _ in range(num_layers)]
        self.v = [zeros(shape, store) for _ in range(num_layers)]
        if fp8:
            self.k_scale = [FP8Scale(kv_cache_dtype, s) for s in _layer_scales(k_scales, num_layers, "k_scales")]
            self.v_scale = [FP8Scale(kv_cache_dtype, s) for s in _layer_scales(v_scales, num_layers, "v_scales")]
        else:
            self.k_scale = [zeros(shape[:3], np.float32) if quantized else None for _ in range(num_layers)]
            self.v_scale = [zeros(shape[:3], np.float32) if quantized else None for _ in range(num_layers)]
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = np.dtype(dtype)
        self.kv_cache_dtype = kv_cache_dtype

    def layer(self, i: int) -> LayerKVCache:
        """Layer ``i``'s pools and scales."""
        return LayerKVCache(self.k[i], self.v[i], self.k_scale[i], self.v_scale[i], self.dtype)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, itemsize: int,
                        kv_cache_dtype: str = "auto") -> int:
        """Bytes one block takes across all layers, keys and values (``itemsize``: bytes per
        activation value; with "float16", 2 bytes per value; with "int8", 1 byte per value plus
        a 4-byte scale per token and head;
        with fp8, 1 byte per value: its scales are per layer, not per block)."""
        if kv_cache_dtype == "int8":
            row = head_dim + 4
        elif kv_cache_dtype == "float16":
            row = head_dim * 2
        elif kv_cache_dtype in FP8_KV_CACHE_DTYPES:
            row = head_dim
        else:
            row = head_dim * itemsize
        return 2 * num_layers * block_size * num_kv_heads * row


def _layer_scales(scales, num_layers: int, what: str) -> list[float]:
    """Per-layer fp8 scales: ``scales`` (one finite float > 0 per layer) or 1.0 each.

    Raises:
        ValueError: the wrong count, or a scale that is not a finite float > 0.
    """
    if scales is None:
        return [1.0] * num_layers
    scales = [float(s) for s in scales]
    if len(scales) != num_layers:
        raise ValueError(f"{what} has {len(scales)} entries for {num_layers} layers")
    for i, s in enumerate(scales):
        if not (np.isfinite(s) and s > 0 and np.isfinite(np.float32(s)) and np.float32(s) > 0):
            raise ValueError(f"{what}[{i}]={s!r}: an fp8 KV scale must be a finite float32 > 0")
    return scales
