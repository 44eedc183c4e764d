"""The LoRA product's numba kernel (refengine/cpu/lora_products.py) against its NumPy twin
(refengine.lora.add_lora_reference), and the row grouping (refengine.lora.LoRABatch)."""

from __future__ import annotations

import numpy as np
import pytest

from refengine.cpu.layer_ops import NumbaOps
from refengine.cpu.lora_products import add_lora
from refengine.lora import LoRABatch, LoRAWeights, add_lora_reference, lora_scale
from refengine.ops.numpy_ops import NumpyOps


def case(rng, rows=9, n_in=40, n_out=24, rank=6):
    x = rng.standard_normal((rows, n_in)).astype(np.float32)
    y = rng.standard_normal((rows, n_out)).astype(np.float32)
    a = rng.standard_normal((rank, n_in)).astype(np.float32)
    b = rng.standard_normal((rank, n_out)).astype(np.float32)
    scale = rng.uniform(0.5, 2.0, n_out).astype(np.float32)
    return x, y, a, b, scale


@pytest.mark.parametrize("rows", [[0], [1, 2, 5], list(range(9))])
def test_kernel_matches_twin_and_leaves_other_rows(rows):
    rng = np.random.default_rng(0)
    x, y, a, b, scale = case(rng)
    rows = np.array(rows, np.int64)
    want, got = y.copy(), y.copy()
    add_lora_reference(want, x, rows, a, b, scale)
    add_lora(got, x, rows, a, b, scale)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    others = np.setdiff1d(np.arange(9), rows)
    assert np.array_equal(got[others], y[others])  # rows of no adapter keep their bits
    # the formula itself, in float64: x A^T B scale
    delta = (x[rows].astype(np.float64) @ a.T.astype(np.float64) @ b.astype(np.float64)) * scale
    np.testing.assert_allclose(got[rows] - y[rows], delta, rtol=1e-4, atol=1e-4)


def test_kernel_rows_are_batch_invariant():
    """A row's result is the same bits alone or among others."""
    rng = np.random.default_rng(1)
    x, y, a, b, scale = case(rng, rows=33)
    alone, together = y.copy(), y.copy()
    add_lora(alone, x, np.array([7], np.int64), a, b, scale)
    add_lora(together, x, np.arange(33, dtype=np.int64), a, b, scale)
    assert np.array_equal(alone[7], together[7])


def test_kernel_refuses_bad_shapes_and_rows():
    rng = np.random.default_rng(2)
    x, y, a, b, scale = case(rng)
    with pytest.raises(ValueError, match="do not fit"):
        add_lora(y, x, np.array([0]), a[:, :-1], b, scale)
    with pytest.raises(ValueError, match=r"rows must be in \[0, 9\)"):
        add_lora(y, x, np.array([9]), a, b, scale)


def test_scale_is_peft_s():
    assert lora_scale(16, 32, False) == 2.0 and lora_scale(16, 32, True) == 8.0


class _Adapter:
    def __init__(self, w):
        self.layers = [{"qkv": w}]


@pytest.mark.parametrize("ops", [NumpyOps(), NumbaOps()], ids=["numpy", "numba"])
def test_batch_groups_rows_by_adapter_and_slices(ops):
    """Rows of two adapters and of none; a slice of the batch (the chunked MLP) gets the
    same values as the whole."""
    rng = np.random.default_rng(3)
    x, y, a, b, scale = case(rng, rows=10)
    w1, w2 = LoRAWeights(a, b, scale), LoRAWeights(a * 2, b, scale)

    class Seq:
        def __init__(self, lora):
            self.lora_request = lora

    from refengine.lora import LoRARequest

    r1, r2 = LoRARequest("one", 1, "/p1"), LoRARequest("two", 2, "/p2")
    adapters = {1: _Adapter(w1), 2: _Adapter(w2)}
    batch = LoRABatch.from_sequences([(Seq(r2), 3), (Seq(None), 2), (Seq(r1), 4), (Seq(r2), 1)],
                                     lambda r: adapters[r.lora_int_id])
    assert [(ad is adapters[2], rows.tolist()) for ad, rows in batch.groups] == [(False, [5, 6, 7, 8]),
                                                                                 (True, [0, 1, 2, 9])]
    whole = y.copy()
    batch.apply(ops, whole, x, 0, "qkv")
    assert np.array_equal(whole[3:5], y[3:5])
    want = y.copy()
    add_lora_reference(want, x, np.array([5, 6, 7, 8]), a, b, scale)
    add_lora_reference(want, x, np.array([0, 1, 2, 9]), a * 2, b, scale)
    np.testing.assert_allclose(whole, want, rtol=1e-5, atol=1e-5)
    sliced = y.copy()
    for r0 in (0, 4, 8):
        part = sliced[r0:r0 + 4].copy()
        batch.apply(ops, part, x[r0:r0 + 4], 0, "qkv", first_row=r0)
        sliced[r0:r0 + 4] = part
    if ops.name == "numba":  # one fixed order per row: the same bits in any slice
        assert np.array_equal(sliced, whole)
    np.testing.assert_allclose(sliced, whole, rtol=1e-5, atol=1e-4)
    assert LoRABatch.from_sequences([(Seq(None), 3)], adapters.get) is None
