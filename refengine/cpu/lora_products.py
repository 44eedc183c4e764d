"""The LoRA adapter product as a numba kernel: ``y[rows] += ((x[rows] @ A.T) @ B) * scale``.

:func:`add_lora` is :meth:`refengine.cpu.layer_ops.NumbaOps.add_lora`; its NumPy twin,
the reference it is tested against, is :func:`refengine.lora.add_lora_reference`
(``tests/kernels/test_lora_kernels.py``). The formula and its sources: :mod:`refengine.lora`.

One task per row (Punica's BGMV shape over one adapter's rows; the rows of one adapter
come as one group, :class:`refengine.lora.LoRABatch`):

* shrink: ``s[k] = sum_i x[t, i] * a[k, i]`` for ``k < R`` (``a`` is ``lora_A``'s
  ``[R, in]`` rows, so each is one contiguous dot product);
* expand: ``acc[j] = sum_k s[k] * b[k, j]`` over ``b [R, out]`` rows (``k`` outer, so the
  inner loop runs along contiguous ``j`` and vectorises), then ``y[t, j] += acc[j] * scale[j]``.

Every row is summed in one fixed order, whichever rows share the call and however many
threads run: a row's result is the same bits alone or in any batch (batch-invariant).
"""

from __future__ import annotations

import sys

import numpy as np
from numba import njit, prange

from refengine.cpu.numba_support import get_num_threads, parallel_kernel, register_kernels

_FMA = {"contract"}


@njit(cache=True, fastmath=_FMA)
def _lora_rows(y, x, rows, a, b, scale, i0, i1):  # pragma: no cover - compiled
    """Rows ``rows[i0:i1]`` of :func:`_add_lora`: shrink, expand, scale, add."""
    rank, n_in = a.shape
    n_out = b.shape[1]
    s = np.empty(rank, dtype=np.float32)
    acc = np.empty(n_out, dtype=np.float32)
    for i in range(i0, i1):
        t = rows[i]
        for k in range(rank):
            d = np.float32(0.0)
            for c in range(n_in):
                d += x[t, c] * a[k, c]
            s[k] = d
        for j in range(n_out):
            acc[j] = 0.0
        for k in range(rank):
            sk = s[k]
            for j in range(n_out):
                acc[j] += sk * b[k, j]
        for j in range(n_out):
            y[t, j] += acc[j] * scale[j]


@parallel_kernel(fastmath=_FMA)
def _add_lora(y, x, rows, a, b, scale, per):  # pragma: no cover - compiled
    n = rows.shape[0]
    for blk in prange((n + per - 1) // per):
        _lora_rows(y, x, rows, a, b, scale, blk * per, min(n, blk * per + per))


def add_lora(y: np.ndarray, x: np.ndarray, rows: np.ndarray, a: np.ndarray, b: np.ndarray,
             scale: np.ndarray) -> None:
    """``y[rows] += ((x[rows] @ a.T) @ b) * scale`` in place (shapes as
    :func:`refengine.lora.add_lora_reference`): C-contiguous float32 ``y``, ``x``, ``a``,
    ``b``, ``scale``; ``rows`` int64, each in ``[0, T)``, none repeated.

    Raises:
        ValueError: shapes that do not fit, or a row outside ``[0, T)``.
    """
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    n_rows = x.shape[0]
    if (y.shape[0] != n_rows or a.shape[1] != x.shape[1] or b.shape[0] != a.shape[0]
            or b.shape[1] != y.shape[1] or scale.shape != (y.shape[1],)):
        raise ValueError(f"add_lora: x {x.shape}, y {y.shape}, a {a.shape}, b {b.shape}, scale {scale.shape} "
                         "do not fit y [T, out] += ((x [T, in] @ a.T [in, R]) @ b [R, out]) * scale [out]")
    if rows.size and (rows.min() < 0 or rows.max() >= n_rows):
        raise ValueError(f"add_lora: rows must be in [0, {n_rows}), got {rows.min()} .. {rows.max()}")
    if rows.size == 0:
        return
    threads = get_num_threads()
    per = max(1, -(-rows.size // (4 * threads)))
    _add_lora.for_threads(threads if rows.size > 1 else 1)(y, np.ascontiguousarray(x, dtype=np.float32), rows,
                                                            a, b, scale, per)


register_kernels(sys.modules[__name__])
