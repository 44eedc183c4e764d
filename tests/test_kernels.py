"""The CUDA kernels (cuda/*.cu), run on the CPU emulator, against two references.

* the NumPy twin (:class:`refengine.attention.numpy_ref.NumpyAttention`), and
* a dense reference written here: per sequence, build K/V from the *logical* token
  order (not through the cache), causal mask by position, softmax in float64.

Inputs are fresh random numbers; physical blocks are shuffled (non-contiguous block
tables); every cache slot that no sequence owns, and one guard block on each side of
the cache, hold NaN, so a kernel that reads a wrong slot produces NaN; the kernel's
output is NaN before the launch, so a row it forgets to write stays NaN.

Tolerances: float32 storage differs from the float64 reference only by float32
accumulation and exp rounding over at most a few hundred keys: rtol=atol=2e-5 is
generous. With float16/bfloat16 storage the reference is computed from the *same*
rounded inputs, so the remaining error is the final rounding of the output to the
storage type (half an ulp: 2^-11 relative for float16, 2^-8 for bfloat16) plus float32
noise: rtol=atol=2e-3 (float16) and 1e-2 (bfloat16). The tensor-core kernel also rounds
the probabilities to the storage type before P·V (as FlashAttention-2 does); those
roundings are unbiased and averaged over the keys, so the same bounds hold (observed
maxima: ~1e-3 for float16, ~9e-3 for bfloat16 on outputs of magnitude up to ~3). The NumPy
twin runs in float32 on the upcast inputs and gets the same tolerances.

Every test is deterministic (fixed seeds).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import pytest

from refengine.attention import AttentionMetadata
from refengine.attention.cuda import EmulatedCudaAttention, build_emulation_library

try:
    from refengine.attention.numpy_ref import NumpyAttention
except ImportError:  # the twin is written in parallel; the dense reference still runs
    NumpyAttention = None

BF16 = np.dtype(ml_dtypes.bfloat16)
TOLERANCE = {np.dtype(np.float32): 2e-5, np.dtype(np.float16): 2e-3, BF16: 1e-2}


@pytest.fixture(scope="module")
def backend() -> EmulatedCudaAttention:
    return EmulatedCudaAttention()


@dataclass
class Case:
    q: np.ndarray  # [T, H, D] storage dtype
    k_new: np.ndarray  # [T, KVH, D] this step's keys (to write through write_kv)
    v_new: np.ndarray
    k_cache: np.ndarray  # [num_blocks, bs, KVH, D], a view inside a NaN-guarded buffer
    v_cache: np.ndarray
    meta: AttentionMetadata
    k_logical: list  # per sequence [seq_len, KVH, D] float64 (rounded to the storage dtype)
    v_logical: list
    q_lens: np.ndarray
    scale: float


def make_case(rng, seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, spare_blocks=3) -> Case:
    """Build a batch. ``seqs`` is a list of ``(seq_len, q_len)``; the first
    ``seq_len - q_len`` tokens of each are already in the cache, the rest are new."""
    dtype = np.dtype(dtype)
    seq_lens = np.array([s for s, _ in seqs], np.int32)
    q_lens = np.array([q for _, q in seqs], np.int32)
    blocks_per_seq = [-(-int(s) // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    physical = rng.permutation(num_blocks)
    max_blocks = max(blocks_per_seq) + 1  # one column of pure padding
    block_tables = np.full((len(seqs), max_blocks), -1, np.int32)
    start = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = physical[start:start + n]
        start += n

    # Guard blocks before and after the cache: out-of-range reads see NaN.
    shape = (num_blocks + 2, block_size, num_kv_heads, head_dim)
    k_buf = np.full(shape, np.nan, np.float32).astype(dtype)
    v_buf = np.full(shape, np.nan, np.float32).astype(dtype)
    k_cache, v_cache = k_buf[1:-1], v_buf[1:-1]

    k_logical, v_logical, k_new, v_new, slots = [], [], [], [], []
    for i, (seq_len, q_len) in enumerate(seqs):
        k = rng.standard_normal((seq_len, num_kv_heads, head_dim)).astype(np.float32).astype(dtype)
        v = rng.standard_normal((seq_len, num_kv_heads, head_dim)).astype(np.float32).astype(dtype)
        k_logical.append(k.astype(np.float64))
        v_logical.append(v.astype(np.float64))
        for pos in range(seq_len):
            block, offset = block_tables[i, pos // block_size], pos % block_size
            if pos < seq_len - q_len:  # cached by an earlier step
                k_cache[block, offset] = k[pos]
                v_cache[block, offset] = v[pos]
            else:
                slots.append(block * block_size + offset)
        k_new.append(k[seq_len - q_len:])
        v_new.append(v[seq_len - q_len:])

    num_tokens = int(q_lens.sum())
    q = rng.standard_normal((num_tokens, num_heads, head_dim)).astype(np.float32).astype(dtype)
    meta = AttentionMetadata(
        query_start_loc=np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
        seq_lens=seq_lens,
        block_tables=block_tables,
        slot_mapping=np.array(slots, np.int32),
        max_query_len=int(q_lens.max()),
        max_seq_len=int(seq_lens.max()),
    )
    return Case(q, np.concatenate(k_new), np.concatenate(v_new), k_cache, v_cache, meta, k_logical, v_logical,
                q_lens, 1.0 / np.sqrt(head_dim))


def dense_reference(case: Case) -> np.ndarray:
    """Causal softmax attention per sequence in float64 from the logical K/V."""
    num_tokens, num_heads, head_dim = case.q.shape
    num_kv_heads = case.k_logical[0].shape[1]
    group = num_heads // num_kv_heads
    out = np.zeros((num_tokens, num_heads, head_dim))
    q_all = case.q.astype(np.float64)
    for i, q_len in enumerate(case.q_lens):
        start = case.meta.query_start_loc[i]
        seq_len = case.meta.seq_lens[i]
        positions = np.arange(seq_len - q_len, seq_len)
        mask = np.arange(seq_len)[None, :] <= positions[:, None]  # [q_len, seq_len]
        for h in range(num_heads):
            kv = h // group
            s = q_all[start:start + q_len, h] @ case.k_logical[i][:, kv].T * case.scale
            s = np.where(mask, s, -np.inf)
            p = np.exp(s - s.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            out[start:start + q_len, h] = p @ case.v_logical[i][:, kv]
    return out


def numpy_twin(case: Case) -> np.ndarray:
    """The NumPy backend on float32 copies of the same cache (NaN slots replaced by a
    finite value: the twin's decode path multiplies masked probabilities, which are
    exactly 0, by whatever the padding slots hold, and 0 * NaN would be NaN)."""
    k_cache = np.nan_to_num(case.k_cache.astype(np.float32), nan=1e4)
    v_cache = np.nan_to_num(case.v_cache.astype(np.float32), nan=1e4)
    return NumpyAttention().forward(case.q.astype(np.float32), k_cache, v_cache, case.meta, case.scale)


def run_and_check(backend, case: Case, *, check_twin: bool = True) -> np.ndarray:
    """write_kv then forward through the emulated kernels; compare with both references."""
    backend.write_kv(case.k_cache, case.v_cache, case.k_new, case.v_new, case.meta)
    out = backend.forward(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert out.dtype == case.q.dtype and out.shape == case.q.shape
    got = out.astype(np.float64)
    assert np.isfinite(got).all(), "kernel left NaN/inf in the output"
    tol = TOLERANCE[case.q.dtype]
    np.testing.assert_allclose(got, dense_reference(case), rtol=tol, atol=tol)
    if check_twin and NumpyAttention is not None:
        np.testing.assert_allclose(got, numpy_twin(case), rtol=tol, atol=tol)
    return out


BLOCK_SIZE = 16
# Context lengths around block boundaries (1, bs-1, bs, bs+1) and one long one.
EDGE_LENGTHS = [1, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 300]


def mixed_batch():
    """Prefill-kernel batch: full prompts at block edges, chunked prefills (q_len <
    seq_len) including a long context, and decode rows (q_len 1) in the same batch."""
    return [(1, 1), (BLOCK_SIZE - 1, BLOCK_SIZE - 1), (BLOCK_SIZE, 5), (BLOCK_SIZE + 1, BLOCK_SIZE + 1),
            (300, 40), (37, 1), (33, 33)]


def heads_for(group: int) -> tuple[int, int]:
    num_kv_heads = 2 if group <= 3 else 1
    return num_kv_heads * group, num_kv_heads


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

def decode_batch():
    return [(n, 1) for n in EDGE_LENGTHS] + [(100, 1)]


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
def test_rms_norm(backend, dtype, hidden):
    rng = np.random.default_rng(hidden)
    x = (rng.standard_normal((5, hidden)) * 3).astype(np.float32).astype(dtype)
    weight = rng.standard_normal(hidden).astype(np.float32).astype(dtype)
    xd = x.astype(np.float64)
    expected = xd / np.sqrt((xd ** 2).mean(axis=1, keepdims=True) + 1e-5) * weight.astype(np.float64)
    got = backend.rms_norm(x, weight, 1e-5)
    assert got.dtype == x.dtype
    tol = TOLERANCE[np.dtype(dtype)]
    np.testing.assert_allclose(got.astype(np.float64), expected, rtol=tol, atol=tol)


@LAYER_DTYPES
def test_silu_and_mul(backend, dtype):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((7, 2 * 300)) * 4).astype(np.float32).astype(dtype)
    xd = x.astype(np.float64)
    gate, up = xd[:, :300], xd[:, 300:]
    expected = gate / (1 + np.exp(-gate)) * up
    tol = TOLERANCE[np.dtype(dtype)]
    np.testing.assert_allclose(backend.silu_and_mul(x).astype(np.float64), expected, rtol=tol, atol=tol)


@LAYER_DTYPES
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (128, 128), (64, 32)])
def test_rotary_embedding(backend, dtype, head_dim, rotary_dim):
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
    backend.rotary_embedding(positions, q, k, cos_sin, rotary_dim)
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

def fake_cupy():
    """A minimal stand-in for the parts of CuPy that CudaAttention and gpu_check use:
    arrays are NumPy arrays (a subclass with ``.data.ptr``), RawModule kernels launch on
    the CPU emulator, events read the wall clock. Only NVRTC compilation is not covered
    here (tests/test_nvrtc.py compiles the same module with the real NVRTC)."""
    import time
    import types

    from refengine.attention.cuda import Launch, emulated_launch

    class ndarray(np.ndarray):
        @property
        def data(self):
            return types.SimpleNamespace(ptr=np.asarray(self).ctypes.data)

    class RawModule:
        def __init__(self, code, options=()):
            assert "extern \"C\" __global__" in code
            self.lib = build_emulation_library()

        def get_function(self, name):
            def launch(grid, block, args, shared_mem=0):
                plain = tuple(np.asarray(a) if isinstance(a, np.ndarray) else a for a in args)
                emulated_launch(self.lib, Launch(name, tuple(grid), tuple(block), shared_mem, plain))
            return launch

    class Event:
        def record(self):
            self.t = time.perf_counter()

        def synchronize(self):
            pass

    cp = types.ModuleType("cupy")
    cp.__version__ = "stand-in"
    cp.ndarray = ndarray
    cp.asarray = lambda x, dtype=None: np.array(x, dtype=dtype).view(ndarray)
    cp.empty = lambda shape, dtype=np.float32: np.full(shape, np.nan, np.float32).astype(dtype).view(ndarray)
    cp.ascontiguousarray = lambda x: np.ascontiguousarray(x).view(ndarray)
    cp.asnumpy = lambda x: np.array(np.asarray(x))
    cp.float16, cp.float32 = np.float16, np.float32
    cp.random = types.SimpleNamespace(
        standard_normal=lambda shape, dtype=np.float32: np.random.default_rng(0).standard_normal(shape).astype(
            dtype).view(ndarray))
    cp.get_default_memory_pool = lambda: types.SimpleNamespace(free_all_blocks=lambda: None)
    cp.RawModule = RawModule
    cp.cuda = types.SimpleNamespace(
        runtime=types.SimpleNamespace(getDeviceCount=lambda: 1,
                                      getDeviceProperties=lambda i: {"name": b"stand-in", "multiProcessorCount": 1}),
        Device=lambda: types.SimpleNamespace(id=0), get_cuda_path=lambda: None, Event=Event,
        get_elapsed_time=lambda a, b: (b.t - a.t) * 1e3)
    return cp


def test_cuda_backend_code_path(monkeypatch):
    """CudaAttention (the CuPy backend) end to end on the stand-in CuPy."""
    import sys

    from refengine.attention.cuda import CudaAttention

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


def load_gpu_check():
    """benchmarks/gpu_check.py as a module (benchmarks/ is not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    return gpu_check


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
    from refengine.attention.cuda import Launch, emulated_launch

    rng = np.random.default_rng(0)
    a = rng.standard_normal((16, 16)).astype(np.float32).astype(dtype)
    b = rng.standard_normal((16, 8)).astype(np.float32).astype(dtype)
    d = np.full((16, 8), np.nan, np.float32)
    tag = "f16" if np.dtype(dtype) == np.float16 else "bf16"
    emulated_launch(build_emulation_library(), Launch(f"mma_check_{tag}", (1, 1, 1), (32, 1, 1), 0, (a, b, d)))
    expected = a.astype(np.float64) @ b.astype(np.float64)  # products of 16-bit values are exact in float32
    np.testing.assert_allclose(d, expected, rtol=1e-5, atol=1e-5)  # float32 sums of 16 terms


def test_ldmatrix_fragment_layout_and_cp_async_zero_fill():
    """The emulated ldmatrix / ldmatrix.trans (mma.cuh) against the PTX layout as
    gpu_check.ldmatrix_expected writes it out; ``make gpu-check`` runs the same kernel on the
    GPU against the same expectation, which ties the emulation to the hardware."""
    from refengine.attention.cuda import Launch, emulated_launch

    m = np.random.default_rng(0).standard_normal((4, 8, 8)).astype(np.float16)
    out = np.full(32 * 4 * 3, 0xDEADBEEF, np.uint32)
    emulated_launch(build_emulation_library(), Launch("ldmatrix_check_f16", (1, 1, 1), (32, 1, 1), 32 * 24 * 2,
                                                      (m, out)))
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
