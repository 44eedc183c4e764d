"""Layer operations as CUDA kernels (``cuda/layers.cu``), on CuPy arrays.

The NumPy versions in :mod:`refengine.layers` are their reference.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class CudaLayerOps:
    """RMSNorm, RoPE and SiLU-and-mul through the kernels of ``cuda/layers.cu``; the matrix
    product through cuBLAS (CuPy's ``@``, float32 accumulation).

    Args:
        kernels: the object that launches the compiled kernels (``rms_norm``,
            ``silu_and_mul``, ``rotary_embedding``).
    """

    name = "cuda"

    def __init__(self, kernels: Any):
        self.kernels = kernels
        self._cos_sin = None

    def device_positions(self, positions: np.ndarray) -> np.ndarray:
        return positions  # the RoPE kernel takes host positions

    def linear(self, x, w):
        return (x.astype(w.dtype, copy=False) @ w).astype(np.float32, copy=False)

    def rms_norm(self, x, weight, eps: float):
        return self.kernels.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).reshape(x.shape)

    def rope(self, q, k, positions, rope):
        xp = rope.xp
        if self._cos_sin is None:
            self._cos_sin = xp.ascontiguousarray(xp.concatenate([rope.cos, rope.sin], axis=1))
        q, k = xp.ascontiguousarray(q), xp.ascontiguousarray(k)
        self.kernels.rotary_embedding(positions, q, k, self._cos_sin)  # in place
        return q, k

    def silu_and_mul(self, x):
        return self.kernels.silu_and_mul(x)
