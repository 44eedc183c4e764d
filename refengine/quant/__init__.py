"""Quantized weights: matrices kept in the compressed form they were stored or loaded in.

Decode reads every weight once per step, so its speed is the bytes read per token; a
weight kept as 4-bit blocks is read in 4.5 to 5 bits per weight instead of 32. A
:class:`QuantizedWeight` is a matrix ``[out_features, in_features]`` (the checkpoint's
``[out, in]`` orientation) held in one such format; the layer operations multiply by it
and dequantize on the fly, block by block (:meth:`refengine.ops.LayerOps.linear`), and the
model code never knows which form it got (``../docs/quantization.md``).

Formats (one module each):

* :mod:`refengine.quant.gguf_blocks`: GGUF's block types as stored in the file (Q4_0 ...
  Q6_K, F16, BF16), the ``gguf`` package's ``dequantize`` as the bit-exact oracle.
* :mod:`refengine.quant.int8`: per-output-channel symmetric int8 computed at load
  (``quantization="int8"``).
* :mod:`refengine.quant.int4`: 4-bit groups with scales and zero points, the form AWQ and
  GPTQ checkpoints are repacked into (:mod:`refengine.quant.awq_gptq`).

Every format implements :meth:`QuantizedWeight.dequantize`, the readable definition its
compiled kernels are tested against; :func:`reference_linear` is the NumPy twin of every
quantized product.
"""

from __future__ import annotations

from types import ModuleType
from typing import Callable, Sequence

import numpy as np

#: The compiled products of the weight formats, by family (``"gguf"``, ``"q8"``, ``"int"``):
#: loaders of modules the CPU wing (:mod:`refengine.cpu`) registers as it is imported; a
#: format's ``numba_linear`` reaches its kernels through :func:`compiled_products`.
_PRODUCT_LOADERS: dict[str, Callable[[], ModuleType]] = {}
_PRODUCTS: dict[str, ModuleType] = {}


def register_compiled_products(family: str, load: Callable[[], ModuleType]) -> None:
    """Make :func:`compiled_products` ``(family)`` return ``load()`` (called at its first use:
    numba loads only then)."""
    _PRODUCT_LOADERS[family] = load
    _PRODUCTS.pop(family, None)


def compiled_products(family: str) -> ModuleType:
    """The module of compiled products registered for ``family``, loaded at the first call.

    Raises:
        LookupError: nothing registered for ``family`` (:mod:`refengine.cpu` not imported).
    """
    module = _PRODUCTS.get(family)
    if module is None:
        if family not in _PRODUCT_LOADERS:
            raise LookupError(f"no compiled products registered for {family!r} (import refengine.cpu)")
        module = _PRODUCTS[family] = _PRODUCT_LOADERS[family]()
    return module

#: Rows dequantized at a time by the NumPy twin: the whole model is never dequantized at once.
REFERENCE_ROWS = 4096


class QuantizedWeight:
    """A matrix ``[out_features, in_features]`` in a compressed format (abstract).

    Attributes:
        format: the format's name (``"Q4_1"``, ``"int8"``, ``"int4"`` ...).
        shape: ``(out_features, in_features)``.
    """

    format: str = "?"
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        """Bytes the product reads: every array the format holds."""
        raise NotImplementedError

    def dequantize(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows ``start:stop`` as float32 ``[stop - start, in_features]`` (the definition of the format)."""
        raise NotImplementedError

    def select_rows(self, rows: np.ndarray) -> np.ndarray:
        """Rows ``rows`` (int ``[n]``) as float32 ``[n, in_features]``: an embedding lookup.
        Formats may override it with a cheaper gather; this one dequantizes row by row."""
        rows = np.asarray(rows).reshape(-1)
        out = np.empty((rows.shape[0], self.shape[1]), dtype=np.float32)
        for i, r in enumerate(rows.tolist()):
            out[i] = self.dequantize(r, r + 1)[0]
        return out

    def take_rows(self, order: np.ndarray) -> "QuantizedWeight":
        """The matrix whose row ``i`` is this one's row ``order[i]`` (a permutation or a subset),
        in the same format: rows are quantized independently, so this moves stored bytes only."""
        raise NotImplementedError

    def take_columns(self, start: int, stop: int) -> "QuantizedWeight":
        """Input features ``start:stop`` of every row, in the same format (a row-parallel
        split, :mod:`refengine.parallel.tensor_parallel`).

        Raises:
            NotImplementedError: the format cannot cut its rows (this default).
            ValueError: the bounds cut through one of the format's blocks.
        """
        raise NotImplementedError(f"{self.format} weights cannot be split on the input axis")

    @classmethod
    def concat_rows(cls, parts: Sequence["QuantizedWeight"]) -> "QuantizedWeight":
        """The parts (same format and ``in_features``) stacked on the output axis, in the same format."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.format}, shape={self.shape}, {self.nbytes / 2**20:.2f} MiB)"


class StackedWeight(QuantizedWeight):
    """Matrices of different formats stacked on the output axis (e.g. a fused q/k/v whose
    parts a GGUF file stores in different block types): the product is each part's product,
    concatenated. Parts are :class:`QuantizedWeight` or float ``[out, in]`` arrays."""

    format = "stacked"

    def __init__(self, parts: Sequence):
        self.parts = list(parts)
        ins = {p.shape[1] for p in self.parts}
        if len(ins) != 1:
            raise ValueError(f"stacked parts must share in_features, got {sorted(ins)}")
        self.shape = (sum(p.shape[0] for p in self.parts), ins.pop())

    @property
    def nbytes(self) -> int:
        return sum(int(p.nbytes) for p in self.parts)

    def dequantize(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        full = np.concatenate([_dequantize(p) for p in self.parts], axis=0)
        return full[start:stop]

    def take_rows(self, order):
        return StackedWeight([_as_float(self.dequantize()[np.asarray(order)])])

    def __repr__(self) -> str:
        return f"StackedWeight({', '.join(repr(p) if is_quantized(p) else f'float{p.shape}' for p in self.parts)})"


def is_quantized(w) -> bool:
    """Whether ``w`` is a :class:`QuantizedWeight` (else a float array)."""
    return isinstance(w, QuantizedWeight)


def _dequantize(p) -> np.ndarray:
    return p.dequantize() if is_quantized(p) else np.asarray(p, dtype=np.float32)


def _as_float(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32)


def concat_rows(parts: Sequence):
    """Stack ``parts`` (each ``[out_i, in]``) on the output axis: float arrays into one float
    array, parts of one quantized format into one weight of that format, a mix into a
    :class:`StackedWeight`. One part is returned as it is."""
    parts = list(parts)
    if len(parts) == 1:
        return parts[0]
    if not any(is_quantized(p) for p in parts):
        return np.concatenate(parts, axis=0)
    kinds = {(type(p), p.format) if is_quantized(p) else None for p in parts}
    if len(kinds) == 1:
        cls = type(parts[0])
        try:
            return cls.concat_rows(parts)
        except NotImplementedError:
            pass
    return StackedWeight(parts)


def reference_linear(x: np.ndarray, w: QuantizedWeight) -> np.ndarray:
    """``x [T, in] @ w.T`` -> ``[T, out]`` float32: the NumPy twin of every quantized product.
    Dequantizes :data:`REFERENCE_ROWS` rows at a time and multiplies in float32."""
    x = np.asarray(x, dtype=np.float32)
    out_features = w.shape[0]
    out = np.empty((x.shape[0], out_features), dtype=np.float32)
    for start in range(0, out_features, REFERENCE_ROWS):
        stop = min(start + REFERENCE_ROWS, out_features)
        out[:, start:stop] = x @ w.dequantize(start, stop).T
    return out
