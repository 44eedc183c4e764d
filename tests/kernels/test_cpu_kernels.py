"""The numba CPU kernels against their NumPy twins.

Attention: random paged batches (block-boundary lengths, GQA ratios 1/2/3/8, head_dim
32/64/96/256, chunked prefill, decode rows mixed with prefills, shuffled physical blocks) in a
cache whose unused slots and guard blocks before and after hold NaN (int8 caches: garbage
values, NaN scales), with outputs poisoned with NaN before the kernels run: an out-of-range
read or a forgotten row shows. Sliding windows (1, small, the block size, past a decode
partition and a key tile; contexts three windows long, chunks starting past the window) and
logit soft-capping on every path (serial and parallel decode, flash and BLAS prefill).
Layer ops: the small-row product for 1..20 rows and either side of ``BLAS_MIN_ROWS`` in the
numba, tied-lm_head and BLAS weight layouts (both register tiles, bitwise batch
invariance), RMSNorm, RoPE, SiLU-and-mul. Then a whole tiny Llama on the numba backend against the NumPy one.

The paged metadata is built by a local helper (``make_batch``): no shared helper for it
exists in ``refengine.attention`` in this tree.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import pytest

pytest.importorskip("numba")

from numba import njit  # noqa: E402

from refengine.attention import AttentionMetadata  # noqa: E402
from refengine.attention.kv_cache import quantize_int8
from refengine.attention.numpy_ref import NumpyAttention  # noqa: E402
from refengine.attention.selector import get_attention_backend  # noqa: E402
from refengine.cpu.attention import NumbaAttention, _Plan, _soft_cap, _transpose_keys  # noqa: E402
from refengine.cpu.layer_ops import BLAS_MIN_ROWS, DOT_4X4_MIN_ROWS, NumbaOps, _matmul_dot  # noqa: E402
from refengine.cpu.simd import f8_sum, v16_halves, v16_load, v16_store, v16_sums16  # noqa: E402
from refengine.ops import get_layer_ops  # noqa: E402
from refengine.ops.layers import RotaryEmbedding  # noqa: E402
from refengine.ops.numpy_ops import NumpyOps  # noqa: E402
from tests.helpers import shuffled_block_tables  # noqa: E402

U32 = 2.0 ** -24  # float32 unit roundoff

# Attention: both sides are float32 with different summation orders (BLAS tiles vs
# sequential/vectorised loops); scores of O(10) feed exp, so a score error of a few ulps
# (~1e-6) moves the O(1) outputs by ~1e-6. Observed max difference 5e-7; 1e-5 leaves
# a 20x margin and still catches any wrong key, mask or scale (errors of O(0.1)).
ATTN_TOL = 1e-5


@dataclass
class Batch:
    q: np.ndarray
    k_new: np.ndarray
    v_new: np.ndarray
    k_cache: np.ndarray  # a view inside a buffer with one NaN guard block on each side
    v_cache: np.ndarray
    meta: AttentionMetadata
    k_scale: np.ndarray | None = None  # int8 caches: [blocks, block_size, kv heads] float32
    v_scale: np.ndarray | None = None


def _int8_buffer(rng, buf):
    """A float32 cache buffer as int8 rows and scales: cached rows quantized as ``write_kv``
    does, NaN rows (no token) random int8 values with a NaN scale."""
    held = np.isfinite(buf).all(axis=-1)
    q, scale = quantize_int8(np.where(held[..., None], buf, 0.0).astype(np.float32))
    garbage = rng.integers(-128, 128, buf.shape, dtype=np.int8)
    return np.where(held[..., None], q, garbage), np.where(held, scale, np.nan).astype(np.float32)


def make_batch(rng, seqs, num_heads, num_kv_heads, head_dim, block_size, spare_blocks=3, int8=False) -> Batch:
    """``seqs``: ``(seq_len, q_len)`` per sequence; its first ``seq_len - q_len`` tokens are
    already cached, the last ``q_len`` are this step's (written through ``write_kv``).
    Physical blocks are a random permutation; every slot not holding a cached token is NaN
    (``int8``: int8 caches with scales, such slots garbage with a NaN scale)."""
    seq_lens = np.array([s for s, _ in seqs], np.int32)
    q_lens = np.array([q for _, q in seqs], np.int32)
    block_tables, num_blocks = shuffled_block_tables(rng, seq_lens, block_size, spare_blocks)  # + a padding column
    shape = (num_blocks + 2, block_size, num_kv_heads, head_dim)
    k_buf, v_buf = np.full(shape, np.nan, np.float32), np.full(shape, np.nan, np.float32)
    k_cache, v_cache = k_buf[1:-1], v_buf[1:-1]
    k_new, v_new, slots = [], [], []
    for i, (seq_len, q_len) in enumerate(seqs):
        k = rng.standard_normal((seq_len, num_kv_heads, head_dim), dtype=np.float32)
        v = rng.standard_normal((seq_len, num_kv_heads, head_dim), dtype=np.float32)
        for pos in range(seq_len):
            block, off = block_tables[i, pos // block_size], pos % block_size
            if pos < seq_len - q_len:
                k_cache[block, off], v_cache[block, off] = k[pos], v[pos]
            else:
                slots.append(block * block_size + off)
        k_new.append(k[seq_len - q_len:])
        v_new.append(v[seq_len - q_len:])
    q = rng.standard_normal((int(q_lens.sum()), num_heads, head_dim), dtype=np.float32)
    meta = AttentionMetadata(query_start_loc=np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
                             seq_lens=seq_lens, block_tables=block_tables, slot_mapping=np.array(slots, np.int32),
                             max_query_len=int(q_lens.max()), max_seq_len=int(seq_lens.max()))
    if not int8:
        return Batch(q, np.concatenate(k_new), np.concatenate(v_new), k_cache, v_cache, meta)
    (kq, ks), (vq, vs) = _int8_buffer(rng, k_buf), _int8_buffer(rng, v_buf)
    return Batch(q, np.concatenate(k_new), np.concatenate(v_new), kq[1:-1], vq[1:-1], meta, ks[1:-1], vs[1:-1])


def run_both(batch: Batch, invariant: bool = False, **options):
    """write_kv + forward through the twin and through numba (output poisoned with NaN);
    ``invariant``: numba in batch-invariant mode; ``options``: the per-layer keywords
    (``sliding_window``, ``logits_soft_cap``) for both."""
    scale = 1.0 / np.sqrt(batch.q.shape[-1])
    caches = (batch.k_cache, batch.v_cache) + (() if batch.k_scale is None else (batch.k_scale, batch.v_scale))
    refs = [a.copy() for a in caches]
    scales = {} if batch.k_scale is None else {"k_scale": refs[2], "v_scale": refs[3]}
    twin = NumpyAttention()
    twin.write_kv(refs[0], refs[1], batch.k_new, batch.v_new, batch.meta, **scales)
    want = twin.forward(batch.q, refs[0], refs[1], batch.meta, scale, **options, **scales)
    assert np.isfinite(want).all()

    nb = NumbaAttention(batch_invariant=invariant)
    nb.prepare(batch.meta)
    scales = {} if batch.k_scale is None else {"k_scale": batch.k_scale, "v_scale": batch.v_scale}
    nb.write_kv(batch.k_cache, batch.v_cache, batch.k_new, batch.v_new, batch.meta, **scales)
    for a, b in zip(caches, refs):
        np.testing.assert_array_equal(a, b)  # NaN == NaN here: untouched slots stay NaN
    out = np.full(batch.q.shape, np.nan, np.float32)
    got = nb.forward(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale, out=out, **options, **scales)
    assert got is out
    assert np.isfinite(got).all(), "a row was not written, or a NaN slot was read"
    np.testing.assert_allclose(got, want, rtol=ATTN_TOL, atol=ATTN_TOL)
    return got


BS = 16
EDGES = [1, BS - 1, BS, BS + 1, 2 * BS + 7, 33, 300]
GQA = {1: (4, 4), 2: (4, 2), 3: (9, 3), 8: (8, 1)}  # group -> (heads, kv heads)


@pytest.mark.parametrize("head_dim", [32, 40, 64])  # 40: a rest of single dimensions
@pytest.mark.parametrize("group", list(GQA))
def test_paged_decode(head_dim, group):
    rng = np.random.default_rng(group * 100 + head_dim)
    heads, kv = GQA[group]
    run_both(make_batch(rng, [(n, 1) for n in EDGES], heads, kv, head_dim, BS))


def test_paged_decode_long_context_partitions():
    """Contexts past one decode partition (merged partial softmaxes), lengths around the cut."""
    from refengine.cpu import attention

    part = attention.DECODE_PARTITION
    rng = np.random.default_rng(7)
    run_both(make_batch(rng, [(part - 1, 1), (part, 1), (part + 1, 1), (3 * part + 5, 1)], 9, 3, 64, BS))


@pytest.mark.parametrize("head_dim", [32, 64])
@pytest.mark.parametrize("group", list(GQA))
def test_flash_prefill_whole_and_chunked(head_dim, group):
    rng = np.random.default_rng(group * 10 + head_dim)
    heads, kv = GQA[group]
    seqs = [(n, n) for n in EDGES if n > 1]  # whole prompts
    seqs += [(40, 9), (BS + 1, 2), (300, 37), (130, 65)]  # chunked: q_len < seq_len
    run_both(make_batch(rng, seqs, heads, kv, head_dim, BS))


@pytest.mark.parametrize("blas", [True, False])
def test_long_prefill_blas_and_flash_paths(blas, monkeypatch):
    """Long chunks go to the BLAS-tiled path by default (several query tiles, chunks that
    start mid-context); the flash kernel must be right there too."""
    from refengine.cpu import attention

    rng = np.random.default_rng(3)
    tile, low = attention.BLAS_PREFILL_Q_TILE, attention.BLAS_PREFILL_MIN_ROWS
    seqs = [(800, 70), (low + 5, low), (900, 1), (300, 300), (2 * tile + 9, 2 * tile + 3), (140, low - 1)]
    b = make_batch(rng, seqs, 9, 3, 64, BS)
    if not blas:
        monkeypatch.setattr(attention, "BLAS_PREFILL_MIN_ROWS", 1 << 30)
    assert _Plan(b.meta, BS).blas_prefill == ([0, 1, 3, 4] if blas else [])
    run_both(b)


@pytest.mark.parametrize("block_size", [8, 16, 32, 5])
def test_mixed_decode_and_prefill(block_size):
    """Decode rows and prefill chunks in one batch, odd block sizes, shuffled blocks."""
    rng = np.random.default_rng(block_size)
    seqs = [(1, 1), (block_size - 1, 1), (37, 12), (block_size, block_size), (block_size + 1, 1),
            (71, 3), (2, 2), (150, 150), (65, 1)]
    run_both(make_batch(rng, seqs, 9, 3, 64, block_size))


def test_plan_and_bad_inputs():
    rng = np.random.default_rng(0)
    b = make_batch(rng, [(20, 1), (5, 5)], 4, 2, 32, BS)
    nb = NumbaAttention()
    plan = _Plan(b.meta, BS)
    assert plan.decode_seqs.tolist() == [0] and plan.tile_seq.tolist() == [1]
    with pytest.raises(TypeError):
        nb.forward(b.q.astype(np.float64), b.k_cache, b.v_cache, b.meta, 0.1)
    bad = AttentionMetadata(b.meta.query_start_loc, b.meta.seq_lens, b.meta.block_tables + 1000,
                            b.meta.slot_mapping, b.meta.max_query_len, b.meta.max_seq_len)
    with pytest.raises(ValueError, match="outside the cache"):
        nb.forward(b.q, b.k_cache, b.v_cache, bad, 0.1)
    bad_slots = AttentionMetadata(b.meta.query_start_loc, b.meta.seq_lens, b.meta.block_tables,
                                  b.meta.slot_mapping + 10_000, b.meta.max_query_len, b.meta.max_seq_len)
    with pytest.raises(IndexError):
        nb.write_kv(b.k_cache, b.v_cache, b.k_new, b.v_new, bad_slots)


# --- sliding window, soft-cap, head dims ---------------------------------------------------

PART = 128  # attention.DECODE_PARTITION, checked below
WINDOWS = [1, 5, BS, PART + 9]  # the last: past a decode partition and a prefill key tile


def window_batch(window):
    """Prompts shorter than, equal to and longer than the window (three windows long), chunks
    starting inside and past it, decode rows at and past its edge, a context several key
    tiles long."""
    W = window
    return [(max(1, W - 1), max(1, W - 1)), (W, W), (W + 1, W + 1), (3 * W, 3 * W), (3 * W, W // 2 + 1),
            (2 * W + 5, 7), (W, 1), (W + 1, 1), (3 * W + 2, 1), (1, 1), (2 * 128 + 3 * W, W + 3)]


@pytest.fixture(params=["flash", "blas"])
def prefill_path(request, monkeypatch):
    """Every chunk of two rows or more through the flash kernel, or through the BLAS path."""
    from refengine.cpu import attention

    monkeypatch.setattr(attention, "BLAS_PREFILL_MIN_ROWS", 1 << 30 if request.param == "flash" else 2)
    return request.param


@pytest.fixture(params=["serial", "parallel"])
def decode_path(request, monkeypatch):
    """Every decode batch on the calling thread, or as a parallel launch."""
    from refengine.cpu import attention

    monkeypatch.setattr(attention, "SERIAL_DECODE_MAX_TOKENS", 1 << 30 if request.param == "serial" else 0)
    return request.param


def test_window_constants():
    from refengine.cpu import attention

    assert attention.DECODE_PARTITION == PART and attention.PREFILL_K_TILE == 128


@pytest.mark.parametrize("window", WINDOWS)
def test_sliding_window_decode(window, decode_path):
    rng = np.random.default_rng(window)
    W = window
    seqs = [(n, 1) for n in sorted({1, max(1, W - 1), W, W + 1, 3 * W, 3 * W + 5, 3 * PART + 7, BS + 1})]
    run_both(make_batch(rng, seqs, 9, 3, 64, BS), sliding_window=window)


@pytest.mark.parametrize("window", WINDOWS)
def test_sliding_window_prefill(window, prefill_path, decode_path):
    rng = np.random.default_rng(window + 1)
    run_both(make_batch(rng, window_batch(window), 9, 3, 64, BS), sliding_window=window)


@pytest.mark.parametrize("window", [3, 40])
def test_sliding_window_rows_without_keys_in_a_key_tile(window, monkeypatch):
    """Key tiles smaller than a query tile: later rows of a query tile find whole key tiles
    before their window; they must skip them (no NaN, no key outside the window)."""
    from refengine.cpu import attention

    monkeypatch.setattr(attention, "PREFILL_K_TILE", 4)
    monkeypatch.setattr(attention, "BLAS_PREFILL_MIN_ROWS", 1 << 30)
    rng = np.random.default_rng(window)
    run_both(make_batch(rng, [(64, 64), (150, 40), (97, 33), (9, 9)], 4, 2, 32, BS), sliding_window=window)


@pytest.mark.parametrize("window", [5, PART + 9])
def test_sliding_window_int8_caches(window, prefill_path, decode_path):
    rng = np.random.default_rng(window + 2)
    run_both(make_batch(rng, window_batch(window), 9, 3, 64, BS, int8=True), sliding_window=window)


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("cap", [0.5, 20.0])
def test_logits_soft_cap(cap, window, prefill_path, decode_path):
    rng = np.random.default_rng(int(cap * 10) + (window or 0))
    b = make_batch(rng, window_batch(7) + [(3 * PART + 5, 1)], 8, 2, 32, BS)
    b.q *= 8  # scores of several units: the cap bends them
    got = run_both(b, sliding_window=window, logits_soft_cap=cap)
    assert not np.allclose(got, run_both(b, sliding_window=window), atol=1e-3)  # the cap changed something


def test_logits_soft_cap_int8_caches(prefill_path):
    rng = np.random.default_rng(11)
    b = make_batch(rng, window_batch(7), 9, 3, 64, BS, int8=True)
    b.q *= 8
    run_both(b, sliding_window=7, logits_soft_cap=5.0)


@pytest.mark.parametrize("head_dim", [96, 256])
@pytest.mark.parametrize("window", [None, 20])
def test_head_dims_96_and_256(head_dim, window, prefill_path, decode_path):
    """Phi-3 (96) and Gemma (256): no kernel may assume a head_dim multiple of 64 or at most 128."""
    rng = np.random.default_rng(head_dim + (window or 0))
    seqs = [(1, 1), (BS + 1, 1), (3 * PART + 5, 1), (70, 70), (130, 65), (300, 37), (40, 9), (2, 2)]
    options = {"sliding_window": window, "logits_soft_cap": 30.0 if window else None}
    run_both(make_batch(rng, seqs, 8, 2, head_dim, BS), **options)
    run_both(make_batch(rng, seqs[:4], 4, 2, head_dim, BS, int8=True), **options)


def test_decode_partitions_cover_only_the_window():
    """Per window: consecutive partitions of at most DECODE_PARTITION tokens over exactly
    ``[max(0, seq_len - W), seq_len)``, built once per step and window."""
    rng = np.random.default_rng(0)
    lens = [1, 5, BS, 300, 1000, 3 * PART + 7]
    b = make_batch(rng, [(n, 1) for n in lens] + [(40, 9)], 4, 2, 32, BS)
    plan = _Plan(b.meta, BS)
    for window in (None, 1, 5, PART, PART + 9, 512):
        parts = plan.decode_parts(window)
        assert plan.decode_parts(window) is parts  # cached for the step's other layers
        assert (parts.end - parts.start <= PART).all() and (parts.end > parts.start).all()
        for d, n in enumerate(lens):
            mine = parts.seq == d
            start, end = parts.start[mine], parts.end[mine]
            assert start[0] == (0 if window is None else max(0, n - window)) and end[-1] == n
            assert (start[1:] == end[:-1]).all()
        assert parts.tokens == sum(n if window is None else min(n, window) for n in lens)
    assert plan.decode_parts(10_000) is plan.decode_parts(None)  # a window past every context: the same work


@pytest.mark.parametrize("window", [None, 70])
def test_batch_invariant_rows_are_decode_rows(monkeypatch, window):
    """Batch-invariant mode: every query row, prefill rows too, is a decode row of the paged
    decode kernel whose context ends at its own position; a step's rows are split into
    launches of whole rows, and the split changes no bit. Against the twin, int8 too."""
    from refengine.cpu import attention

    rng = np.random.default_rng(5)
    seqs = [(300, 37), (20, 1), (5, 5), (3 * PART + 7, 2), (PART + 1, PART)]
    options = {"sliding_window": window, "logits_soft_cap": 30.0 if window else None}
    b = make_batch(rng, seqs, 4, 2, 32, BS)
    plan = _Plan(b.meta, BS, batch_invariant=True)
    qsl, lens = b.meta.query_start_loc, b.meta.seq_lens
    assert plan.tile_seq.size == 0 and plan.blas_prefill == []
    assert plan.decode_rows.tolist() == list(range(qsl[-1]))
    assert plan._decode_lens.tolist() == [int(lens[i] - (qsl[i + 1] - 1 - r))
                                          for i in range(len(seqs)) for r in range(qsl[i], qsl[i + 1])]
    whole = run_both(b, invariant=True, **options)
    monkeypatch.setattr(attention, "DECODE_PARTS_PER_LAUNCH", 3)
    parts = _Plan(b.meta, BS, batch_invariant=True).decode_parts(window)
    assert len(parts.launches) > 10 and sum(t for *_, t in parts.launches) == parts.tokens
    assert [p for a, e, _ in parts.launches for p in range(a, e)] == list(range(parts.seq.size))
    assert all(parts.seq[a] != parts.seq[a - 1] for a, _, _ in parts.launches[1:])  # whole rows
    np.testing.assert_array_equal(run_both(b, invariant=True, **options), whole)
    run_both(make_batch(rng, seqs, 4, 2, 32, BS, int8=True), invariant=True, **options)


def test_soft_cap_kernel_matches_tanh():
    """Within 4 ulp relative (8 units of 2^-24) of float64 ``c * tanh(a x / c)``, at 0, tiny,
    moderate and huge scores; the sign kept, NaN propagated, in place for every length."""
    x = np.concatenate([np.linspace(-80, 80, 100_001), [0.0, 1e-30, -1e-30, 1e-7, 3e-4, 1e30, -1e30]]).astype(np.float32)
    for a, cap in ((1.0, 50.0), (0.125, 0.5), (1.0, 1.0)):
        got = x.copy()
        _soft_cap(got, got.size, a, cap, np.empty(2 * got.size, np.int32))
        want = cap * np.tanh(a * x.astype(np.float64) / cap)
        err = np.abs(got - want) / np.maximum(np.abs(want), 1e-300)
        assert err[want != 0].max() <= 8 * U32 and (got[want == 0] == 0).all()
        assert (np.sign(got) == np.sign(want)).all()
    y = np.array([np.nan, 2.0, -3.0], np.float32)
    _soft_cap(y, 2, 1.0, 1.0, np.empty(6, np.int32))  # only the first two
    assert np.isnan(y[0]) and abs(y[1] - np.tanh(2.0)) < 1e-6 and y[2] == -3.0


def test_bad_window_and_cap():
    rng = np.random.default_rng(0)
    b = make_batch(rng, [(20, 1), (5, 5)], 4, 2, 32, BS)
    nb = NumbaAttention()
    for bad in (0, -3, 2.5):
        with pytest.raises(ValueError, match="sliding_window"):
            nb.forward(b.q, b.k_cache, b.v_cache, b.meta, 0.1, sliding_window=bad)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="logits_soft_cap"):
            nb.forward(b.q, b.k_cache, b.v_cache, b.meta, 0.1, logits_soft_cap=bad)


def test_backend_registry():
    assert get_attention_backend("numba").name == "numba"
    assert get_layer_ops("numba").name == "numba"


# --- layer ops ------------------------------------------------------------------------


def product_check(x, w):
    """The check of a float32 ``x @ w``: against float64 and against BLAS, within the rounding
    bound of a K-term float32 sum: |computed - exact| <= K * u * (|x| @ |w|) (Higham,
    "Accuracy and Stability", eq. 3.5; both sides obey it, so they differ by at most twice
    that). Returns the check, a function of the computed product; the bound and both
    references are computed once, for every kernel variant checked against them."""
    k = x.shape[1]
    bound = k * U32 * (np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64))
    exact = x.astype(np.float64) @ w.astype(np.float64)
    blas = x @ w

    def check(got):
        assert np.isfinite(got).all()
        assert (np.abs(got - exact) <= bound).all()
        assert (np.abs(got - blas) <= 2 * bound).all()

    return check


def check_product(got, x, w):
    """:func:`product_check` of ``x @ w`` on ``got``."""
    product_check(x, w)(got)


@pytest.mark.parametrize("rows", list(range(1, 21)) + [BLAS_MIN_ROWS - 1, BLAS_MIN_ROWS])
def test_linear_all_layouts(rows):
    """The numba layout (``weight``: ``[out, in]`` rows, a transposed view), the tied
    lm_head (``embed.T``, the same layout, not copied) and a plain ``[in, out]`` array (BLAS)."""
    rng = np.random.default_rng(rows)
    ops = NumbaOps()
    x = rng.standard_normal((rows, 131), dtype=np.float32)  # K = 131: the lanes' tail runs
    m = rng.standard_normal((203, 131), dtype=np.float32)  # N = 203: a partial tile of weight rows
    w = ops.weight(m)
    assert w.shape == (131, 203) and w.T.flags.c_contiguous
    check_product(ops.linear(x, w), x, m.T)
    check_product(ops.linear(x, np.ascontiguousarray(m.T)), x, m.T)
    check_product(ops.linear(x[:, :128], ops.weight(m[:, :128])), x[:, :128], m[:, :128].T)  # K % 16 == 0


@pytest.mark.parametrize("rows", [1, 2, 5, 7, 16])
def test_linear_kernel_writes_every_output(rows):
    """The kernel straight (parallel and serial twins, both register tiles), into
    NaN-poisoned outputs, at SmolLM2's shapes, with task blocks that split the weight rows
    into whole tiles, partial tiles and one block."""
    rng = np.random.default_rng(rows)
    for k, n in ((576, 960), (576, 3072), (1536, 576), (576, 1000), (130, 50)):
        x = rng.standard_normal((rows, k), dtype=np.float32)
        wt = rng.standard_normal((n, k), dtype=np.float32)
        check = product_check(x, wt.T)
        for block in (4, 6, 64, n):
            for tile4x4 in (False, True):
                for kernel in (_matmul_dot.parallel, _matmul_dot.serial):
                    out = np.full((rows, n), np.nan, np.float32)
                    kernel(x, wt, out, block, tile4x4)
                    check(out)


def test_linear_does_not_depend_on_thread_count():
    """The thread count adapts to load; the product's sums must not change with it."""
    import numba

    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 576), dtype=np.float32)
    w = NumbaOps().weight(rng.standard_normal((960, 576), dtype=np.float32))
    before = numba.get_num_threads()
    try:
        results = []
        for n in sorted({1, before}):
            numba.set_num_threads(n)
            results.append(NumbaOps().linear(x, w))
    finally:
        numba.set_num_threads(before)
    for r in results[1:]:
        np.testing.assert_array_equal(r, results[0])


@pytest.mark.parametrize("k", [576, 131])
def test_linear_rows_do_not_depend_on_batch(k):
    """Below the BLAS threshold a row's result is the same bits alone or in any batch, in
    either register tile (every output summed in the same order: the module docstring)."""
    rng = np.random.default_rng(1)
    ops = NumbaOps()
    w = ops.weight(rng.standard_normal((962, k), dtype=np.float32))
    x = rng.standard_normal((BLAS_MIN_ROWS - 1, k), dtype=np.float32)
    full = ops.linear(x, w)
    for rows in (1, 2, DOT_4X4_MIN_ROWS - 1, DOT_4X4_MIN_ROWS, 9):
        np.testing.assert_array_equal(ops.linear(x[:rows], w), full[:rows])
    for r in (0, 5, x.shape[0] - 1):
        np.testing.assert_array_equal(ops.linear(x[r:r + 1], w)[0], full[r])
    for tile4x4 in (False, True):
        out = np.empty_like(full)
        _matmul_dot(x, w.T, out, 64, tile4x4)
        np.testing.assert_array_equal(out, full)


@pytest.mark.parametrize("rows", [1, 5, 70])
def test_rms_norm(rows):
    """Sums of squares in a different order (vectorised partial sums vs NumPy's pairwise
    sum): the variance differs by a few ulps, halved by the square root, then the same two
    products; 2e-6 relative (about 16 ulps) bounds it at d = 576."""
    rng = np.random.default_rng(rows)
    x = 3 * rng.standard_normal((rows, 576), dtype=np.float32)
    weight = rng.standard_normal(576, dtype=np.float32)
    got, want = NumbaOps().rms_norm(x, weight, 1e-5), NumpyOps().rms_norm(x, weight, 1e-5)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=0)
    # per-head norm (Qwen3) on a strided view
    qkv = rng.standard_normal((rows, 3, 2, 32), dtype=np.float32)
    np.testing.assert_allclose(NumbaOps().rms_norm(qkv[:, 1], weight[:32], 1e-6),
                               NumpyOps().rms_norm(qkv[:, 1], weight[:32], 1e-6), rtol=2e-6, atol=0)


@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_rope_bitwise(head_dim):
    """Same float32 operations in the same order, no FMA: equal to the twin bit for bit,
    in place on views into a fused qkv row."""
    rng = np.random.default_rng(head_dim)
    rope = RotaryEmbedding(head_dim, 4096, 10000.0, None)
    tokens, hq, hkv = 7, 9, 3
    qkv = rng.standard_normal((tokens, (hq + 2 * hkv) * head_dim), dtype=np.float32)
    q = qkv[:, :hq * head_dim].reshape(tokens, hq, head_dim)
    k = qkv[:, hq * head_dim:(hq + hkv) * head_dim].reshape(tokens, hkv, head_dim)
    positions = rng.integers(0, 4096, tokens)
    want_q, want_k = NumpyOps().rope(q.copy(), k.copy(), positions, rope)
    got_q, got_k = NumbaOps().rope(q, k, NumbaOps().device_positions(positions), rope)
    np.testing.assert_array_equal(got_q, want_q)
    np.testing.assert_array_equal(got_k, want_k)
    for bad in ([4096] * tokens, [0] * (tokens - 1) + [-1]):
        with pytest.raises(IndexError, match=r"\[0, 4096\)"):
            NumbaOps().rope(q, k, np.array(bad), rope)


@pytest.mark.parametrize("rows", [1, 9])
def test_silu_and_mul(rows):
    """C ``expf`` vs NumPy's SIMD exp (each within ~1 ulp), then the same divide and
    multiply: a few ulps relative; 1e-6 (8 ulps)."""
    rng = np.random.default_rng(rows)
    x = 4 * rng.standard_normal((rows, 2 * 1536), dtype=np.float32)
    np.testing.assert_allclose(NumbaOps().silu_and_mul(x), NumpyOps().silu_and_mul(x), rtol=1e-6, atol=1e-30)


# --- whole model ----------------------------------------------------------------------


def test_tiny_model_numba_backend_matches_numpy(tiny_llama_dir):
    """Greedy tokens equal token for token; prompt logits within 1e-5 (the kernels' float32
    rounding differs from BLAS's at ~1e-7 relative per product; three layers of it stay
    below ~1e-6 on logits of O(1), and a wrong kernel moves them by O(0.1))."""
    from refengine import LLM, SamplingParams

    prompts = [list(range(3, 40)), [5, 9, 17], list(range(50, 67)), [7]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    kw = dict(block_size=8, max_num_batched_tokens=24, log_stats=False)  # chunked prefill mixed with decodes
    numpy_llm = LLM(tiny_llama_dir, attention_backend="numpy", **kw)
    numba_llm = LLM(tiny_llama_dir, attention_backend="numba", **kw)
    assert numba_llm.llm_engine.model.ops.name == "numba"
    want = [o.outputs[0].token_ids for o in numpy_llm.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in numba_llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    for ids in prompts[:3]:
        np.testing.assert_allclose(numba_llm.prompt_logits(ids), numpy_llm.prompt_logits(ids), rtol=1e-5, atol=1e-5)


# --- threads --------------------------------------------------------------------------


def test_configure_and_adapt_threads(monkeypatch):
    import numba
    from threadpoolctl import threadpool_info

    from refengine.cpu import threads

    assert threads.numba_threading_layer() in ("omp", "workqueue", "tbb")
    try:
        with pytest.raises(ValueError):
            threads.configure_threads(0)
        assert threads.configure_threads(1) == 1
        assert numba.get_num_threads() == 1
        assert all(lib["num_threads"] == 1 for lib in threadpool_info() if lib["user_api"] == "blas")
        assert threads.adapt_threads() == 1  # fixed: no adaptation

        # adaptive: others kept 1.5 of our cores busy over the last interval -> 2 fewer threads
        cores = threads.usable_cores()
        samples = iter([(0.0, 0.0, 0.0), (2.0, 2.0 * 1.5 + 1.0, 1.0)])  # (wall, busy of our cores, own CPU)
        monkeypatch.setattr(threads, "_sample", lambda: next(samples))
        monkeypatch.setattr(threads.time, "monotonic", lambda: 10.0)
        assert threads.configure_threads(None) == cores
        assert threads.adapt_threads() == max(1, cores - 2)
        assert numba.get_num_threads() == max(1, cores - 2)

        # BLAS's threads only in BLAS steps; numba's in every step (its idle threads spin briefly)
        monkeypatch.setattr(threads, "_sample", lambda: None)
        monkeypatch.setattr(threads, "_short_spin", True)
        blas_threads = lambda: {lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"}  # noqa: E731
        n = max(1, cores - 2)
        assert threads.adapt_threads(blas_step=True) == n
        assert numba.get_num_threads() == n and blas_threads() == {n}
        assert threads.adapt_threads(blas_step=False) == n
        assert numba.get_num_threads() == n and blas_threads() == {1}
        threads.adapt_threads()
        assert numba.get_num_threads() == n and blas_threads() == {n}
    finally:
        monkeypatch.undo()
        threads.configure_threads(None)


@pytest.mark.parametrize("first", ["setup_cpu_runtime", "numba_imported_first"])
def test_wait_policy_is_set_only_while_numba_starts(first):
    """numba's pool starts with GOMP_SPINCOUNT set when the CPU runtime set-up starts it,
    also when the program imported numba and NumPy before refengine; the variable is back
    to unset after."""
    import subprocess
    import sys

    start = ("from refengine.cpu import setup_cpu_runtime; setup_cpu_runtime()" if first == "setup_cpu_runtime"
             else "import numpy, numba.np.ufunc.parallel\nfrom refengine.cpu import setup_cpu_runtime\n"
                  "setup_cpu_runtime()\nfrom refengine.cpu import threads as th; th.configure_threads(2)")
    code = ("import os, numba, numba.np.ufunc.parallel as par\n"
            "seen = []\n"
            "launch = par._launch_threads\n"
            "def spy():\n"
            "    if not seen: seen.append(os.environ.get('GOMP_SPINCOUNT'))\n"
            "    launch()\n"
            "par._launch_threads = spy\n"
            f"{start}\n"
            "from refengine.cpu.threads import numba_threading_layer as t\n"
            "print(t(), seen[0], os.environ.get('GOMP_SPINCOUNT'))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, check=True)
    layer, at_start, after = out.stdout.split()
    from refengine.cpu.threads import GOMP_SPINCOUNT

    assert layer in ("omp", "workqueue", "tbb") and at_start == GOMP_SPINCOUNT and after == "None"


# Kernels of these tests alone, compiled once per process (every parametrization calls them
# with the same types) and cached by numba beside this file, as the engine's kernels are.
@njit(cache=True)
def _copy_key_tile(kf, first, row, count, dims, ktf, j0, k_tile):  # pragma: no cover - compiled
    """:func:`refengine.cpu.attention._transpose_keys` called as the flash kernel calls it."""
    _transpose_keys(kf, np.uintp(first), np.uintp(row), np.uintp(count), np.uintp(dims), ktf, np.uintp(j0),
                    np.uintp(k_tile))


@njit(cache=True)
def _sums_both_ways(a, at_once, one_by_one):  # pragma: no cover - compiled
    """The sums of ``a``'s sixteen 16-lane vectors by ``v16_sums16`` into ``at_once`` and one
    at a time by ``f8_sum(v16_halves(v))`` into ``one_by_one``."""
    ld = lambda i: v16_load(a, np.uintp(16 * i))  # noqa: E731
    v16_store(at_once, np.uintp(0), v16_sums16(ld(0), ld(1), ld(2), ld(3), ld(4), ld(5), ld(6), ld(7), ld(8),
                                               ld(9), ld(10), ld(11), ld(12), ld(13), ld(14), ld(15)))
    for i in range(16):
        one_by_one[i] = f8_sum(v16_halves(ld(i)))


@pytest.mark.parametrize("dims,count", [(64, 16), (64, 13), (12, 16), (8, 3)])
def test_key_tile_transpose_is_a_copy(dims, count):
    """The flash kernel's key-tile copy (8 x 8 register transposes where ``dims`` is a
    multiple of eight, element by element otherwise and for the last keys) puts key row
    ``i`` of the cache into column ``j0 + i`` of the tile, every value bit for bit."""
    rng = np.random.default_rng(dims * 100 + count)
    row, k_tile, j0, first = 3 * dims, 32, 5, dims  # rows of three heads, the second one's keys
    cache = rng.standard_normal(first + count * row + dims).astype(np.float32)
    tile = np.full(dims * k_tile, np.nan, dtype=np.float32)
    _copy_key_tile(cache, first, row, count, dims, tile, j0, k_tile)
    keys = np.stack([cache[first + i * row:first + i * row + dims] for i in range(count)])  # [count, dims]
    tile = tile.reshape(dims, k_tile)
    assert np.array_equal(tile[:, j0:j0 + count].view(np.uint32), keys.T.view(np.uint32))
    assert np.isnan(tile[:, :j0]).all() and np.isnan(tile[:, j0 + count:]).all()  # nothing else written


def test_sixteen_lane_sums_at_once_equal_one_at_a_time():
    """``v16_sums16`` (the decode kernel's scores, sixteen positions at once) gives each
    vector's sum with the bits of ``f8_sum(v16_halves(v))``, the one-at-a-time sum, in order."""
    rng = np.random.default_rng(16)
    # values of many magnitudes, so that any other order of the additions rounds differently
    a = (rng.standard_normal(256) * 10.0 ** rng.integers(-6, 7, 256)).astype(np.float32)
    at_once, one_by_one = np.empty(16, np.float32), np.empty(16, np.float32)
    _sums_both_ways(a, at_once, one_by_one)
    assert np.array_equal(at_once.view(np.uint32), one_by_one.view(np.uint32))
    np.testing.assert_allclose(at_once, a.reshape(16, 16).astype(np.float64).sum(axis=1), rtol=1e-5, atol=1e-3)


def test_exp_affine_accuracy_and_edges():
    """Within 2 ulp (4 units of 2^-24 relative) of exp over the range softmax and SiLU use;
    clamped below -87, inf above the float32 range, NaN kept."""
    from refengine.cpu.layer_ops import exp_affine

    x = np.linspace(-87.0, 88.3, 400_001).astype(np.float32)
    out = np.empty_like(x)
    exp_affine(x, 1.0, 0.0, out, np.empty(2 * x.size, np.int32))
    want = np.exp(x.astype(np.float64))
    assert (np.abs(out - want) / want).max() <= 4 * U32
    y = np.array([-200.0, 100.0, np.nan, 1.0], np.float32)
    exp_affine(y, -1.0, 0.5, y, np.empty(8, np.int32))  # exp(-x + 0.5), in place
    assert y[0] == np.inf and np.isnan(y[2])
    np.testing.assert_allclose(y[[1, 3]], np.exp([-87.0, -0.5]), rtol=4 * U32)


def test_keep_freed_memory_applies_once_and_respects_the_user(monkeypatch):
    import platform

    from refengine.cpu import malloc

    monkeypatch.setattr(malloc, "_applied", False)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert malloc.keep_freed_memory() is False  # the user's glibc settings stand
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    for name in malloc._USER_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert malloc.keep_freed_memory() is glibc
    assert malloc.keep_freed_memory() is glibc  # a second call changes nothing


def test_huge_page_zeros_is_an_aligned_writable_zero_array():
    """The KV pool's allocation: zeros, writable, C-contiguous, the requested shape and dtype,
    starting on a 2 MB boundary when it is big enough to hold a huge page; small arrays are
    plain ``np.zeros``. Whether the kernel grants huge pages is its business (THP mode)."""
    from refengine.attention import kv_cache as malloc  # the KV pool's allocator
    from refengine.attention.kv_cache import KVCache

    big = malloc.huge_page_zeros((300, 16, 3, 64), np.float32)  # 3.5 MB
    assert big.shape == (300, 16, 3, 64) and big.dtype == np.float32 and big.flags.c_contiguous
    assert big.flags.writeable and not big.any()
    if hasattr(__import__("mmap"), "MADV_HUGEPAGE"):
        assert big.ctypes.data % malloc.HUGE_PAGE == 0
    big[-1, -1, -1, -1] = 7.0  # the last element is inside the mapping
    assert big.sum() == 7.0
    small = malloc.huge_page_zeros((4, 5), np.float64)
    assert small.shape == (4, 5) and small.dtype == np.float64 and not small.any()
    pool = KVCache(2, 300, 16, 3, 64)
    assert all(a.shape == (300, 16, 3, 64) and not a.any() for a in pool.k + pool.v)
    pool.k[0][1] = 1.0
    assert not pool.k[1].any() and not pool.v[0].any()  # separate mappings


def test_warm_up_says_once_what_compiling_took(tiny_llama_dir, monkeypatch, caplog):
    """The engine warms the numba kernels up at start; a cache miss is reported in one line,
    a run that loads everything from the cache says nothing."""
    import logging

    from refengine import LLM
    from refengine.cpu import numba_support
    from refengine.cpu.engine_hooks import warm_up as warm_up_cpu_kernels

    llm = LLM(str(tiny_llama_dir), max_model_len=128, log_stats=False)
    engine = llm.llm_engine
    caplog.clear()  # the engine's own warm-up: silent or not, depending on numba's cache
    counts = iter([5, 9])  # before and after: 4 kernels compiled
    monkeypatch.setattr(numba_support, "kernel_cache_misses", lambda: next(counts))
    with caplog.at_level(logging.WARNING, logger="refengine.core.model_runner"):
        warm_up_cpu_kernels(engine.model, engine.kv_cache, 2048, 128)
    (record,) = caplog.records
    assert record.getMessage().startswith("compiled 4 numba CPU kernels in ")
    caplog.clear()
    monkeypatch.setattr(numba_support, "kernel_cache_misses", lambda: 7)  # all from the cache
    with caplog.at_level(logging.WARNING, logger="refengine.core.model_runner"):
        warm_up_cpu_kernels(engine.model, engine.kv_cache, 2048, 128)
        warm_up_cpu_kernels(engine.model, engine.kv_cache, 1, 2)  # too short a context: nothing runs
    assert not caplog.records
    assert numba_support.kernel_cache_dirs()  # where they are cached is known


def test_warm_up_prefill_reaches_every_row_switch():
    """The warm-up's prefill chunk is at least every row count from which a compiled kernel
    replaces another, so it runs the versions any longer chunk would."""
    from refengine.cpu.attention import BLAS_PREFILL_MIN_ROWS
    from refengine.cpu.engine_hooks import WARM_UP_PREFILL_ROWS
    from refengine.cpu.gguf_products import PREFILL_MIN_ROWS
    from refengine.cpu.int_products import INT4_BLAS_MIN_ROWS, INT8_TILE_MIN_ROWS
    from refengine.cpu.layer_ops import DOT_4X4_MIN_ROWS, ELEMENTWISE_PARALLEL_MIN_ROWS

    switches = [BLAS_PREFILL_MIN_ROWS, PREFILL_MIN_ROWS, INT4_BLAS_MIN_ROWS, INT8_TILE_MIN_ROWS,
                ELEMENTWISE_PARALLEL_MIN_ROWS, DOT_4X4_MIN_ROWS]
    assert WARM_UP_PREFILL_ROWS == max(switches)


@pytest.mark.parametrize("rows,k,n", [(64, 576, 1536), (161, 131, 77), (512, 64, 300), (31, 16, 8)])
def test_blas_matmul_over_own_threads(rows, k, n):
    """Row blocks over refengine's threads, each a one-thread BLAS call, give ``a @ b`` into
    ``out`` or a new array at any thread count: within the forward error bound of a K-term
    float32 dot product, ``K * eps * (|a| @ |b|)`` (OpenBLAS's summation order depends on how
    it blocks the rows, single- or multi-threaded alike); and one thread is one call."""
    from threadpoolctl import threadpool_limits

    from refengine.cpu import blas

    rng = np.random.default_rng(rows)
    a = rng.standard_normal((rows, k), dtype=np.float32)
    b = rng.standard_normal((n, k), dtype=np.float32).T  # the transposed views the numba backend hands BLAS
    bound = k * np.finfo(np.float32).eps * (np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64))
    exact = a.astype(np.float64) @ b.astype(np.float64)
    with threadpool_limits(limits=1, user_api="blas"):
        before = blas.get_threads()
        try:
            blas.set_threads(1)
            assert np.array_equal(blas.matmul(a, b), np.matmul(a, b))
            for threads in (2, 3, 5):
                blas.set_threads(threads)
                got = blas.matmul(a, b)
                assert got.dtype == np.float32 and np.all(np.abs(got - exact) <= bound)
                out = np.full((rows, n), np.nan, dtype=np.float32)
                assert blas.matmul(a, b, out=out) is out and np.array_equal(out, got)
        finally:
            blas.set_threads(before)


def test_pools_per_step_for_the_numba_backend(monkeypatch):
    """The numba backend keeps the BLAS library on one thread and spreads its products over
    refengine's own threads; numba's kernels run serial in a BLAS step only while numba's
    idle threads spin long (libgomp loaded by another library first)."""
    import numba
    from threadpoolctl import threadpool_info

    from refengine.cpu import blas, threads

    blas_threads = lambda: {lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"}  # noqa: E731
    try:
        monkeypatch.setattr(threads, "usable_cores", lambda: 2)
        monkeypatch.setattr(threads, "_sample", lambda: None)
        assert threads.configure_threads(None, library_blas=False) == 2
        assert blas_threads() == {1} and blas.get_threads() == 2
        for short, numba_in_blas_step in ((True, min(2, numba.config.NUMBA_NUM_THREADS)), (False, 1)):
            monkeypatch.setattr(threads, "_short_spin", short)
            assert threads.adapt_threads(blas_step=True) == 2
            assert blas_threads() == {1} and blas.get_threads() == 2
            assert numba.get_num_threads() == numba_in_blas_step
            threads.adapt_threads(blas_step=False)
            assert blas_threads() == {1} and numba.get_num_threads() == min(2, numba.config.NUMBA_NUM_THREADS)
    finally:
        monkeypatch.undo()
        threads.configure_threads(None)


def test_short_spin_follows_who_loaded_libgomp():
    """The spin is long in a fresh process (refengine's GOMP_SPINCOUNT) and in one that loaded
    libgomp (torch does) before refengine's set-up (libgomp's default); short only when the
    user asks for it (a GOMP_SPINCOUNT of at most SHORT_SPINCOUNT)."""
    import subprocess
    import sys

    code = ("import ctypes, sys\n"
            "if sys.argv[1] == 'first': ctypes.CDLL('libgomp.so.1')\n"
            "from refengine.cpu import setup_cpu_runtime, threads\n"
            "setup_cpu_runtime()\n"
            "print(threads.numba_threading_layer(), threads.short_spin())\n")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    got = {}
    for case in ("fresh", "first", "user-short"):
        case_env = dict(env, GOMP_SPINCOUNT="2000") if case == "user-short" else env
        out = subprocess.run([sys.executable, "-c", code, case], env=case_env, cwd=root, capture_output=True,
                             text=True, check=True)
        got[case] = out.stdout.split()
    if got["fresh"][0] != "omp":
        pytest.skip(f"numba's threading layer here is {got['fresh'][0]!r}, not libgomp's")
    assert got == {"fresh": ["omp", "False"], "first": ["omp", "False"], "user-short": ["omp", "True"]}
