"""The reference layer operations: :mod:`refengine.ops.layers` over an array module ``xp``."""

from __future__ import annotations

import numpy as np

from refengine.lora import add_lora_reference
from refengine.ops.layers import gelu_tanh_and_mul, rms_norm, silu_and_mul
from refengine.quant import is_quantized, reference_linear


def linear_f32(x, w):
    """``x [T, in] @ w [in, out]`` -> ``[T, out]`` float32, ``x`` cast to ``w``'s dtype first
    (no copies when both are float32; on a GPU cuBLAS accumulates 16-bit products in float32).
    Works for NumPy and CuPy arrays alike."""
    return (x.astype(w.dtype, copy=False) @ w).astype(np.float32, copy=False)


def embedding_rows(table, input_ids, xp=np):
    """Rows ``input_ids [T]`` of an embedding ``table [V, hidden]`` -> ``[T, hidden]`` float32
    in ``xp``'s arrays: an array gathered on its device; a quantized table
    (:mod:`refengine.quant`) dequantizes just those rows on the host, then they are placed
    where the activations live.

    Raises:
        IndexError: an id outside ``[0, V)``.
    """
    if is_quantized(table):
        return xp.asarray(table.select_rows(np.asarray(input_ids)))
    return table[input_ids].astype(xp.float32)


def blas_weight(matrix: np.ndarray) -> np.ndarray:
    """A checkpoint matrix ``[out, in]`` -> ``[in, out]`` C-contiguous, host, same dtype: the
    layout BLAS and cuBLAS multiply ``x @ w`` by (:meth:`refengine.ops.LayerOps.weight`)."""
    return np.ascontiguousarray(matrix.T)


class NoStepHooks:
    """The engine hooks of :class:`refengine.ops.LayerOps` for ops with no process-wide or per-step
    policy (NumPy, CUDA): each does nothing; :meth:`capture_decode` captures nothing."""

    def setup_runtime(self) -> None:
        """Nothing to set up."""

    def prepare_model(self, model, config, *, draft: bool = False) -> None:
        """Nothing to prepare."""

    def begin_step(self, model, num_rows: int, longest_chunk: int) -> None:
        """Nothing to size."""

    def warm_up(self, model, kv_cache, max_rows: int, max_model_len: int) -> None:
        """Nothing to compile."""

    def capture_decode(self, model, kv_cache, max_model_len: int | None) -> None:
        """No capture: every step runs the forward."""
        return None


class NumpyOps(NoStepHooks):
    """Layer operations in NumPy (or CuPy when ``xp`` is ``cupy``). float32 activations."""

    name = "numpy"

    def __init__(self, xp=np):
        self.xp = xp

    def device_positions(self, positions: np.ndarray):
        return self.xp.asarray(positions)

    def embedding(self, table, input_ids):
        return embedding_rows(table, input_ids, self.xp)

    def weight(self, matrix: np.ndarray) -> np.ndarray:
        return blas_weight(matrix)

    def linear(self, x, w):
        if is_quantized(w):  # the twin: dequantize a few thousand rows at a time, multiply in float32
            return reference_linear(x, w)
        return linear_f32(x, w)

    def add_lora(self, y, x, rows, a, b, scale) -> None:
        add_lora_reference(y, x, rows, a, b, scale, self.xp)

    def rms_norm(self, x, weight, eps: float):
        return rms_norm(x, weight, eps, self.xp)

    def rope(self, q, k, positions, rope):
        return rope(q, positions), rope(k, positions)

    def silu_and_mul(self, x):
        return silu_and_mul(x, self.xp)

    def gelu_tanh_and_mul(self, x):
        return gelu_tanh_and_mul(x, self.xp)
