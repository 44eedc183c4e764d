"""Layer operations as CUDA kernels (``cuda/layers.cu``), on CuPy arrays (or NumPy arrays
on the CPU emulator).

The NumPy versions in :mod:`refengine.layers` are their reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from refengine.kernels.build import KernelModule, cupy_kernels
from refengine.kernels.plans import LAYER_THREADS, RMS_NORM_SHARED_BYTES, Launch, dtype_tag
from refengine.ops.numpy_ops import blas_weight, linear_f32


@dataclass
class DevicePositions:
    """One step's token positions, copied to the device once for every layer's RoPE.

    Attributes:
        host: ``[T]`` int host array (for the range check, which needs no device sync).
        device: ``[T]`` int32 copy the kernel reads.
    """

    host: np.ndarray
    device: Any


class CudaLayerOps:
    """RMSNorm, RoPE, SiLU-and-mul and GELU(tanh)-and-mul through the kernels of
    ``cuda/layers.cu``; the matrix product through cuBLAS (CuPy's ``@``, float32 accumulation).

    Args:
        kernels: the launcher of the compiled module; default the current device's CuPy
            module (:func:`refengine.kernels.build.cupy_kernels`), the one
            :class:`refengine.attention.cuda.CudaAttention` uses too.
    Raises:
        ImportError: no ``kernels`` given and CuPy is not installed.
    """

    name = "cuda"

    def __init__(self, kernels: KernelModule | None = None):
        self.kernels = cupy_kernels() if kernels is None else kernels
        # id(rope) -> (rope, its [max_positions, head_dim] cos|sin table): one per RoPE object,
        # as layers may carry different ones (Gemma 3's local and global bases)
        self._cos_sin: dict[int, tuple[Any, Any]] = {}

    def device_positions(self, positions: np.ndarray) -> DevicePositions:
        """``positions [T]`` (host ints) copied to the device as int32, once per step."""
        positions = np.asarray(positions)
        return DevicePositions(positions, self.kernels.int32(positions))

    def weight(self, matrix: np.ndarray) -> np.ndarray:
        return blas_weight(matrix)

    def linear(self, x, w):
        return linear_f32(x, w)

    def rms_norm(self, x: Any, weight: Any, eps: float) -> Any:
        """``x / sqrt(mean(x**2, -1) + eps) * weight`` with float32 statistics (HF LlamaRMSNorm).

        Args:
            x: ``[..., hidden]``; weight: ``[hidden]``, same dtype (float32, float16 or bfloat16).
        Returns:
            x's shape and dtype.
        Raises:
            ValueError: shapes disagree. TypeError: dtypes differ or are unsupported.
        """
        rows = x.reshape(-1, x.shape[-1])
        if weight.shape != (rows.shape[1],):
            raise ValueError(f"rms_norm wants x [..., hidden] and weight [hidden], got {tuple(x.shape)}, "
                             f"{tuple(weight.shape)}")
        if weight.dtype != x.dtype:
            raise TypeError(f"weight dtype {weight.dtype} != x dtype {x.dtype}")
        kern = self.kernels
        out = kern.empty(tuple(rows.shape), x.dtype)
        if rows.shape[0]:
            kern.launch(Launch(f"rms_norm_{dtype_tag(x.dtype)}", (int(rows.shape[0]), 1, 1), (LAYER_THREADS, 1, 1),
                               RMS_NORM_SHARED_BYTES, (out, kern.contiguous(rows), kern.contiguous(weight),
                                                       np.int32(rows.shape[1]), np.float32(eps))))
        return out.reshape(x.shape)

    def rope(self, q, k, positions: DevicePositions, rope):
        """Rotate ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` by ``positions`` with ``rope``'s tables
        (:class:`refengine.layers.RotaryEmbedding`, ``cos``/``sin [max_positions, D // 2]``;
        any even D, 96 and 256 included). Their concatenation is built once per ``rope`` object.

        Returns:
            ``(q, k)`` rotated (C-contiguous copies of the inputs if they were not, else the
            inputs themselves, rotated in place).
        """
        xp = rope.xp
        cached = self._cos_sin.get(id(rope))  # the entry keeps rope alive: its id is not reused
        if cached is None:
            table = xp.ascontiguousarray(xp.concatenate([rope.cos, rope.sin], axis=1))
            cached = self._cos_sin[id(rope)] = (rope, table)
        q, k = xp.ascontiguousarray(q), xp.ascontiguousarray(k)
        self.rotary_embedding(positions, q, k, cached[1])  # in place
        return q, k

    def silu_and_mul(self, x: Any) -> Any:
        """SwiGLU activation: ``silu(x[:, :I]) * x[:, I:]`` for ``x [T, 2I]`` -> ``[T, I]``.

        Raises:
            ValueError: x is not 2-D with an even last dimension.
        """
        return self._gated("silu_and_mul", x)

    def gelu_tanh_and_mul(self, x: Any) -> Any:
        """GeGLU activation (Gemma's ``gelu_pytorch_tanh``): ``gelu_tanh(x[:, :I]) * x[:, I:]``
        for ``x [T, 2I]`` -> ``[T, I]``, as :func:`refengine.layers.gelu_tanh_and_mul`.

        Raises:
            ValueError: x is not 2-D with an even last dimension.
        """
        return self._gated("gelu_tanh_and_mul", x)

    def _gated(self, kernel: str, x: Any) -> Any:
        """One ``<kernel>_<dt>`` launch of layers.cu's gated activations (one block per row)."""
        if x.ndim != 2 or x.shape[1] % 2:
            raise ValueError(f"{kernel} wants x [T, 2 * intermediate], got {tuple(x.shape)}")
        kern = self.kernels
        inter = int(x.shape[1]) // 2
        out = kern.empty((int(x.shape[0]), inter), x.dtype)
        if x.shape[0]:
            kern.launch(Launch(f"{kernel}_{dtype_tag(x.dtype)}", (int(x.shape[0]), 1, 1), (LAYER_THREADS, 1, 1),
                               0, (out, kern.contiguous(x), np.int32(inter))))
        return out

    def rotary_embedding(self, positions: np.ndarray | DevicePositions, q: Any, k: Any, cos_sin_cache: Any,
                         rotary_dim: int | None = None) -> None:
        """Rotate ``q`` and ``k`` in place by their positions (HF Llama ``rotate_half`` pairing).

        Args:
            positions: ``[T]`` int host array, or :meth:`device_positions`'s copy of one.
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
        host = positions.host if isinstance(positions, DevicePositions) else np.asarray(positions)
        if host.shape != (num_tokens,) or (num_tokens and not 0 <= host.min() <= host.max()
                                           < cos_sin_cache.shape[0]):
            raise ValueError(f"positions must be [T] in [0, {cos_sin_cache.shape[0]})")
        if num_tokens:
            kern = self.kernels
            device = positions.device if isinstance(positions, DevicePositions) else kern.int32(host)
            kern.launch(Launch(f"rotary_embedding_{dtype_tag(q.dtype)}", (num_tokens, 1, 1), (LAYER_THREADS, 1, 1),
                               0, (q, k, device, kern.contiguous(cos_sin_cache), np.int32(num_heads),
                                   np.int32(k.shape[1]), np.int32(head_dim), np.int32(rotary_dim))))
