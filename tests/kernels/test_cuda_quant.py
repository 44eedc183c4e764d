"""Weights kept quantized on the CUDA path: ``cuda/quant_matmul.cu`` (int8 and int4 GEMV /
tiled GEMM) on the CPU emulator, against the float64 product of the dequantized weights and
the NumPy twin :func:`refengine.quant.reference_linear`; ``CudaLayerOps.linear``; and whole
tiny quantized models (int8, AWQ, GPTQ with act-order) on the ``device="cuda"`` code path
against the CPU quantized path.

Tolerance (derived, not tuned): the kernels and the twin both multiply the exact
dequantized float32 weights ``w'`` (int4: ``float(q - z) * s`` with the one rounding of
the definition; int8: ``scale * sum(x * q)``, one extra rounding) by inputs that are exact
in float32 (float16/bfloat16 x upcast exactly), accumulating in float32 in some order. A
float32 sum of K products is within ``K * u * sum|x * w'|`` of the exact sum (u = 2^-24,
Higham, *Accuracy and Stability of Numerical Algorithms*, §3.1); the int8 scale and the
rounding of ``w'`` add ``2u``: :func:`bound` is ``(K + 2) * u * (|x| @ |w'|.T)``. The output
is float32 whatever the activation dtype, so there is no storage rounding to add.
"""

from __future__ import annotations

import numpy as np
import pytest
from tests.helpers import BF16

from refengine.kernels.build import EmulatedKernels, cuda_source_dir, emulated_launch
from refengine.kernels.plans import QUANT_GEMV_MAX_ROWS, quant_linear_launch
from refengine.ops.cuda import CudaLayerOps
from refengine.quant import StackedWeight, reference_linear
from refengine.quant.int4 import Int4Weight
from refengine.quant.int8 import Int8Weight

U = 2.0 ** -24  # float32 unit roundoff
DTYPES = [np.float32, np.float16, BF16]
DTYPE_IDS = ["f32", "f16", "bf16"]
# 1..33 rows: the GEMV (<= 8), its edge, the GEMM at one tile, one tile and a row
ROW_COUNTS = [1, 2, 7, QUANT_GEMV_MAX_ROWS, QUANT_GEMV_MAX_ROWS + 1, 32, 33]


@pytest.fixture(scope="module")
def kernels() -> EmulatedKernels:
    return EmulatedKernels()


def bound(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``(K + 2) u |x| @ |w'|.T``: the float32 accumulation bound of the module docstring."""
    x64 = np.abs(np.asarray(x, dtype=np.float64))
    return (x.shape[1] + 2) * U * (x64 @ np.abs(w.astype(np.float64)).T)


def exact(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The product of the upcast inputs and the dequantized weights, in float64."""
    return np.asarray(x, dtype=np.float64) @ w.astype(np.float64).T


def random_int8(rng, out_features, in_features) -> Int8Weight:
    return Int8Weight.quantize(rng.standard_normal((out_features, in_features)).astype(np.float32))


def random_int4(rng, out_features, in_features, group_size, act_order=False) -> Int4Weight:
    n_groups = -(-in_features // group_size)
    q = rng.integers(0, 16, (out_features, in_features))
    zeros = rng.integers(0, 17, (out_features, n_groups))  # 16: GPTQ v1's offset
    scales = rng.uniform(0.01, 0.1, (out_features, n_groups)).astype(np.float32)
    perm = rng.permutation(in_features) if act_order else None
    return Int4Weight.from_values(q, scales, zeros, group_size, perm)


def run_kernel(kernels, fmt, x, arrays, shape, group_size=0, schedule="reverse"):
    """One launch of the plan on the emulator; the output starts NaN (poisoned)."""
    out = kernels.empty((x.shape[0], shape[0]), np.float32)
    launch = quant_linear_launch(fmt, out, np.ascontiguousarray(x), arrays, shape[0], shape[1], group_size)
    emulated_launch(kernels.lib, launch, schedule)
    return out, launch.kernel


def check(got, x, w, name):
    """Every output written, and within :func:`bound` of the exact product."""
    assert np.isfinite(got).all(), f"{name}: an output left unwritten (NaN)"
    err = np.abs(got - exact(x, w))
    limit = bound(x, w)
    assert (err <= limit).all(), f"{name}: max excess {np.max(err - limit)}"


# --- the kernels --------------------------------------------------------------------------

# (out, in): rows of 16-byte vector loads, out not a multiple of the 4 channels per block
# nor of the 64 per tile; an odd K (byte-wise path, K not a multiple of the 32-column step)
INT8_SHAPES = [(37, 48), (70, 50), (5, 16)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", INT8_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_int8_kernels_match_exact_product_and_twin(kernels, shape, dtype):
    rng = np.random.default_rng(shape[0])
    w = random_int8(rng, *shape)
    w_deq = w.dequantize()
    for rows in ROW_COUNTS:
        x = rng.standard_normal((rows, shape[1])).astype(np.float32).astype(dtype)
        got, kernel = run_kernel(kernels, "int8", x, (w.q, w.scales), shape)
        assert kernel == f"int8_{'gemv' if rows <= QUANT_GEMV_MAX_ROWS else 'gemm'}_{DTYPE_IDS[DTYPES.index(dtype)]}"
        check(got, x, w_deq, f"{kernel} rows={rows}")
        twin = reference_linear(x, w)
        assert (np.abs(twin - exact(x, w_deq)) <= bound(x, w_deq)).all()


# (out, in, group_size): 32-column steps inside one group; steps straddling 16-column
# groups; a short last group (96 = 64 + 32); K not a multiple of the group (50 = 2 x 20 + 10)
# nor of 32 (the byte-wise path)
INT4_SHAPES = [(37, 64, 32), (37, 64, 16), (21, 96, 64), (10, 50, 20), (66, 128, 128)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", INT4_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}g{s[2]}")
def test_int4_kernels_match_exact_product_and_twin(kernels, shape, dtype):
    out_features, in_features, group_size = shape
    rng = np.random.default_rng(in_features + group_size)
    w = random_int4(rng, out_features, in_features, group_size)
    w_deq = w.dequantize()
    for rows in ROW_COUNTS:
        x = rng.standard_normal((rows, in_features)).astype(np.float32).astype(dtype)
        got, kernel = run_kernel(kernels, "int4", x, (w.packed, w.scales, w.zeros), w.shape, group_size)
        check(got, x, w_deq, f"{kernel} rows={rows}")
        twin = reference_linear(x, w)
        assert (np.abs(twin - exact(x, w_deq)) <= bound(x, w_deq)).all()


def test_unaligned_weights_take_the_bytewise_path(kernels):
    """Weights whose first byte is not 16-byte aligned (a view into a buffer) must not be
    read by uint4 loads: the kernels fall back to bytes and stay exact."""
    rng = np.random.default_rng(3)
    w8 = random_int8(rng, 9, 32)
    buf = np.empty(w8.q.size + 1, np.int8)
    q = buf[1:].reshape(w8.q.shape)
    q[...] = w8.q
    assert q.ctypes.data % 16 and q.flags.c_contiguous
    w4 = random_int4(rng, 9, 64, 32)
    buf4 = np.empty(w4.packed.size + 1, np.uint8)
    packed = buf4[1:].reshape(w4.packed.shape)
    packed[...] = w4.packed
    for rows in (3, 12):
        x = rng.standard_normal((rows, 32)).astype(np.float32)
        check(run_kernel(kernels, "int8", x, (q, w8.scales), w8.shape)[0], x, w8.dequantize(), "int8 unaligned")
        x = rng.standard_normal((rows, 64)).astype(np.float32)
        got = run_kernel(kernels, "int4", x, (packed, w4.scales, w4.zeros), w4.shape, 32)[0]
        check(got, x, w4.dequantize(), "int4 unaligned")


@pytest.mark.parametrize("schedule", ["forward", "shuffle"])
def test_gemm_under_other_thread_orders(kernels, schedule):
    """The tiled GEMM's barriers hold under every order the emulator runs threads in."""
    rng = np.random.default_rng(4)
    w = random_int4(rng, 70, 96, 32)
    x = rng.standard_normal((33, 96)).astype(np.float32)
    got = run_kernel(kernels, "int4", x, (w.packed, w.scales, w.zeros), w.shape, 32, schedule)[0]
    check(got, x, w.dequantize(), f"int4_gemm {schedule}")


def test_gemm_without_its_second_barrier_fails(tmp_path):
    """The emulator catches a missing barrier between the multiply and the next K step's
    restaging (the tile is overwritten while other threads still read it)."""
    text = (cuda_source_dir() / "quant_matmul.cu").read_text()
    old = "        __syncthreads();  // every thread is done with the tiles before the next step restages them\n"
    assert text.count(old) == 1
    broken = tmp_path / "quant_matmul.cu"
    broken.write_text(text.replace(old, ""))
    kern = EmulatedKernels(sources=[broken])
    rng = np.random.default_rng(5)
    w = random_int8(rng, 64, 96)  # three K steps
    x = rng.standard_normal((32, 96)).astype(np.float32)
    got = run_kernel(kern, "int8", x, (w.q, w.scales), w.shape)[0]
    assert not np.allclose(got, exact(x, w.dequantize()), rtol=1e-3, atol=1e-3)


# --- the layer operations -------------------------------------------------------------------

def test_layer_ops_linear_places_once_and_matches_the_twin():
    """CudaLayerOps.linear: int8, int4 with act-order (x gathered by perm), and a
    StackedWeight of act-order parts with different permutations next to a float part."""
    ops = CudaLayerOps(EmulatedKernels())
    rng = np.random.default_rng(6)
    w8 = random_int8(rng, 40, 64)
    w4 = random_int4(rng, 24, 64, 32, act_order=True)
    floats = rng.standard_normal((8, 64)).astype(np.float32)
    stacked = StackedWeight([random_int4(rng, 16, 64, 16, act_order=True), w4, floats])
    for rows in (1, 5, 20):
        x = rng.standard_normal((rows, 64)).astype(np.float32)
        for w in (w8, w4, stacked):
            got = ops.linear(x, w)
            w_deq = w.dequantize()
            assert got.shape == (rows, w.shape[0]) and got.dtype == np.float32
            assert (np.abs(got - exact(x, w_deq)) <= bound(x, w_deq)).all(), type(w).__name__
    assert set(ops._placed) == {id(w8), id(w4), id(stacked)}  # each placed once
    assert ops.linear(np.zeros((0, 64), np.float32), w8).shape == (0, 40)
    with pytest.raises(ValueError, match=r"a \[40, 64\] weight multiplies x \[T, 64\], got \(2, 63\)"):
        ops.linear(np.zeros((2, 63), np.float32), w8)


# --- whole models on the device="cuda" code path ------------------------------------------------

def _logit_tolerance(cfg) -> float:
    """Relative to the largest logit: each of the 4 products per layer and the lm_head is
    within 2 (K + 2) u of the CPU path's (kernel and twin each within (K + 2) u of exact),
    and the differences add along the chain (norms rescale, residuals add)."""
    k_max = max(cfg.hidden_size, cfg.intermediate_size)
    return (4 * cfg.num_hidden_layers + 1) * 2 * (k_max + 2) * U


def _gpu_llm(path, monkeypatch, **kw):
    import sys

    from tests.kernels.test_emulated_model import fake_cupy_for_the_model

    from refengine import LLM

    monkeypatch.setitem(sys.modules, "cupy", fake_cupy_for_the_model())
    return LLM(path, device="cuda", dtype="float32", block_size=8, num_kv_blocks=64, log_stats=False, **kw)


def _compare(cpu, gpu, ids):
    from refengine.quant import is_quantized

    model = gpu.llm_engine.model
    assert model.ops.name == "cuda" and is_quantized(model.layers[0].qkv)
    want, got = cpu.prompt_logits(ids), gpu.prompt_logits(ids)
    tol = _logit_tolerance(model.config) * np.abs(want).max()
    assert np.abs(got - want).max() <= tol
    assert len(model.ops._placed) >= 4 * model.config.num_hidden_layers  # the products ran as quant_matmul kernels
    return tol


def test_tiny_model_int8_on_cuda_matches_cpu(tiny_llama_dir, monkeypatch):
    from refengine import LLM, SamplingParams

    cpu = LLM(tiny_llama_dir, attention_backend="numpy", quantization="int8", block_size=8, log_stats=False)
    gpu = _gpu_llm(tiny_llama_dir, monkeypatch, quantization="int8", max_num_batched_tokens=24)
    assert gpu.llm_engine.config.quantization == "int8"
    _compare(cpu, gpu, list(range(3, 40)))  # 37 rows: the GEMM
    _compare(cpu, gpu, [5, 9, 17])  # the GEMV
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [list(range(3, 20)), [5, 9, 17]]
    want = [o.outputs[0].token_ids for o in cpu.generate(prompts, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in gpu.generate(prompts, params, use_tqdm=False)] == want


@pytest.mark.parametrize("case", ["awq-g32", "gptq-v2-g64-act"])
def test_tiny_awq_gptq_on_cuda_match_cpu(case, tmp_path, monkeypatch):
    from tests.quant.test_quant_awq_gptq import CASES, build_quantized

    from refengine import LLM

    build_quantized(tmp_path, *CASES[case])
    cpu = LLM(tmp_path, attention_backend="numpy", block_size=8, log_stats=False)
    gpu = _gpu_llm(tmp_path, monkeypatch)
    assert gpu.llm_engine.config.quantization == CASES[case][0]
    ids = np.random.default_rng(1).integers(3, 211, size=40).tolist()
    _compare(cpu, gpu, ids)
    _compare(cpu, gpu, ids[:5])


# --- benchmarks/gpu_check.py's checks, run here first (stand-in CuPy) --------------------------

def test_gpu_check_quant_sections_run(monkeypatch):
    """gpu_check.py's correctness check and benchmark of these kernels on the stand-in CuPy
    (small shapes; the emulator's timings mean nothing), so the GPU run is not their first."""
    import sys

    from tests.helpers import fake_cupy, load_gpu_check

    gpu_check = load_gpu_check()
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy())
    cp = sys.modules["cupy"]
    monkeypatch.setattr(gpu_check, "QUANT_SHAPES", ((9, 64, 32), (5, 50, 20)))
    results = gpu_check.check_quant_matmul(cp, np.random.default_rng(0))
    assert len(results) == 2 * 2 * 3 * len(gpu_check.QUANT_ROWS)
    assert all(ok for _, ok, _ in results), [r for r in results if not r[1]]
    bench = gpu_check.bench_quant_matmul(cp, float("inf"), shape=(8, 64), rows=(1, 9))
    assert [(r["format"], r["rows"]) for r in bench] == [("int8", 1), ("int8", 9), ("int4", 1), ("int4", 9)]
    assert all(r["gbps"] > 0 and r["tflops"] > 0 for r in bench)
