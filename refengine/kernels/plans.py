"""Launch plans of the CUDA kernels: grid, block, dynamic shared memory and arguments.

Pure functions of shapes and already-placed arrays (NumPy for the emulator, CuPy on a
GPU): nothing here allocates, copies or launches. Each constant mirrors the kernel
source named beside it; each file's header comment in ``cuda/`` gives the thread and
shared-memory layout these numbers describe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

# 96: Phi-3; 256: Gemma 2/3. Every kernel file instantiates each of these.
SUPPORTED_HEAD_DIMS = (32, 64, 96, 128, 256)

# Launch geometry; each constant mirrors the kernel source named beside it.
RESHAPE_THREADS = 128
LAYER_THREADS = 256  # layers.cu: any multiple of 32
RMS_NORM_SHARED_BYTES = 32 * 4  # layers.cu: layers::kMaxWarps floats, one partial sum per warp
PREFILL_THREADS = 128  # flash_prefill.cu prefill::kNumThreads
PREFILL_BLOCK_M = 32  # prefill::kBlockM (query rows per block)
PREFILL_BLOCK_N = 32  # prefill::block_n<D>() (keys per shared-memory tile) ...
PREFILL_BLOCK_N_HD256 = 16  # ... and at head_dim 256
MMA_BLOCK_M = 64  # flash_prefill_mma.cu prefill_mma::kBlockM
MMA_BLOCK_N = 64  # prefill_mma::block_n<D>() ...
MMA_BLOCK_N_HD256 = 32  # ... and at head_dim 256
MMA_PAD = 8  # prefill_mma::kPad
PREFILL_KERNELS = ("auto", "simt", "mma")
DECODE_THREADS = 128  # paged_decode.cu decode::kNumThreads
DECODE_KEY_TILE = 32  # decode::kKeyTile
DECODE_GROUP_TILE = 8  # decode::kGroupTile (query heads per block)
DEFAULT_PARTITION_SIZE = 512  # context tokens per Flash-Decoding partition
INT32_MAX = 2**31 - 1


@dataclass
class Launch:
    """One kernel launch: name, grid, block, dynamic shared bytes and arguments.

    ``args`` holds arrays (NumPy or CuPy) and ``np.int32`` / ``np.float32`` scalars, in the
    kernel's parameter order.
    """

    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int
    args: tuple


@dataclass
class DeviceMetadata:
    """The int32 arrays of :class:`refengine.attention.AttentionMetadata`, placed where the
    kernels read them (device arrays on a GPU, C-contiguous NumPy arrays in emulation),
    with the host-side sizes the launch plans need.

    Attributes:
        query_start_loc: ``[B + 1]`` int32.
        seq_lens: ``[B]`` int32.
        block_tables: ``[B, max_blocks]`` int32.
        slot_mapping: ``[T]`` int32.
        max_blocks: ``block_tables.shape[1]``.
        max_query_len, max_seq_len: as in the host metadata.
    """

    query_start_loc: Any
    seq_lens: Any
    block_tables: Any
    slot_mapping: Any
    max_blocks: int
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])


def dtype_tag(dtype: Any) -> str:
    """Kernel-name suffix for a storage dtype: ``f32``, ``f16`` or ``bf16``.

    Raises:
        TypeError: any other dtype.
    """
    name = np.dtype(dtype).name
    tags = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
    if name not in tags:
        raise TypeError(f"CUDA attention kernels store float32, float16 or bfloat16, not {name}")
    return tags[name]


#: Kernel-name tags of the quantized KV caches (``kv_cache_dtype`` -> ``<kv>`` in
#: ``reshape_and_cache_<dt>_<kv>``, ``flash_prefill_<dt>_<kv>_hd<D>``, ``paged_decode_<dt>_<kv>_hd<D>``).
KV_QUANT_TAGS = {"int8": "int8", "fp8_e4m3": "fp8e4m3", "fp8_e5m2": "fp8e5m2"}


@dataclass
class KvQuantArgs:
    """A quantized cache's extra kernel arguments (the kernels' ``k_scales, v_scales, k_scale,
    v_scale``): int8 gives per-token scale arrays ``[num_blocks, block_size, num_kv_heads]``
    float32 and scales 1.0; fp8 gives the layer's float scales and placeholder arrays (not read).

    Attributes:
        kv_cache_dtype: a key of :data:`KV_QUANT_TAGS`.
        k_scales, v_scales: placed float32 arrays.
        k_scale, v_scale: float scales.
    """

    kv_cache_dtype: str
    k_scales: Any
    v_scales: Any
    k_scale: float = 1.0
    v_scale: float = 1.0

    @property
    def tag(self) -> str:
        return KV_QUANT_TAGS[self.kv_cache_dtype]

    @property
    def args(self) -> tuple:
        return (self.k_scales, self.v_scales, np.float32(self.k_scale), np.float32(self.v_scale))


def prefill_block_n(head_dim: int) -> int:
    """Keys per tile of ``flash_prefill`` (mirrors ``prefill::block_n``): 32, or 16 at head_dim 256."""
    return PREFILL_BLOCK_N_HD256 if head_dim > 128 else PREFILL_BLOCK_N


def mma_block_n(head_dim: int) -> int:
    """Keys per tile of ``flash_prefill_mma`` (mirrors ``prefill_mma::block_n``): 64, or 32 at head_dim 256."""
    return MMA_BLOCK_N_HD256 if head_dim > 128 else MMA_BLOCK_N


def prefill_shared_bytes(head_dim: int, itemsize: int) -> int:
    """Dynamic shared memory of ``flash_prefill``: a K and a V tile of :func:`prefill_block_n` keys."""
    return 2 * prefill_block_n(head_dim) * head_dim * itemsize


def prefill_mma_shared_bytes(head_dim: int) -> int:
    """Dynamic shared memory of ``flash_prefill_mma``: padded K and V tiles of :func:`mma_block_n`
    keys (2-byte T)."""
    return 2 * mma_block_n(head_dim) * (head_dim + MMA_PAD) * 2


def window_arg(sliding_window: int | None) -> np.int32:
    """The kernels' ``window`` argument: keys per query, ``0`` for no window. A window past
    int32 (already wider than any context) is clamped to ``2**31 - 1``."""
    return np.int32(0 if sliding_window is None else min(int(sliding_window), INT32_MAX))


def soft_cap_arg(logits_soft_cap: float | None) -> np.float32:
    """The kernels' ``soft_cap`` argument: ``c`` of ``c * tanh(s / c)``, ``0`` for none."""
    return np.float32(0.0 if logits_soft_cap is None else logits_soft_cap)


def decode_shared_bytes(head_dim: int) -> int:
    """Dynamic shared memory of ``paged_decode`` (float32; mirrors ``decode::shared_floats``):
    37.2 KiB at head_dim 128, 73.2 KiB at 256 (over the 48 KiB default: the GPU launcher opts in)."""
    floats = (DECODE_GROUP_TILE * head_dim + DECODE_KEY_TILE * (head_dim + 1) + DECODE_KEY_TILE * head_dim
              + DECODE_GROUP_TILE * DECODE_KEY_TILE + 3 * DECODE_GROUP_TILE)
    return 4 * floats


def reshape_and_cache_launch(k: Any, v: Any, k_cache: Any, v_cache: Any, slot_mapping: Any,
                             kv_quant: KvQuantArgs | None = None) -> Launch:
    """``reshape_and_cache``: one block per new token copies its K and V rows to their slot
    (quantized, with ``kv_quant``: ``reshape_and_cache_<dt>_<kv>``, int8 with its scales or fp8).

    Args:
        k, v: ``[T, num_kv_heads, head_dim]`` C-contiguous, in the cache dtype (the activation
            dtype for a quantized cache).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        slot_mapping: ``[T]`` int32 (placed arrays; a negative slot is skipped).
        kv_quant: a quantized cache's scales, or None.
    """
    row = k_cache.shape[2:]
    if kv_quant is not None:
        q = kv_quant
        return Launch(f"reshape_and_cache_{dtype_tag(k.dtype)}_{q.tag}", (int(k.shape[0]), 1, 1),
                      (RESHAPE_THREADS, 1, 1), 0,
                      (k, v, k_cache, v_cache, q.k_scales, q.v_scales, slot_mapping, np.int32(row[0]),
                       np.int32(row[1]), np.float32(q.k_scale), np.float32(q.v_scale)))
    return Launch(f"reshape_and_cache_{dtype_tag(k_cache.dtype)}", (int(k.shape[0]), 1, 1), (RESHAPE_THREADS, 1, 1),
                  0, (k, v, k_cache, v_cache, slot_mapping, np.int32(row[0] * row[1])))


def flash_prefill_launch(q: Any, k_cache: Any, v_cache: Any, out: Any, meta: DeviceMetadata, scale: float,
                         use_mma: bool, sliding_window: int | None = None,
                         logits_soft_cap: float | None = None, kv_quant: KvQuantArgs | None = None) -> Launch:
    """``flash_prefill`` (SIMT) or ``flash_prefill_mma`` (tensor cores): grid
    ``(query tiles of the longest chunk, num_heads, num_seqs)``.

    Args:
        q, out: ``[T, num_heads, head_dim]``; k_cache, v_cache: ``[num_blocks, block_size,
            num_kv_heads, head_dim]``; all C-contiguous, one storage dtype.
        meta: the batch's placed metadata.
        scale: softmax scale.
        use_mma: the tensor-core kernel (16-bit storage only; the caller decides).
        sliding_window: keys per query (itself included), or None; already validated.
        logits_soft_cap: ``c`` of ``c * tanh(s / c)``, or None; already validated.
        kv_quant: a quantized cache's scales: ``flash_prefill_<dt>_<kv>_hd<D>`` (SIMT only,
            float32 tiles; the tensor-core kernel reads 16-bit tiles, so the caller sends
            quantized caches here, and ``use_mma`` must be False).
    Raises:
        ValueError: ``use_mma`` with ``kv_quant``.
    """
    _, num_heads, head_dim = (int(s) for s in q.shape)
    _, block_size, num_kv_heads, _ = (int(s) for s in k_cache.shape)
    tag = dtype_tag(q.dtype)
    args = (q, k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables,
            np.int32(meta.max_blocks), np.int32(num_heads), np.int32(num_kv_heads), np.int32(block_size),
            np.float32(scale), window_arg(sliding_window), soft_cap_arg(logits_soft_cap))
    if kv_quant is not None:
        if use_mma:
            raise ValueError("flash_prefill_mma reads unquantized caches only; quantized ones take flash_prefill")
        q_tiles = -(-int(meta.max_query_len) // PREFILL_BLOCK_M)
        return Launch(f"flash_prefill_{tag}_{kv_quant.tag}_hd{head_dim}", (q_tiles, num_heads, meta.num_seqs),
                      (PREFILL_THREADS, 1, 1), prefill_shared_bytes(head_dim, 4), args + kv_quant.args)
    if use_mma:
        q_tiles = -(-int(meta.max_query_len) // MMA_BLOCK_M)
        return Launch(f"flash_prefill_mma_{tag}_hd{head_dim}", (q_tiles, num_heads, meta.num_seqs),
                      (PREFILL_THREADS, 1, 1), prefill_mma_shared_bytes(head_dim), args)
    q_tiles = -(-int(meta.max_query_len) // PREFILL_BLOCK_M)
    return Launch(f"flash_prefill_{tag}_hd{head_dim}", (q_tiles, num_heads, meta.num_seqs), (PREFILL_THREADS, 1, 1),
                  prefill_shared_bytes(head_dim, np.dtype(q.dtype).itemsize), args)


def decode_partitions(max_seq_len: int, partition_size: int, sliding_window: int | None = None) -> int:
    """Flash-Decoding partitions of the longest context, or of the window when it is
    shorter (the kernel reads only the last ``sliding_window`` keys); at least 1."""
    keys = int(max_seq_len) if sliding_window is None else min(int(max_seq_len), int(sliding_window))
    return max(1, -(-keys // partition_size))


def paged_decode_launches(q: Any, k_cache: Any, v_cache: Any, out: Any, partials: tuple[Any, Any, Any],
                          meta: DeviceMetadata, scale: float, partition_size: int,
                          sliding_window: int | None = None, logits_soft_cap: float | None = None,
                          kv_quant: KvQuantArgs | None = None) -> list[Launch]:
    """``paged_decode`` (grid ``(num_kv_heads * group chunks, num_seqs, partitions)``), then
    ``paged_decode_reduce`` (grid ``(num_heads, num_seqs)``) when there is more than one
    partition. With a sliding window the partitions tile only the last ``sliding_window``
    keys of each context, so there are :func:`decode_partitions` of ``min(max_seq_len, W)``.

    Args:
        q, out: ``[B, num_heads, head_dim]`` (one query row per sequence).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        partials: ``(partial_out [B, num_heads, P, head_dim], partial_max [B, num_heads, P],
            partial_sum [B, num_heads, P])`` float32 for ``P`` = :func:`decode_partitions`
            ``> 1``; with one partition any float32 arrays (not read: the kernel writes ``out``).
        meta: the batch's placed metadata; scale: softmax scale.
        partition_size: context tokens per partition (multiple of 32).
        sliding_window, logits_soft_cap: as for :func:`flash_prefill_launch`.
        kv_quant: a quantized cache's scales (``paged_decode_<dt>_<kv>_hd<D>``, the same
            shared memory: the tiles are float32 already), or None.
    """
    _, num_heads, head_dim = (int(s) for s in q.shape)
    _, block_size, num_kv_heads, _ = (int(s) for s in k_cache.shape)
    tag = dtype_tag(q.dtype)
    partitions = decode_partitions(meta.max_seq_len, partition_size, sliding_window)
    window = window_arg(sliding_window)
    group_chunks = -(-(num_heads // num_kv_heads) // DECODE_GROUP_TILE)
    partial_out, partial_max, partial_sum = partials
    name = f"paged_decode_{tag}_hd{head_dim}" if kv_quant is None else f"paged_decode_{tag}_{kv_quant.tag}_hd{head_dim}"
    launches = [Launch(
        name, (num_kv_heads * group_chunks, meta.num_seqs, partitions),
        (DECODE_THREADS, 1, 1), decode_shared_bytes(head_dim),
        (q, k_cache, v_cache, out, partial_out, partial_max, partial_sum, meta.query_start_loc, meta.seq_lens,
         meta.block_tables, np.int32(meta.max_blocks), np.int32(num_heads), np.int32(num_kv_heads),
         np.int32(block_size), np.float32(scale), np.int32(partition_size), window, soft_cap_arg(logits_soft_cap))
        + (kv_quant.args if kv_quant is not None else ()),
    )]
    if partitions > 1:
        launches.append(Launch(
            f"paged_decode_reduce_{tag}_hd{head_dim}", (num_heads, meta.num_seqs, 1), (head_dim, 1, 1), 0,
            (out, partial_out, partial_max, partial_sum, meta.query_start_loc, meta.seq_lens, np.int32(num_heads),
             np.int32(partitions), np.int32(partition_size), window),
        ))
    return launches


# --- quantized weight products (cuda/quant_matmul.cu) ----------------------------------
QUANT_GEMV_THREADS = 128  # quant_matmul.cu qmm::kGemvThreads (4 warps, one output channel each)
QUANT_GEMV_CHANNELS = QUANT_GEMV_THREADS // 32  # qmm::kGemvWarps
QUANT_GEMV_MAX_ROWS = 8  # qmm::kGemvMaxRows: more rows take the tiled GEMM
QUANT_GEMM_THREADS = 256  # qmm::kGemmThreads
QUANT_GEMM_BLOCK_M, QUANT_GEMM_BLOCK_N, QUANT_GEMM_BLOCK_K = 32, 64, 32  # qmm::kBlockM / kBlockN / kBlockK
# qmm::gemm_shared_bytes: x_tile [K][M + 1] and w_tile [K][N + 1] float32 (12.5 KiB)
QUANT_GEMM_SHARED_BYTES = 4 * QUANT_GEMM_BLOCK_K * (QUANT_GEMM_BLOCK_M + 1 + QUANT_GEMM_BLOCK_N + 1)


def quant_linear_launch(fmt: str, out: Any, x: Any, weights: tuple, out_features: int, in_features: int,
                        group_size: int = 0) -> Launch:
    """``int8_*`` or ``int4_*`` of ``quant_matmul.cu``: ``out = x @ w'.T`` for a weight kept quantized.

    Rows up to :data:`QUANT_GEMV_MAX_ROWS` take the GEMV (grid ``ceil(out / 4)``, one warp
    per output channel); more rows the tiled GEMM (grid ``(ceil(out / 64), ceil(rows / 32))``).

    Args:
        fmt: ``"int8"`` (weights ``(q int8 [out, in], scales float32 [out])``) or ``"int4"``
            (``(packed uint8 [out, in/2], scales float32 [out, G], zeros uint8 [out, G])``, x in
            stored column order).
        out: float32 ``[rows, out]``; x: ``[rows, in]`` float32/float16/bfloat16; all placed
            and C-contiguous.
        group_size: int4 columns per group (ignored for int8).
    Raises:
        ValueError: an unknown ``fmt``. TypeError: an unsupported x dtype.
    """
    if fmt not in ("int8", "int4"):
        raise ValueError(f"quantized CUDA products exist for int8 and int4, not {fmt!r}")
    rows = int(x.shape[0])
    extra = (np.int32(group_size),) if fmt == "int4" else ()
    args = (out, x, *weights, np.int32(rows), np.int32(out_features), np.int32(in_features), *extra)
    tag = dtype_tag(x.dtype)
    if rows <= QUANT_GEMV_MAX_ROWS:
        return Launch(f"{fmt}_gemv_{tag}", (-(-out_features // QUANT_GEMV_CHANNELS), 1, 1), (QUANT_GEMV_THREADS, 1, 1),
                      0, args)
    grid = (-(-out_features // QUANT_GEMM_BLOCK_N), -(-rows // QUANT_GEMM_BLOCK_M), 1)
    return Launch(f"{fmt}_gemm_{tag}", grid, (QUANT_GEMM_THREADS, 1, 1), QUANT_GEMM_SHARED_BYTES, args)
