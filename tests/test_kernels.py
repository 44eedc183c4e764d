"""The CUDA kernels (cuda/*.cu), run on the CPU emulator, against two references.

* the NumPy twin (:class:`refengine.attention.numpy_ref.NumpyAttention`), and
* a dense reference written here: per sequence, build K/V from the *logical* token
  order (not through the cache), causal mask by position, softmax in float64.

Inputs are fresh random numbers; physical blocks are shuffled (non-contiguous block
tables); every cache slot that no sequence owns, and one guard block on each side of
the cache, hold NaN, so a kernel that reads a wrong slot produces NaN; the kernel's
output is NaN before the launch, so a row it forgets to write stays NaN.

Tolerances: see ``helpers.py``.

Every test is deterministic (fixed seeds).
"""

from __future__ import annotations

import ctypes

import ml_dtypes
import numpy as np
import pytest
from helpers import (BF16, BLOCK_SIZE, TOLERANCE, decode_batch, dense_reference, fake_cupy, heads_for,
                     load_gpu_check, make_case, mixed_batch, run_and_check)

from refengine.attention import AttentionMetadata, paged_metadata
from refengine.attention.cuda import CudaAttention, EmulatedCudaAttention
from refengine.kernels.build import (SELF_TEST_SOURCES, EmulatedKernels, build_emulation_library, cuda_source_dir,
                                     emulated_launch)
from refengine.kernels.plans import Launch
from refengine.layers import RotaryEmbedding
from refengine.ops import get_layer_ops
from refengine.ops.cuda import CudaLayerOps


@pytest.fixture(scope="module")
def backend() -> EmulatedCudaAttention:
    return EmulatedCudaAttention()


@pytest.fixture(scope="module")
def layer_ops() -> CudaLayerOps:
    """The layer kernels on the emulator (the same launcher kind the attention backend uses)."""
    return CudaLayerOps(EmulatedKernels())


def self_test_library():
    """The layout self-tests (cuda/mma_check.cu), built apart from the production module."""
    return build_emulation_library([cuda_source_dir() / name for name in SELF_TEST_SOURCES])


# --------------------------------------------------------------------------------------
# reshape_and_cache
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16], ids=["f32", "f16", "bf16"])
def test_reshape_and_cache(backend, dtype):
    rng = np.random.default_rng(1)
    num_blocks, block_size, kv_heads, head_dim = 7, 16, 3, 64
    k_cache = np.full((num_blocks, block_size, kv_heads, head_dim), np.nan, np.float32).astype(dtype)
    v_cache = k_cache.copy()
    slots = rng.permutation(num_blocks * block_size)[:40].astype(np.int32)
    slots[[3, 17]] = -1  # padding tokens are skipped
    k = rng.standard_normal((40, kv_heads, head_dim)).astype(np.float32).astype(dtype)
    v = rng.standard_normal((40, kv_heads, head_dim)).astype(np.float32).astype(dtype)
    meta = AttentionMetadata(np.array([0, 40], np.int32), np.array([40], np.int32), np.zeros((1, 1), np.int32),
                             slots, 40, 40)
    expected_k, expected_v = k_cache.copy(), v_cache.copy()
    keep = slots >= 0
    expected_k.reshape(-1, kv_heads, head_dim)[slots[keep]] = k[keep]
    expected_v.reshape(-1, kv_heads, head_dim)[slots[keep]] = v[keep]
    backend.write_kv(k_cache, v_cache, k, v, meta)
    # Bit-exact: a copy. (NaN == NaN for the untouched slots via the byte view.)
    assert k_cache.view(np.uint8).tobytes() == expected_k.view(np.uint8).tobytes()
    assert v_cache.view(np.uint8).tobytes() == expected_v.view(np.uint8).tobytes()


# --------------------------------------------------------------------------------------
# flash prefill (any batch with a q_len > 1)
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 7, 8])
def test_flash_prefill_float32(backend, head_dim, group):
    rng = np.random.default_rng(100 * group + head_dim)
    num_heads, num_kv_heads = heads_for(group)
    case = make_case(rng, mixed_batch(), num_heads, num_kv_heads, head_dim, BLOCK_SIZE, np.float32)
    run_and_check(backend, case)


@pytest.mark.parametrize("kernel", ["mma", "simt"])
@pytest.mark.parametrize("dtype", [np.float16, BF16], ids=["f16", "bf16"])
@pytest.mark.parametrize("head_dim,group", [(64, 3), (128, 8), (32, 7)])
def test_flash_prefill_half_storage(dtype, head_dim, group, kernel):
    """16-bit storage through the tensor-core kernel (flash_prefill_mma.cu, the default for
    f16/bf16) and through the SIMT kernel."""
    rng = np.random.default_rng(7 * group + head_dim)
    num_heads, num_kv_heads = heads_for(group)
    case = make_case(rng, mixed_batch(), num_heads, num_kv_heads, head_dim, BLOCK_SIZE, dtype)
    run_and_check(EmulatedCudaAttention(prefill_kernel=kernel), case)


@pytest.mark.parametrize("seq_len", [63, 64, 65, 200])
def test_flash_prefill_mma_tile_edges(seq_len):
    """Whole prompts around the tensor-core kernel's 64-row / 64-key tiles."""
    rng = np.random.default_rng(seq_len)
    case = make_case(rng, [(seq_len, seq_len), (seq_len + 3, 2)], 4, 2, 64, BLOCK_SIZE, np.float16)
    run_and_check(EmulatedCudaAttention(prefill_kernel="mma"), case)


@pytest.mark.parametrize("seq_len", [2, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 31, 32, 33, 300])
def test_flash_prefill_whole_prompt(backend, seq_len):
    """A single full prompt (no cached context), lengths at block and tile edges."""
    rng = np.random.default_rng(seq_len)
    case = make_case(rng, [(seq_len, seq_len)], 2, 1, 64, BLOCK_SIZE, np.float32)
    run_and_check(backend, case)


def test_flash_prefill_head_dim_32_and_odd_block_size(backend):
    rng = np.random.default_rng(5)
    case = make_case(rng, [(45, 45), (70, 9), (13, 1)], 6, 2, 32, 5, np.float32)
    run_and_check(backend, case)


# --------------------------------------------------------------------------------------
# paged decode (every sequence q_len == 1)
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("partition_size", [64, 512])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 7, 8])
def test_paged_decode_float32(head_dim, group, partition_size):
    rng = np.random.default_rng(group * 1000 + head_dim + partition_size)
    num_heads, num_kv_heads = heads_for(group)
    case = make_case(rng, decode_batch(), num_heads, num_kv_heads, head_dim, BLOCK_SIZE, np.float32)
    backend = EmulatedCudaAttention(decode_partition_size=partition_size)
    run_and_check(backend, case)


@pytest.mark.parametrize("dtype", [np.float16, BF16], ids=["f16", "bf16"])
@pytest.mark.parametrize("head_dim,group", [(64, 3), (128, 8)])
def test_paged_decode_half_storage(dtype, head_dim, group):
    rng = np.random.default_rng(3 * group + head_dim)
    num_heads, num_kv_heads = heads_for(group)
    case = make_case(rng, decode_batch(), num_heads, num_kv_heads, head_dim, BLOCK_SIZE, dtype)
    run_and_check(EmulatedCudaAttention(decode_partition_size=64), case)


def test_paged_decode_group_larger_than_one_block():
    """group = 16 > kGroupTile (8): the group is split over two blocks per KV head."""
    rng = np.random.default_rng(16)
    case = make_case(rng, [(50, 1), (9, 1)], 32, 2, 64, BLOCK_SIZE, np.float32)
    run_and_check(EmulatedCudaAttention(decode_partition_size=32), case)


# --------------------------------------------------------------------------------------
# Emulator schedules and the emulator itself
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule,seed", [("forward", 0), ("shuffle", 1), ("shuffle", 2)])
def test_kernels_under_other_schedules(schedule, seed):
    """Correct kernels give the same answer whatever order the threads run in."""
    rng = np.random.default_rng(seed)
    backend = EmulatedCudaAttention(decode_partition_size=32, schedule=schedule, seed=seed)
    run_and_check(backend, make_case(rng, mixed_batch()[:5], 6, 2, 64, BLOCK_SIZE, np.float32))
    run_and_check(backend, make_case(rng, mixed_batch()[:5], 6, 2, 64, BLOCK_SIZE, np.float16))  # mma kernel
    run_and_check(backend, make_case(rng, decode_batch(), 6, 2, 64, BLOCK_SIZE, np.float32))


def test_half_and_bfloat16_rounding_matches_numpy():
    """The emulator's __float2half_rn / __float2bfloat16_rn round like NumPy / ml_dtypes
    (round to nearest even, subnormals, overflow to inf, NaN)."""
    lib = build_emulation_library()
    rng = np.random.default_rng(0)
    special = np.array([0.0, -0.0, 1.0, 65504.0, 65519.0, 65520.0, 1e6, -1e6, 6.1e-5, 6e-8, 3e-8, 2.98e-8,
                        1e-10, np.inf, -np.inf, np.nan, 1.0009765625, 1.00048828125, 1.0014648438], np.float32)
    bits = rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.concatenate([special, rng.standard_normal(20000).astype(np.float32) * 100, bits])
    out = np.empty(x.size, np.uint16)
    ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731

    lib.refengine_emu_f32_to_f16(ptr(x), ptr(out), ctypes.c_size_t(x.size))
    with np.errstate(over="ignore"):
        expected = x.astype(np.float16)
    same = (out == expected.view(np.uint16)) | (np.isnan(x) & np.isnan(out.view(np.float16)))
    assert same.all(), x[~same][:5]
    back = np.empty(x.size, np.float32)
    lib.refengine_emu_f16_to_f32(ptr(out), ptr(back), ctypes.c_size_t(x.size))
    np.testing.assert_array_equal(back, out.view(np.float16).astype(np.float32))

    lib.refengine_emu_f32_to_bf16(ptr(x), ptr(out), ctypes.c_size_t(x.size))
    with np.errstate(invalid="ignore"):
        expected = x.astype(ml_dtypes.bfloat16)
    same = (out == expected.view(np.uint16)) | (np.isnan(x) & np.isnan(out.view(ml_dtypes.bfloat16).astype(np.float32)))
    assert same.all(), x[~same][:5]
    lib.refengine_emu_bf16_to_f32(ptr(out), ptr(back), ctypes.c_size_t(x.size))
    np.testing.assert_array_equal(back, out.view(ml_dtypes.bfloat16).astype(np.float32))


def test_bad_inputs_raise(backend):
    rng = np.random.default_rng(0)
    case = make_case(rng, [(20, 20)], 2, 1, 64, BLOCK_SIZE, np.float32)
    with pytest.raises(ValueError, match="head_dim"):
        q = np.zeros((20, 2, 48), np.float32)
        cache = np.zeros((4, 16, 1, 48), np.float32)
        backend.forward(q, cache, cache.copy(), case.meta, 0.1)
    with pytest.raises(TypeError, match="dtype"):
        backend.forward(case.q.astype(np.float16), case.k_cache, case.v_cache, case.meta, 0.1)
    with pytest.raises(ValueError, match="multiple"):
        backend.forward(np.zeros((20, 3, 64), np.float32), np.zeros((4, 16, 2, 64), np.float32),
                        np.zeros((4, 16, 2, 64), np.float32), case.meta, 0.1)
    with pytest.raises(TypeError, match="mma"):
        EmulatedCudaAttention(prefill_kernel="mma").forward(case.q, case.k_cache, case.v_cache, case.meta, 0.1)
    with pytest.raises(ValueError, match="prefill_kernel"):
        EmulatedCudaAttention(prefill_kernel="wmma")
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        backend.forward(case.q.astype(np.float64), case.k_cache.astype(np.float64),
                        case.v_cache.astype(np.float64), case.meta, 0.1)


# --------------------------------------------------------------------------------------
# Layer kernels (layers.cu)
# --------------------------------------------------------------------------------------

LAYER_DTYPES = pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16], ids=["f32", "f16", "bf16"])


@LAYER_DTYPES
@pytest.mark.parametrize("hidden", [64, 576, 1000])
def test_rms_norm(layer_ops, dtype, hidden):
    rng = np.random.default_rng(hidden)
    x = (rng.standard_normal((5, hidden)) * 3).astype(np.float32).astype(dtype)
    weight = rng.standard_normal(hidden).astype(np.float32).astype(dtype)
    xd = x.astype(np.float64)
    expected = xd / np.sqrt((xd ** 2).mean(axis=1, keepdims=True) + 1e-5) * weight.astype(np.float64)
    got = layer_ops.rms_norm(x, weight, 1e-5)
    assert got.dtype == x.dtype
    tol = TOLERANCE[np.dtype(dtype)]
    np.testing.assert_allclose(got.astype(np.float64), expected, rtol=tol, atol=tol)


@LAYER_DTYPES
def test_silu_and_mul(layer_ops, dtype):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((7, 2 * 300)) * 4).astype(np.float32).astype(dtype)
    xd = x.astype(np.float64)
    gate, up = xd[:, :300], xd[:, 300:]
    expected = gate / (1 + np.exp(-gate)) * up
    tol = TOLERANCE[np.dtype(dtype)]
    np.testing.assert_allclose(layer_ops.silu_and_mul(x).astype(np.float64), expected, rtol=tol, atol=tol)


@LAYER_DTYPES
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (128, 128), (64, 32)])
def test_rotary_embedding(layer_ops, dtype, head_dim, rotary_dim):
    rng = np.random.default_rng(head_dim + rotary_dim)
    num_tokens, num_heads, num_kv_heads, max_pos = 9, 6, 2, 4096
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, rotary_dim, 2) / rotary_dim))
    angles = np.arange(max_pos)[:, None] * inv_freq[None, :]
    cos_sin = np.concatenate([np.cos(angles), np.sin(angles)], axis=1).astype(np.float32)
    positions = rng.integers(0, max_pos, num_tokens).astype(np.int32)
    q = rng.standard_normal((num_tokens, num_heads, head_dim)).astype(np.float32).astype(dtype)
    k = rng.standard_normal((num_tokens, num_kv_heads, head_dim)).astype(np.float32).astype(dtype)

    def reference(x):  # HF apply_rotary_pos_emb: x * cos + rotate_half(x) * sin
        x = x.astype(np.float64).copy()
        half = rotary_dim // 2
        c = cos_sin[positions, :half].astype(np.float64)[:, None, :]
        s = cos_sin[positions, half:].astype(np.float64)[:, None, :]
        x1, x2 = x[..., :half].copy(), x[..., half:rotary_dim].copy()
        x[..., :half] = x1 * c - x2 * s
        x[..., half:rotary_dim] = x2 * c + x1 * s
        return x

    expected_q, expected_k = reference(q), reference(k)
    layer_ops.rotary_embedding(positions, q, k, cos_sin, rotary_dim)
    tol = TOLERANCE[np.dtype(dtype)]
    np.testing.assert_allclose(q.astype(np.float64), expected_q, rtol=tol, atol=tol)
    np.testing.assert_allclose(k.astype(np.float64), expected_k, rtol=tol, atol=tol)


def test_misaligned_cache_is_rejected(backend):
    rng = np.random.default_rng(0)
    case = make_case(rng, [(20, 20)], 2, 1, 64, BLOCK_SIZE, np.float32)
    raw = np.zeros(case.k_cache.nbytes + 4, np.uint8)
    shifted = np.frombuffer(raw.data, dtype=np.float32, offset=4).reshape(case.k_cache.shape)
    with pytest.raises(ValueError, match="aligned"):
        backend.forward(case.q, shifted, case.v_cache, case.meta, case.scale)


# --------------------------------------------------------------------------------------
# The CuPy backend's code path, on a stand-in CuPy that runs the emulator
# --------------------------------------------------------------------------------------

def test_cuda_backend_code_path(monkeypatch):
    """CudaAttention (the CuPy backend) end to end on the stand-in CuPy."""
    import sys

    cp = fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cp)
    rng = np.random.default_rng(11)
    for dtype, partition in ((np.float16, 64), (np.float32, 512)):
        case = make_case(rng, mixed_batch(), 6, 2, 64, BLOCK_SIZE, dtype)
        backend = CudaAttention(decode_partition_size=partition)
        k_cache, v_cache = cp.asarray(case.k_cache), cp.asarray(case.v_cache)
        backend.write_kv(k_cache, v_cache, cp.asarray(case.k_new), cp.asarray(case.v_new), case.meta)
        out = cp.asnumpy(backend.forward(cp.asarray(case.q), k_cache, v_cache, case.meta, case.scale))
        tol = TOLERANCE[np.dtype(dtype)]
        np.testing.assert_allclose(out.astype(np.float64), dense_reference(case), rtol=tol, atol=tol)
        decode = make_case(rng, decode_batch(), 6, 2, 64, BLOCK_SIZE, dtype)
        k_cache, v_cache = cp.asarray(decode.k_cache), cp.asarray(decode.v_cache)
        backend.write_kv(k_cache, v_cache, cp.asarray(decode.k_new), cp.asarray(decode.v_new), decode.meta)
        out = cp.asnumpy(backend.forward(cp.asarray(decode.q), k_cache, v_cache, decode.meta, decode.scale))
        np.testing.assert_allclose(out.astype(np.float64), dense_reference(decode), rtol=tol, atol=tol)


def test_gpu_check_script_runs(monkeypatch, capsys):
    """benchmarks/gpu_check.py's correctness section on the stand-in CuPy (small batches),
    and its exit status 2 without CuPy."""
    import sys

    gpu_check = load_gpu_check()

    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    assert gpu_check.main([]) == 2
    assert "CuPy with a CUDA device is required" in capsys.readouterr().out

    monkeypatch.setitem(sys.modules, "cupy", fake_cupy())
    monkeypatch.setattr(gpu_check, "CORRECTNESS_BATCHES",
                        {"decode": [(1, 1), (100, 1)], "prefill": [(40, 40)], "mixed": [(70, 9), (17, 17)]})
    assert gpu_check.main(["--quick", "--skip-bench"]) == 0
    assert "FAIL" not in capsys.readouterr().out


@pytest.mark.parametrize("dtype", [np.float16, BF16], ids=["f16", "bf16"])
def test_mma_fragment_layout(dtype):
    """mma_check.cu builds fragments from the PTX layout formulas written out on their own;
    the emulated instruction (mma.cuh) must then compute exactly A·B."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((16, 16)).astype(np.float32).astype(dtype)
    b = rng.standard_normal((16, 8)).astype(np.float32).astype(dtype)
    d = np.full((16, 8), np.nan, np.float32)
    tag = "f16" if np.dtype(dtype) == np.float16 else "bf16"
    emulated_launch(self_test_library(), Launch(f"mma_check_{tag}", (1, 1, 1), (32, 1, 1), 0, (a, b, d)))
    expected = a.astype(np.float64) @ b.astype(np.float64)  # products of 16-bit values are exact in float32
    np.testing.assert_allclose(d, expected, rtol=1e-5, atol=1e-5)  # float32 sums of 16 terms


def test_ldmatrix_fragment_layout_and_cp_async_zero_fill():
    """The emulated ldmatrix / ldmatrix.trans (mma.cuh) against the PTX layout as
    gpu_check.ldmatrix_expected writes it out; ``make gpu-check`` runs the same kernel on the
    GPU against the same expectation, which ties the emulation to the hardware."""
    m = np.random.default_rng(0).standard_normal((4, 8, 8)).astype(np.float16)
    out = np.full(32 * 4 * 3, 0xDEADBEEF, np.uint32)
    emulated_launch(self_test_library(), Launch("ldmatrix_check_f16", (1, 1, 1), (32, 1, 1), 32 * 24 * 2, (m, out)))
    np.testing.assert_array_equal(out, load_gpu_check().ldmatrix_expected(m))


def test_gpu_check_benchmarks_run(monkeypatch):
    """The benchmark sections of gpu_check.py (tiny shapes, stand-in CuPy): the GPU run
    must not be the first to execute them. Timings on the emulator mean nothing."""
    import sys

    gpu_check = load_gpu_check()
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy())
    cp = sys.modules["cupy"]
    prefill = gpu_check.bench_prefill(cp, True, float("inf"), head_dims=(64,), seqs=(64,), tokens_per_batch=64)
    assert [(r["head_dim"], r["seq"], r["batch"]) for r in prefill] == [(64, 64, 1)]
    assert prefill[0]["mma_tflops"] > 0 and prefill[0]["simt_tflops"] > 0
    decode = gpu_check.bench_decode(cp, True, float("inf"), batches=(2,), contexts=(64,))
    assert [(r["batch"], r["ctx"]) for r in decode] == [(2, 64)]
    assert decode[0]["best_partition"] in (128, 256, 512, 1024) and decode[0]["best_gbps"] > 0


# --------------------------------------------------------------------------------------
# Metadata: built from lengths, placed on the device once per step; one module per device
# --------------------------------------------------------------------------------------

def test_paged_metadata_matches_the_contract():
    """The new tokens are the last q_len positions of each sequence, placed through its block table."""
    block_tables = np.array([[4, 0, 6], [2, 5, -1], [3, -1, -1]], np.int32)
    meta = paged_metadata(np.array([3, 1, 5]), np.array([19, 9, 5]), block_tables, block_size=8)
    np.testing.assert_array_equal(meta.query_start_loc, [0, 3, 4, 9])
    # positions 16-18 in block 6; position 8 in block 5; positions 0-4 in block 3
    np.testing.assert_array_equal(meta.slot_mapping, [48, 49, 50, 40, 24, 25, 26, 27, 28])
    np.testing.assert_array_equal(meta.seq_lens, [19, 9, 5])
    assert all(a.dtype == np.int32 for a in (meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                            meta.slot_mapping))
    assert (meta.max_query_len, meta.max_seq_len, meta.num_seqs, meta.num_tokens) == (5, 19, 3, 9)

    with pytest.raises(ValueError, match=r"\[0, seq_lens\]"):
        paged_metadata(np.array([6]), np.array([5]), block_tables[:1], 8)
    with pytest.raises(ValueError, match="cannot hold"):
        paged_metadata(np.array([1]), np.array([25]), block_tables[:1], 8)
    with pytest.raises(ValueError, match="must be"):
        paged_metadata(np.array([1, 1]), np.array([5]), block_tables[:1], 8)


class CountingKernels(EmulatedKernels):
    """The emulator, counting host-to-device copies of int32 arrays."""

    def __init__(self):
        super().__init__()
        self.uploads = 0

    def int32(self, host):
        self.uploads += 1
        return super().int32(host)


def test_metadata_is_placed_once_per_step():
    """prepare(meta) copies the four int32 arrays once; every layer's write_kv/forward reuses
    them; a new metadata object (the next step) is copied again, even unprepared."""
    backend = EmulatedCudaAttention(decode_partition_size=64)
    backend.kernels = counting = CountingKernels()
    rng = np.random.default_rng(3)
    case = make_case(rng, mixed_batch(), 4, 2, 64, BLOCK_SIZE, np.float32)
    backend.prepare(case.meta)
    assert counting.uploads == 4
    for _ in range(3):  # three "layers"
        run_and_check(backend, case, check_twin=False)
    assert counting.uploads == 4
    decode = make_case(rng, decode_batch(), 4, 2, 64, BLOCK_SIZE, np.float32)
    run_and_check(backend, decode, check_twin=False)
    assert counting.uploads == 8


def test_rope_positions_are_placed_once_per_step():
    """device_positions copies the positions once; rope with them equals rope with the host
    array bit for bit; out-of-range positions raise on either path."""
    ops = CudaLayerOps(CountingKernels())
    rng = np.random.default_rng(0)
    positions = rng.integers(0, 64, 5)
    rope = RotaryEmbedding(32, 64, 10000.0, None, xp=np)
    cos_sin = np.ascontiguousarray(np.concatenate([rope.cos, rope.sin], axis=1))
    q = rng.standard_normal((5, 4, 32)).astype(np.float32)
    k = rng.standard_normal((5, 2, 32)).astype(np.float32)
    placed = ops.device_positions(positions)
    assert ops.kernels.uploads == 1
    got = [ops.rope(q.copy(), k.copy(), placed, rope) for _ in range(2)]
    assert ops.kernels.uploads == 1
    want_q, want_k = q.copy(), k.copy()
    ops.rotary_embedding(positions, want_q, want_k, cos_sin)
    for got_q, got_k in got:
        assert got_q.tobytes() == want_q.tobytes() and got_k.tobytes() == want_k.tobytes()
    tol = TOLERANCE[np.dtype(np.float32)]
    np.testing.assert_allclose(want_q, rope(q, positions), rtol=tol, atol=tol)  # the NumPy reference
    np.testing.assert_allclose(want_k, rope(k, positions), rtol=tol, atol=tol)
    with pytest.raises(ValueError, match=r"positions must be \[T\] in \[0, 64\)"):
        ops.rope(q.copy(), k.copy(), ops.device_positions(positions + 60), rope)
    with pytest.raises(ValueError, match=r"positions must be \[T\] in \[0, 64\)"):
        ops.rotary_embedding(positions - 60, q.copy(), k.copy(), cos_sin)


def test_self_tests_are_not_in_the_production_module():
    production = set(build_emulation_library().refengine_emu_list_kernels().decode().split())
    self_test = set(self_test_library().refengine_emu_list_kernels().decode().split())
    assert self_test == {"mma_check_f16", "mma_check_bf16", "ldmatrix_check_f16"}
    assert not production & self_test
    assert len(production) == 45


def test_attention_and_layer_ops_share_one_module(monkeypatch):
    """On a GPU the attention backend and the layer operations launch from one compiled
    module per device (NVRTC runs once)."""
    import sys

    cp = fake_cupy()
    compiled = []
    raw_module = cp.RawModule
    cp.RawModule = lambda code, options=(): compiled.append(code) or raw_module(code, options)
    monkeypatch.setitem(sys.modules, "cupy", cp)
    attention = CudaAttention()
    ops = get_layer_ops("cuda", cp)
    assert ops.kernels is attention.kernels is CudaAttention(decode_partition_size=64).kernels
    assert len(compiled) == 1
