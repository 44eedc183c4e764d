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
import os
import re
import shutil
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from tests.helpers import (BF16, BLOCK_SIZE, ROOT, TOLERANCE, decode_batch, dense_reference, fake_cupy, heads_for,
                     load_gpu_check, make_case, mixed_batch, run_and_check, wait_until)

from refengine.attention import AttentionMetadata, paged_metadata
from refengine.attention.cuda import CudaAttention, EmulatedCudaAttention
from refengine.kernels import plans
from refengine.kernels.build import (SELF_TEST_SOURCES, EmulatedKernels, build_emulation_library, cuda_source_dir,
                                     emulated_launch)
from refengine.kernels.plans import DeviceMetadata, Launch
from refengine.ops import get_layer_ops
from refengine.ops.cuda import CudaLayerOps
from refengine.ops.layers import RotaryEmbedding


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
# Per-layer options: sliding window and attention-logit soft cap
# --------------------------------------------------------------------------------------
#
# Besides matching both references, these tests write NaN into the cache slots of keys a
# kernel must never load: for prefill, keys before the 64-aligned start of the window of a
# chunk's first row (64 is a multiple of every key tile, so those lie in tiles that are to be
# skipped, not just masked: a masked key's V still meets p = 0, and 0 * NaN = NaN); for
# decode, every key before the window. The dense reference reads the logical K/V and the
# NumPy twin maps NaN to a large finite value, so only a kernel that reads them fails.

PREFILL_KERNELS_AND_DTYPES = pytest.mark.parametrize(
    "kernel,dtype", [("simt", np.float32), ("simt", np.float16), ("simt", BF16), ("mma", np.float16), ("mma", BF16)],
    ids=["simt-f32", "simt-f16", "simt-bf16", "mma-f16", "mma-bf16"])


def window_prefill_batch(window: int):
    """Prompts shorter than, equal to and longer than the window; chunks starting inside it
    and past it (several key tiles past); decode rows at and past its edge; a 130-token
    prompt, whose second query tile (of 32 or 64 rows) starts at key tile 0 while its later
    rows' windows (for W <= 64) lie wholly in later key tiles (running max -inf at first)."""
    W = window
    return [(max(1, W - 1), max(1, W - 1)), (W, W), (W + 1, W + 1), (3 * W, 3 * W), (3 * W, W // 2 + 1),
            (2 * W + 5, 7), (W, 1), (3 * W + 2, 1), (1, 1), (140 + 3 * W, W + 3), (130, 130)]


def poison_unreachable(case, window: int, decode: bool) -> int:
    """NaN into the cache slots of keys no kernel may read with this window (see above);
    returns how many positions were poisoned."""
    block_size = case.k_cache.shape[1]
    poisoned = 0
    for i, q_len in enumerate(case.q_lens):
        seq_len = int(case.meta.seq_lens[i])
        first_key = max(0, seq_len - int(q_len) - window + 1)  # of the chunk's first row
        end = max(0, seq_len - window) if decode else first_key // 64 * 64
        for pos in range(end):
            block, offset = case.meta.block_tables[i, pos // block_size], pos % block_size
            case.k_cache[block, offset] = np.nan
            case.v_cache[block, offset] = np.nan
        poisoned += end
    return poisoned


def sharpen(case, factor: float = 4.0):
    """Scale q (by a power of two: exact in every storage type) so that scores reach the
    range where a soft cap bends them."""
    case.q = (case.q.astype(np.float32) * np.float32(factor)).astype(case.q.dtype)


@PREFILL_KERNELS_AND_DTYPES
@pytest.mark.parametrize("options", [
    {"sliding_window": 1},
    {"sliding_window": 5, "logits_soft_cap": 0.5},  # later rows of a query tile meet wholly masked key tiles
    {"sliding_window": 64},  # one tensor-core key tile, two SIMT ones
    {"sliding_window": 37, "logits_soft_cap": 20.0},
    {"logits_soft_cap": 0.5},
], ids=["w1", "w5-cap0.5", "w64", "w37-cap20", "cap0.5"])
def test_flash_prefill_window_and_soft_cap(kernel, dtype, options):
    window = options.get("sliding_window")
    rng = np.random.default_rng(window or 0)
    case = make_case(rng, window_prefill_batch(window or 40), 4, 2, 64, BLOCK_SIZE, dtype)
    if "logits_soft_cap" in options:
        sharpen(case)
    if window is not None:
        assert poison_unreachable(case, window, decode=False) > 0
    run_and_check(EmulatedCudaAttention(prefill_kernel=kernel), case, **options)


@pytest.mark.parametrize("kernel,dtype", [("simt", np.float32), ("mma", np.float16)], ids=["simt-f32", "mma-f16"])
@pytest.mark.parametrize("window", [3, 33, 64, 65])
def test_chunked_prefill_starting_past_the_window(kernel, dtype, window):
    """Chunks whose first row's window starts several key tiles into the context, next to
    decode rows and a whole prompt (a mixed batch); keys before it are never read."""
    rng = np.random.default_rng(window)
    seqs = [(200, 40), (260, 70), (131, 2), (150, 1), (20, 20)]
    case = make_case(rng, seqs, 6, 2, 64, BLOCK_SIZE, dtype)
    assert poison_unreachable(case, window, decode=False) > 0
    run_and_check(EmulatedCudaAttention(prefill_kernel=kernel), case, sliding_window=window)


def test_mixed_batch_window_and_soft_cap(backend):
    """The prefill kernel's mixed batch (decode rows included) with both options at once."""
    rng = np.random.default_rng(8)
    case = make_case(rng, mixed_batch(), 8, 2, 64, BLOCK_SIZE, np.float32)
    sharpen(case)
    run_and_check(backend, case, sliding_window=12, logits_soft_cap=1.5)


def window_decode_batch(window: int):
    """Contexts shorter than, equal to and just past the window, three windows long, and at
    block edges."""
    W = window
    return [(1, 1), (max(1, W - 1), 1), (W, 1), (W + 1, 1), (3 * W, 1), (3 * W + 7, 1), (BLOCK_SIZE + 1, 1)]


@pytest.mark.parametrize("partition_size", [32, 64])
@pytest.mark.parametrize("window", [1, 20, 32, 64, 100])  # below, at and above each partition size
def test_paged_decode_window(partition_size, window):
    rng = np.random.default_rng(window * 7 + partition_size)
    case = make_case(rng, window_decode_batch(window), 6, 2, 64, BLOCK_SIZE, np.float32)
    options = {"sliding_window": window}
    if window % 2 == 0:
        sharpen(case)
        options["logits_soft_cap"] = 2.0
    assert poison_unreachable(case, window, decode=True) > 0
    run_and_check(EmulatedCudaAttention(decode_partition_size=partition_size), case, **options)


@pytest.mark.parametrize("dtype", [np.float16, BF16], ids=["f16", "bf16"])
def test_paged_decode_window_half_storage(dtype):
    rng = np.random.default_rng(5)
    case = make_case(rng, window_decode_batch(40) + [(500, 1)], 16, 2, 128, BLOCK_SIZE, dtype)
    sharpen(case)
    assert poison_unreachable(case, 40, decode=True) > 0
    run_and_check(EmulatedCudaAttention(decode_partition_size=32), case, sliding_window=40, logits_soft_cap=3.0)


def test_paged_decode_soft_cap_alone():
    rng = np.random.default_rng(6)
    case = make_case(rng, decode_batch(), 6, 2, 64, BLOCK_SIZE, np.float32)
    sharpen(case)
    run_and_check(EmulatedCudaAttention(decode_partition_size=64), case, logits_soft_cap=1.0)


def test_decode_grid_is_sized_by_the_window():
    """The plan launches ceil(min(max_seq_len, W) / partition_size) partitions, and the
    merge kernel gets the same window."""
    q = np.zeros((2, 4, 64), np.float32)
    cache = np.zeros((80, 16, 2, 64), np.float32)
    meta = DeviceMetadata(np.array([0, 1, 2], np.int32), np.array([1000, 30], np.int32),
                          np.zeros((2, 63), np.int32), np.zeros(2, np.int32), 63, 1, 1000)
    assert plans.decode_partitions(1000, 64) == 16
    assert plans.decode_partitions(1000, 64, 100) == 2
    assert plans.decode_partitions(1000, 64, 64) == 1
    assert plans.decode_partitions(50, 64, 100) == 1
    decode, merge = plans.paged_decode_launches(q, cache, cache, q, (q,) * 3, meta, 0.125, 64, sliding_window=100,
                                                logits_soft_cap=30.0)
    assert decode.grid == (2, 2, 2)
    assert decode.args[-2:] == (np.int32(100), np.float32(30.0))
    assert merge.args[-3:] == (np.int32(2), np.int32(64), np.int32(100))  # partitions, partition size, window
    (only,) = plans.paged_decode_launches(q, cache, cache, q, (q,) * 3, meta, 0.125, 64, sliding_window=64)
    assert only.grid[2] == 1
    assert plans.paged_decode_launches(q, cache, cache, q, (q,) * 3, meta, 0.125, 64)[0].grid[2] == 16
    assert plans.window_arg(None) == 0 and plans.window_arg(2**40) == 2**31 - 1


@pytest.mark.parametrize("options,bad", [
    ({"sliding_window": 0}, "0"), ({"sliding_window": -3}, "-3"), ({"sliding_window": 2.5}, "2.5"),
    ({"sliding_window": True}, "True"), ({"sliding_window": "8"}, "'8'"),
    ({"logits_soft_cap": 0.0}, "0.0"), ({"logits_soft_cap": -1.0}, "-1.0"), ({"logits_soft_cap": float("nan")}, "nan"),
    ({"logits_soft_cap": float("inf")}, "inf"), ({"logits_soft_cap": "50"}, "'50'"),
    ({"logits_soft_cap": 1e39}, "1e+39"), ({"logits_soft_cap": 1e-40}, "1e-40"),  # subnormal in float32
])
def test_bad_options_raise(backend, options, bad):
    rng = np.random.default_rng(0)
    case = make_case(rng, [(20, 20)], 2, 1, 64, BLOCK_SIZE, np.float32)
    name = next(iter(options))
    with pytest.raises(ValueError, match=f"{name}.*{re.escape(bad)}"):
        backend.forward(case.q, case.k_cache, case.v_cache, case.meta, case.scale, **options)


def test_integral_options_of_other_types(backend):
    """A NumPy integer window and an integer cap are accepted (and mean the same)."""
    rng = np.random.default_rng(2)
    case = make_case(rng, [(40, 40), (30, 1)], 4, 2, 32, BLOCK_SIZE, np.float32)
    out = run_and_check(backend, case, sliding_window=np.int64(9), logits_soft_cap=3)
    again = backend.forward(case.q, case.k_cache, case.v_cache, case.meta, case.scale, sliding_window=9,
                            logits_soft_cap=3.0)
    assert out.tobytes() == again.tobytes()


# --------------------------------------------------------------------------------------
# Head dims 96 (Phi-3) and 256 (Gemma 2/3)
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("head_dim", [96, 256])
@pytest.mark.parametrize("kernel,dtype", [("simt", np.float32), ("simt", BF16), ("mma", np.float16), ("mma", BF16)],
                         ids=["simt-f32", "simt-bf16", "mma-f16", "mma-bf16"])
@pytest.mark.parametrize("options", [{}, {"sliding_window": 21, "logits_soft_cap": 2.0}], ids=["plain", "w21-cap2"])
def test_flash_prefill_new_head_dims(head_dim, kernel, dtype, options):
    """At 256 the key tiles are smaller (16 SIMT, 32 tensor-core): a window of 21 starts
    inside a tile, and the chunk of 40 rows past it skips several."""
    rng = np.random.default_rng(head_dim)
    case = make_case(rng, [(70, 70), (33, 33), (150, 40), (17, 5), (90, 1)], 4, 2, head_dim, BLOCK_SIZE, dtype)
    if options:
        sharpen(case, 2.0)
        poison_unreachable(case, options["sliding_window"], decode=False)
    run_and_check(EmulatedCudaAttention(prefill_kernel=kernel), case, **options)


@pytest.mark.parametrize("head_dim", [96, 256])
@pytest.mark.parametrize("dtype,group,partition_size", [(np.float32, 3, 32), (np.float32, 8, 512), (BF16, 8, 64),
                                                        (np.float16, 1, 32)], ids=["f32-g3-p32", "f32-g8-p512",
                                                                                   "bf16-g8-p64", "f16-g1-p32"])
def test_paged_decode_new_head_dims(head_dim, dtype, group, partition_size):
    """At 96 a thread's output dimension changes from one accumulator to the next; at 256 the
    kernel carves 73 KiB of shared memory. Unused head slots (group < 8) stay unwritten."""
    rng = np.random.default_rng(head_dim + group)
    num_heads, num_kv_heads = heads_for(group)
    backend = EmulatedCudaAttention(decode_partition_size=partition_size)
    case = make_case(rng, [(1, 1), (16, 1), (17, 1), (100, 1)], num_heads, num_kv_heads, head_dim, BLOCK_SIZE, dtype)
    run_and_check(backend, case)
    case = make_case(rng, [(1, 1), (40, 1), (100, 1)], num_heads, num_kv_heads, head_dim, BLOCK_SIZE, dtype)
    sharpen(case, 2.0)
    poison_unreachable(case, 33, decode=True)
    run_and_check(backend, case, sliding_window=33, logits_soft_cap=4.0)


def test_head_dims_have_every_kernel():
    """Each supported head dim has every attention kernel in the emulated module (which
    tests/kernels/test_nvrtc.py ties to the GPU module)."""
    production = set(build_emulation_library().refengine_emu_list_kernels().decode().split())
    for head_dim in plans.SUPPORTED_HEAD_DIMS:
        for tag in ("f32", "f16", "bf16"):
            for family in ("flash_prefill", "paged_decode", "paged_decode_reduce"):
                assert f"{family}_{tag}_hd{head_dim}" in production
        for tag in ("f16", "bf16"):
            assert f"flash_prefill_mma_{tag}_hd{head_dim}" in production
    assert (96 in plans.SUPPORTED_HEAD_DIMS) and (256 in plans.SUPPORTED_HEAD_DIMS)


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
@pytest.mark.parametrize("hidden", [64, 96, 256, 576, 1000])  # 96, 256: per-head q/k norms at those head dims
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
def test_gelu_tanh_and_mul(layer_ops, dtype):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((7, 2 * 300)) * 4).astype(np.float32).astype(dtype)
    xd = x.astype(np.float64)
    gate, up = xd[:, :300], xd[:, 300:]
    expected = 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate ** 3))) * up
    got = layer_ops.gelu_tanh_and_mul(x)
    assert got.dtype == x.dtype and got.shape == (7, 300)
    tol = TOLERANCE[np.dtype(dtype)]
    np.testing.assert_allclose(got.astype(np.float64), expected, rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="gelu_tanh_and_mul"):
        layer_ops.gelu_tanh_and_mul(x[:, :5])


@LAYER_DTYPES
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (128, 128), (64, 32), (96, 96), (256, 256), (256, 128)])
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
        # the per-layer options travel to the kernels on this path too
        out = cp.asnumpy(backend.forward(cp.asarray(decode.q), k_cache, v_cache, decode.meta, decode.scale,
                                         sliding_window=20, logits_soft_cap=1.0))
        np.testing.assert_allclose(out.astype(np.float64), dense_reference(decode, 20, 1.0), rtol=tol, atol=tol)


def test_cuda_backend_opts_in_to_large_shared_memory(monkeypatch):
    """paged_decode at head_dim 256 carves 73 KiB of shared memory: the CuPy launcher raises
    the kernel's limit (max_dynamic_shared_size_bytes) before launching it, once; kernels
    within the 48 KiB default are left alone."""
    cp = fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cp)
    rng = np.random.default_rng(12)
    backend = CudaAttention(decode_partition_size=32)
    for _ in range(2):
        case = make_case(rng, [(40, 1), (3, 1)], 4, 2, 256, BLOCK_SIZE, np.float32)
        k_cache, v_cache = cp.asarray(case.k_cache), cp.asarray(case.v_cache)
        backend.write_kv(k_cache, v_cache, cp.asarray(case.k_new), cp.asarray(case.v_new), case.meta)
        out = cp.asnumpy(backend.forward(cp.asarray(case.q), k_cache, v_cache, case.meta, case.scale))
        np.testing.assert_allclose(out.astype(np.float64), dense_reference(case), rtol=2e-5, atol=2e-5)
    kernels = backend.kernels._kernels
    assert plans.decode_shared_bytes(256) > 48 * 1024
    assert kernels["paged_decode_f32_hd256"].max_dynamic_shared_size_bytes == plans.decode_shared_bytes(256)
    assert not hasattr(kernels["paged_decode_reduce_f32_hd256"], "max_dynamic_shared_size_bytes")
    assert not hasattr(kernels["reshape_and_cache_f32"], "max_dynamic_shared_size_bytes")
    for head_dim in plans.SUPPORTED_HEAD_DIMS:  # what else could need it: only decode at 256
        for itemsize in (2, 4):
            assert plans.prefill_shared_bytes(head_dim, itemsize) <= 48 * 1024
        assert plans.prefill_mma_shared_bytes(head_dim) <= 48 * 1024
        assert (plans.decode_shared_bytes(head_dim) > 48 * 1024) == (head_dim == 256)


def test_gpu_check_script_runs(monkeypatch, capsys):
    """benchmarks/gpu_check.py's correctness section on the stand-in CuPy (small batches),
    and its exit status 2 without CuPy."""
    gpu_check = load_gpu_check()

    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    assert gpu_check.main([]) == 2
    assert "CuPy with a CUDA device is required" in capsys.readouterr().out

    monkeypatch.setitem(sys.modules, "cupy", fake_cupy())
    monkeypatch.setattr(gpu_check, "CORRECTNESS_BATCHES",
                        {"decode": [(1, 1), (100, 1)], "prefill": [(40, 40)], "mixed": [(70, 9), (17, 17)]})
    monkeypatch.setattr(gpu_check, "OPTION_BATCHES", {"decode": [(1, 1), (100, 1)], "mixed": [(90, 9), (70, 70)]})
    monkeypatch.setattr(gpu_check, "OPTION_HEAD_DIMS", (96, 256))
    assert gpu_check.main(["--quick", "--skip-bench"]) == 0
    out = capsys.readouterr().out
    assert "FAIL" not in out
    assert "hd256 h8/kv2 window 64 cap None part64 auto" in out and "hd96 h8/kv2 window 200 cap 1.0" in out


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
    gpu_check = load_gpu_check()
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy())
    cp = sys.modules["cupy"]
    prefill = gpu_check.bench_prefill(cp, True, float("inf"), head_dims=(64,), seqs=(64,), tokens_per_batch=64)
    assert [(r["head_dim"], r["seq"], r["batch"]) for r in prefill] == [(64, 64, 1)]
    assert prefill[0]["mma_tflops"] > 0 and prefill[0]["simt_tflops"] > 0
    decode = gpu_check.bench_decode(cp, True, float("inf"), batches=(2,), contexts=(64,))
    assert [(r["batch"], r["ctx"]) for r in decode] == [(2, 64)]
    assert decode[0]["best_partition"] in (128, 256, 512, 1024) and decode[0]["best_gbps"] > 0
    # what --performance-md writes: one table per benchmark, a cell per header
    tables = gpu_check.speed_tables(prefill, decode, [], copy_gbps=4000.0)
    assert [len(rows) for _, (_, rows) in tables] == [1, 1, 0]
    assert all(len(row) == len(headers) for _, (headers, rows) in tables for row in rows)
    assert tables[1][1][1][0][:2] == [2, 64]
    from refengine.kernels.build import cupy_kernels

    assert cupy_kernels().compile() >= 0.0


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


def test_rope_tables_are_kept_per_rope_object(layer_ops):
    """Layers may carry different RoPE tables (Gemma 3: local and global bases): each rope
    object's own table is used, at head_dim 256 too."""
    rng = np.random.default_rng(1)
    positions = rng.integers(0, 128, 6)
    q = rng.standard_normal((6, 2, 256)).astype(np.float32)
    k = rng.standard_normal((6, 1, 256)).astype(np.float32)
    placed = layer_ops.device_positions(positions)
    tol = TOLERANCE[np.dtype(np.float32)]
    for theta in (10000.0, 1000000.0, 10000.0):
        rope = RotaryEmbedding(256, 128, theta, None, xp=np)
        got_q, got_k = layer_ops.rope(q.copy(), k.copy(), placed, rope)
        np.testing.assert_allclose(got_q, rope(q, positions), rtol=tol, atol=tol)
        np.testing.assert_allclose(got_k, rope(k, positions), rtol=tol, atol=tol)


def test_self_tests_are_not_in_the_production_module():
    production = set(build_emulation_library().refengine_emu_list_kernels().decode().split())
    self_test = set(self_test_library().refengine_emu_list_kernels().decode().split())
    assert self_test == {"mma_check_f16", "mma_check_bf16", "ldmatrix_check_f16"}
    assert not production & self_test
    # 3 cache writes + 12 layer kernels + 55 attention kernels (5 head dims), 12 quantized
    # matmuls, and for the int8/fp8 caches 9 cache writes + 45 prefill + 45 decode kernels
    assert len(production) == 70 + 12 + 99


def test_attention_and_layer_ops_share_one_module(monkeypatch):
    """On a GPU the attention backend and the layer operations launch from one compiled
    module per device (NVRTC runs once)."""
    cp = fake_cupy()
    compiled = []
    raw_module = cp.RawModule
    cp.RawModule = lambda code, options=(): compiled.append(code) or raw_module(code, options)
    monkeypatch.setitem(sys.modules, "cupy", cp)
    attention = CudaAttention()
    ops = get_layer_ops("cuda", cp)
    assert ops.kernels is attention.kernels is CudaAttention(decode_partition_size=64).kernels
    assert len(compiled) == 1


BUILD_IN_CHILD = """
import sys, time
from pathlib import Path
from refengine.kernels.build import build_emulation_library
source, build_dir, ready, go = sys.argv[1:]
Path(ready).touch()
while not Path(go).exists():  # both processes start the build together
    time.sleep(0.005)
print(build_emulation_library([source], build_dir=build_dir).refengine_emu_list_kernels().decode())
"""


def test_concurrent_builds_compile_each_file_once(tmp_path):
    """Two processes that build the same emulation library at once (the two pytest-xdist workers
    on a cold build cache) run the compiler once per file: the second waits for the first's
    objects and library, and both load it."""
    source = tmp_path / "noop.cu"
    source.write_text('#include "common.cuh"\n'
                      'extern "C" __global__ void noop(float* x) { x[threadIdx.x] = 1.0f; }\n'
                      "REFENGINE_EXPORT_KERNEL(noop)\n")
    calls = tmp_path / "calls.log"
    cxx = tmp_path / "cxx"  # g++, logging each call
    cxx.write_text(f'#!/bin/sh\necho "$*" >> "{calls}"\nexec "{shutil.which("g++")}" "$@"\n')
    cxx.chmod(0o755)
    go = tmp_path / "go"
    ready = [tmp_path / f"ready{i}" for i in range(2)]
    children = [subprocess.Popen([sys.executable, "-c", BUILD_IN_CHILD, str(source), str(tmp_path / "build"),
                                  str(flag), str(go)], cwd=ROOT, env={**os.environ, "CXX": str(cxx)},
                                 stdout=subprocess.PIPE, text=True) for flag in ready]
    try:
        wait_until(lambda: all(flag.exists() for flag in ready) or any(c.poll() is not None for c in children),
                   timeout=60)
        go.touch()
        outputs = [child.communicate(timeout=300)[0] for child in children]
    finally:
        for child in children:
            child.kill()
    assert [child.returncode for child in children] == [0, 0]
    assert [out.split() for out in outputs] == [["noop"], ["noop"]]
    # emu_runtime.cpp, noop.cu, the link: once each
    assert len(calls.read_text().splitlines()) == 3, calls.read_text()
