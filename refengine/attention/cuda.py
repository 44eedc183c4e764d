"""Attention through refengine's hand-written CUDA kernels (``cuda/*.cu``).

Two backends run the *same* kernel sources and the same launch plans
(:mod:`refengine.kernels.plans`); they differ only in the launcher
(:mod:`refengine.kernels.build`):

* :class:`CudaAttention` (``"cuda"``): on an NVIDIA GPU, the module compiled at first use
  by ``cupy.RawModule`` (NVRTC), shared with the layer operations; CuPy arrays in and out.
* :class:`EmulatedCudaAttention` (``"cuda-emulated"``): on the CPU, every block of every
  launch on the strict thread emulator; NumPy arrays in and out. This is how CI, which
  has no GPU, tests the kernels.

Kernels (see each file's header comment for thread layout and sources, and cuda/README.md):

* ``reshape_and_cache_<dt>``: ``write_kv``, new K/V rows into their cache slots;
* ``flash_prefill_<dt>_hd<D>``: FlashAttention-2 over the paged cache, any mix of chunk
  lengths (decode rows included), SIMT float32 FMAs;
* ``flash_prefill_mma_<dt>_hd<D>``: the same on tensor cores (``mma.sync`` m16n8k16,
  ``ldmatrix`` fragments, ``cp.async`` K/V tiles), float16/bfloat16 only; the default for
  those dtypes at every head_dim (at 256 with 32-key tiles instead of 64, and Q's fragments
  loaded per k-step rather than held for the whole kernel, to stay within 255 registers);
* ``paged_decode_<dt>_hd<D>``: one query per sequence, all heads of a KV group per block,
  context split into partitions (Flash-Decoding), and ``paged_decode_reduce_<dt>_hd<D>``
  to merge the partitions by their softmax statistics.

``<dt>`` is ``f32``, ``f16`` or ``bf16`` (storage type; arithmetic is float32) and ``D``
(head_dim) is one of :data:`refengine.kernels.plans.SUPPORTED_HEAD_DIMS` (32, 64, 96, 128, 256).

Per-layer options of ``forward``, as in :mod:`refengine.attention.numpy_ref`: ``sliding_window``
W (a query at ``p`` sees keys ``max(0, p - W + 1) ..= p``; the prefill kernels skip key tiles
wholly before the window of a query tile's first row, decode reads and partitions only the
last W keys) and ``logits_soft_cap`` c (scores ``c * tanh(s / c)``, Gemma 2). The kernels take
them as ``int window`` and ``float soft_cap``, 0 meaning off.

Quantized caches (``kv_cache_dtype`` "int8", "fp8_e4m3", "fp8_e5m2"; :mod:`refengine.core.block_manager`):
``reshape_and_cache_<dt>_<kv>`` quantizes as it writes (int8: a float32 scale per token and KV
head, LMDeploy's scheme; fp8: ``fp8(x / scale)`` with the layer's :class:`FP8Scale`, vLLM's),
and ``flash_prefill_<dt>_<kv>_hd<D>`` / ``paged_decode_<dt>_<kv>_hd<D>`` dequantize into their
float32 shared-memory tiles, so prefill and decode read the same float32 values as the twin
(:func:`refengine.attention.numpy_ref.gather_context`). The tensor-core prefill has no
quantized variant: it feeds 16-bit tiles to ``ldmatrix``, and dequantized values rounded to
16 bits would differ from what decode reads; quantized caches take the SIMT prefill.

Not done yet: a deeper (multi-stage, TMA) pipeline and Hopper ``wgmma`` in the prefill
kernel, a tensor-core decode for large groups, a tensor-core prefill over quantized caches.
"""

from __future__ import annotations

import math
import numbers
import os
from typing import Any, Sequence

import numpy as np

from refengine.attention import AttentionMetadata
from refengine.attention.kv_cache import FP8Scale
from refengine.kernels import plans
from refengine.kernels.build import EmulatedKernels, KernelModule, cupy_kernels
from refengine.kernels.plans import DEFAULT_PARTITION_SIZE, DECODE_KEY_TILE, PREFILL_KERNELS, SUPPORTED_HEAD_DIMS


class _KernelAttention:
    """Backend-independent part: validation, metadata placement and the launches."""

    name = "cuda-kernels"
    kernels: KernelModule

    def __init__(self, decode_partition_size: int = DEFAULT_PARTITION_SIZE, prefill_kernel: str = "auto") -> None:
        if decode_partition_size <= 0 or decode_partition_size % DECODE_KEY_TILE:
            raise ValueError(f"decode_partition_size must be a positive multiple of {DECODE_KEY_TILE}")
        if prefill_kernel not in PREFILL_KERNELS:
            raise ValueError(f"prefill_kernel must be one of {PREFILL_KERNELS}, got {prefill_kernel!r}")
        self.decode_partition_size = decode_partition_size
        self.prefill_kernel = prefill_kernel
        self._prepared: tuple[AttentionMetadata, plans.DeviceMetadata] | None = None

    # --- the AttentionBackend protocol ----------------------------------------------------
    def prepare(self, meta: AttentionMetadata) -> None:
        """Copy ``meta``'s int32 arrays to the device once for the step's layers.

        Optional: ``write_kv`` / ``forward`` with a metadata object other than the last
        prepared one prepare it themselves. ``meta`` must not change afterwards.
        """
        self._device_metadata(meta)

    def _device_metadata(self, meta: AttentionMetadata) -> plans.DeviceMetadata:
        if self._prepared is None or self._prepared[0] is not meta:
            k = self.kernels
            placed = plans.DeviceMetadata(
                k.int32(meta.query_start_loc), k.int32(meta.seq_lens), k.int32(meta.block_tables),
                k.int32(meta.slot_mapping), int(meta.block_tables.shape[1]), int(meta.max_query_len),
                int(meta.max_seq_len))
            self._prepared = (meta, placed)
        return self._prepared[1]

    def write_kv(self, k_cache: Any, v_cache: Any, k: Any, v: Any, meta: AttentionMetadata, *,
                 k_scale: Any = None, v_scale: Any = None) -> None:
        """Store ``k, v [T, num_kv_heads, head_dim]`` into the caches at ``meta.slot_mapping``.

        Args:
            k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, C-contiguous,
                written in place: float32/float16/bfloat16, or int8 (with ``k_scale, v_scale
                [num_blocks, block_size, num_kv_heads]`` float32, written too), or uint8 fp8
                codes (with ``k_scale, v_scale`` :class:`FP8Scale`).
            k, v: ``[T, num_kv_heads, head_dim]`` in the cache dtype (a quantized cache: in the
                activation dtype, float32/float16/bfloat16).
            meta: ``slot_mapping [T]`` int32; a negative slot is skipped.
        Raises:
            ValueError: shapes disagree, the cache is not C-contiguous, or only one scale is given.
            TypeError: dtypes differ or are not float32/float16/bfloat16; scales that do not
                fit the cache dtype.
        """
        _check_cache(k_cache, v_cache)
        quant = self._kv_quant(k_cache, k_scale, v_scale)
        num_tokens = k.shape[0]
        row = k_cache.shape[2:]
        if tuple(k.shape[1:]) != tuple(row) or k.shape != v.shape:
            raise ValueError(f"k/v {tuple(k.shape)}/{tuple(v.shape)} do not match cache rows {tuple(row)}")
        if quant is not None:
            if k.dtype != v.dtype:
                raise TypeError(f"k/v dtypes {k.dtype}/{v.dtype} differ")
        elif k.dtype != k_cache.dtype or v.dtype != k_cache.dtype:
            raise TypeError(f"k/v dtype {k.dtype}/{v.dtype} differs from the cache dtype {k_cache.dtype}")
        if len(meta.slot_mapping) != num_tokens:
            raise ValueError(f"slot_mapping has {len(meta.slot_mapping)} entries for {num_tokens} tokens")
        if num_tokens == 0:
            return
        plans.dtype_tag(k.dtype)  # raises TypeError before anything is copied
        kern = self.kernels
        kern.launch(plans.reshape_and_cache_launch(kern.contiguous(k), kern.contiguous(v), k_cache, v_cache,
                                                   self._device_metadata(meta).slot_mapping, quant))

    def forward(self, q: Any, k_cache: Any, v_cache: Any, meta: AttentionMetadata, scale: float, *,
                sliding_window: int | None = None, logits_soft_cap: float | None = None,
                k_scale: Any = None, v_scale: Any = None) -> Any:
        """Attention of ``q`` over the paged cache, per the contract in :mod:`refengine.attention`.

        A pure decode batch (``meta.max_query_len == 1``) goes to ``paged_decode`` (plus
        ``paged_decode_reduce`` when the longest context spans several partitions);
        anything else, mixed batches included, to ``flash_prefill``.

        Args:
            q: ``[T, num_heads, head_dim]``, same dtype as the cache.
            k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
            meta: query_start_loc ``[B+1]``, seq_lens ``[B]``, block_tables ``[B, max_blocks]``
                (int32 host arrays, copied to the device once per metadata object, see
                :meth:`prepare`), max_query_len, max_seq_len.
            scale: softmax scale, usually ``1 / sqrt(head_dim)``.
            sliding_window: keys per query, itself included (an int >= 1), or None for all.
            logits_soft_cap: ``c`` of ``c * tanh(scale * q.k / c)`` (a finite float > 0), or None.
            k_scale, v_scale: a quantized cache's scales, as for :meth:`write_kv` (None: the
                cache is in q's dtype). Quantized caches take the SIMT prefill.
        Returns:
            ``[T, num_heads, head_dim]`` in q's dtype.
        Raises:
            ValueError: inconsistent shapes, head_dim not in :data:`SUPPORTED_HEAD_DIMS`,
                num_heads not a multiple of num_kv_heads, a cache not 16-byte aligned, a bad
                ``sliding_window`` / ``logits_soft_cap``, or only one scale.
            TypeError: unsupported or mismatched dtypes, scales that do not fit the cache, or
                ``prefill_kernel="mma"`` with a quantized cache.
        """
        _check_options(sliding_window, logits_soft_cap)
        _check_cache(k_cache, v_cache)
        quant = self._kv_quant(k_cache, k_scale, v_scale)
        if q.ndim != 3:
            raise ValueError(f"q must be [T, num_heads, head_dim], got shape {tuple(q.shape)}")
        num_tokens, num_heads, head_dim = (int(s) for s in q.shape)
        _, block_size, num_kv_heads, cache_head_dim = (int(s) for s in k_cache.shape)
        if head_dim != cache_head_dim:
            raise ValueError(f"q head_dim {head_dim} != cache head_dim {cache_head_dim}")
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"head_dim {head_dim} has no compiled kernel; supported: {SUPPORTED_HEAD_DIMS}")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        if quant is None and q.dtype != k_cache.dtype:
            raise TypeError(f"q dtype {q.dtype} differs from the cache dtype {k_cache.dtype}")
        tag = plans.dtype_tag(q.dtype)
        kern = self.kernels
        if kern.address(k_cache) % 16 or kern.address(v_cache) % 16:
            raise ValueError("k_cache and v_cache must start at 16-byte aligned addresses (the kernels "
                             "load 16 bytes at a time); NumPy and CuPy allocations are")
        out = kern.empty((num_tokens, num_heads, head_dim), q.dtype)
        num_seqs = meta.num_seqs
        if num_tokens == 0 or num_seqs == 0:
            return out
        q = kern.contiguous(q)
        placed = self._device_metadata(meta)

        options = {"sliding_window": sliding_window, "logits_soft_cap": logits_soft_cap}
        if meta.max_query_len == 1:
            partitions = plans.decode_partitions(meta.max_seq_len, self.decode_partition_size, sliding_window)
            if partitions > 1:
                partials = (kern.empty((num_seqs, num_heads, partitions, head_dim), np.float32),
                            kern.empty((num_seqs, num_heads, partitions), np.float32),
                            kern.empty((num_seqs, num_heads, partitions), np.float32))
            else:  # not read: the kernel writes `out` directly
                partials = (kern.empty((1,), np.float32),) * 3
            for launch in plans.paged_decode_launches(q, k_cache, v_cache, out, partials, placed, scale,
                                                      self.decode_partition_size, **options, kv_quant=quant):
                kern.launch(launch)
            return out

        kern.launch(plans.flash_prefill_launch(q, k_cache, v_cache, out, placed, scale,
                                               self._use_mma(tag, quant is not None), **options, kv_quant=quant))
        return out

    def _kv_quant(self, k_cache: Any, k_scale: Any, v_scale: Any) -> plans.KvQuantArgs | None:
        """The kernels' scale arguments for a quantized cache (None for an unquantized one).

        int8 caches take ``[num_blocks, block_size, num_kv_heads]`` float32 C-contiguous scale
        arrays; uint8 (fp8) caches an :class:`FP8Scale` each, of one format.

        Raises:
            ValueError: one scale without the other, or scale arrays of the wrong shape.
            TypeError: scales that do not fit the cache's dtype.
        """
        if k_scale is None and v_scale is None:
            return None
        if k_scale is None or v_scale is None:
            raise ValueError("k_scale and v_scale: give both or neither")
        cache = np.dtype(k_cache.dtype)
        if isinstance(k_scale, FP8Scale) or isinstance(v_scale, FP8Scale):
            if not (isinstance(k_scale, FP8Scale) and isinstance(v_scale, FP8Scale)
                    and k_scale.kv_cache_dtype == v_scale.kv_cache_dtype
                    and k_scale.kv_cache_dtype in plans.KV_QUANT_TAGS and cache == np.uint8):
                raise TypeError(f"fp8 KV caches are uint8 with two FP8Scale of one format; got a {cache} cache "
                                f"and {k_scale!r}, {v_scale!r}")
            unused = self.kernels.empty((1,), np.float32)  # the int8 scale arrays: not read
            return plans.KvQuantArgs(k_scale.kv_cache_dtype, unused, unused, k_scale.scale, v_scale.scale)
        if cache != np.int8:
            raise TypeError(f"per-token scale arrays go with int8 KV caches, not {cache} ones")
        want = tuple(int(s) for s in k_cache.shape[:3])
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if tuple(s.shape) != want or s.dtype != np.float32 or not s.flags.c_contiguous:
                raise ValueError(f"{name} must be C-contiguous float32 of shape {want}, got {s.dtype} "
                                 f"{tuple(s.shape)}")
        return plans.KvQuantArgs("int8", k_scale, v_scale)

    def _use_mma(self, tag: str, quantized: bool = False) -> bool:
        """Tensor-core prefill for 16-bit storage (``prefill_kernel="auto"`` or ``"mma"``);
        never for a quantized cache (see the module docstring)."""
        if self.prefill_kernel == "simt":
            return False
        if quantized:
            if self.prefill_kernel == "mma":
                raise TypeError("prefill_kernel='mma' reads unquantized caches only; a quantized KV cache "
                                "(kv_cache_dtype int8/fp8) takes prefill_kernel='auto' or 'simt'")
            return False
        if tag == "f32":
            if self.prefill_kernel == "mma":
                raise TypeError("prefill_kernel='mma' needs float16 or bfloat16 storage")
            return False
        return True


def _check_options(sliding_window: Any, logits_soft_cap: Any) -> None:
    """The per-layer options: ``sliding_window`` an int >= 1 or None, ``logits_soft_cap`` a
    finite real > 0 (and a normal float32, as the kernels get it) or None.

    Raises:
        ValueError: either is anything else (the message names the value).
    """
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, numbers.Integral) or sliding_window < 1:
            raise ValueError(f"sliding_window must be an int >= 1 or None, got {sliding_window!r}")
    if logits_soft_cap is not None:
        ok = isinstance(logits_soft_cap, numbers.Real) and not isinstance(logits_soft_cap, bool)
        if not ok or not math.isfinite(float(logits_soft_cap)) or not float(logits_soft_cap) > 0:
            raise ValueError(f"logits_soft_cap must be a finite float > 0 or None, got {logits_soft_cap!r}")
        with np.errstate(over="ignore"):
            cap32 = float(np.float32(logits_soft_cap))
        # 1e39 overflows float32; below its smallest normal, -ftz=true (CuPy's NVRTC flag) would
        # flush the kernels' cap to 0, i.e. off
        if not (math.isfinite(cap32) and cap32 >= float(np.finfo(np.float32).tiny)):
            raise ValueError(f"logits_soft_cap {logits_soft_cap!r} is not a finite normal positive float32")


def _check_cache(k_cache: Any, v_cache: Any) -> None:
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache/v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(f"k_cache dtype {k_cache.dtype} != v_cache dtype {v_cache.dtype}")
    if not (k_cache.flags.c_contiguous and v_cache.flags.c_contiguous):
        raise ValueError("k_cache and v_cache must be C-contiguous (the kernels index them as flat arrays)")


class EmulatedCudaAttention(_KernelAttention):
    """The CUDA kernels run on the CPU emulator (``attention_backend="cuda-emulated"``).

    NumPy arrays in (float32, float16 or ``ml_dtypes.bfloat16``), NumPy arrays out. The
    output is filled with NaN before the kernel runs, so an element the kernel forgets to
    write shows up. Slow (every CUDA thread is a fiber): meant for tests and small models.

    Args:
        decode_partition_size: context tokens per Flash-Decoding partition (multiple of 32).
        schedule: thread order between barriers, see
            :func:`refengine.kernels.build.emulated_launch`.
        seed: seed of the ``"shuffle"`` schedule.
        sources: kernel sources to build instead of ``cuda/*.cu`` (the strictness tests use
            deliberately broken copies).
        prefill_kernel: ``"auto"`` (tensor cores for float16/bfloat16, SIMT for float32),
            ``"simt"`` or ``"mma"``.
    Raises:
        ValueError: a bad option. RuntimeError: the emulation build failed.
    """

    name = "cuda-emulated"

    def __init__(self, decode_partition_size: int = DEFAULT_PARTITION_SIZE, schedule: str = "reverse",
                 seed: int = 0, sources: Sequence[os.PathLike | str] | None = None,
                 prefill_kernel: str = "auto") -> None:
        super().__init__(decode_partition_size, prefill_kernel)
        self.kernels = EmulatedKernels(sources, schedule, seed)


class CudaAttention(_KernelAttention):
    """The CUDA kernels on an NVIDIA GPU via CuPy (``attention_backend="cuda"``).

    CuPy arrays in (float16, bfloat16 or float32 storage), CuPy arrays out; the metadata's
    int32 host arrays are copied to the device once per step (:meth:`prepare`).
    ``decode_partition_size`` and ``prefill_kernel`` as for :class:`EmulatedCudaAttention`.
    The kernels are compiled by NVRTC on first use per device
    (:func:`refengine.kernels.build.cupy_kernels`; CuPy caches the binary on disk).

    Raises:
        ImportError: CuPy is not installed (``pip install 'refengine[cuda]'``).
    """

    name = "cuda"

    def __init__(self, decode_partition_size: int = DEFAULT_PARTITION_SIZE, prefill_kernel: str = "auto") -> None:
        super().__init__(decode_partition_size, prefill_kernel)
        self.kernels = cupy_kernels()
