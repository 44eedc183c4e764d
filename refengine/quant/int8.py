"""Per-output-channel symmetric int8 weights, computed at load (``quantization="int8"``).

For a float matrix ``w [out, in]`` (the checkpoint's orientation), each output row ``o``
gets one float32 scale and ``in`` int8 values::

    scale[o] = max_i |w[o, i]| / 127
    q[o, i]  = clip(round(w[o, i] / scale[o]), -127, 127)      (round half to even)
    w'[o, i] = q[o, i] * scale[o]                              (float32: the dequantized weight)

so ``|w' - w| <= scale[o] / 2`` (plus one float32 rounding of the product). An all-zero
row has ``scale = 0`` and ``q = 0``. -128 is never used, so the grid is symmetric around 0
(the "absmax" scheme of LLM.int8(), Dettmers et al. 2022, without its outlier columns; the
weight side of SmoothQuant's W8, Xiao et al. 2022). The product scales once per output:
``(x @ w'.T)[t, o] = scale[o] * sum_i x[t, i] * q[o, i]``.

The embedding ``[vocab, hidden]`` is quantized the same way, one scale per token row:
an embedding lookup dequantizes its rows (:meth:`Int8Weight.select_rows`), and the tied
``lm_head`` is the same matrix with one scale per vocabulary logit, i.e. per output
channel. Norms and biases (1-D) stay float32 (:func:`quantize_weights`).

Size: 1 byte per weight plus 4 per row, a quarter of float32's bytes, which decode reads
once per step (``docs/quantization.md``).
"""

from __future__ import annotations

import sys
from typing import Sequence

import numpy as np

from refengine.quant import QuantizedWeight, compiled_products

#: The largest magnitude of the grid: the symmetric int8 range [-127, 127].
QMAX = 127
#: Rows quantized at a time (bounds the float64 temporaries at load).
_CHUNK_ROWS = 4096


class Int8Weight(QuantizedWeight):
    """A matrix ``[out_features, in_features]`` as int8 values and one float32 scale per row.

    Args:
        q: int8 ``[out, in]``, values in [-127, 127] (C-contiguous).
        scales: float32 ``[out]``, >= 0.
    Raises:
        ValueError: wrong dtypes, ranks or shapes.
    """

    format = "int8"

    def __init__(self, q: np.ndarray, scales: np.ndarray):
        q, scales = np.asarray(q), np.asarray(scales)
        if q.dtype != np.int8 or q.ndim != 2:
            raise ValueError(f"int8 weight values must be an int8 [out, in] array, got {q.dtype} {q.shape}")
        if scales.dtype != np.float32 or scales.shape != (q.shape[0],):
            raise ValueError(f"int8 weight scales must be float32 [{q.shape[0]}], got {scales.dtype} {scales.shape}")
        self.q = np.ascontiguousarray(q)
        self.scales = np.ascontiguousarray(scales)
        self.shape = (int(q.shape[0]), int(q.shape[1]))

    @classmethod
    def quantize(cls, w: np.ndarray, name: str = "weight") -> "Int8Weight":
        """Quantize a float matrix ``w [out, in]`` (any float dtype) per output row (module docstring).

        The division and rounding run in float64 (the nearest grid point of the exact
        ratio); the scale is float32, as stored.

        Raises:
            ValueError: ``w`` is not 2-D, or holds NaN or inf (``name`` in the message).
        """
        w = np.asarray(w)
        if w.ndim != 2:
            raise ValueError(f"{name}: int8 quantizes matrices, got shape {w.shape}")
        return cls.from_rows(lambda start, stop: w[start:stop], w.shape, name)

    @classmethod
    def from_rows(cls, rows, shape: tuple[int, int], name: str = "weight") -> "Int8Weight":
        """Quantize a matrix of ``shape`` ``[out, in]`` given as its rows: ``rows(start, stop)``
        returns rows ``start:stop`` as a float array ``[stop - start, in]``, asked for
        :data:`_CHUNK_ROWS` at a time, so a matrix stored otherwise (GGUF blocks) is never
        decoded whole. Same values as :meth:`quantize` of the whole matrix (each row is
        quantized on its own).

        Raises:
            ValueError: a chunk that is not ``[n, in]``, or holds NaN or inf (``name`` in the message).
        """
        out_features, in_features = int(shape[0]), int(shape[1])
        q = np.empty((out_features, in_features), dtype=np.int8)
        scales = np.empty(out_features, dtype=np.float32)
        for start in range(0, out_features, _CHUNK_ROWS):
            stop = min(start + _CHUNK_ROWS, out_features)
            block = np.asarray(rows(start, stop))
            if block.shape != (stop - start, in_features):
                raise ValueError(f"{name}: rows {start}:{stop} came as shape {block.shape}, "
                                 f"not {(stop - start, in_features)}")
            block = block.astype(np.float64)
            amax = np.abs(block).max(axis=1) if block.shape[1] else np.zeros(block.shape[0])
            if not np.isfinite(amax).all():
                raise ValueError(f"{name}: cannot quantize to int8: the matrix holds NaN or inf")
            scale = (amax / QMAX).astype(np.float32)
            safe = np.where(scale > 0, scale, 1.0).astype(np.float64)[:, None]
            q[start:start + block.shape[0]] = np.clip(np.rint(block / safe), -QMAX, QMAX)
            scales[start:start + block.shape[0]] = scale
        return cls(q, scales)

    @property
    def nbytes(self) -> int:
        return int(self.q.nbytes + self.scales.nbytes)

    def dequantize(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows ``start:stop`` as float32 ``q * scale`` (the definition of the format)."""
        return self.q[start:stop].astype(np.float32) * self.scales[start:stop, None]

    def select_rows(self, rows: np.ndarray) -> np.ndarray:
        """Rows ``rows`` (int ``[n]``) as float32 ``[n, in]``: a gather, then one multiply per element."""
        rows = np.asarray(rows).reshape(-1)
        return self.q[rows].astype(np.float32) * self.scales[rows, None]

    def take_rows(self, order: np.ndarray) -> "Int8Weight":
        order = np.asarray(order)
        return Int8Weight(self.q[order], self.scales[order])

    def take_columns(self, start: int, stop: int) -> "Int8Weight":
        """Input features ``start:stop``: the int8 values sliced, every row's scale kept
        (a per-output-channel scale covers any part of its row)."""
        return Int8Weight(self.q[:, start:stop], self.scales)

    @classmethod
    def concat_rows(cls, parts: Sequence["Int8Weight"]) -> "Int8Weight":
        """Stack on the output axis (rows are quantized independently: the bytes move as they are).

        Raises:
            ValueError: parts with different ``in_features``.
        """
        ins = {p.shape[1] for p in parts}
        if len(ins) != 1:
            raise ValueError(f"int8 parts must share in_features, got {sorted(ins)}")
        return cls(np.concatenate([p.q for p in parts]), np.concatenate([p.scales for p in parts]))

    def numba_linear(self, x: np.ndarray, *, batch_invariant: bool = False) -> np.ndarray:
        """``x [T, in]`` (C-contiguous float32) ``@ w'.T`` -> float32 ``[T, out]`` by the numba
        kernels (:func:`refengine.cpu.int_products.int8_linear`); ``batch_invariant``: the dot
        kernel at every row count."""
        products = compiled_products("int")
        return products.int8_linear(x, self.q, self.scales, sys.maxsize if batch_invariant else None)


def quantize_weights(weights: dict) -> dict:
    """``quantization="int8"`` as a transform of a loaded checkpoint: every float matrix
    (the linear layers, the embedding, an untied ``lm_head``) -> :class:`Int8Weight`;
    vectors (norms, biases) and weights already quantized are left as they are.

    Args:
        weights: HF tensor name -> array (as :func:`refengine.formats.loader.load_weights` returns it);
            each matrix is replaced in the dict as it is quantized (its float copy freed).
    Returns:
        ``weights`` itself.
    Raises:
        ValueError: a matrix holding NaN or inf.
    """
    for name in list(weights):
        w = weights[name]
        if isinstance(w, np.ndarray) and w.ndim == 2 and np.issubdtype(w.dtype, np.floating):
            weights[name] = Int8Weight.quantize(w, name)
    return weights
