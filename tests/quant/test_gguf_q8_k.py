"""Q8_K activations for the GGUF K-quants, Q4_K, Q5_K and Q6_K (refengine.cpu.q8_products,
``activation_dtype="q8_0"``).

Two oracles. The NumPy twin (:func:`refengine.quant.gguf_blocks.reference_quantize_q8_k`,
ggml's ``quantize_row_q8_K_ref``, and :func:`~refengine.quant.gguf_blocks.reference_q8_k_linear`,
ggml's integer dot products with the kernels' float32 steps) must give the kernels' bits.
And ggml's dot-product semantics, the integer sums times the scales with the minimums
through the activations' ``bsums``, must be the product of gguf-py's dequantized weights with
the dequantized activations ``d * q``, in float64, up to float32 rounding.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("numba")

from refengine.cpu import q8_products  # noqa: E402
from refengine.cpu.q8_products import q8_linear, quantize_q8_k  # noqa: E402
from refengine.quant.gguf_blocks import (Q8_K_TYPES, GGUFWeight, reference_q8_k_linear,  # noqa: E402
                                         reference_quantize_q8_k)
from tests.quant.test_gguf_blocks import PRODUCT_TOL, bits, oracle, random_raw  # noqa: E402


def _activations(rng, rows: int, k: int) -> np.ndarray:
    """float32 ``[rows, k]`` whose superblocks differ in size by orders of magnitude; with
    several superblocks, row 0's last is zero."""
    x = rng.standard_normal((rows, k // 256, 256)) * np.float32(10.0) ** rng.uniform(-3, 3, (rows, k // 256, 1))
    if k > 256:
        x[0, -1] = 0.0
    return x.astype(np.float32).reshape(rows, k)


def test_quantize_matches_ggml_reference():
    """ggml's Q8_K rounding: the first value of largest magnitude sets the (signed) scale,
    ties round to even, a zero block has d = 0; the kernel gives the NumPy twin's bits."""
    x = _activations(np.random.default_rng(1), 3, 768)
    x[1, :256] = np.linspace(-20, 20, 256, dtype=np.float32)
    x[1, 0] = -127.0  # iscale = -127 / -127 = 1: the values are their own quants
    x[1, 1:9] = [2.5, 3.5, -2.5, -3.5, 0.5, -0.5, 1.5, 126.5]  # ties
    x[1, 256:512] = np.float32(0.25)
    x[1, 256 + 5], x[1, 256 + 9] = 3.0, -3.0  # the same magnitude twice: the first sets the sign
    x[2, 512:] *= np.float32(1e-30)
    q, d, bs = quantize_q8_k(x)
    rq, rd, rbs = reference_quantize_q8_k(x)
    assert q.dtype == np.int8 and d.dtype == np.float32 and bs.dtype == np.int32
    assert np.array_equal(q, rq) and np.array_equal(bits(d), bits(rd)) and np.array_equal(bs, rbs)
    assert d[1, 0] == 1.0  # roundf would give 3, 4, -3, -4, 1, -1, 2, 127 for the ties:
    assert q[1, :9].tolist() == [-127, 2, 4, -2, -4, 0, 0, 2, 126]
    assert d[1, 1] == np.float32(1.0) / (np.float32(-127.0) / np.float32(3.0))
    assert q[1, 256 + 5] == -127 and q[1, 256 + 9] == 127
    assert d[0, 2] == 0 and not q[0, 512:].any() and not bs[0, 32:].any()
    assert np.array_equal(bs, q.reshape(3, 48, 16).sum(-1))
    step = np.repeat(np.abs(d), 256, axis=1)
    assert np.all(np.abs(np.repeat(d, 256, axis=1) * q - x) <= step * np.float32(0.5001))
    many = _activations(np.random.default_rng(2), q8_products.QUANTIZE_PARALLEL_MIN_ROWS + 3, 256)
    got, want = quantize_q8_k(many), reference_quantize_q8_k(many)  # rows in parallel
    assert all(np.array_equal(bits(a), bits(b)) for a, b in zip(got, want))
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize_q8_k(np.zeros((2, 128), np.float32))
    with pytest.raises(ValueError, match="multiple of 256"):
        reference_quantize_q8_k(np.zeros((2, 128), np.float32))


#: Input widths: one superblock, and three (the accumulation over superblocks).
WIDTHS = (256, 768)


@pytest.fixture(scope="module")
def k_weights():
    """(name, K) -> (GGUFWeight [37, K], its raw blocks): three groups of sixteen rows, the last partial."""
    rng = np.random.default_rng(21)
    out = {}
    for k in WIDTHS:
        for name in Q8_K_TYPES:
            raw = random_raw(name, 37, k, rng)
            out[name, k] = GGUFWeight.from_raw(name, raw, (37, k)), raw
    return out


@pytest.mark.parametrize("k", WIDTHS)
@pytest.mark.parametrize("name", Q8_K_TYPES)
def test_product_is_the_numpy_twin_bitwise(k_weights, name, k):
    """Every row count (groups of four rows and single ones): the twin's bits, and each row
    alone, through the weight's bound one-row product too, the bits it has in the batch."""
    import numba

    w = k_weights[name, k][0]
    rng = np.random.default_rng(8)
    for t in (1, 2, 5, 9):
        x = _activations(rng, t, k)
        got = q8_linear(x, w)
        assert got.shape == (t, 37) and got.dtype == np.float32
        assert np.array_equal(bits(got), bits(reference_q8_k_linear(x, w))), f"{name} K={k} T={t}"
        for i in {0, t - 1}:
            assert np.array_equal(bits(q8_linear(x[i:i + 1], w)), bits(got[i:i + 1])), f"{name} K={k} T={t} row {i}"
            one = w.row_product(numba.get_num_threads())
            assert isinstance(one, q8_products.RowProduct)
            assert np.array_equal(bits(one(np.ascontiguousarray(x[i:i + 1]))), bits(got[i:i + 1]))


@pytest.mark.parametrize("name", Q8_K_TYPES)
def test_twin_is_the_dequantized_product(k_weights, name):
    """ggml's semantics: ``d_x d_w sum_s sc_s dot(q_w, q_x) - d_x dmin_w sum_s m_s bsums_s``
    per superblock is ``dequantize(w) @ (d * q)``, against gguf-py's dequantization in
    float64 (the integer sums are exact: only float32 scaling and accumulation round)."""
    w, raw = k_weights[name, 768]
    x = _activations(np.random.default_rng(5), 6, 768)
    q, d, _ = reference_quantize_q8_k(x)
    xd = (q.reshape(6, 3, 256) * d[..., None].astype(np.float64)).reshape(6, 768)
    wd = oracle(name, raw, 768).astype(np.float64)
    err = float((np.abs(reference_q8_k_linear(x, w) - xd @ wd.T) / (np.abs(xd) @ np.abs(wd).T)).max())
    assert err < PRODUCT_TOL, f"{name}: {err:.2e}"
    with pytest.raises(ValueError, match="Q8_0"):
        reference_q8_k_linear(x, GGUFWeight.from_raw("Q8_0", random_raw("Q8_0", 2, 768, np.random.default_rng(0)),
                                                      (2, 768)))


@pytest.mark.parametrize("n", [37, 48])
@pytest.mark.parametrize("name", Q8_K_TYPES)
def test_interleaved_copy_alone_gives_the_planes_back(name, n, monkeypatch):
    """A K-quant weight that keeps only its interleaved copy (written over its own buffers
    where the rows fill whole groups; Q4_K/Q5_K's scales decoded to a byte each): its planes,
    row lookups, dequantization and pickle are those of the row-major weight, its products
    the same bits, and its planes the sizes planned."""
    rng = np.random.default_rng(31)
    k = 512
    raw = random_raw(name, n, k, rng)
    want = GGUFWeight.from_raw(name, raw, (n, k))
    w = GGUFWeight.from_raw(name, raw, (n, k))
    x = _activations(rng, 3, k)
    product = bits(q8_linear(x, want))
    quants = w.planes["ql" if name == "Q6_K" else "qs"]
    monkeypatch.setattr(q8_products, "_CHUNK_BYTES", 1)  # one group at a time: several chunks in place
    qr, hr, sr, dr, mr = q8_products.interleave(w, keep_row_major=False)
    assert w._planes is None and np.shares_memory(qr, quants) == (n % 16 == 0)
    groups, nb = -(-n // 16), k // 256
    assert qr.size == groups * nb * 2048 and dr.size == groups * nb * 16
    assert hr.size == groups * nb * {"Q4_K": 0, "Q5_K": 512, "Q6_K": 1024}[name]
    assert sr.size == groups * nb * 256 and mr.size == (0 if name == "Q6_K" else groups * nb * 16)
    for key, plane in want.planes.items():
        assert np.array_equal(w.planes[key], plane) and w.planes[key].dtype == plane.dtype, key
    rows = np.array([36, 0, 17, -1, 16])
    assert np.array_equal(bits(w.select_rows(rows)), bits(want.select_rows(rows)))
    assert np.array_equal(bits(w.dequantize(3, 20)), bits(want.dequantize(3, 20)))
    assert np.array_equal(bits(q8_linear(x, w)), product)
    copy = pickle.loads(pickle.dumps(w))
    assert "_x16" not in vars(copy) and all(np.array_equal(copy.planes[key], p) for key, p in want.planes.items())
