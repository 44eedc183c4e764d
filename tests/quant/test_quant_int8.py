"""``quantization="int8"``: per-output-channel symmetric int8 weights computed at load
(refengine/quant/int8.py), their numba kernels (refengine/cpu/int_products.py) against the
NumPy twin, and the engine with int8 weights against float32 (docs/quantization.md)."""

from __future__ import annotations

import re

import numpy as np
import pytest
from click.testing import CliRunner

from refengine import LLM, SamplingParams
from refengine.engine_args import EngineArgs
from refengine.ops.numpy_ops import NumpyOps
from refengine.quant import StackedWeight, concat_rows, is_quantized, reference_linear
from refengine.quant.awq_gptq import resolve_quantization
from refengine.quant.int8 import QMAX, Int8Weight, quantize_weights

ROWS = [1, 2, 3, 5, 8, 17, 64, 200]  # decode sizes, odd rows, both sides of the dot / tile switch
SHAPES = [(1, 7), (37, 53), (64, 33), (130, 576), (96, 1000)]  # [out, in]: odd, below and above 32 columns


def _matrix(rng, shape, zero_row=True):
    w = (rng.standard_normal(shape) * rng.uniform(0.01, 3.0, size=(shape[0], 1))).astype(np.float32)
    if zero_row and shape[0] > 2:
        w[1] = 0.0  # an all-zero row: scale 0
    return w


@pytest.mark.parametrize("shape", SHAPES)
def test_round_trip_error_is_at_most_half_a_step(shape):
    w = _matrix(np.random.default_rng(0), shape)
    q = Int8Weight.quantize(w)
    assert q.q.dtype == np.int8 and q.scales.dtype == np.float32 and q.shape == shape
    assert np.abs(q.q).max() <= QMAX
    np.testing.assert_array_equal(q.scales, (np.abs(w.astype(np.float64)).max(axis=1) / QMAX).astype(np.float32))
    err = np.abs(q.dequantize().astype(np.float64) - w)
    # half a grid step, plus the float32 rounding of the scale and of q * scale
    bound = q.scales[:, None].astype(np.float64) / 2 * (1 + 1e-6) + np.abs(w) * 2.0 ** -23
    assert (err <= bound).all(), float((err - bound).max())
    if shape[0] > 2:
        assert (q.q[1] == 0).all() and q.scales[1] == 0
    assert q.nbytes == w.size + 4 * shape[0]


def test_quantize_refuses_non_finite_and_non_matrices():
    w = np.ones((4, 8), np.float32)
    w[2, 3] = np.nan
    with pytest.raises(ValueError, match="layer.weight: cannot quantize to int8: the matrix holds NaN or inf"):
        Int8Weight.quantize(w, "layer.weight")
    w[2, 3] = np.inf
    with pytest.raises(ValueError, match="NaN or inf"):
        Int8Weight.quantize(w)
    with pytest.raises(ValueError, match="int8 quantizes matrices"):
        Int8Weight.quantize(np.ones(8, np.float32))
    with pytest.raises(ValueError, match="int8 weight values must be an int8"):
        Int8Weight(np.ones((2, 3), np.int16), np.ones(2, np.float32))


def test_rows_gather_take_and_concat():
    rng = np.random.default_rng(1)
    a, b = Int8Weight.quantize(_matrix(rng, (10, 40))), Int8Weight.quantize(_matrix(rng, (6, 40)))
    full = a.dequantize()
    rows = np.array([3, 0, 9, 3])
    np.testing.assert_array_equal(a.select_rows(rows), full[rows])  # the embedding lookup
    np.testing.assert_array_equal(a.take_rows(rows).dequantize(), full[rows])
    np.testing.assert_array_equal(a.dequantize(2, 7), full[2:7])
    both = concat_rows([a, b])
    assert isinstance(both, Int8Weight) and both.shape == (16, 40)
    np.testing.assert_array_equal(both.dequantize(), np.concatenate([full, b.dequantize()]))
    mixed = concat_rows([a, np.ones((3, 40), np.float32)])  # a float part: stacked, not requantized
    assert isinstance(mixed, StackedWeight) and mixed.shape == (13, 40)


def test_quantize_weights_transforms_matrices_only():
    rng = np.random.default_rng(2)
    weights = {"model.embed_tokens.weight": _matrix(rng, (50, 16)), "model.norm.weight": np.ones(16, np.float32),
               "model.layers.0.self_attn.q_proj.bias": np.ones(16, np.float32),
               "model.layers.0.mlp.down_proj.weight": _matrix(rng, (16, 24))}
    out = quantize_weights(weights)
    assert out is weights
    assert isinstance(weights["model.embed_tokens.weight"], Int8Weight)
    assert isinstance(weights["model.layers.0.mlp.down_proj.weight"], Int8Weight)
    assert weights["model.norm.weight"].dtype == np.float32 and not is_quantized(weights["model.norm.weight"])
    assert not is_quantized(weights["model.layers.0.self_attn.q_proj.bias"])


@pytest.mark.parametrize("shape", SHAPES)
def test_numba_kernel_matches_the_numpy_twin(shape):
    pytest.importorskip("numba")
    from refengine.cpu.layer_ops import NumbaOps

    rng = np.random.default_rng(3)
    w = Int8Weight.quantize(_matrix(rng, shape))
    deq = w.dequantize().astype(np.float64)
    for rows in ROWS:
        x = rng.standard_normal((rows, shape[1])).astype(np.float32)
        got = w.numba_linear(x)
        assert got.dtype == np.float32 and got.shape == (rows, shape[0])
        want = reference_linear(x, w)
        bound = 1e-5 * (np.abs(x).astype(np.float64) @ np.abs(deq).T) + 1e-30  # float32 sums, any order
        assert (np.abs(got - want) <= bound).all(), (rows, float((np.abs(got - want) / bound).max()))
        np.testing.assert_array_equal(NumbaOps().linear(x, w), got)  # the layer op dispatches to it
        np.testing.assert_array_equal(NumpyOps().linear(x, w), want)


@pytest.mark.parametrize("n_out", [70, 71])
def test_dot_kernel_results_do_not_depend_on_the_batch(n_out):
    """Below the tile switch every row is summed in one fixed order: a row alone, in a pair,
    as the odd last row or in a 4 x 2 tile (from INT8_TILE_MIN_ROWS rows; an odd weight-row count
    pairs the last row with itself) gives the same bits, over several blocks of input rows
    with a partial last one; batch-invariant, so do rows past the tile switch."""
    pytest.importorskip("numba")
    from refengine.cpu.int_products import INT8_BLAS_MIN_ROWS, INT8_TILE_MIN_ROWS

    rng = np.random.default_rng(4)
    w = Int8Weight.quantize(_matrix(rng, (n_out, 200)))
    x = rng.standard_normal((INT8_BLAS_MIN_ROWS + 8, 200)).astype(np.float32)
    batch = w.numba_linear(x[:INT8_BLAS_MIN_ROWS - 1])
    for t in (0, 1, 2, INT8_BLAS_MIN_ROWS - 2):
        np.testing.assert_array_equal(w.numba_linear(x[t:t + 1]), batch[t:t + 1])
    for rows in (2, 3, 5, INT8_TILE_MIN_ROWS - 1, INT8_TILE_MIN_ROWS, INT8_TILE_MIN_ROWS + 1, INT8_TILE_MIN_ROWS + 3):
        np.testing.assert_array_equal(w.numba_linear(x[:rows]), batch[:rows])
    invariant = w.numba_linear(x, batch_invariant=True)
    np.testing.assert_array_equal(invariant[:INT8_BLAS_MIN_ROWS - 1], batch)
    for t in (150, INT8_BLAS_MIN_ROWS + 7):
        np.testing.assert_array_equal(w.numba_linear(x[t:t + 1]), invariant[t:t + 1])


def test_empty_batch():
    pytest.importorskip("numba")
    w = Int8Weight.quantize(np.ones((5, 8), np.float32))
    assert w.numba_linear(np.zeros((0, 8), np.float32)).shape == (0, 5)


# --- the engine ----------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_tiny_model_int8_close_to_float(tiny_llama_dir, backend):
    if backend == "numba":
        pytest.importorskip("numba")
    ids = list(range(3, 40))
    ref = LLM(tiny_llama_dir, attention_backend=backend, log_stats=False)
    llm = LLM(tiny_llama_dir, attention_backend=backend, quantization="int8", log_stats=False)
    model = llm.llm_engine.model
    assert llm.llm_engine.config.quantization == "int8"
    assert isinstance(model.embed, Int8Weight) and model.lm_head is model.embed  # tied: the same quantized rows
    assert all(isinstance(getattr(model.layers[0], n), Int8Weight) for n in ("qkv", "o", "gate_up", "down"))
    assert model.layers[0].input_norm.dtype == np.float32
    want, got = ref.prompt_logits(ids), llm.prompt_logits(ids)
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max()  # int8 rounding, not a bug
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9


def test_tiny_model_int8_numba_equals_numpy_twin(tiny_llama_dir):
    pytest.importorskip("numba")
    ids = list(range(3, 40))
    a = LLM(tiny_llama_dir, attention_backend="numpy", quantization="int8", log_stats=False).prompt_logits(ids)
    b = LLM(tiny_llama_dir, attention_backend="numba", quantization="int8", log_stats=False).prompt_logits(ids)
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4 * np.abs(a).max())


PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def test_smollm2_int8_greedy_close_to_float32(smollm2_dir):
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    ref = [o.outputs[0] for o in LLM(smollm2_dir, log_stats=False).generate(PROMPTS, sp, use_tqdm=False)]
    llm = LLM(smollm2_dir, quantization="int8", log_stats=False)
    out = [o.outputs[0] for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
    model = llm.llm_engine.model
    assert isinstance(model.embed, Int8Weight) and model.embed.shape == (49152, 576)
    for r, o in zip(ref, out):
        assert o.token_ids[:8] == r.token_ids[:8], (r.text, o.text)  # the first tokens equal
        same = next((i for i, (a, b) in enumerate(zip(r.token_ids, o.token_ids)) if a != b), len(r.token_ids))
        assert same >= 8, (same, r.text, o.text)


# --- bad values ----------------------------------------------------------------------------

def test_bad_quantization_values(tiny_llama_dir, tmp_path):
    with pytest.raises(ValueError, match="quantization='fp8' is not one of 'int8', 'awq', 'gptq'"):
        EngineArgs(quantization="fp8")
    with pytest.raises(ValueError, match="quantization=8 is invalid"):
        EngineArgs(quantization=8)
    for method in ("awq", "gptq"):
        with pytest.raises(ValueError, match=f"quantization='{method}' but the checkpoint in .* is not "
                                             f"{method}-quantized .*quantization='int8' quantizes"):
            LLM(tiny_llama_dir, quantization=method, log_stats=False)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    for method in ("awq", "gptq"):  # a GGUF file's blocks are not an AWQ/GPTQ checkpoint
        with pytest.raises(ValueError, match=f"quantization='{method}' does not apply to the GGUF file"):
            resolve_quantization(method, gguf)
    assert resolve_quantization("int8", gguf) == "int8"  # requantized from its blocks at load
    assert resolve_quantization(None, gguf) is None
    assert resolve_quantization(None, tiny_llama_dir) is None
    assert resolve_quantization("int8", tiny_llama_dir) == "int8"


def test_quantization_is_accepted_on_cuda(tiny_llama_dir, monkeypatch):
    """int8 runs on device="cuda" through cuda/quant_matmul.cu (tests/kernels/test_cuda_quant.py)."""
    import refengine.engine_args as ea

    monkeypatch.setattr(ea, "resolve_device", lambda device: "cuda")
    args = EngineArgs(model=str(tiny_llama_dir), device="cuda", quantization="int8", num_kv_blocks=8)
    assert args.create_engine_config(*args.model_config()).quantization == "int8"


def test_cli_flag(tiny_llama_dir):
    from refengine.cli import main

    res = CliRunner().invoke(main, ["generate", "hi", "--model", str(tiny_llama_dir), "--quantization", "awq"])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert re.search(r"quantization='awq' but the checkpoint", res.output), res.output
    res = CliRunner().invoke(main, ["generate", "hi", "--model", str(tiny_llama_dir), "--quantization", "nf4"])
    assert res.exit_code == 2 and "nf4" in res.output


# --- quantized as loaded, and from a GGUF file ------------------------------------------------

def test_from_rows_is_quantize_asked_a_slab_at_a_time(monkeypatch):
    import refengine.quant.int8 as int8

    monkeypatch.setattr(int8, "_CHUNK_ROWS", 16)
    w = _matrix(np.random.default_rng(3), (37, 53))
    asked = []

    def rows(start, stop):
        asked.append((start, stop))
        return w[start:stop]

    got, want = Int8Weight.from_rows(rows, w.shape, "x"), Int8Weight.quantize(w)
    assert asked == [(0, 16), (16, 32), (32, 37)]  # never the whole matrix at once
    np.testing.assert_array_equal(got.q, want.q)
    np.testing.assert_array_equal(got.scales, want.scales)
    with pytest.raises(ValueError, match=r"x: rows 0:16 came as shape \(16, 52\), not \(16, 53\)"):
        Int8Weight.from_rows(lambda a, b: w[a:b, :52], w.shape, "x")


def test_load_weights_quantizes_each_tensor_as_read(tmp_path):
    """``load_weights(quantization="int8")`` gives what quantizing the float32 load gives,
    from a bfloat16 checkpoint too (the float64 quantization of a bfloat16 value is that of
    its exact float32 cast); vectors stay float32."""
    import ml_dtypes
    from safetensors.numpy import save_file

    from refengine.formats.loader import load_weights

    rng = np.random.default_rng(5)
    w = rng.standard_normal((6, 40)).astype(ml_dtypes.bfloat16)
    norm = rng.standard_normal(40).astype(ml_dtypes.bfloat16)
    save_file({"a.weight": w, "n.weight": norm}, str(tmp_path / "model.safetensors"))
    want = {"a.weight": (6, 40), "n.weight": (40,)}
    got = load_weights(tmp_path, want, tied_embeddings=False, quantization="int8")
    ref = Int8Weight.quantize(w.astype(np.float32))
    assert isinstance(got["a.weight"], Int8Weight)
    np.testing.assert_array_equal(got["a.weight"].q, ref.q)
    np.testing.assert_array_equal(got["a.weight"].scales, ref.scales)
    assert got["n.weight"].dtype == np.float32
    np.testing.assert_array_equal(got["n.weight"], norm.astype(np.float32))
    with pytest.raises(ValueError, match="quantization='int4' is not None or 'int8'"):
        load_weights(tmp_path, want, tied_embeddings=False, quantization="int4")
    bad = np.ones((6, 40), np.float32)
    bad[2, 2] = np.inf
    save_file({"a.weight": bad, "n.weight": norm.astype(np.float32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="a.weight: cannot quantize to int8: the matrix holds NaN or inf"):
        load_weights(tmp_path, want, tied_embeddings=False, quantization="int8")


def test_int8_of_the_gguf_is_int8_of_its_float32_directory(gguf_path, smollm2_dir):
    """``quantization="int8"`` of the GGUF file dequantizes each tensor from its blocks and
    quantizes it per channel. weights/SmolLM2-135M-Instruct is that file's float32
    dequantization (``convert-gguf``; tests/formats/test_convert.py), so the int8 weights must be
    bit for bit those of the directory's int8 load. Given equal weights, the logits differ
    at most by the float32 summation order of the BLAS row blocks, which follow the thread
    count each step picks (adapted to the machine's load): hence 1e-4 of the largest
    logit, a hundred times below the int8 rounding error the test above allows (0.05)."""
    pytest.importorskip("numba")
    a = LLM(gguf_path, quantization="int8", log_stats=False)
    b = LLM(smollm2_dir, quantization="int8", log_stats=False)
    ma, mb = a.llm_engine.model, b.llm_engine.model
    assert a.llm_engine.config.quantization == "int8"
    pairs = [(ma.embed, mb.embed)] + [(getattr(la, n), getattr(lb, n)) for la, lb in zip(ma.layers, mb.layers)
                                      for n in ("qkv", "o", "gate_up", "down")]
    for wa, wb in pairs:
        assert isinstance(wa, Int8Weight) and isinstance(wb, Int8Weight)
        np.testing.assert_array_equal(wa.q, wb.q)
        np.testing.assert_array_equal(wa.scales, wb.scales)
    np.testing.assert_array_equal(ma.norm, mb.norm)
    ids = a.get_tokenizer().encode("The history of the printing press begins in the fifteenth century.")
    want, got = b.prompt_logits(ids), a.prompt_logits(ids)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_tile_path_rows_do_not_depend_on_the_batch(threads, monkeypatch):
    """On the tile path each thread multiplies all of ``x`` by its own tiles:
    whatever the thread count and the rows beside it, a row's result is the exact product's
    up to float32 rounding (not bit for bit: OpenBLAS's summation changes with the number
    of rows, one thread too, as before this path; the dot kernels below the switch are the
    batch-independent ones, test_dot_kernel_results_do_not_depend_on_the_batch)."""
    pytest.importorskip("numba")
    from refengine.cpu import int_products
    from refengine.cpu import blas

    rng = np.random.default_rng(7)
    w = Int8Weight.quantize(_matrix(rng, (960, 576)))
    x = rng.standard_normal((200, 576)).astype(np.float32)
    monkeypatch.setattr(blas, "_threads", threads)
    assert blas.balanced_tile_rows(960, 576, 2, int_products.TILE_BYTES) == 480  # two equal tiles, one per thread
    switch = 64  # the tile path from 64 rows here (INT8_BLAS_MIN_ROWS is larger: 200 rows would not reach it)
    full = int_products.int8_linear(x, w.q, w.scales, switch)
    part = int_products.int8_linear(x[:switch + 3], w.q, w.scales, switch)
    want = x.astype(np.float64) @ w.dequantize().astype(np.float64).T
    np.testing.assert_allclose(part, want[:switch + 3], rtol=0, atol=1e-5 * np.abs(want).max())
    np.testing.assert_allclose(full, want, rtol=0, atol=1e-5 * np.abs(want).max())
