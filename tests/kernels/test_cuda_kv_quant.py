"""Quantized KV caches in the CUDA kernels (``kv_cache_dtype`` int8, fp8_e4m3, fp8_e5m2), emulated.

int8 is LMDeploy's scheme (int8 values, a float32 scale per token and KV head), as on the CPU
backends; fp8 is vLLM's (one byte per value, ``fp8(x / scale)`` with a per-layer scale). The
NumPy twin (``refengine/attention/numpy_ref.py``) is the oracle: its fp8 conversions must equal
ml_dtypes on every value in range (and saturate beyond it); the emulated kernels must write
the twin's bytes and scales bit for bit, decode every fp8 code to the twin's float bit for bit,
and match the twin's attention at block boundaries, odd sizes, sliding windows and soft caps,
over caches poisoned outside the contexts (NaN scales, random bytes, NaN codes) and into
NaN-poisoned outputs. End to end: the tiny model on the emulated kernels generates the
twin's tokens, and a decode over a prefill's quantized cache gives that prefill's
log-probabilities to float32 rounding.
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest

from refengine import LLM, SamplingParams, engine_args
from refengine.attention import AttentionMetadata, paged_metadata
from refengine.attention.cuda import EmulatedCudaAttention
from refengine.attention.kv_cache import FP8Scale, KVCache, quantize_int8
from refengine.attention.numpy_ref import NumpyAttention, float_to_fp8, fp8_to_float
from refengine.engine_args import EngineArgs
from tests.helpers import shuffled_block_tables

ml_dtypes = pytest.importorskip("ml_dtypes")

BS = 16
KV_DTYPES = ["int8", "fp8_e4m3", "fp8_e5m2"]
FP8 = {"fp8_e4m3": (ml_dtypes.float8_e4m3fn, 448.0), "fp8_e5m2": (ml_dtypes.float8_e5m2, 57344.0)}
GQA = {1: (4, 4), 3: (6, 2), 8: (8, 1)}  # group -> (heads, kv heads)
# the kernels read the twin's dequantized values bit for bit: only float32 summation order differs
ATTN_TOL = 1e-5


@pytest.fixture(scope="module")
def emu():
    return EmulatedCudaAttention(decode_partition_size=64)


# --- the fp8 conversions ---------------------------------------------------------------------

def _interesting_floats(fmt: str, rng) -> np.ndarray:
    """Random floats over the whole float32 range, float32 subnormals, the format's midpoints
    (ties) and their neighbours, its limits, infinities and NaNs."""
    _, fmax = FP8[fmt]
    wide = rng.standard_normal(20000).astype(np.float32) * (np.float32(10.0) ** rng.integers(-12, 9, 20000)
                                                               ).astype(np.float32)
    values = fp8_to_float(np.arange(127, dtype=np.uint8), fmt).astype(np.float64)
    values = values[np.isfinite(values)]
    mids = ((values[:-1] + values[1:]) / 2).astype(np.float32)
    special = np.array([0.0, -0.0, fmax, -fmax, fmax * 1.01, fmax * 1.0625, fmax * 1.2, 1e30, -1e30, 3e38,
                        np.inf, -np.inf, np.nan, -np.nan, 1e-45, -1e-40], np.float32)
    return np.concatenate([wide, mids, -mids, np.nextafter(mids, np.float32(np.inf)),
                           np.nextafter(mids, np.float32(0)), special]).astype(np.float32)


def _saturated_oracle(x: np.ndarray, fmt: str) -> np.ndarray:
    """ml_dtypes' round-to-nearest-even of x clipped to +-max (it overflows to NaN/inf instead)."""
    dt, fmax = FP8[fmt]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return np.clip(np.nan_to_num(x, nan=0.0, posinf=fmax, neginf=-fmax), -fmax, fmax).astype(dt).view(np.uint8)


@pytest.mark.parametrize("fmt", list(FP8))
def test_fp8_twin_matches_ml_dtypes(fmt):
    dt, fmax = FP8[fmt]
    codes = np.arange(256, dtype=np.uint8)
    want = codes.view(dt).astype(np.float32)
    got = fp8_to_float(codes, fmt)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    finite = ~np.isnan(want)
    np.testing.assert_array_equal(got[finite].view(np.uint32), want[finite].view(np.uint32))  # -0.0 included
    assert np.nanmax(got[np.isfinite(got)]) == fmax
    nans = {0x7F, 0xFF} if fmt == "fp8_e4m3" else set(range(0x7D, 0x80)) | set(range(0xFD, 0x100))
    assert set(np.flatnonzero(np.isnan(got))) == nans

    x = _interesting_floats(fmt, np.random.default_rng(0))
    enc = float_to_fp8(x, fmt)
    nan = np.isnan(x)
    np.testing.assert_array_equal(enc[~nan], _saturated_oracle(x, fmt)[~nan])
    np.testing.assert_array_equal(enc[nan] & 0x7F, 0x7F)  # NaN stays NaN (sign | 0x7F)
    assert (enc[x == np.inf] == float_to_fp8(np.float32(fmax), fmt)).all()  # saturating, not inf
    # every code that is a number survives the round trip (an infinity saturates to the max)
    number = np.isfinite(got)
    np.testing.assert_array_equal(float_to_fp8(got[number], fmt), codes[number])


def _one_token_meta(num_tokens: int, slots) -> AttentionMetadata:
    return AttentionMetadata(np.array([0, num_tokens], np.int32), np.array([num_tokens], np.int32),
                             np.zeros((1, 1), np.int32), np.asarray(slots, np.int32), num_tokens, num_tokens)


@pytest.mark.parametrize("fmt", list(FP8))
def test_emulated_fp8_write_is_the_twins_bit_for_bit(emu, fmt):
    rng = np.random.default_rng(1)
    x = _interesting_floats(fmt, rng)
    n = x.size // 128
    k = x[:n * 128].reshape(n, 2, 64)
    v = -k[::-1].copy()
    for scale in (1.0, 0.37, 24.0):
        caches = {}
        for name, backend in (("twin", NumpyAttention()), ("emulated", emu)):
            kc, vc = np.full((2, -(-n // 4), 4, 2, 64), 0x55, np.uint8)
            slots = np.arange(n, dtype=np.int32)[::-1].copy()
            backend.write_kv(kc, vc, k, v, _one_token_meta(n, slots),
                             k_scale=FP8Scale(fmt, scale), v_scale=FP8Scale(fmt, scale * 2))
            caches[name] = (kc, vc)
        for a, b in zip(caches["twin"], caches["emulated"]):
            np.testing.assert_array_equal(a, b)
        kc, _ = caches["emulated"]
        want = float_to_fp8(k / np.float32(scale), fmt)
        np.testing.assert_array_equal(kc.reshape(-1, 2, 64)[:n][::-1], want)


@pytest.mark.parametrize("fmt", list(FP8))
@pytest.mark.parametrize("decode", [True, False], ids=["paged_decode", "flash_prefill"])
def test_emulated_kernels_decode_every_fp8_code_bit_for_bit(emu, fmt, decode):
    """One key (zero) whose value row holds all 256 codes: the softmax weight is exactly 1, so
    the output is the dequantized row itself, code for code (NaN and infinities included)."""
    head_dim, scale = 256, 2.0
    kc = np.zeros((2, BS, 1, head_dim), np.uint8)
    vc = np.zeros_like(kc)
    vc[0, 0, 0] = np.arange(256, dtype=np.uint8)
    q = np.ones((1, 1, head_dim), np.float32)
    meta = AttentionMetadata(np.array([0, 1], np.int32), np.array([1], np.int32), np.array([[0]], np.int32),
                             np.array([], np.int32), 1, 1)
    if not decode:  # a second sequence of 2 rows sends the whole batch to flash_prefill
        q = np.ones((3, 1, head_dim), np.float32)
        meta = AttentionMetadata(np.array([0, 1, 3], np.int32), np.array([1, 2], np.int32),
                                 np.array([[0], [1]], np.int32), np.array([], np.int32), 2, 2)
    out = emu.forward(q, kc, vc, meta, 1.0, k_scale=FP8Scale(fmt, 1.0), v_scale=FP8Scale(fmt, scale))
    want = fp8_to_float(np.arange(256, dtype=np.uint8), fmt) * np.float32(scale)
    # exact values, NaNs in the same places (-0.0 reads as 0.0: the kernels add it to a 0.0 sum)
    np.testing.assert_array_equal(out[0, 0], want)


def test_emulated_int8_write_is_the_twins_bit_for_bit(emu):
    rng = np.random.default_rng(2)
    num_blocks, kv, d = 5, 3, 64
    k = rng.standard_normal((33, kv, d)).astype(np.float32) * rng.uniform(1e-3, 1e3, (33, kv, 1)).astype(np.float32)
    v = rng.standard_normal((33, kv, d)).astype(np.float32)
    k[3] = 0.0  # zero rows: scale 0, values 0
    v[7, 1] = 0.0
    v[8, 2] = 0.0
    v[8, 2, 5] = -7.5  # a single nonzero value: -127
    slots = rng.permutation(num_blocks * BS)[:33].astype(np.int32)
    slots[10] = -1  # padding: skipped
    caches = {}
    for name, backend in (("twin", NumpyAttention()), ("emulated", emu)):
        kc, vc = np.full((2, num_blocks, BS, kv, d), 99, np.int8)
        ks, vs = np.full((2, num_blocks, BS, kv), np.nan, np.float32)
        meta = _one_token_meta(33, slots)
        if name == "twin":  # the twin knows no padding slots: give it the real ones only
            keep = slots >= 0
            meta = _one_token_meta(int(keep.sum()), slots[keep])
            backend.write_kv(kc, vc, k[keep], v[keep], meta, k_scale=ks, v_scale=vs)
        else:
            backend.write_kv(kc, vc, k, v, meta, k_scale=ks, v_scale=vs)
        caches[name] = (kc, vc, ks, vs)
    for a, b in zip(caches["twin"], caches["emulated"]):
        np.testing.assert_array_equal(a, b)  # bitwise (NaN == NaN here)
    kc, vc, ks, vs = caches["emulated"]
    b, o = slots[8] // BS, slots[8] % BS
    assert vc[b, o, 2, 5] == -127 and np.count_nonzero(vc[b, o, 2]) == 1
    untouched = np.ones(num_blocks * BS, bool)
    untouched[slots[slots >= 0]] = False  # the padding token's row went nowhere
    assert (kc.reshape(num_blocks * BS, -1)[untouched] == 99).all() and np.isnan(vs.reshape(-1, kv)[untouched]).all()


# --- attention over quantized caches against the twin ----------------------------------------

@dataclasses.dataclass
class QuantBatch:
    q: np.ndarray
    k_new: np.ndarray
    v_new: np.ndarray
    caches: tuple  # k_cache, v_cache and (int8) k_scale, v_scale arrays
    scales: tuple  # what write_kv / forward take as k_scale, v_scale
    meta: AttentionMetadata


def make_batch(rng, seqs, num_heads, num_kv_heads, head_dim, block_size, kv_dtype, spare_blocks=2) -> QuantBatch:
    """``seqs``: ``(seq_len, q_len)``; the first ``seq_len - q_len`` tokens are already in the
    quantized cache (written by the twin), the last ``q_len`` come through ``write_kv``.
    Shuffled physical blocks; every slot outside a context holds random bytes (NaN codes
    among them) and, for int8, a NaN scale."""
    q_lens = np.array([q for _, q in seqs], np.int32)
    seq_lens = np.array([s for s, _ in seqs], np.int32)
    block_tables, num_blocks = shuffled_block_tables(rng, seq_lens, block_size, spare_blocks)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    store = np.int8 if kv_dtype == "int8" else np.uint8
    k_cache, v_cache = rng.integers(0, 256, (2, *shape), dtype=np.uint8).view(store)
    if kv_dtype == "int8":
        k_scale, v_scale = np.full((2, *shape[:3]), np.nan, np.float32)
        caches, scales = (k_cache, v_cache, k_scale, v_scale), None
    else:
        k_cache.reshape(-1)[::97] = 0x7F  # NaN codes too
        caches, scales = (k_cache, v_cache), (FP8Scale(kv_dtype, 0.5), FP8Scale(kv_dtype, 1.5))
    k_new, v_new, cached, cached_slots = [], [], [], []
    for i, (seq_len, q_len) in enumerate(seqs):
        k = rng.standard_normal((seq_len, num_kv_heads, head_dim), dtype=np.float32) * 3
        v = rng.standard_normal((seq_len, num_kv_heads, head_dim), dtype=np.float32)
        pos = np.arange(seq_len)
        slot = block_tables[i, pos // block_size] * block_size + pos % block_size
        old = pos < seq_len - q_len
        cached.append((k[old], v[old]))
        cached_slots.append(slot[old])
        k_new.append(k[~old])
        v_new.append(v[~old])
    batch = QuantBatch(None, np.concatenate(k_new), np.concatenate(v_new), caches, scales, None)
    # the context already cached: written by the twin
    ck = np.concatenate([c[0] for c in cached])
    cv = np.concatenate([c[1] for c in cached])
    slots = np.concatenate(cached_slots).astype(np.int32)
    if slots.size:
        NumpyAttention().write_kv(caches[0], caches[1], ck, cv, _one_token_meta(slots.size, slots),
                                  **batch_scales(batch))
    batch.q = rng.standard_normal((int(q_lens.sum()), num_heads, head_dim), dtype=np.float32)
    batch.meta = paged_metadata(q_lens, seq_lens, block_tables, block_size)
    return batch


def batch_scales(batch: QuantBatch, caches=None) -> dict:
    caches = batch.caches if caches is None else caches
    if batch.scales is None:  # int8: the scale arrays
        return {"k_scale": caches[2], "v_scale": caches[3]}
    return {"k_scale": batch.scales[0], "v_scale": batch.scales[1]}


def run_both(emu, batch: QuantBatch, **options) -> np.ndarray:
    """write_kv + forward through the twin and through the emulated kernels (outputs NaN-filled
    first by the emulator): the caches must be equal bitwise, the outputs close."""
    scale = 1.0 / np.sqrt(batch.q.shape[-1])
    twin_caches = [a.copy() for a in batch.caches]
    twin = NumpyAttention()
    twin.write_kv(twin_caches[0], twin_caches[1], batch.k_new, batch.v_new, batch.meta,
                  **batch_scales(batch, twin_caches))
    with np.errstate(invalid="ignore", over="ignore"):
        want = twin.forward(batch.q, twin_caches[0], twin_caches[1], batch.meta, scale, **options,
                            **batch_scales(batch, twin_caches))
    assert np.isfinite(want).all()
    caches = [a.copy() for a in batch.caches]
    emu.prepare(batch.meta)
    emu.write_kv(caches[0], caches[1], batch.k_new, batch.v_new, batch.meta, **batch_scales(batch, caches))
    for a, b in zip(caches, twin_caches):
        np.testing.assert_array_equal(a, b)
    got = emu.forward(batch.q, caches[0], caches[1], batch.meta, scale, **options, **batch_scales(batch, caches))
    assert np.isfinite(got).all(), "a row was not written, or a slot outside a context was read"
    np.testing.assert_allclose(got, want, rtol=ATTN_TOL, atol=ATTN_TOL)
    return got


EDGES = [1, BS - 1, BS, BS + 1, 2 * BS + 7, 150]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("group", list(GQA))
def test_paged_decode(emu, kv_dtype, group):
    rng = np.random.default_rng(group)
    heads, kv = GQA[group]
    # partitions of 64 keys: 150 and 129 span several, merged by paged_decode_reduce
    run_both(emu, make_batch(rng, [(n, 1) for n in EDGES] + [(129, 1)], heads, kv, 32, BS, kv_dtype))


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_flash_prefill_whole_chunked_and_mixed(emu, kv_dtype):
    rng = np.random.default_rng(5)
    seqs = [(n, n) for n in EDGES if n > 1] + [(40, 9), (BS + 1, 2), (70, 33), (20, 1)]
    run_both(emu, make_batch(rng, seqs, 6, 2, 64, BS, kv_dtype))


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("block_size", [5, 32])
def test_odd_block_sizes_and_head_dim_96(emu, kv_dtype, block_size):
    rng = np.random.default_rng(block_size)
    seqs = [(1, 1), (block_size - 1, 1), (37, 12), (block_size + 1, 1), (2, 2), (71, 3)]
    run_both(emu, make_batch(rng, seqs, 3, 1, 96, block_size, kv_dtype))


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_sliding_window_and_soft_cap(emu, kv_dtype):
    rng = np.random.default_rng(7)
    options = dict(sliding_window=19, logits_soft_cap=5.0)
    prefill = make_batch(rng, [(90, 90), (60, 7), (BS, BS), (45, 1)], 4, 2, 32, BS, kv_dtype)
    run_both(emu, prefill, **options)
    decode = make_batch(rng, [(n, 1) for n in EDGES] + [(140, 1)], 4, 2, 32, BS, kv_dtype)
    run_both(emu, decode, sliding_window=70, logits_soft_cap=5.0)  # 70 keys: two partitions of 64


def test_bad_scale_arguments(emu):
    rng = np.random.default_rng(0)
    b = make_batch(rng, [(20, 1), (5, 5)], 4, 2, 32, BS, "int8")
    kc, vc, ks, vs = b.caches
    with pytest.raises(ValueError, match="give both or neither"):
        emu.write_kv(kc, vc, b.k_new, b.v_new, b.meta, k_scale=ks)
    with pytest.raises(ValueError, match=r"k_scale must be C-contiguous float32 of shape \(5, 16, 2\)"):
        emu.forward(b.q, kc, vc, b.meta, 0.1, k_scale=ks[:, :1], v_scale=vs)
    with pytest.raises(TypeError, match="per-token scale arrays go with int8 KV caches"):
        emu.forward(b.q, kc.view(np.uint8), vc.view(np.uint8), b.meta, 0.1, k_scale=ks, v_scale=vs)
    with pytest.raises(TypeError, match="fp8 KV caches are uint8 with two FP8Scale of one format"):
        emu.forward(b.q, kc, vc, b.meta, 0.1, k_scale=FP8Scale("fp8_e4m3", 1.0), v_scale=FP8Scale("fp8_e4m3", 1.0))
    with pytest.raises(TypeError, match="fp8 KV caches are uint8 with two FP8Scale of one format"):
        emu.forward(b.q, kc.view(np.uint8), vc.view(np.uint8), b.meta, 0.1,
                    k_scale=FP8Scale("fp8_e4m3", 1.0), v_scale=FP8Scale("fp8_e5m2", 1.0))
    with pytest.raises(TypeError, match="prefill_kernel='mma' reads unquantized caches only"):
        EmulatedCudaAttention(prefill_kernel="mma").forward(b.q.astype(np.float16), kc, vc, b.meta, 0.1,
                                                            k_scale=ks, v_scale=vs)


# --- the pool and the engine options ---------------------------------------------------------

def test_pool_layout_sizes_and_backend_rules(tiny_llama_dir):
    cache = KVCache(2, 5, BS, 3, 64, kv_cache_dtype="fp8_e5m2", k_scales=[0.5, 2.0])
    layer = cache.layer(1)
    assert layer.k.dtype == np.uint8 and layer.k.shape == (5, BS, 3, 64)
    assert layer.k_scale == FP8Scale("fp8_e5m2", 2.0) and layer.v_scale == FP8Scale("fp8_e5m2", 1.0)
    with pytest.raises(ValueError, match=r"k_scales\[0\]=0.0: an fp8 KV scale must be a finite float32 > 0"):
        KVCache(1, 5, BS, 3, 64, kv_cache_dtype="fp8_e4m3", k_scales=[0.0])
    with pytest.raises(ValueError, match="v_scales has 1 entries for 2 layers"):
        KVCache(2, 5, BS, 3, 64, kv_cache_dtype="fp8_e4m3", v_scales=[1.0])

    args = dict(kv_cache_memory=64 * 2**20, log_stats=False, attention_backend="cuda-emulated")
    configs = {}
    for kv_dtype in ("auto", *KV_DTYPES):
        ea = EngineArgs(str(tiny_llama_dir), kv_cache_dtype=kv_dtype, **args)
        configs[kv_dtype] = ea.create_engine_config(*ea.model_config())
    mc = configs["auto"].model_config
    values = 2 * mc.num_hidden_layers * BS * mc.num_key_value_heads
    assert configs["auto"].bytes_per_block == values * mc.head_dim * 4  # float32 on the CPU
    assert configs["int8"].bytes_per_block == values * (mc.head_dim + 4)
    for fmt in FP8:
        assert configs[fmt].kv_cache_dtype == fmt
        assert configs[fmt].bytes_per_block == values * mc.head_dim
        assert configs[fmt].num_kv_blocks == 64 * 2**20 // (values * mc.head_dim)  # 4x float32's

    for fmt in FP8:
        for backend in ("numpy", "numba"):
            ea = EngineArgs(str(tiny_llama_dir), kv_cache_dtype=fmt, attention_backend=backend, log_stats=False)
            with pytest.raises(ValueError, match=f"kv_cache_dtype='{fmt}' is not supported with attention_backend="
                                                 f"'{backend}': it runs on the cuda, cuda-emulated backends"):
                ea.create_engine_config(*ea.model_config())


# --- end to end: the tiny model ----------------------------------------------------------------

@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_tiny_model_through_emulated_kernels_matches_the_twin(tiny_llama_dir, kv_dtype, monkeypatch):
    # the twin backend reads fp8 too (it is the kernels' oracle); the engine refuses fp8 on the
    # CPU backends only because their fast kernels (numba) do not read it
    monkeypatch.setattr(engine_args, "FP8_KV_BACKENDS", (*engine_args.FP8_KV_BACKENDS, "numpy"))
    prompts = [list(range(3, 40)), [5, 9, 17], list(range(50, 67))]  # 37, 3 and 17 tokens: block edges at 8
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    kw = dict(block_size=8, max_num_batched_tokens=24, log_stats=False, kv_cache_dtype=kv_dtype)
    twin = LLM(tiny_llama_dir, attention_backend="numpy", **kw)
    emu_llm = LLM(tiny_llama_dir, attention_backend="cuda-emulated", **kw)
    assert emu_llm.llm_engine.kv_cache.k[0].dtype == (np.int8 if kv_dtype == "int8" else np.uint8)
    want = [o.outputs[0].token_ids for o in twin.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in emu_llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    np.testing.assert_allclose(emu_llm.prompt_logits(prompts[0]), twin.prompt_logits(prompts[0]),
                               rtol=1e-4, atol=1e-4)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_decode_over_the_prefills_cache(tiny_llama_dir, kv_dtype):
    """Score a text by one prefill (flash_prefill); then, over the cache it wrote, decode each
    position again (paged_decode; its own K/V write sent to a spare block, so every value it
    reads is the prefill's): the log-probabilities agree to float32 rounding."""
    llm = LLM(tiny_llama_dir, attention_backend="cuda-emulated", kv_cache_dtype=kv_dtype, log_stats=False)
    engine = llm.llm_engine
    model, mc = engine.model, engine.model_config
    ids = list(range(7, 7 + 2 * BS + 5))
    n = len(ids)
    kv = KVCache(mc.num_hidden_layers, 4, BS, mc.num_key_value_heads, mc.head_dim, kv_cache_dtype=kv_dtype)
    table = np.arange(3, dtype=np.int32)[None]
    prefill = log_softmax(model.forward(np.array(ids), np.arange(n), kv, paged_metadata([n], [n], table, BS),
                                        np.arange(n)))
    for pos in (1, BS - 1, BS, BS + 1, n - 1):
        meta = dataclasses.replace(paged_metadata([1], [pos + 1], table, BS),
                                   slot_mapping=np.array([3 * BS], np.int32))  # the spare block
        decode = log_softmax(model.forward(np.array(ids[pos:pos + 1]), np.array([pos]), kv, meta, np.array([0])))
        np.testing.assert_allclose(decode[0], prefill[pos], atol=1e-5, rtol=0)
