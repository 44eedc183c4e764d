"""GGUF block types kept as stored (refengine.quant.gguf_blocks) and their compiled products
(refengine.cpu.gguf_products).

Every type is tried on random blocks: random bytes with the f16 scales (and F16/BF16/F32
values) replaced by finite values of a realistic size, row counts 1/3/7/33, several blocks
per row. ``gguf.quants.dequantize`` (gguf-py) is the bit-exact oracle of ``dequantize``; the
compiled decoders must give the same bits; the products are checked against ``x @ W.T`` in
float64, below and above the prefill threshold, and bitwise against themselves one row at a
time (batch invariance of the fused kernels).
"""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("numba")

from gguf.quants import dequantize as gguf_dequantize  # noqa: E402

from refengine.quant import concat_rows, reference_linear  # noqa: E402
from refengine.quant.gguf_blocks import BLOCK_LAYOUTS, SUPPORTED_TYPES, GGUFWeight  # noqa: E402

TYPES = list(SUPPORTED_TYPES)
ROWS = (1, 3, 7, 33)
# float32 dot products of K terms: the error is far below K * 2**-24 relative to sum |x w|
# (observed ~1e-7); 1e-5 still catches a wrong weight, scale or block (errors of O(1e-2)).
PRODUCT_TOL = 1e-5


def _cols(name: str) -> int:
    """Several blocks per row; for the 16-bit and F32 types a length that leaves a tail of lanes."""
    block = BLOCK_LAYOUTS[name][0]
    return {1: 203, 32: 5 * 32, 256: 3 * 256}[block]


def random_raw(name: str, rows: int, cols: int, rng) -> np.ndarray:
    """uint8 ``[rows, bytes_per_row]``: random blocks, their f16 fields finite (|d| ~ 0.05)."""
    block, size, fields = BLOCK_LAYOUTS[name]
    nb = cols // block
    raw = rng.integers(0, 256, size=(rows, nb, size), dtype=np.uint8)
    if name == "F32":
        raw[:] = rng.standard_normal((rows, nb, 1)).astype(np.float32).view(np.uint8).reshape(rows, nb, 4)
    elif name == "BF16":
        top = rng.standard_normal((rows, nb, 1)).astype(np.float32).view(np.uint16)[..., 1:2]
        raw[:] = np.ascontiguousarray(top).view(np.uint8).reshape(rows, nb, 2)
    else:
        for _field, offset, nbytes, dtype in fields:
            if dtype == "<u2":  # f16 scales (and F16 values)
                v = (rng.standard_normal((rows, nb, nbytes // 2)) * 0.05).astype(np.float16)
                raw[:, :, offset:offset + nbytes] = v.view(np.uint8).reshape(rows, nb, nbytes)
    return raw.reshape(rows, nb * size)


def oracle(name: str, raw: np.ndarray, cols: int) -> np.ndarray:
    values = gguf_dequantize(raw, gguf.GGMLQuantizationType[name])
    return np.asarray(values, dtype=np.float32).reshape(raw.shape[0], cols)


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


@pytest.fixture(scope="module")
def weights():
    """(name, rows) -> (GGUFWeight, raw bytes, oracle float32) for every type and row count."""
    rng = np.random.default_rng(1234)
    out = {}
    for name in TYPES:
        cols = _cols(name)
        for rows in ROWS:
            raw = random_raw(name, rows, cols, rng)
            out[name, rows] = (GGUFWeight.from_raw(name, raw, (rows, cols)), raw, oracle(name, raw, cols))
    return out


# ----------------------------------------------------------------------------------------
# Storage and the NumPy definition


@pytest.mark.parametrize("name", TYPES)
def test_dequantize_matches_gguf_bitwise(weights, name):
    for rows in ROWS:
        w, raw, ref = weights[name, rows]
        assert w.shape == ref.shape and w.format == name
        assert np.array_equal(bits(w.dequantize()), bits(ref)), f"{name} rows={rows}"
        assert np.array_equal(bits(w.dequantize(1, 3)), bits(ref[1:3]))
        assert np.array_equal(w.to_raw(), raw)
        assert w.nbytes == raw.nbytes  # the file's bytes per weight


@pytest.mark.parametrize("name", TYPES)
def test_rows_moved_not_requantized(weights, name):
    w, _raw, ref = weights[name, 33]
    order = np.random.default_rng(7).permutation(33)
    taken = w.take_rows(order)
    assert taken.format == name and np.array_equal(bits(taken.dequantize()), bits(ref[order]))
    assert np.array_equal(bits(w.take_rows([5, 5, 0]).dequantize()), bits(ref[[5, 5, 0]]))
    w3, _raw3, ref3 = weights[name, 3]
    both = GGUFWeight.concat_rows([w3, w])
    assert both.shape == (36, w.shape[1]) and np.array_equal(bits(both.dequantize()), bits(np.concatenate([ref3, ref])))
    assert isinstance(concat_rows([w3, w]), GGUFWeight)
    picked = np.array([[32, 0], [7, 7]])
    assert np.array_equal(bits(w.select_rows(picked)), bits(ref[picked.reshape(-1)]))
    with pytest.raises(IndexError):
        w.select_rows([33])


def test_from_tensor_reads_a_gguf_file(tmp_path):
    rng = np.random.default_rng(3)
    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    tensors = {}
    for name in ("Q4_1", "Q8_0", "Q6_K", "BF16", "F16", "F32"):
        cols = _cols(name)
        raw = random_raw(name, 5, cols, rng)
        tensors[name] = oracle(name, raw, cols)
        qtype = gguf.GGMLQuantizationType[name]
        data = raw.view(np.float32) if name == "F32" else raw.view(np.float16) if name == "F16" else raw
        writer.add_tensor(name, data, raw_shape=None if name in ("F32", "F16") else raw.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for tensor in gguf.GGUFReader(str(path)).tensors:
        w = GGUFWeight.from_tensor(tensor)
        assert w.format == tensor.tensor_type.name == tensor.name
        assert np.array_equal(bits(w.dequantize()), bits(tensors[tensor.name]))


def test_bad_input_names_value_and_limit():
    raw = np.zeros((2, 40), dtype=np.uint8)
    with pytest.raises(ValueError, match="Q3_K"):
        GGUFWeight.from_raw("Q3_K", raw)
    with pytest.raises(ValueError, match="NOPE"):
        GGUFWeight.from_raw("NOPE", raw)
    with pytest.raises(ValueError, match="48.*32"):
        GGUFWeight.from_raw("Q4_1", np.zeros((2, 30), dtype=np.uint8), (2, 48))
    with pytest.raises(ValueError, match="80 bytes, got 40"):
        GGUFWeight.from_raw("Q4_1", np.zeros((2, 20), dtype=np.uint8), (2, 64))
    with pytest.raises(ValueError, match="20-byte"):
        GGUFWeight.from_raw("Q4_1", np.zeros((2, 30), dtype=np.uint8))
    a, b = GGUFWeight.from_raw("Q4_1", raw), GGUFWeight.from_raw("Q8_0", np.zeros((2, 34), dtype=np.uint8))
    with pytest.raises(ValueError, match="Q4_1.*Q8_0"):
        GGUFWeight.concat_rows([a, b])
    with pytest.raises(ValueError, match=r"\[T, 64\]"):
        a.numba_linear(np.zeros((1, 32), dtype=np.float32))


# ----------------------------------------------------------------------------------------
# Compiled decoders and products


def test_f16_conversion_exact_for_every_pattern():
    from numba import njit

    from refengine.cpu.simd import f16_to_f32, f8_load_f16, f8_load_f16_bits, f8_store

    @njit
    def convert(h, scalar, vector, bit_vector):
        for i in range(h.shape[0]):
            scalar[i] = f16_to_f32(h[i])
        for i in range(0, h.shape[0], 8):
            f8_store(vector, i, f8_load_f16(h, i))
            f8_store(bit_vector, i, f8_load_f16_bits(h, i))

    h = np.arange(65536, dtype=np.uint16)
    outs = [np.empty(65536, np.float32) for _ in range(3)]
    convert(h, *outs)
    ref = h.view(np.float16).astype(np.float32)
    finite = ~np.isnan(ref)  # subnormals, zeros and infinities included
    for got in outs:
        assert np.array_equal(bits(got[finite]), bits(ref[finite]))
        assert np.isnan(got[~finite]).all()


@pytest.mark.parametrize("name", TYPES)
def test_compiled_dequantize_bitwise(weights, name):
    from refengine.cpu.gguf_products import dequantize_rows

    w, _raw, ref = weights[name, 33]
    buf = np.full((40, w.shape[1]), np.nan, dtype=np.float32)
    assert np.array_equal(bits(dequantize_rows(w, 0, 33, buf)), bits(ref))
    assert np.array_equal(bits(dequantize_rows(w, 4, 9, buf)), bits(ref[4:9]))
    with pytest.raises(ValueError):
        dequantize_rows(w, 0, 34, buf)


@pytest.mark.parametrize("name", TYPES)
def test_product_against_float64(weights, name):
    from refengine.cpu.gguf_products import PREFILL_MIN_ROWS

    rng = np.random.default_rng(99)
    for rows in ROWS:
        w, _raw, ref = weights[name, rows]
        wd = ref.astype(np.float64)
        for t in (1, 2, 3, 5, 8, 17, 64, 200):
            x = rng.standard_normal((t, w.shape[1])).astype(np.float32)
            got = w.numba_linear(x)
            assert got.shape == (t, rows) and got.dtype == np.float32
            exact = x.astype(np.float64) @ wd.T
            scale = np.abs(x).astype(np.float64) @ np.abs(wd).T
            err = float((np.abs(got - exact) / scale).max())
            assert err < PRODUCT_TOL, f"{name} rows={rows} T={t}: {err:.2e}"
            if t < PREFILL_MIN_ROWS:  # the fused kernels: each row's result does not depend on the batch
                for i in {0, t - 1}:
                    assert np.array_equal(bits(w.numba_linear(x[i:i + 1])), bits(got[i:i + 1])), f"{name} T={t} row {i}"


@pytest.mark.parametrize("name", ["Q4_1", "Q8_0", "Q6_K", "F16"])
def test_product_paths_and_threads(weights, name):
    """Both paths at one and two threads (the serial twins and the parallel loops), on one
    size, and through NumbaOps.linear."""
    import numba

    from refengine.cpu import blas
    from refengine.cpu.gguf_products import fused_linear, tiled_blas_linear
    from refengine.cpu.layer_ops import NumbaOps

    w, _raw, ref = weights[name, 33]
    x = np.random.default_rng(5).standard_normal((40, w.shape[1])).astype(np.float32)
    want = reference_linear(x, w)
    tol = PRODUCT_TOL * (np.abs(x) @ np.abs(ref).T)
    before = numba.get_num_threads(), blas.get_threads()
    try:
        results = []
        for threads in sorted({1, min(2, numba.config.NUMBA_NUM_THREADS)}):
            numba.set_num_threads(threads)
            blas.set_threads(threads)  # the tiles on two BLAS threads
            fused = fused_linear(x, w)
            results.append(fused)
            for got in (fused, tiled_blas_linear(x, w), NumbaOps().linear(x, w)):
                assert (np.abs(got - want) <= tol).all()
        assert all(np.array_equal(bits(r), bits(results[0])) for r in results)  # threads change no bit
    finally:
        numba.set_num_threads(before[0])
        blas.set_threads(before[1])


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("extra", [1, 2, 5, 7])
def test_fused_rows_do_not_depend_on_the_batch_across_input_blocks(weights, name, extra):
    """Batch-invariant products run the fused kernels at every row count, taking the input
    rows in cache-sized blocks and, in a block, in groups of eight (32-weight types), four
    and one: past the first block, with a last block of 1, 2, 5 or 7 rows, each row alone
    gives its bits in the batch."""
    from refengine.cpu.numba_support import x_block_rows

    w = weights[name, 7][0]
    block = int(x_block_rows(w.shape[1], 8 if name[-1] != "K" else 4))
    x = np.random.default_rng(extra).standard_normal((block + extra, w.shape[1])).astype(np.float32)
    batch = w.numba_linear(x, batch_invariant=True)
    for i in sorted({0, 1, block - 1, block, block + extra - 1}):
        alone = w.numba_linear(x[i:i + 1], batch_invariant=True)
        assert np.array_equal(bits(alone), bits(batch[i:i + 1])), f"{name} T={block + extra} row {i}"


def test_smollm2_gguf_tensors(gguf_path):
    """The real file: its Q8_0 embedding (tied lm_head) and a layer's Q4_1 matrices as stored,
    against gguf-py, and their products against the NumPy twin."""
    reader = gguf.GGUFReader(str(gguf_path))
    names = ("token_embd.weight", "blk.0.ffn_down.weight", "blk.0.attn_k.weight")
    picked = [t for t in reader.tensors if t.name in names]
    assert len(picked) == 3
    rng = np.random.default_rng(0)
    for tensor in picked:
        w = GGUFWeight.from_tensor(tensor)
        assert w.nbytes == tensor.n_bytes
        rows = np.array([0, 1, w.shape[0] - 1, w.shape[0] // 2])
        ref = oracle(w.format, np.asarray(tensor.data[rows]), w.shape[1])
        assert np.array_equal(bits(w.select_rows(rows)), bits(ref))
        for t in (1, 40):
            x = rng.standard_normal((t, w.shape[1])).astype(np.float32)
            want = reference_linear(x, w)
            tol = PRODUCT_TOL * np.abs(x) @ np.abs(w.dequantize()).T
            assert (np.abs(w.numba_linear(x) - want) <= tol).all(), tensor.name
