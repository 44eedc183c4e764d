"""Attention through refengine's hand-written CUDA kernels (``cuda/*.cu``).

Two backends run the *same* kernel sources:

* :class:`CudaAttention` (``"cuda"``): on an NVIDIA GPU, compiled at first use by
  ``cupy.RawModule`` (NVRTC); CuPy arrays in and out.
* :class:`EmulatedCudaAttention` (``"cuda-emulated"``): on the CPU. The kernels are compiled
  by ``g++`` with ``cuda/cuda_emu.h`` force-included, into a shared library cached under
  ``cuda/build/``; every block of every launch runs on a strict thread emulator (fibers
  scheduled adversarially, poisoned shared memory, checked warp collectives). NumPy arrays
  in and out. This is how CI, which has no GPU, tests the kernels.

Kernels (see each file's header comment for thread layout and sources, and cuda/README.md):

* ``reshape_and_cache_<dt>``: ``write_kv``, new K/V rows into their cache slots;
* ``flash_prefill_<dt>_hd<D>``: FlashAttention-2 over the paged cache, any mix of chunk
  lengths (decode rows included), SIMT float32 FMAs;
* ``flash_prefill_mma_<dt>_hd<D>``: the same on tensor cores (``mma.sync`` m16n8k16,
  ``ldmatrix`` fragments, ``cp.async`` K/V tiles), float16/bfloat16 only; the default for
  those dtypes;
* ``paged_decode_<dt>_hd<D>``: one query per sequence, all heads of a KV group per block,
  context split into partitions (Flash-Decoding), and ``paged_decode_reduce_<dt>_hd<D>``
  to merge the partitions by their softmax statistics;
* ``rms_norm_<dt>``, ``silu_and_mul_<dt>``, ``rotary_embedding_<dt>`` (layers.cu): the
  per-token layer kernels, offered as methods of both backends for a GPU model path;
* ``mma_check_<dt>``, ``ldmatrix_check_f16``: one tensor-core MMA / one ldmatrix (and
  cp.async) on known matrices (layout self-tests, run on the GPU by ``make gpu-check``).

``<dt>`` is ``f32``, ``f16`` or ``bf16`` (storage type; arithmetic is float32) and ``D``
(head_dim) is one of :data:`SUPPORTED_HEAD_DIMS`.

Not done yet: a deeper (multi-stage, TMA) pipeline and Hopper ``wgmma`` in the prefill
kernel, a tensor-core decode for large groups, FP8 KV cache.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from refengine.attention import AttentionMetadata
from refengine.resources import build_cache_dir, cuda_source_dir

CUDA_DIR = cuda_source_dir()
BUILD_DIR = build_cache_dir() / "cuda-emulated"
KERNEL_SOURCES = ("reshape_and_cache.cu", "flash_prefill.cu", "flash_prefill_mma.cu", "paged_decode.cu", "layers.cu",
                  "mma_check.cu")
EMULATION_SUPPORT = ("cuda_emu.h", "common.cuh", "mma.cuh", "cp_async.cuh", "emu_runtime.cpp")
SUPPORTED_HEAD_DIMS = (32, 64, 128)

# Launch geometry; each constant mirrors the kernel source named beside it.
RESHAPE_THREADS = 128
LAYER_THREADS = 256  # layers.cu: any multiple of 32
PREFILL_THREADS = 128  # flash_prefill.cu prefill::kNumThreads
PREFILL_BLOCK_M = 32  # prefill::kBlockM (query rows per block)
PREFILL_BLOCK_N = 32  # prefill::kBlockN (keys per shared-memory tile)
MMA_BLOCK_M = 64  # flash_prefill_mma.cu prefill_mma::kBlockM
MMA_BLOCK_N = 64  # prefill_mma::kBlockN
MMA_PAD = 8  # prefill_mma::kPad
PREFILL_KERNELS = ("auto", "simt", "mma")
DECODE_THREADS = 128  # paged_decode.cu decode::kNumThreads
DECODE_KEY_TILE = 32  # decode::kKeyTile
DECODE_GROUP_TILE = 8  # decode::kGroupTile (query heads per block)
DEFAULT_PARTITION_SIZE = 512  # context tokens per Flash-Decoding partition

GXX_FLAGS = ("-std=c++17", "-O2", "-fPIC", "-shared", "-fno-strict-aliasing", "-DREFENGINE_EMULATION")


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


def prefill_shared_bytes(head_dim: int, itemsize: int) -> int:
    """Dynamic shared memory of ``flash_prefill``: a K and a V tile of 32 keys."""
    return 2 * PREFILL_BLOCK_N * head_dim * itemsize


def prefill_mma_shared_bytes(head_dim: int) -> int:
    """Dynamic shared memory of ``flash_prefill_mma``: padded K and V tiles of 64 keys (2-byte T)."""
    return 2 * MMA_BLOCK_N * (head_dim + MMA_PAD) * 2


def decode_shared_bytes(head_dim: int) -> int:
    """Dynamic shared memory of ``paged_decode`` (float32; mirrors ``decode::shared_floats``)."""
    floats = (DECODE_GROUP_TILE * head_dim + DECODE_KEY_TILE * (head_dim + 1) + DECODE_KEY_TILE * head_dim
              + DECODE_GROUP_TILE * DECODE_KEY_TILE + 3 * DECODE_GROUP_TILE)
    return 4 * floats


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


class _KernelAttention:
    """Backend-independent part: validation and the launch plan of each kernel."""

    name = "cuda-kernels"

    def __init__(self, decode_partition_size: int = DEFAULT_PARTITION_SIZE, prefill_kernel: str = "auto") -> None:
        if decode_partition_size <= 0 or decode_partition_size % DECODE_KEY_TILE:
            raise ValueError(f"decode_partition_size must be a positive multiple of {DECODE_KEY_TILE}")
        if prefill_kernel not in PREFILL_KERNELS:
            raise ValueError(f"prefill_kernel must be one of {PREFILL_KERNELS}, got {prefill_kernel!r}")
        self.decode_partition_size = decode_partition_size
        self.prefill_kernel = prefill_kernel

    # --- to be provided by the concrete backend -----------------------------------------
    def _launch(self, launch: Launch) -> None:
        raise NotImplementedError

    def _empty(self, shape: tuple, dtype: Any, like: Any) -> Any:
        raise NotImplementedError

    def _int32(self, host: np.ndarray) -> Any:
        raise NotImplementedError

    def _contiguous(self, x: Any) -> Any:
        raise NotImplementedError

    def _address(self, x: Any) -> int:
        raise NotImplementedError

    # --- the AttentionBackend protocol ----------------------------------------------------
    def prepare(self, meta: AttentionMetadata) -> None:
        """Nothing yet: metadata is uploaded per call."""

    def write_kv(self, k_cache: Any, v_cache: Any, k: Any, v: Any, meta: AttentionMetadata) -> None:
        """Store ``k, v [T, num_kv_heads, head_dim]`` into the caches at ``meta.slot_mapping``.

        Args:
            k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, C-contiguous,
                written in place.
            k, v: ``[T, num_kv_heads, head_dim]`` in the cache dtype.
            meta: ``slot_mapping [T]`` int32; a negative slot is skipped.
        Raises:
            ValueError: shapes disagree or the cache is not C-contiguous.
            TypeError: dtypes differ or are not float32/float16/bfloat16.
        """
        _check_cache(k_cache, v_cache)
        num_tokens = k.shape[0]
        row = k_cache.shape[2:]
        if tuple(k.shape[1:]) != tuple(row) or k.shape != v.shape:
            raise ValueError(f"k/v {tuple(k.shape)}/{tuple(v.shape)} do not match cache rows {tuple(row)}")
        if k.dtype != k_cache.dtype or v.dtype != k_cache.dtype:
            raise TypeError(f"k/v dtype {k.dtype}/{v.dtype} differs from the cache dtype {k_cache.dtype}")
        if len(meta.slot_mapping) != num_tokens:
            raise ValueError(f"slot_mapping has {len(meta.slot_mapping)} entries for {num_tokens} tokens")
        if num_tokens == 0:
            return
        tag = dtype_tag(k_cache.dtype)
        self._launch(Launch(
            f"reshape_and_cache_{tag}", (num_tokens, 1, 1), (RESHAPE_THREADS, 1, 1), 0,
            (self._contiguous(k), self._contiguous(v), k_cache, v_cache, self._int32(meta.slot_mapping),
             np.int32(row[0] * row[1])),
        ))

    def forward(self, q: Any, k_cache: Any, v_cache: Any, meta: AttentionMetadata, scale: float) -> Any:
        """Attention of ``q`` over the paged cache, per the contract in :mod:`refengine.attention`.

        A pure decode batch (``meta.max_query_len == 1``) goes to ``paged_decode`` (plus
        ``paged_decode_reduce`` when the longest context spans several partitions);
        anything else, mixed batches included, to ``flash_prefill``.

        Args:
            q: ``[T, num_heads, head_dim]``, same dtype as the cache.
            k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
            meta: query_start_loc ``[B+1]``, seq_lens ``[B]``, block_tables ``[B, max_blocks]``
                (int32 host arrays), max_query_len, max_seq_len.
            scale: softmax scale, usually ``1 / sqrt(head_dim)``.
        Returns:
            ``[T, num_heads, head_dim]`` in q's dtype.
        Raises:
            ValueError: inconsistent shapes, head_dim not in :data:`SUPPORTED_HEAD_DIMS`,
                num_heads not a multiple of num_kv_heads, or a cache not 16-byte aligned.
            TypeError: unsupported or mismatched dtypes.
        """
        _check_cache(k_cache, v_cache)
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
        if q.dtype != k_cache.dtype:
            raise TypeError(f"q dtype {q.dtype} differs from the cache dtype {k_cache.dtype}")
        tag = dtype_tag(q.dtype)
        if self._address(k_cache) % 16 or self._address(v_cache) % 16:
            raise ValueError("k_cache and v_cache must start at 16-byte aligned addresses (the kernels "
                             "load 16 bytes at a time); NumPy and CuPy allocations are")
        out = self._empty((num_tokens, num_heads, head_dim), q.dtype, like=q)
        num_seqs = meta.num_seqs
        if num_tokens == 0 or num_seqs == 0:
            return out
        q = self._contiguous(q)
        query_start_loc = self._int32(meta.query_start_loc)
        seq_lens = self._int32(meta.seq_lens)
        block_tables = self._int32(meta.block_tables)
        max_blocks = np.int32(meta.block_tables.shape[1])
        common = (np.int32(num_heads), np.int32(num_kv_heads), np.int32(block_size), np.float32(scale))

        if meta.max_query_len == 1:
            partitions = max(1, -(-int(meta.max_seq_len) // self.decode_partition_size))
            group = num_heads // num_kv_heads
            group_chunks = -(-group // DECODE_GROUP_TILE)
            if partitions > 1:
                partial_out = self._empty((num_seqs, num_heads, partitions, head_dim), np.float32, like=q)
                partial_max = self._empty((num_seqs, num_heads, partitions), np.float32, like=q)
                partial_sum = self._empty((num_seqs, num_heads, partitions), np.float32, like=q)
            else:  # not read: the kernel writes `out` directly
                partial_out = partial_max = partial_sum = self._empty((1,), np.float32, like=q)
            partition_size = np.int32(self.decode_partition_size)
            self._launch(Launch(
                f"paged_decode_{tag}_hd{head_dim}", (num_kv_heads * group_chunks, num_seqs, partitions),
                (DECODE_THREADS, 1, 1), decode_shared_bytes(head_dim),
                (q, k_cache, v_cache, out, partial_out, partial_max, partial_sum, query_start_loc, seq_lens,
                 block_tables, max_blocks, *common, partition_size),
            ))
            if partitions > 1:
                self._launch(Launch(
                    f"paged_decode_reduce_{tag}_hd{head_dim}", (num_heads, num_seqs, 1), (head_dim, 1, 1), 0,
                    (out, partial_out, partial_max, partial_sum, query_start_loc, seq_lens, np.int32(num_heads),
                     np.int32(partitions), partition_size),
                ))
            return out

        args = (q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, max_blocks, *common)
        if self._use_mma(tag):
            q_tiles = -(-int(meta.max_query_len) // MMA_BLOCK_M)
            self._launch(Launch(f"flash_prefill_mma_{tag}_hd{head_dim}", (q_tiles, num_heads, num_seqs),
                                (PREFILL_THREADS, 1, 1), prefill_mma_shared_bytes(head_dim), args))
        else:
            q_tiles = -(-int(meta.max_query_len) // PREFILL_BLOCK_M)
            self._launch(Launch(f"flash_prefill_{tag}_hd{head_dim}", (q_tiles, num_heads, num_seqs),
                                (PREFILL_THREADS, 1, 1), prefill_shared_bytes(head_dim, np.dtype(q.dtype).itemsize),
                                args))
        return out

    def _use_mma(self, tag: str) -> bool:
        """Tensor-core prefill for 16-bit storage (``prefill_kernel="auto"`` or ``"mma"``)."""
        if self.prefill_kernel == "simt":
            return False
        if tag == "f32":
            if self.prefill_kernel == "mma":
                raise TypeError("prefill_kernel='mma' needs float16 or bfloat16 storage")
            return False
        return True

    # --- layer kernels (layers.cu); not part of the attention protocol ---------------------
    def rms_norm(self, x: Any, weight: Any, eps: float) -> Any:
        """``x / sqrt(mean(x**2, -1) + eps) * weight`` with float32 statistics (HF LlamaRMSNorm).

        Args:
            x: ``[T, hidden]``; weight: ``[hidden]``, same dtype.
        Returns:
            ``[T, hidden]`` in x's dtype.
        Raises:
            ValueError: shapes disagree. TypeError: dtypes differ or are unsupported.
        """
        if x.ndim != 2 or weight.shape != (x.shape[1],):
            raise ValueError(f"rms_norm wants x [T, hidden] and weight [hidden], got {tuple(x.shape)}, "
                             f"{tuple(weight.shape)}")
        if weight.dtype != x.dtype:
            raise TypeError(f"weight dtype {weight.dtype} != x dtype {x.dtype}")
        out = self._empty(tuple(x.shape), x.dtype, like=x)
        if x.shape[0]:
            self._launch(Launch(f"rms_norm_{dtype_tag(x.dtype)}", (int(x.shape[0]), 1, 1), (LAYER_THREADS, 1, 1),
                                32 * 4, (out, self._contiguous(x), self._contiguous(weight),
                                         np.int32(x.shape[1]), np.float32(eps))))
        return out

    def silu_and_mul(self, x: Any) -> Any:
        """SwiGLU activation: ``silu(x[:, :I]) * x[:, I:]`` for ``x [T, 2I]`` -> ``[T, I]``.

        Raises:
            ValueError: x is not 2-D with an even last dimension.
        """
        if x.ndim != 2 or x.shape[1] % 2:
            raise ValueError(f"silu_and_mul wants x [T, 2 * intermediate], got {tuple(x.shape)}")
        inter = int(x.shape[1]) // 2
        out = self._empty((int(x.shape[0]), inter), x.dtype, like=x)
        if x.shape[0]:
            self._launch(Launch(f"silu_and_mul_{dtype_tag(x.dtype)}", (int(x.shape[0]), 1, 1), (LAYER_THREADS, 1, 1),
                                0, (out, self._contiguous(x), np.int32(inter))))
        return out

    def rotary_embedding(self, positions: np.ndarray, q: Any, k: Any, cos_sin_cache: Any,
                         rotary_dim: int | None = None) -> None:
        """Rotate ``q`` and ``k`` in place by their positions (HF Llama ``rotate_half`` pairing).

        Args:
            positions: ``[T]`` int (host array).
            q: ``[T, num_heads, head_dim]``; k: ``[T, num_kv_heads, head_dim]``; C-contiguous.
            cos_sin_cache: float32 ``[max_position, rotary_dim]``: ``cos(p * inv_freq)`` in the
                first ``rotary_dim / 2`` columns, the sines in the rest.
            rotary_dim: rotated leading dimensions (default head_dim).
        Raises:
            ValueError: shapes disagree, a position is outside the cache, or q/k are not
                C-contiguous.
            TypeError: cos_sin_cache is not float32.
        """
        num_tokens, num_heads, head_dim = (int(s) for s in q.shape)
        rotary_dim = head_dim if rotary_dim is None else int(rotary_dim)
        if k.ndim != 3 or k.shape[0] != num_tokens or k.shape[2] != head_dim or k.dtype != q.dtype:
            raise ValueError(f"k {tuple(k.shape)} {k.dtype} does not match q {tuple(q.shape)} {q.dtype}")
        if rotary_dim % 2 or rotary_dim > head_dim or cos_sin_cache.shape[1] != rotary_dim:
            raise ValueError(f"rotary_dim {rotary_dim} vs head_dim {head_dim} / cache {tuple(cos_sin_cache.shape)}")
        if not (q.flags.c_contiguous and k.flags.c_contiguous):
            raise ValueError("rotary_embedding works in place: q and k must be C-contiguous")
        if np.dtype(cos_sin_cache.dtype) != np.float32:
            raise TypeError("cos_sin_cache must be float32")
        positions = np.asarray(positions)
        if positions.shape != (num_tokens,) or (num_tokens and not 0 <= positions.min() <= positions.max()
                                                 < cos_sin_cache.shape[0]):
            raise ValueError(f"positions must be [T] in [0, {cos_sin_cache.shape[0]})")
        if num_tokens:
            self._launch(Launch(f"rotary_embedding_{dtype_tag(q.dtype)}", (num_tokens, 1, 1), (LAYER_THREADS, 1, 1),
                                0, (q, k, self._int32(positions), self._contiguous(cos_sin_cache),
                                    np.int32(num_heads), np.int32(k.shape[1]), np.int32(head_dim),
                                    np.int32(rotary_dim))))


def nvrtc_program(cuda_include: os.PathLike | str | None) -> tuple[str, tuple[str, ...]]:
    """The one translation unit and the options :class:`CudaAttention` hands to NVRTC.

    Every file of :data:`KERNEL_SOURCES`, concatenated (each includes ``common.cuh``, whose
    ``#pragma once`` keeps the helpers single). NVRTC has no ``cuda_fp16.h`` /
    ``cuda_bf16.h`` of its own: ``cuda_include`` is the CUDA include directory that holds
    them (CuPy's ``get_cuda_path()/include``; with pip wheels, ``nvidia/cu13/include`` from
    ``nvidia-cuda-runtime``). ``tests/test_nvrtc.py`` compiles exactly this for sm_90;
    CuPy adds ``-arch`` and its own flags (``cupy/cuda/compiler.py``).

    Returns:
        ``(source, options)``: the CUDA C++ text and the NVRTC command-line options.
    Raises:
        OSError: a file of :data:`KERNEL_SOURCES` cannot be read.
    """
    code = "\n".join((CUDA_DIR / name).read_text() for name in KERNEL_SOURCES)
    options = ["--std=c++17", f"-I{CUDA_DIR}"]
    if cuda_include is not None:
        options.append(f"-I{cuda_include}")
    return code, tuple(options)


def _check_cache(k_cache: Any, v_cache: Any) -> None:
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache/v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(f"k_cache dtype {k_cache.dtype} != v_cache dtype {v_cache.dtype}")
    if not (k_cache.flags.c_contiguous and v_cache.flags.c_contiguous):
        raise ValueError("k_cache and v_cache must be C-contiguous (the kernels index them as flat arrays)")


# =======================================================================================
# CPU emulation
# =======================================================================================

_build_lock = threading.Lock()
_launch_lock = threading.Lock()  # the emulator keeps its scheduler state in globals
_libraries: dict[Path, ctypes.CDLL] = {}


def build_emulation_library(sources: Sequence[os.PathLike | str] | None = None, *,
                            build_dir: os.PathLike | str = BUILD_DIR,
                            extra_flags: Sequence[str] = ()) -> ctypes.CDLL:
    """Compile kernel sources for the CPU emulator (once) and load the library.

    Every translation unit (each ``.cu`` file, and ``emu_runtime.cpp``) becomes an object
    file named after a hash of its text, the shared headers (``cuda_emu.h``,
    ``common.cuh``, ``mma.cuh``) and the flags; the library is named after its objects.
    So an edited source rebuilds only itself, an unchanged tree is reused across
    processes, and the objects compile in parallel. Every file is written under a
    temporary name and moved into place, so concurrent builders (pytest-xdist workers)
    never see half a file.

    Args:
        sources: ``.cu`` files; default: every kernel in ``cuda/``. ``#include "common.cuh"``
            resolves to ``cuda/`` even for a copy elsewhere.
        build_dir: where objects and libraries are kept (default ``cuda/build``).
        extra_flags: additional g++ flags.
    Returns:
        The loaded ``ctypes.CDLL`` with ``refengine_emu_*`` functions typed.
    Raises:
        RuntimeError: g++ is missing or compilation failed (its output included).
    """
    source_paths = [Path(s) for s in (sources or [CUDA_DIR / name for name in KERNEL_SOURCES])]
    flags = [*GXX_FLAGS, *extra_flags, f"-I{CUDA_DIR}"]
    shared = hashlib.sha256(" ".join(flags).encode())
    for name in EMULATION_SUPPORT:
        shared.update(name.encode() + b"\0" + (CUDA_DIR / name).read_bytes() + b"\0")
    build_dir = Path(build_dir)

    def object_path(source: Path) -> Path:
        digest = hashlib.sha256(shared.digest() + source.read_bytes()).hexdigest()[:16]
        return build_dir / f"{source.stem}_{digest}.o"

    units = [(CUDA_DIR / "emu_runtime.cpp", ["-x", "c++"])] + [
        (path, ["-include", str(CUDA_DIR / "cuda_emu.h"), "-x", "c++"]) for path in source_paths]
    objects = [object_path(path) for path, _ in units]
    target = build_dir / ("refengine_emu_" + hashlib.sha256("".join(o.name for o in objects).encode()).hexdigest()[:16]
                          + ".so")

    with _build_lock:
        if target in _libraries:
            return _libraries[target]
        if not target.exists():
            compiler = shutil.which(os.environ.get("CXX", "g++"))
            if compiler is None:
                raise RuntimeError("the cuda-emulated attention backend needs g++ (set CXX to another C++17 compiler)")
            build_dir.mkdir(parents=True, exist_ok=True)
            jobs = [[compiler, *flags, *lang, "-c", str(path)] for (path, lang), obj in zip(units, objects)
                    if not obj.exists()]
            missing = [obj for obj in objects if not obj.exists()]
            with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
                list(pool.map(lambda job: _compile_to(job[0], job[1]), zip(jobs, missing)))
            _compile_to([compiler, *flags, *map(str, objects)], target)
        lib = ctypes.CDLL(str(target))
        lib.refengine_emu_launch.restype = ctypes.c_int
        lib.refengine_emu_launch.argtypes = [ctypes.c_char_p] + [ctypes.c_uint] * 6 + [
            ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
        lib.refengine_emu_last_error.restype = ctypes.c_char_p
        lib.refengine_emu_list_kernels.restype = ctypes.c_char_p
        lib.refengine_emu_set_schedule.argtypes = [ctypes.c_int, ctypes.c_ulonglong]
        _libraries[target] = lib
        return lib


def _compile_to(cmd: list[str], output: Path) -> None:
    """Run ``cmd -o <temporary>`` and move the result to ``output`` atomically."""
    fd, tmp = tempfile.mkstemp(prefix=output.stem + ".", suffix=".tmp" + output.suffix, dir=output.parent)
    os.close(fd)
    result = subprocess.run([*cmd, "-o", tmp], capture_output=True, text=True)
    if result.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"emulation build failed:\n$ {' '.join(cmd)}\n{result.stderr}")
    os.replace(tmp, output)


SCHEDULES = {"reverse": 0, "forward": 1, "shuffle": 2}


def emulated_launch(lib: ctypes.CDLL, launch: Launch, schedule: str = "reverse", seed: int = 0) -> None:
    """Run one :class:`Launch` on the CPU emulator.

    Args:
        lib: from :func:`build_emulation_library`.
        launch: arrays in ``args`` must be C-contiguous NumPy arrays (passed by pointer).
        schedule: thread order between barriers: ``"reverse"`` (default), ``"forward"`` or
            ``"shuffle"`` (seeded by ``seed``).
    Raises:
        RuntimeError: the kernel broke an emulation rule (divergent barrier, divergent warp
            collective, too little shared memory) or the kernel/arity is unknown.
    """
    holders = []
    argv = (ctypes.c_void_p * len(launch.args))()
    for i, arg in enumerate(launch.args):
        if isinstance(arg, np.ndarray):
            if not arg.flags.c_contiguous:
                raise ValueError(f"argument {i} of {launch.kernel} is not C-contiguous")
            holder = ctypes.c_void_p(arg.ctypes.data)
        elif isinstance(arg, np.int32):
            holder = ctypes.c_int32(int(arg))
        elif isinstance(arg, np.float32):
            holder = ctypes.c_float(float(arg))
        else:
            raise TypeError(f"argument {i} of {launch.kernel}: {type(arg).__name__} "
                            "(want ndarray, np.int32 or np.float32)")
        holders.append(holder)
        argv[i] = ctypes.cast(ctypes.pointer(holder), ctypes.c_void_p)
    with _launch_lock:
        lib.refengine_emu_set_schedule(SCHEDULES[schedule], seed)
        rc = lib.refengine_emu_launch(launch.kernel.encode(), *launch.grid, *launch.block, launch.shared_bytes,
                                      argv, len(launch.args))
        if rc != 0:
            raise RuntimeError(f"{launch.kernel}: {lib.refengine_emu_last_error().decode()}")


class EmulatedCudaAttention(_KernelAttention):
    """The CUDA kernels run on the CPU emulator (``attention_backend="cuda-emulated"``).

    NumPy arrays in (float32, float16 or ``ml_dtypes.bfloat16``), NumPy arrays out. The
    output is filled with NaN before the kernel runs, so an element the kernel forgets to
    write shows up. Slow (every CUDA thread is a fiber): meant for tests and small models.

    Args:
        decode_partition_size: context tokens per Flash-Decoding partition (multiple of 32).
        prefill_kernel: ``"auto"`` (tensor cores for float16/bfloat16, SIMT for float32),
            ``"simt"`` or ``"mma"``.
        schedule: thread order between barriers, see :func:`emulated_launch`.
        seed: seed of the ``"shuffle"`` schedule.
        sources: kernel sources to build instead of ``cuda/*.cu`` (the strictness tests use
            deliberately broken copies).
    """

    name = "cuda-emulated"

    def __init__(self, decode_partition_size: int = DEFAULT_PARTITION_SIZE, schedule: str = "reverse",
                 seed: int = 0, sources: Sequence[os.PathLike | str] | None = None,
                 prefill_kernel: str = "auto") -> None:
        super().__init__(decode_partition_size, prefill_kernel)
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {tuple(SCHEDULES)}")
        self.schedule = schedule
        self.seed = seed
        self._lib = build_emulation_library(sources)

    def _launch(self, launch: Launch) -> None:
        emulated_launch(self._lib, launch, self.schedule, self.seed)

    def _empty(self, shape: tuple, dtype: Any, like: Any) -> np.ndarray:
        return np.full(shape, np.nan, dtype=dtype)

    def _int32(self, host: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(host, dtype=np.int32)

    def _contiguous(self, x: np.ndarray) -> np.ndarray:
        if not isinstance(x, np.ndarray):
            raise TypeError(f"cuda-emulated attention takes NumPy arrays, got {type(x).__name__}")
        return np.ascontiguousarray(x)

    def _address(self, x: np.ndarray) -> int:
        return int(x.ctypes.data)


# =======================================================================================
# GPU (CuPy)
# =======================================================================================

class CudaAttention(_KernelAttention):
    """The CUDA kernels on an NVIDIA GPU via CuPy (``attention_backend="cuda"``).

    CuPy arrays in (float16, bfloat16 or float32 storage), CuPy arrays out; the metadata's
    int32 host arrays are copied to the device on each call. ``decode_partition_size`` and
    ``prefill_kernel`` as for :class:`EmulatedCudaAttention`. The kernels are compiled by
    NVRTC on first use (CuPy caches the binary on disk).

    Raises:
        ImportError: CuPy is not installed (``pip install 'refengine[cuda]'``).
    """

    name = "cuda"

    def __init__(self, decode_partition_size: int = DEFAULT_PARTITION_SIZE, prefill_kernel: str = "auto") -> None:
        super().__init__(decode_partition_size, prefill_kernel)
        try:
            import cupy
        except ImportError as exc:  # pragma: no cover - depends on the machine
            raise ImportError("attention_backend='cuda' needs CuPy with a CUDA device: "
                              "pip install 'refengine[cuda]' (cupy-cuda13x)") from exc
        self._cp = cupy
        cuda_path = cupy.cuda.get_cuda_path() if hasattr(cupy.cuda, "get_cuda_path") else None
        code, options = nvrtc_program(Path(cuda_path) / "include" if cuda_path else None)
        self._module = cupy.RawModule(code=code, options=options)
        self._kernels: dict[str, Any] = {}

    def _launch(self, launch: Launch) -> None:
        kernel = self._kernels.get(launch.kernel)
        if kernel is None:
            kernel = self._kernels[launch.kernel] = self._module.get_function(launch.kernel)
        kernel(launch.grid, launch.block, launch.args, shared_mem=launch.shared_bytes)

    def _empty(self, shape: tuple, dtype: Any, like: Any) -> Any:
        return self._cp.empty(shape, dtype=dtype)

    def _int32(self, host: np.ndarray) -> Any:
        return self._cp.asarray(np.ascontiguousarray(host, dtype=np.int32))

    def _contiguous(self, x: Any) -> Any:
        return self._cp.ascontiguousarray(x)

    def _address(self, x: Any) -> int:
        return int(x.data.ptr)
