"""Layer operations on a GPU (:class:`CudaLayerOps`): CUDA kernels and cuBLAS on CuPy arrays.

The kernels of ``cuda/layers.cu``, and of ``cuda/quant_matmul.cu`` for weights kept
quantized (int8, AWQ/GPTQ 4-bit; GGUF files are dequantized at load on a GPU); float
products through cuBLAS. NumPy arrays on the CPU emulator.

The NumPy versions in :mod:`refengine.ops.layers` are their reference; the NumPy twin of the
quantized products is :func:`refengine.quant.reference_linear`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from refengine.kernels.build import KernelModule, cupy_kernels
from refengine.kernels.plans import LAYER_THREADS, RMS_NORM_SHARED_BYTES, Launch, dtype_tag, quant_linear_launch
from refengine.ops.numpy_ops import NoStepHooks, blas_weight, embedding_rows, linear_f32
from refengine.quant import QuantizedWeight, StackedWeight, is_quantized
from refengine.quant.int4 import Int4Weight
from refengine.quant.int8 import Int8Weight


@dataclass
class DevicePositions:
    """One step's token positions, copied to the device once for every layer's RoPE.

    Attributes:
        host: ``[T]`` int host array (for the range check, which needs no device sync).
        device: ``[T]`` int32 copy the kernel reads.
    """

    host: np.ndarray
    device: Any


@dataclass
class DeviceQuantized:
    """A :class:`refengine.quant.QuantizedWeight`'s arrays placed for ``cuda/quant_matmul.cu``
    (the host bytes as they are).

    Attributes:
        format: ``"int8"`` (arrays ``(q int8 [out, in], scales float32 [out])``) or ``"int4"``
            (``(packed uint8 [out, in/2], scales float32 [out, G], zeros uint8 [out, G])``).
        shape: ``(out_features, in_features)``.
        arrays: as above, on the device.
        group_size: int4 columns per group (0 for int8).
        perm: int4 act-order permutation on the device (int64 ``[in]``), or None.
    """

    format: str
    shape: tuple[int, int]
    arrays: tuple
    group_size: int = 0
    perm: Any = None


class CudaLayerOps(NoStepHooks):
    """RMSNorm, RoPE, SiLU-and-mul and GELU(tanh)-and-mul through the kernels of
    ``cuda/layers.cu``; the matrix product through cuBLAS (CuPy's ``@``, float32 accumulation),
    or, for a weight kept quantized (int8, int4: ``quantization="int8"``, AWQ, GPTQ), through
    the kernels of ``cuda/quant_matmul.cu`` (:meth:`linear`).

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
        # id(weight) -> (weight, its placed form): a quantized weight is copied to the device
        # once, at its first product (the model keeps the host object; its code is unchanged)
        self._placed: dict[int, tuple[QuantizedWeight, Any]] = {}

    def embedding(self, table, input_ids):
        """The embedding rows of ``input_ids`` (:func:`refengine.ops.numpy_ops.embedding_rows` on the device's arrays)."""
        return embedding_rows(table, input_ids, self.kernels.xp)

    def device_positions(self, positions: np.ndarray) -> DevicePositions:
        """``positions [T]`` (host ints) copied to the device as int32, once per step."""
        positions = np.asarray(positions)
        return DevicePositions(positions, self.kernels.int32(positions))

    def weight(self, matrix: np.ndarray) -> np.ndarray:
        return blas_weight(matrix)

    def linear(self, x, w):
        """``x [T, in] @ w`` -> float32 ``[T, out]``: a float ``w [in, out]`` (from :meth:`weight`)
        through cuBLAS; a :class:`refengine.quant.QuantizedWeight` ``[out, in]`` through
        :meth:`quantized_linear` (placed on the device at its first use)."""
        if is_quantized(w):
            return self.quantized_linear(x, self.place_quantized(w))
        return linear_f32(x, w)

    def add_lora(self, y, x, rows, a, b, scale) -> None:
        """One adapter's rows through cuBLAS: the twin (:func:`refengine.lora.add_lora_reference`) on CuPy arrays."""
        from refengine.lora import add_lora_reference

        add_lora_reference(y, x, rows, a, b, scale, self.kernels.xp)

    def place_quantized(self, w: QuantizedWeight) -> Any:
        """``w``'s arrays on the device, copied once per weight object: a :class:`DeviceQuantized`,
        or for a :class:`refengine.quant.StackedWeight` a list of its parts' placed forms (float
        parts as ``[in, out]`` float32 arrays for cuBLAS).

        Raises:
            TypeError: a format without CUDA kernels (GGUF blocks: ``device="cuda"`` dequantizes
                GGUF files at load).
        """
        cached = self._placed.get(id(w))  # the entry keeps w alive: its id is not reused
        if cached is None:
            cached = self._placed[id(w)] = (w, self._place(w))
        return cached[1]

    def _place(self, w: Any) -> Any:
        xp = self.kernels.xp
        if isinstance(w, Int8Weight):
            return DeviceQuantized("int8", w.shape, (xp.asarray(w.q), xp.asarray(w.scales)))
        if isinstance(w, Int4Weight):
            return DeviceQuantized("int4", w.shape, (xp.asarray(w.packed), xp.asarray(w.scales), xp.asarray(w.zeros)),
                                   w.group_size, None if w.perm is None else xp.asarray(w.perm))
        if isinstance(w, StackedWeight):
            return [self._place(p) if is_quantized(p) else xp.asarray(blas_weight(np.asarray(p, dtype=np.float32)))
                    for p in w.parts]
        raise TypeError(f"no CUDA kernels for {w.format} weights (the CUDA path runs int8 and int4)")

    def quantized_linear(self, x: Any, placed: Any) -> Any:
        """``x [T, in] @ w'.T`` -> float32 ``[T, out]`` for a weight placed by :meth:`place_quantized`
        (``quant_matmul.cu``: a GEMV for up to 8 rows, a tiled GEMM beyond; float32 accumulation).

        Args:
            x: float32, float16 or bfloat16 ``[T, in]`` (any layout; made C-contiguous). An
                act-order int4 weight reads ``x[:, perm]`` (one gather of ``T x in`` values).
        Raises:
            ValueError: x's shape does not match the weight. TypeError: an unsupported x dtype.
        """
        kern = self.kernels
        if isinstance(placed, list):  # a stack: each part's product, side by side
            outs = [self.quantized_linear(x, p) if isinstance(p, DeviceQuantized) else linear_f32(x, p)
                    for p in placed]
            return kern.xp.concatenate(outs, axis=1)
        out_features, in_features = placed.shape
        if x.ndim != 2 or int(x.shape[1]) != in_features:
            raise ValueError(f"a [{out_features}, {in_features}] weight multiplies x [T, {in_features}], "
                             f"got {tuple(x.shape)}")
        if placed.perm is not None:  # stored column j is input feature perm[j]
            x = x[:, placed.perm]  # a gather by a device index array (NumPy and CuPy alike)
        x = kern.contiguous(x)
        out = kern.empty((int(x.shape[0]), out_features), np.float32)
        if x.shape[0] and out_features:
            kern.launch(quant_linear_launch(placed.format, out, x, placed.arrays, out_features, in_features,
                                            placed.group_size))
        return out

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
        (:class:`refengine.ops.layers.RotaryEmbedding`, ``cos``/``sin [max_positions, D // 2]``;
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
        for ``x [T, 2I]`` -> ``[T, I]``, as :func:`refengine.ops.layers.gelu_tanh_and_mul`.

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
