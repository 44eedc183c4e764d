"""Layer operations: everything in a decoder layer that is not attention.

A model's forward pass calls these through one :class:`LayerOps` object chosen once per
engine (by device and backend), so a faster implementation of RMSNorm, RoPE, SiLU-and-mul
or the matrix product (compiled CPU kernels, CUDA kernels, quantized matmuls) slots in
without touching the model code. The NumPy implementation (:mod:`refengine.ops.numpy_ops`,
over :mod:`refengine.ops.layers`) is the reference every other one is tested against.

Implementations:

* ``"numpy"``: :class:`refengine.ops.numpy_ops.NumpyOps` (NumPy, or CuPy through ``xp``).
* ``"numba"``: :class:`refengine.cpu.layer_ops.NumbaOps`, CPU kernels compiled by numba,
  registered by the CPU wing (:func:`register_layer_ops`).
* ``"cuda"``: :class:`refengine.ops.cuda.CudaLayerOps`, the kernels of ``cuda/layers.cu``.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import numpy as np

LAYER_OPS = ("numpy", "numba", "cuda")

#: Layer ops that live outside this package, by name: ``"numba"``, which the CPU wing
#: (:mod:`refengine.cpu`) registers as it is imported (``import refengine`` does).
_REGISTERED: dict[str, Callable[..., "LayerOps"]] = {}


def register_layer_ops(name: str, factory: Callable[..., "LayerOps"]) -> None:
    """Make ``get_layer_ops(name, xp, kernels, batch_invariant=..., activation_dtype=...)``
    call ``factory`` with those arguments. ``name`` must be one of :data:`LAYER_OPS`.

    Raises:
        ValueError: ``name`` is not one of :data:`LAYER_OPS`.
    """
    if name not in LAYER_OPS:
        raise ValueError(f"layer ops {name!r} is not one of {LAYER_OPS}")
    _REGISTERED[name] = factory


class LayerOps(Protocol):
    """What a decoder layer needs besides attention. Activations are float32 ``[T, ...]``."""

    name: str

    def device_positions(self, positions: np.ndarray) -> Any:
        """Positions ``[T]`` int64 (host) in the form :meth:`rope` takes; called once per step."""

    def embedding(self, table: Any, input_ids: Any) -> Any:
        """Rows ``input_ids [T]`` (int) of the embedding ``table [V, hidden]`` (an array in
        the weight dtype, or a quantized weight) -> ``[T, hidden]`` float32.

        Raises:
            IndexError: an id outside ``[0, V)``.
        """

    def weight(self, matrix: np.ndarray) -> np.ndarray:
        """A checkpoint matrix ``[out, in]`` -> the host array the model puts on the device
        for :meth:`linear`: shaped ``[in, out]``, in the memory layout this implementation's
        product reads fastest (``[in, out]`` C-contiguous for BLAS and cuBLAS; the transposed
        view of the ``[out, in]`` rows for the numba dot-product kernels)."""

    def linear(self, x: Any, w: Any) -> Any:
        """``x [T, in]`` float32 times ``w [in, out]`` (weight dtype, from :meth:`weight`) -> ``[T, out]`` float32."""

    def add_lora(self, y: Any, x: Any, rows: np.ndarray, a: Any, b: Any, scale: Any) -> None:
        """``y[rows] += ((x[rows] @ a.T) @ b) * scale`` in place: one LoRA adapter's product on
        its rows of a projection (``y [T, out]``, ``x [T, in]``, ``a [R, in]``, ``b [R, out]``,
        ``scale [out]`` float32; ``rows [n]`` int64 host, sorted, distinct). The twin:
        :func:`refengine.lora.add_lora_reference`; the formula: :mod:`refengine.lora`."""

    def rms_norm(self, x: Any, weight: Any, eps: float) -> Any:
        """RMSNorm over the last axis of ``x [..., d]`` with ``weight [d]`` float32 -> float32."""

    def rope(self, q: Any, k: Any, positions: Any, rope: Any) -> tuple[Any, Any]:
        """Rotate ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` by ``positions`` (from
        :meth:`device_positions`) with the tables of ``rope`` (a
        :class:`refengine.ops.layers.RotaryEmbedding`); may work in place; returns ``(q, k)``."""

    def silu_and_mul(self, x: Any) -> Any:
        """``silu(x[:, :I]) * x[:, I:]`` for ``x [T, 2I]`` float32 -> ``[T, I]`` float32."""

    def gelu_tanh_and_mul(self, x: Any) -> Any:
        """``gelu_tanh(x[:, :I]) * x[:, I:]`` for ``x [T, 2I]`` float32 -> ``[T, I]`` float32
        (:func:`refengine.ops.layers.gelu_tanh_and_mul`)."""


def get_layer_ops(name: str, xp=np, kernels: Any = None, *, batch_invariant: bool = False,
                  activation_dtype: str = "auto") -> LayerOps:
    """Build the layer operations called ``name`` (one of :data:`LAYER_OPS`).

    ``batch_invariant``: the numba ops' batch-invariant mode (:class:`refengine.cpu.layer_ops.NumbaOps`);
    the other ops have none (the engine refuses the combination first). ``activation_dtype``:
    ``"q8_0"`` for the numba ops' Q8_0-activation products (the engine allows it there only).

    ``kernels`` is the launcher of ``"cuda"`` (a :class:`refengine.kernels.build.KernelModule`);
    by default the current device's CuPy module, the one the CUDA attention backend uses.

    Raises:
        ValueError: ``name`` is not known, or not registered (``"numba"`` without :mod:`refengine.cpu`).
    """
    if name == "numpy":
        from refengine.ops.numpy_ops import NumpyOps

        return NumpyOps(xp)
    if name in _REGISTERED:
        return _REGISTERED[name](xp, kernels, batch_invariant=batch_invariant, activation_dtype=activation_dtype)
    if name == "cuda":
        from refengine.ops.cuda import CudaLayerOps

        return CudaLayerOps(kernels)
    raise ValueError(f"layer ops {name!r} is not one of {LAYER_OPS}")
