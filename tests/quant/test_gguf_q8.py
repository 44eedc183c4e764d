"""Q8_0 activations for the GGUF 32-weight block types (refengine.cpu.q8_products,
``activation_dtype="q8_0"``).

gguf-py is the oracle twice over: its ``quantize(x, Q8_0)`` must give the same blocks as
:func:`quantize_q8_0` bit for bit, and the products must equal ``dequantize(w) @
dequantize(quantize(x))`` in float64 (their integer sums are exact, so only the float32
scaling and accumulation round). Each row's result must be the same bits alone, in any
batch (across the kernels' row groups and input blocks) and on any number of threads.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("numba")

from gguf.quants import dequantize, quantize  # noqa: E402

from refengine.cpu.q8_products import Q8_TYPES, q8_linear, quantize_q8_0  # noqa: E402
from refengine.quant.gguf_blocks import GGUFWeight  # noqa: E402
from tests.quant.test_gguf_blocks import PRODUCT_TOL, bits, oracle, random_raw  # noqa: E402

Q8_0 = gguf.GGMLQuantizationType.Q8_0


def _gguf_q8_0(x: np.ndarray):
    """gguf-py's Q8_0 blocks of ``x [T, K]``: (d as float32 [T, K/32], q int8 [T, K])."""
    blocks = quantize(x, Q8_0).reshape(x.shape[0], -1, 34)
    d = np.ascontiguousarray(blocks[:, :, :2]).view(np.float16).astype(np.float32)[:, :, 0]
    return d, np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).reshape(x.shape)


def test_quantize_matches_gguf_bitwise():
    rng = np.random.default_rng(3)
    # rows of very different sizes (subnormal and large f16 scales), a zero block, exact halves
    x = (rng.standard_normal((9, 256)) * np.float32(10.0) ** rng.uniform(-6, 4, (9, 1))).astype(np.float32)
    x[0, :32] = 0.0
    x[1, :32] = np.arange(32, dtype=np.float32) - 15.5  # q = x * 127 / 16.5: not halves, but near them
    x[2, :32] = np.float32(0.5) * (np.arange(32) - 16) * np.float32(127.0 / 8.0)
    for rows in (x[:1], x):  # one row (the serial kernel) and several
        q, d, qsum = quantize_q8_0(rows)
        want_d, want_q = _gguf_q8_0(rows)
        assert q.dtype == np.int8 and d.dtype == qsum.dtype == np.float32
        assert np.array_equal(q, want_q) and np.array_equal(bits(d), bits(want_d))
        # qsum: the block's dequantized sum, d times the exact integer sum, rounded once
        assert np.array_equal(bits(qsum), bits(d * q.reshape(len(rows), -1, 32).sum(-1).astype(np.float32)))
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q8_0(np.zeros((2, 48), np.float32))


def test_quantize_many_rows_in_parallel_gives_the_same_bits():
    """From QUANTIZE_PARALLEL_MIN_ROWS rows the quantizer runs its rows in parallel."""
    from refengine.cpu.q8_products import QUANTIZE_PARALLEL_MIN_ROWS

    x = np.random.default_rng(4).standard_normal((QUANTIZE_PARALLEL_MIN_ROWS + 3, 64)).astype(np.float32)
    q, d, _ = quantize_q8_0(x)
    want_d, want_q = _gguf_q8_0(x)
    assert np.array_equal(q, want_q) and np.array_equal(bits(d), bits(want_d))


def test_f16_round_matches_numpy_for_every_half_boundary():
    """The scale's rounding to f16: every f16 value, the midpoints between neighbours and the
    floats either side of them, in the subnormal and normal ranges and at the overflow."""
    from numba import njit

    from refengine.cpu.q8_products import f16_round

    @njit
    def rounded(v, out):
        for i in range(v.size):
            out[i] = f16_round(v[i])

    halves = np.arange(0x7C00, dtype=np.uint16).view(np.float16).astype(np.float64)
    mids = ((halves[1:] + halves[:-1]) / 2).astype(np.float32)
    v = np.concatenate([halves.astype(np.float32), mids, np.nextafter(mids, np.float32(0)),
                        np.nextafter(mids, np.float32(np.inf)), np.float32([65519.99, 65520.0, 1e30])])
    out = np.empty_like(v)
    rounded(v, out)
    with np.errstate(over="ignore"):
        want = v.astype(np.float16).astype(np.float32)
    assert np.array_equal(bits(out), bits(want))


#: Input widths: 18 blocks (SmolLM2's 576: pairs only) and 17 (544: an odd last block alone).
WIDTHS = (576, 544)


@pytest.fixture(scope="module")
def q8_weights():
    """(name, K) -> (GGUFWeight [37, K], its float64 dequantization) for the Q8-activation types."""
    rng = np.random.default_rng(21)
    out = {}
    for k in WIDTHS:
        for name in Q8_TYPES:
            raw = random_raw(name, 37, k, rng)
            out[name, k] = (GGUFWeight.from_raw(name, raw, (37, k)), oracle(name, raw, k).astype(np.float64))
    return out


@pytest.mark.parametrize("k", WIDTHS)
@pytest.mark.parametrize("name", Q8_TYPES)
def test_product_is_the_dequantized_product(q8_weights, name, k):
    w, wd = q8_weights[name, k]
    rng = np.random.default_rng(8)
    for t in (1, 2, 3, 5, 6, 9, 40):
        x = rng.standard_normal((t, k)).astype(np.float32)
        got = q8_linear(x, w)
        assert got.shape == (t, 37) and got.dtype == np.float32
        xd = dequantize(quantize(x, Q8_0), Q8_0).reshape(t, k).astype(np.float64)
        err = float((np.abs(got - xd @ wd.T) / (np.abs(xd) @ np.abs(wd).T)).max())
        assert err < PRODUCT_TOL, f"{name} K={k} T={t}: {err:.2e}"
        for i in {0, t - 1}:  # a row alone: the same bits as in the batch
            assert np.array_equal(bits(q8_linear(x[i:i + 1], w)), bits(got[i:i + 1])), f"{name} K={k} T={t} row {i}"


@pytest.mark.parametrize("k", WIDTHS)
@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0"])
def test_rows_do_not_depend_on_the_batch_across_input_blocks_or_threads(q8_weights, name, k):
    """Past the first input block, with groups of four and single rows at its end, on one and
    two threads: each row alone gives its bits."""
    import numba

    from refengine.cpu.numba_support import x_block_rows

    w = q8_weights[name, k][0]
    block = int(x_block_rows(k // 2, 4))  # the kernel's input block (int8 rows and their repeated scales)
    x = np.random.default_rng(5).standard_normal((block + 5, k)).astype(np.float32)  # last block: 4 + 1
    before = numba.get_num_threads()
    try:
        runs = []
        for threads in sorted({1, min(2, numba.config.NUMBA_NUM_THREADS)}):
            numba.set_num_threads(threads)
            runs.append(q8_linear(x, w))
    finally:
        numba.set_num_threads(before)
    assert all(np.array_equal(bits(r), bits(runs[0])) for r in runs)
    for i in sorted({0, block - 1, block, block + 3, block + 4}):
        assert np.array_equal(bits(q8_linear(x[i:i + 1], w)), bits(runs[0][i:i + 1])), f"{name} K={k} row {i}"


def test_product_plans_per_thread_count_thread_and_not_pickled(q8_weights):
    """The arguments kept on a weight (:func:`refengine.cpu.gguf_products.product_plan`): one
    plan per thread count and calling thread, each giving the bits a fresh weight gives, and
    none carried through pickle."""
    import pickle
    import threading

    import numba

    from refengine.cpu import gguf_products

    w = q8_weights["Q4_1", 544][0]
    x = np.random.default_rng(9).standard_normal((1, 544)).astype(np.float32)
    fresh = GGUFWeight("Q4_1", w.planes, w.shape)
    want = (bits(q8_linear(x, fresh)), bits(gguf_products.linear(x, fresh)))
    before = numba.get_num_threads()
    try:
        for threads in sorted({1, min(2, numba.config.NUMBA_NUM_THREADS)}):
            numba.set_num_threads(threads)
            for _ in range(2):  # the second call reuses the plan's buffers
                assert np.array_equal(bits(q8_linear(x, w)), want[0])
                assert np.array_equal(bits(gguf_products.linear(x, w)), want[1])
    finally:
        numba.set_num_threads(before)
    other = []

    def in_another_thread():
        other.append(bits(q8_linear(x, w)))
        other.append(dict(vars(w._plans)))  # that thread's plans

    t = threading.Thread(target=in_another_thread)
    t.start()
    t.join()
    assert np.array_equal(other[0], want[0])
    mine, theirs = vars(w._plans), other[1]
    assert theirs and mine and all(theirs[key] is not mine.get(key) for key in theirs)
    copy = pickle.loads(pickle.dumps(w))
    assert "_plans" not in vars(copy) and "_x16" not in vars(copy)
    assert np.array_equal(bits(q8_linear(x, copy)), want[0])


@pytest.mark.parametrize("name", Q8_TYPES)
def test_layer_ops_bind_one_row_products(q8_weights, name):
    """``NumbaOps(activation_dtype="q8_0").linear``: a GGUF weight's first one-row product
    binds a :class:`RowProduct`, which the later ones call directly; every row gives
    :func:`q8_linear`'s bits, other shapes, dtypes and strides take the checked path (and its
    errors), and a thread count change binds the product anew."""
    import numba

    from refengine.cpu.layer_ops import NumbaOps
    from refengine.cpu.q8_products import RowProduct

    w = q8_weights[name, 576][0]
    ops = NumbaOps(activation_dtype="q8_0")
    rng = np.random.default_rng(12)
    x = rng.standard_normal((3, 576)).astype(np.float32)
    want = bits(q8_linear(x, w))
    assert np.array_equal(bits(ops.linear(x, w)), want)  # three rows: not bound
    for i in range(3):  # one row: the weight's bound RowProduct (kept on the weight per thread count)
        assert np.array_equal(bits(ops.linear(x[i:i + 1], w)), want[i:i + 1])
        run = w.row_product(numba.get_num_threads())
        assert isinstance(run, RowProduct) and run.weight is w
    assert np.array_equal(bits(ops.linear(x[1:2].astype(np.float64), w)), want[1:2])  # cast, checked path
    wide = np.zeros((1, 2 * 576), np.float32)
    assert np.array_equal(bits(ops.linear(wide[:, ::2], w)), bits(q8_linear(np.zeros((1, 576), np.float32), w)))
    with pytest.raises(ValueError, match=r"\[T, 576\]"):
        ops.linear(np.zeros((1, 544), np.float32), w)
    before = numba.get_num_threads()
    try:
        for threads in sorted({1, min(2, numba.config.NUMBA_NUM_THREADS)}):
            numba.set_num_threads(threads)
            assert np.array_equal(bits(ops.linear(x[2:3], w)), want[2:3])
            assert w.row_product(numba.get_num_threads()).threads == threads
    finally:
        numba.set_num_threads(before)


def test_other_types_keep_their_float_products():
    """q8_products.linear sends a type without an integer kernel (F16, BF16) to the float32 products."""
    from refengine.cpu import gguf_products, q8_products

    rng = np.random.default_rng(6)
    w = GGUFWeight.from_raw("F16", random_raw("F16", 5, 256, rng), (5, 256))
    x = rng.standard_normal((3, 256)).astype(np.float32)
    assert np.array_equal(bits(q8_products.linear(x, w)), bits(gguf_products.linear(x, w)))
    with pytest.raises(ValueError, match="F16"):
        q8_linear(x, w)
    with pytest.raises(ValueError, match=r"\[T, 256\]"):
        q8_linear(np.zeros((2, 128), np.float32), GGUFWeight.from_raw("Q8_0", random_raw("Q8_0", 4, 256, rng), (4, 256)))


def test_q8_steps_keep_numba_threads():
    """With Q8_0 activations every product of a Q4_1/Q8_0 model (K-quants too) runs in
    numba's kernels at every row count, so a long chunk is no BLAS step (which would leave
    those kernels one thread) and the attention then keeps its compiled prefill; an F16
    matrix, float32 activations or a float matrix bring BLAS back."""
    import types

    from refengine.cpu.engine_hooks import is_blas_step, layer_products_use_blas
    from refengine.cpu.layer_ops import NumbaOps

    rng = np.random.default_rng(3)

    def weight(name):
        return GGUFWeight.from_raw(name, random_raw(name, 4, 256, rng), (4, 256))

    def model(activation_dtype, *matrices):
        layers = [types.SimpleNamespace(qkv=m, norm=np.ones(256, np.float32)) for m in matrices]
        return types.SimpleNamespace(ops=NumbaOps(activation_dtype=activation_dtype), layers=layers,
                                     attention=types.SimpleNamespace(blas_prefill_min_rows=64))

    q8 = model("q8_0", weight("Q4_1"), weight("Q8_0"))
    assert not layer_products_use_blas(q8)
    assert not is_blas_step(q8, 512, 1) and is_blas_step(q8, 512, 512)  # the attention's own BLAS chunk
    assert layer_products_use_blas(model("auto", weight("Q4_1")))
    assert not layer_products_use_blas(model("q8_0", weight("Q4_1"), weight("Q6_K"), weight("Q4_K")))
    assert layer_products_use_blas(model("q8_0", weight("Q4_1"), weight("F16")))
    assert layer_products_use_blas(model("q8_0", weight("Q4_1"), np.zeros((256, 4), np.float32)))
    float_head = model("q8_0", weight("Q4_1"))
    float_head.lm_head = np.zeros((256, 4), np.float32)  # every row's logits would go to BLAS
    assert layer_products_use_blas(float_head)
    assert is_blas_step(model("auto", weight("Q4_1")), 512, 1)


def test_engine_option_is_checked(gguf_path, tmp_path):
    from refengine.engine_args import EngineArgs

    def config(**kw):
        args = EngineArgs(**kw)
        model_dir, mc = args.model_config()
        return args.create_engine_config(model_dir, mc)

    assert config(model=str(gguf_path), activation_dtype="q8_0").activation_dtype == "q8_0"
    with pytest.raises(ValueError, match="attention_backend='numba'"):
        config(model=str(gguf_path), activation_dtype="q8_0", attention_backend="numpy")
    with pytest.raises(ValueError, match="dtype='float32'"):
        config(model=str(gguf_path), activation_dtype="q8_0", dtype="float32")
    with pytest.raises(ValueError, match="quantization='int8'"):
        config(model=str(gguf_path), activation_dtype="q8_0", quantization="int8")


def test_engine_with_q8_activations(gguf_path):
    """SmolLM2's Q4_1 file with Q8_0 activations: the float32 path's first greedy tokens, and
    the batch-invariant promise kept (a prompt's logits the same bits prefilled in one chunk
    or in two with a decode step's worth of rows)."""
    from refengine import LLM, SamplingParams

    prompt = "The capital of France is"
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    texts = {}
    for act in ("auto", "q8_0"):
        llm = LLM(model=str(gguf_path), activation_dtype=act, max_model_len=256, enable_prefix_caching=False)
        texts[act] = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert texts["q8_0"] == texts["auto"]
    model = llm.llm_engine.model  # the q8_0 engine: one copy of each matrix, the interleaved one
    assert model.lm_head is model.embed and model.embed._planes is None
    assert all(w._planes is None for w in (model.layers[0].o, model.layers[-1].down))

    def prompt_logprobs(**kw):
        llm = LLM(model=str(gguf_path), activation_dtype="q8_0", max_model_len=256, enable_prefix_caching=False, **kw)
        out = llm.generate([prompt * 3], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0),
                           use_tqdm=False)[0]
        return [next(iter(p.values())).logprob for p in out.prompt_logprobs[1:]]

    assert prompt_logprobs() == prompt_logprobs(max_num_batched_tokens=5)
    # without batch invariance too: its prompts take the compiled prefill kernel, not BLAS
    llm = LLM(model=str(gguf_path), activation_dtype="q8_0", batch_invariant=False, max_model_len=256)
    attention = llm.llm_engine.model.attention
    assert not attention.use_blas_prefill and attention.blas_prefill_min_rows == sys.maxsize
    llm.generate([prompt * 12], SamplingParams(max_tokens=1), use_tqdm=False)  # one chunk of 60+ rows
    assert attention._plan.tile_seq.size and attention._plan.blas_prefill == []


@pytest.mark.parametrize("name", Q8_TYPES)
def test_interleaved_groups_of_any_row_count(name):
    """The kernels at row counts around their groups of sixteen interleaved rows (a partial
    group alone, whole groups, one row past): the dequantized product, and each input row
    alone gives its bits; the interleaved planes are built once and are the size planned."""
    from refengine.cpu import q8_products

    rng = np.random.default_rng(17)
    k = 96
    x = rng.standard_normal((6, k)).astype(np.float32)
    xd = dequantize(quantize(x, Q8_0), Q8_0).reshape(x.shape).astype(np.float64)
    for n in (1, 5, 16, 17, 32):
        raw = random_raw(name, n, k, rng)
        w = GGUFWeight.from_raw(name, raw, (n, k))
        wd = oracle(name, raw, k).astype(np.float64)
        got = q8_linear(x, w)
        err = float((np.abs(got - xd @ wd.T) / (np.abs(xd) @ np.abs(wd).T)).max())
        assert err < PRODUCT_TOL, f"{name} N={n}: {err:.2e}"
        planes = w._x16
        for i in range(x.shape[0]):
            assert np.array_equal(bits(q8_linear(x[i:i + 1], w)), bits(got[i:i + 1])), f"{name} N={n} row {i}"
        assert w._x16 is planes and q8_products.interleave(w) is planes
        assert planes[0].size == -(-n // 16) * q8_products.GROUP_BLOCK_BYTES[name] * (k // 32)
        assert planes[1].size == (-(-n // 16) * 64 * (k // 32) if name.startswith("Q5") else 0)


def _slice_dots():
    """A fresh (uncompiled) function: the sixteen lanes of ``q16_dpbusd`` and
    ``q16_dpbusd_small`` (each lane four products of ``w``'s bytes and the four bytes of
    ``x`` broadcast), applied twice from zero, into ``out`` and ``out_small``."""
    from numba import njit

    from refengine.cpu.q8_products import b64_bcast4, b64_load, q16_dpbusd, q16_dpbusd_small, q16_zero
    from refengine.cpu.simd import q16_to_f, v16_store

    @njit
    def dots(w, ws, x, out, out_small):  # 64 weight bytes and 4 activation bytes a slice
        for i in range(out.shape[0] // 16):
            xv = b64_bcast4(x, i * 4)
            wv, wsv = b64_load(w, i * 64), b64_load(ws, i * 64)
            v16_store(out, i * 16, q16_to_f(q16_dpbusd(q16_dpbusd(q16_zero(), wv, xv), wv, xv)))
            v16_store(out_small, i * 16, q16_to_f(q16_dpbusd_small(q16_dpbusd_small(q16_zero(), wsv, xv), wsv, xv)))

    return dots


@pytest.mark.parametrize("path", ["native", "no-avx512-vnni", "avx2-no-vnni", "generic-ir"])
def test_integer_dots_exact_on_every_code_path(monkeypatch, path):
    """The slices' integer dots (four unsigned-times-signed byte products a lane) are exact
    on each way the instructions are chosen (the CPU's own; forced down here: no 512-bit
    ``vpdpbusd``, no VNNI at all, no AVX2), at the extremes: bytes up to 255 (Q8_0's
    ``q + 128``) and, for the small form, up to 31 (Q5); activations in [-127, 127]."""
    from refengine.cpu import q8_products

    if path != "native":
        monkeypatch.setattr(q8_products, "_has_avx512_vnni", lambda context: False)
    if path in ("avx2-no-vnni", "generic-ir"):
        monkeypatch.setattr(q8_products, "_has_vnni", lambda context: False)
    if path == "generic-ir":
        monkeypatch.setattr(q8_products, "_has_avx2", lambda context: False)
    rng = np.random.default_rng(4)
    n = 32
    w = rng.integers(0, 256, (n, 16, 4)).astype(np.uint8)
    ws = rng.integers(0, 32, (n, 16, 4)).astype(np.uint8)
    x = rng.integers(-127, 128, (n, 4)).astype(np.int8)
    w[0], ws[0], x[0] = 255, 31, -127  # the largest sums
    w[1], ws[1], x[1] = 255, 31, 127
    out, out_small = np.empty((n, 16), np.float32), np.empty((n, 16), np.float32)
    _slice_dots()(w.reshape(-1), ws.reshape(-1), x.reshape(-1), out.reshape(-1), out_small.reshape(-1))
    xi = x.astype(np.int64)[:, None, :]
    assert np.array_equal(out, (2 * (w.astype(np.int64) * xi).sum(-1)).astype(np.float32))
    assert np.array_equal(out_small, (2 * (ws.astype(np.int64) * xi).sum(-1)).astype(np.float32))


@pytest.mark.parametrize("n", [37, 48])
@pytest.mark.parametrize("name", Q8_TYPES)
def test_interleaved_copy_alone_gives_the_planes_back(name, n, monkeypatch):
    """A weight that keeps only its interleaved copy (``interleave(w, keep_row_major=False)``,
    written over its own buffers where the rows fill whole groups): its planes, row lookups,
    dequantization and pickle are those of the row-major weight, its products the same
    bits, and it holds one copy."""
    import pickle

    from refengine.cpu import gguf_products, q8_products

    rng = np.random.default_rng(31)
    k = 96
    raw = random_raw(name, n, k, rng)
    want = GGUFWeight.from_raw(name, raw, (n, k))
    w = GGUFWeight.from_raw(name, raw, (n, k))
    x = rng.standard_normal((3, k)).astype(np.float32)
    product = bits(q8_linear(x, want))  # not w's: its interleaving comes below
    row_major = want.nbytes
    qs = w.planes["qs"]
    gguf_products.linear(x, w)  # a float32 product's plan holds the row-major planes
    assert "_plans" in vars(w)
    monkeypatch.setattr(q8_products, "_CHUNK_BYTES", 1)  # one group at a time: several chunks in place
    q8_products.interleave(w, keep_row_major=False)
    assert "_plans" not in vars(w)  # that plan would read overwritten bytes
    assert w._planes is None and row_major <= w.nbytes <= row_major * 48 // n + 1  # 48 rows: three groups
    assert np.shares_memory(w._x16[0], qs) == (n % 16 == 0)
    for key, plane in want.planes.items():
        assert np.array_equal(w.planes[key], plane) and w.planes[key].dtype == plane.dtype, key
    rows = np.array([36, 0, 17, -1, 16])
    assert np.array_equal(bits(w.select_rows(rows)), bits(want.select_rows(rows)))
    assert np.array_equal(bits(w.dequantize(3, 20)), bits(want.dequantize(3, 20)))
    assert np.array_equal(bits(q8_linear(x, w)), product)
    copy = pickle.loads(pickle.dumps(w))
    assert "_x16" not in vars(copy) and all(np.array_equal(copy.planes[key], p) for key, p in want.planes.items())
    with pytest.raises(IndexError):
        w.select_rows(np.array([n]))
