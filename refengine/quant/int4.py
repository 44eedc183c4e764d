"""4-bit weights in groups with a scale and a zero point (:class:`Int4Weight`).

The one form AWQ and GPTQ checkpoints are repacked into at load
(:mod:`refengine.quant.awq_gptq`).

A matrix ``[out, in]`` has its input columns split into groups of ``group_size``
consecutive *stored* columns (the last group may be shorter); output row ``o`` and
group ``g`` have a float32 scale ``s[o, g]`` and an integer zero point ``z[o, g]``, and
each weight a 4-bit value ``q`` in [0, 15]::

    w[o, c] = float32(q[o, c] - z[o, g]) * s[o, g]        g = c // group_size

computed in float32 exactly so: ``q - z`` is a small integer (exact), times the scale
with one rounding, which is how AutoAWQ (``dequantize_gemm``) and AutoGPTQ
(``QuantLinear.forward``'s fallback, ``scales * (weight - zeros)``) define it, in their
half precision. The zero points are whole numbers in [0, 16] (GPTQ v1's offset of one
makes 16 possible, ``awq_gptq.py``).

Storage (row-major, C-contiguous):

* ``packed``: uint8 ``[out, in/2]``: byte ``b`` of a row holds stored columns ``2b``
  (low nibble, bits 0-3) and ``2b + 1`` (high nibble, bits 4-7);
* ``scales``: float32 ``[out, n_groups]``; ``zeros``: uint8 ``[out, n_groups]``;
* ``perm``: int64 ``[in]`` or None, the act-order input permutation: stored column ``j``
  is input feature ``perm[j]``.

Act-order (GPTQ ``desc_act``) quantizes the columns in a data-dependent order, so a
group's columns are scattered over the input (``g_idx[i]`` is input ``i``'s group). As
ExLlama does (turboderp/exllama ``cuda_func/q4_matrix.cu``, ``make_sequential``), the
columns are sorted by group once at load, so that groups are contiguous in storage, and
the input vector is permuted the same way at run time (``x[:, perm]``: one gather of
``T x in`` floats per product, small beside reading the weights):
``x @ w.T == x[:, perm] @ w_stored.T``. :meth:`Int4Weight.dequantize` undoes the
permutation, so it returns the matrix in the checkpoint's input order.

Size: half a byte per weight plus 5 bytes per group and row (``group_size=128``: 0.54
bytes per weight, 13.5% of float32).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from refengine.quant import QuantizedWeight, compiled_products


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """uint8 ``[out, in/2]`` from 4-bit values ``q [out, in]`` (ints in [0, 15], ``in`` even):
    byte ``b`` = ``q[:, 2b] | q[:, 2b + 1] << 4``."""
    q = np.asarray(q).astype(np.uint8)
    return np.ascontiguousarray(q[:, 0::2] | (q[:, 1::2] << 4))


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """The 4-bit values ``[out, 2 * half]`` (uint8) of ``packed [out, half]`` (inverse of :func:`pack_nibbles`)."""
    q = np.empty((packed.shape[0], 2 * packed.shape[1]), dtype=np.uint8)
    q[:, 0::2] = packed & 15
    q[:, 1::2] = packed >> 4
    return q


class Int4Weight(QuantizedWeight):
    """A matrix ``[out_features, in_features]`` of 4-bit values in groups (module docstring).

    Args:
        packed: uint8 ``[out, in/2]``, two stored columns per byte.
        scales: float32 ``[out, n_groups]``; zeros: uint8 ``[out, n_groups]`` (0 .. 16).
        group_size: stored columns per group (the last group may be shorter);
            ``n_groups == ceil(in / group_size)``.
        perm: int64 ``[in]``, a permutation: stored column ``j`` is input feature
            ``perm[j]``; None for the identity.
    Raises:
        ValueError: a wrong dtype or shape, an odd ``group_size``, or ``perm`` not a
            permutation of ``range(in)``.
    """

    format = "int4"

    def __init__(self, packed: np.ndarray, scales: np.ndarray, zeros: np.ndarray, group_size: int,
                 perm: np.ndarray | None = None):
        packed, scales, zeros = np.asarray(packed), np.asarray(scales), np.asarray(zeros)
        if packed.dtype != np.uint8 or packed.ndim != 2:
            raise ValueError(f"int4 packed values must be uint8 [out, in/2], got {packed.dtype} {packed.shape}")
        out_features, in_features = packed.shape[0], 2 * packed.shape[1]
        group_size = int(group_size)
        if group_size < 2 or group_size % 2:
            raise ValueError(f"int4 group_size must be even and >= 2, got {group_size}")
        n_groups = -(-in_features // group_size)
        if scales.dtype != np.float32 or scales.shape != (out_features, n_groups):
            raise ValueError(f"int4 scales must be float32 [{out_features}, {n_groups}], got {scales.dtype} "
                             f"{scales.shape}")
        if zeros.dtype != np.uint8 or zeros.shape != (out_features, n_groups):
            raise ValueError(f"int4 zeros must be uint8 [{out_features}, {n_groups}], got {zeros.dtype} {zeros.shape}")
        if perm is not None:
            perm = np.asarray(perm, dtype=np.int64)
            if perm.shape != (in_features,) or not np.array_equal(np.sort(perm), np.arange(in_features)):
                raise ValueError(f"int4 perm must be a permutation of range({in_features})")
            if np.array_equal(perm, np.arange(in_features)):
                perm = None
        self.packed = np.ascontiguousarray(packed)
        self.scales = np.ascontiguousarray(scales)
        self.zeros = np.ascontiguousarray(zeros)
        self.group_size = group_size
        self.perm = perm
        self.shape = (int(out_features), int(in_features))
        self._kernel_index = None

    @classmethod
    def from_values(cls, q: np.ndarray, scales: np.ndarray, zeros: np.ndarray, group_size: int,
                    perm: np.ndarray | None = None) -> "Int4Weight":
        """From unpacked 4-bit values ``q [out, in]`` (ints in [0, 15], stored column order),
        ``scales [out, n_groups]`` (cast to float32) and ``zeros [out, n_groups]`` (ints in [0, 16]).

        Raises:
            ValueError: an odd ``in``, values out of range, or the constructor's checks.
        """
        q, zeros = np.asarray(q), np.asarray(zeros)
        if q.ndim != 2 or q.shape[1] % 2:
            raise ValueError(f"int4 needs an even number of input features, got shape {q.shape}")
        if q.size and (q.min() < 0 or q.max() > 15):
            raise ValueError("int4 values must lie in [0, 15]")
        if zeros.size and (zeros.min() < 0 or zeros.max() > 16):
            raise ValueError("int4 zero points must lie in [0, 16]")
        return cls(pack_nibbles(q), np.asarray(scales, dtype=np.float32), zeros.astype(np.uint8), group_size, perm)

    @property
    def n_groups(self) -> int:
        return int(self.scales.shape[1])

    @property
    def nbytes(self) -> int:
        perm = 0 if self.perm is None else self.perm.nbytes
        return int(self.packed.nbytes + self.scales.nbytes + self.zeros.nbytes + perm)

    # --- the definition ---------------------------------------------------------------
    def _dequantize_stored(self, packed: np.ndarray, scales: np.ndarray, zeros: np.ndarray) -> np.ndarray:
        """``float32(q - z) * s`` for rows given as arrays, in the stored column order."""
        q = unpack_nibbles(packed).astype(np.float32)
        group = np.arange(self.shape[1]) // self.group_size
        return (q - zeros[:, group].astype(np.float32)) * scales[:, group]

    def _to_input_order(self, w_stored: np.ndarray) -> np.ndarray:
        if self.perm is None:
            return w_stored
        w = np.empty_like(w_stored)
        w[:, self.perm] = w_stored
        return w

    def dequantize(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows ``start:stop`` as float32 ``[rows, in]`` in the input order (the definition of
        the format: module docstring)."""
        sl = slice(start, stop)
        return self._to_input_order(self._dequantize_stored(self.packed[sl], self.scales[sl], self.zeros[sl]))

    def select_rows(self, rows: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows).reshape(-1)
        return self._to_input_order(self._dequantize_stored(self.packed[rows], self.scales[rows], self.zeros[rows]))

    def take_rows(self, order: np.ndarray) -> "Int4Weight":
        order = np.asarray(order)
        return Int4Weight(self.packed[order], self.scales[order], self.zeros[order], self.group_size, self.perm)

    @classmethod
    def concat_rows(cls, parts: Sequence["Int4Weight"]) -> "Int4Weight":
        """Stack on the output axis. Parts must share ``in_features``, ``group_size`` and
        ``perm``; otherwise NotImplementedError, and :func:`refengine.quant.concat_rows`
        keeps them as a :class:`refengine.quant.StackedWeight` (act-order matrices whose
        permutations differ)."""
        first = parts[0]
        for p in parts[1:]:
            same_perm = (p.perm is None and first.perm is None) or (
                p.perm is not None and first.perm is not None and np.array_equal(p.perm, first.perm))
            if p.shape[1] != first.shape[1] or p.group_size != first.group_size or not same_perm:
                raise NotImplementedError("int4 parts with different in_features, group_size or act-order permutation")
        return cls(np.concatenate([p.packed for p in parts]), np.concatenate([p.scales for p in parts]),
                   np.concatenate([p.zeros for p in parts]), first.group_size, first.perm)

    # --- the compiled product -----------------------------------------------------------
    def kernel_columns(self) -> np.ndarray:
        """int64 ``[in]``: position ``p`` of the dot kernel's input is input feature
        ``kernel_columns()[p]``: the act-order permutation, then, within every full run
        of 32 stored columns of a group, the 16 even columns before the 16 odd ones (the
        low and the high nibbles of 16 bytes; :func:`refengine.cpu.int_products._int4_rows`)."""
        if self._kernel_index is None:
            in_features, gs = self.shape[1], self.group_size
            order = np.arange(in_features)
            run = np.concatenate([np.arange(0, 32, 2), np.arange(1, 32, 2)])
            for c0 in range(0, in_features, gs):
                c1 = min(c0 + gs, in_features)
                for c in range(c0, c0 + (c1 - c0) // 32 * 32, 32):
                    order[c:c + 32] = c + run
            self._kernel_index = order if self.perm is None else self.perm[order]
        return self._kernel_index

    def numba_linear(self, x: np.ndarray, *, batch_invariant: bool = False) -> np.ndarray:
        """``x [T, in]`` (C-contiguous float32) ``@ w.T`` -> float32 ``[T, out]`` by the numba
        kernels (:func:`refengine.cpu.int_products.int4_linear`): the dot kernels read ``x``
        gathered into :meth:`kernel_columns` order, the tile path (many rows) ``x[:, perm]``
        (one ``T x in`` gather per product). ``batch_invariant``: the dot kernels at every row count."""
        products = compiled_products("int")
        tiles = not batch_invariant and products.int4_uses_blas(x.shape[0])
        if tiles:
            xs = x if self.perm is None else np.take(x, self.perm, axis=1)
        else:
            xs = np.take(x, self.kernel_columns(), axis=1)
        return products.int4_linear(np.ascontiguousarray(xs, dtype=np.float32), self.packed, self.scales, self.zeros,
                           self.group_size, tiles)
