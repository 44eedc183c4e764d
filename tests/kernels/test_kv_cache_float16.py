"""``kv_cache_dtype="float16"``: K/V stored as IEEE half values (llama.cpp's default ``f16``
cache) under float32 activations, on the CPU backends.

Writing rounds each value to nearest once (the numba kernel bit for bit as NumPy's
``astype(np.float16)``, which the twin uses); reading converts exactly, so every numba
attention kernel over a float16 cache must give the same bits as over its float32 copy
(decode, flash and BLAS prefill, mixed batches, windows, soft caps, head dims with vector
tails), and the pool holds twice the blocks. On the real model the greedy text is float32's.
"""

from __future__ import annotations

import numpy as np
import pytest

from refengine import LLM, SamplingParams
from refengine.attention import AttentionMetadata
from refengine.attention.kv_cache import KVCache
from refengine.attention.numpy_ref import NumpyAttention
from refengine.engine_args import EngineArgs
from tests.kernels.test_kv_cache_int8 import BS, EDGES, GQA, make_int8_batch

numba_cpu = pytest.importorskip("refengine.cpu.attention")
import numba  # noqa: E402

from refengine.cpu.simd import f32_to_f16, v16_load_f16, v16_load_f16_bits, v16_store  # noqa: E402


def test_write_rounds_like_numpy():
    """Normal values, halves' subnormals, values past 65504 (infinity), signed zeros: the
    numba write equals the twin's, which is NumPy's cast."""
    rng = np.random.default_rng(1)
    num_blocks, kv, d = 6, 3, 64
    k = rng.standard_normal((40, kv, d)).astype(np.float32) * np.float32(4)
    v = rng.standard_normal((40, kv, d)).astype(np.float32) * np.logspace(-9, 5, d, dtype=np.float32)
    k[0, 0, :6] = [65504.0, 65519.0, 65520.0, -1e9, -0.0, 2.0 ** -25]
    slots = rng.permutation(num_blocks * BS)[:40].astype(np.int32)
    meta = AttentionMetadata(np.array([0, 40], np.int32), np.array([40], np.int32), np.zeros((1, 3), np.int32),
                             slots, 40, 40)
    caches = {}
    for name, backend in (("numpy", NumpyAttention()), ("numba", numba_cpu.NumbaAttention())):
        kc, vc = np.full((2, num_blocks, BS, kv, d), 7, np.float16)  # untouched slots keep 7
        with np.errstate(over="ignore"):
            backend.write_kv(kc, vc, k, v, meta)
        caches[name] = (kc, vc)
    for a, b in zip(caches["numpy"], caches["numba"]):
        assert a.tobytes() == b.tobytes()
    kc, vc = caches["numba"]
    with np.errstate(over="ignore"):
        assert kc[slots[0] // BS, slots[0] % BS, 0, :6].tolist() == [65504.0, 65504.0, np.inf, -np.inf, -0.0, 0.0]
    untouched = np.ones((num_blocks, BS), bool)
    untouched[slots // BS, slots % BS] = False
    assert (kc[untouched] == 7).all()


def float16_batch(rng, seqs, heads, kv, head_dim, block_size):
    """A paged batch whose cached tokens are float16 (random finite halves everywhere else)."""
    b = make_int8_batch(rng, seqs, heads, kv, head_dim, block_size)
    shape = b.caches[0].shape
    caches = [(rng.standard_normal(shape, dtype=np.float32) * 3).astype(np.float16) for _ in range(2)]
    return b, caches


def run_f16(batch, caches, *, batch_invariant=True, **options) -> None:
    """write_kv + forward on the float16 caches and on their float32 copies: the same bits;
    the twin on the float16 caches within float32 summation order."""
    scale = 1.0 / np.sqrt(batch.q.shape[-1])
    kc, vc = (c.copy() for c in caches)
    nb = numba_cpu.NumbaAttention(batch_invariant=batch_invariant)
    nb.prepare(batch.meta)
    nb.write_kv(kc, vc, batch.k_new, batch.v_new, batch.meta)
    k32, v32 = kc.astype(np.float32), vc.astype(np.float32)
    got = nb.forward(batch.q, kc, vc, batch.meta, scale, out=np.full(batch.q.shape, np.nan, np.float32), **options)
    nb.prepare(batch.meta)
    want = nb.forward(batch.q, k32, v32, batch.meta, scale, **options)
    assert np.isfinite(got).all()
    assert got.tobytes() == want.tobytes()
    tk, tv = (c.copy() for c in caches)
    twin = NumpyAttention()
    twin.write_kv(tk, tv, batch.k_new, batch.v_new, batch.meta)
    assert tk.tobytes() == kc.tobytes() and tv.tobytes() == vc.tobytes()
    np.testing.assert_allclose(got, twin.forward(batch.q, tk, tv, batch.meta, scale, **options), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("batch_invariant", [True, False], ids=["invariant", "flash"])
@pytest.mark.parametrize("head_dim", [40, 64, 96])
@pytest.mark.parametrize("group", list(GQA))
def test_decode_and_prefill_read_the_halves_exactly(group, head_dim, batch_invariant):
    """Invariant: every row through the decode kernel; else decode rows there and chunks of
    2-63 rows through the flash prefill kernel (its key transposes and value tiles)."""
    rng = np.random.default_rng(group * 100 + head_dim)
    heads, kv = GQA[group]
    part = numba_cpu.DECODE_PARTITION
    seqs = [(n, 1) for n in EDGES] + [(part + 1, 1), (3 * part + 5, 1), (40, 9), (BS + 1, 2), (130, 63), (37, 37)]
    batch, caches = float16_batch(rng, seqs, heads, kv, head_dim, BS)
    if not batch_invariant:
        plan = numba_cpu._Plan(batch.meta, BS)
        assert plan.tile_seq.size and not plan.blas_prefill
    run_f16(batch, caches, batch_invariant=batch_invariant)


@pytest.mark.parametrize("batch_invariant", [True, False], ids=["invariant", "flash"])
@pytest.mark.parametrize("options", [{"sliding_window": 20}, {"logits_soft_cap": 5.0}])
def test_window_and_soft_cap(options, batch_invariant):
    rng = np.random.default_rng(5)
    run_f16(*float16_batch(rng, [(300, 1), (90, 33), (17, 17)], 8, 2, 64, BS), batch_invariant=batch_invariant,
            **options)


@pytest.mark.parametrize("options", [{}, {"sliding_window": 50, "logits_soft_cap": 5.0}])
def test_blas_prefill(options):
    rng = np.random.default_rng(3)
    low = numba_cpu.BLAS_PREFILL_MIN_ROWS
    batch, caches = float16_batch(rng, [(400, 70), (low + 5, low), (300, 1)], 9, 3, 64, BS)
    assert numba_cpu._Plan(batch.meta, BS).blas_prefill == [0, 1]
    run_f16(batch, caches, batch_invariant=False, **options)


# Kernels of the conversion test alone, cached by numba beside this file as the engine's are.
@numba.njit(cache=True)
def _read_halves(h, out, bits):  # pragma: no cover - compiled
    """``out[i] = float32(h[i])`` by the 16-lane loads: ``vcvtph2ps`` or (``bits``) the bit arithmetic."""
    for i in range(0, h.shape[0], 16):
        v16_store(out, i, v16_load_f16_bits(h, i) if bits else v16_load_f16(h, i))


@numba.njit(cache=True)
def _write_halves(x, out):  # pragma: no cover - compiled
    """``out[i]``: the float16 bits of ``x[i]`` as the cache write rounds it."""
    for i in range(x.shape[0]):
        out[i] = f32_to_f16(x[i])


def test_conversions_against_numpy_on_every_half():
    """Every float16 bit pattern read by the 16-lane loads (``vcvtph2ps`` and the bit
    arithmetic fallback) as NumPy converts it; every half, every midpoint between two
    neighbours (the ties) and a spread of float32 written as NumPy rounds them."""
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    want = halves.view(np.float16).astype(np.float32)
    for bits in (False, True):
        got = np.empty(1 << 16, np.float32)
        _read_halves(halves, got, bits)
        nan = np.isnan(want)
        assert np.isnan(got[nan]).all() and got[~nan].tobytes() == want[~nan].tobytes()
    finite = want[np.isfinite(want)].astype(np.float64)
    finite.sort()
    ties = ((finite[1:] + finite[:-1]) / 2).astype(np.float32)  # exact in float32: one bit more than a half
    spread = np.random.default_rng(0).standard_normal(1 << 16).astype(np.float32) * np.float32(1e4)
    x = np.concatenate([want[np.isfinite(want)], ties, np.nextafter(ties, np.float32(np.inf)), spread])
    out = np.empty(x.shape, np.uint16)
    _write_halves(x, out)
    with np.errstate(over="ignore"):
        assert out.tobytes() == x.astype(np.float16).tobytes()


def test_bad_caches_are_refused():
    rng = np.random.default_rng(0)
    b, (kc, vc) = float16_batch(rng, [(20, 1)], 4, 2, 32, BS)
    nb = numba_cpu.NumbaAttention()
    with pytest.raises(TypeError, match=r"float32 or float16 caches without scales \(k and v alike\), "
                                        "got k_cache float16 and v_cache float32"):
        nb.forward(b.q, kc, vc.astype(np.float32), b.meta, 0.1)


def test_pool_and_engine_options(tiny_llama_dir):
    layer = KVCache(2, 5, BS, 3, 64, kv_cache_dtype="float16").layer(1)
    assert layer.k.dtype == np.float16 and layer.k_scale is None and layer.dtype == np.float32
    configs = {}
    for kv_dtype in ("auto", "float16"):
        ea = EngineArgs(str(tiny_llama_dir), kv_cache_dtype=kv_dtype, kv_cache_memory=64 * 2**20)
        configs[kv_dtype] = ea.create_engine_config(*ea.model_config())
    assert configs["float16"].bytes_per_block * 2 == configs["auto"].bytes_per_block
    assert configs["float16"].num_kv_blocks == 64 * 2**20 // configs["float16"].bytes_per_block
    assert configs["float16"].num_kv_blocks // 2 == configs["auto"].num_kv_blocks
    ea = EngineArgs(str(tiny_llama_dir), kv_cache_dtype="float16", attention_backend="cuda-emulated")
    with pytest.raises(ValueError, match="kv_cache_dtype='float16' is not supported with "
                                         "attention_backend='cuda-emulated': it runs on the numpy, numba backends"):
        ea.create_engine_config(*ea.model_config())


def test_real_model_keeps_float32s_text(gguf_path):
    """SmolLM2's Q4_1 file: greedy tokens as with the float32 cache, prompt log-probabilities
    close to them, and the engine idle with every block back afterwards. The engines run on
    one thread: the bits do not depend on the thread count (batch invariance), and one thread
    spares each engine's start the warm-up of the parallel kernels (most of its CPU time)."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    runs = {}
    for kv_dtype in ("auto", "float16"):
        llm = LLM(model=str(gguf_path), kv_cache_dtype=kv_dtype, max_model_len=256, log_stats=False, num_threads=1)
        runs[kv_dtype] = ([o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)],
                          llm.prompt_logits(llm.get_tokenizer().encode(prompts[2] * 4)))
        assert llm.llm_engine.scheduler.block_manager.num_free_blocks == llm.llm_engine.config.num_kv_blocks
    assert runs["float16"][0] == runs["auto"][0]
    assert llm.llm_engine.kv_cache.k[0].dtype == np.float16
    a, b = runs["auto"][1], runs["float16"][1]
    err = np.abs(a - b).max()
    print(f"max |logit difference| {err:.2e} of max |logit| {np.abs(a).max():.1f}")
    # halves really round; a half's relative step is 2**-11 (4.9e-4), and the logits move by
    # about that relative to their size. Seen: 2.1e-2 of max |logit| 30.9 (7e-4), every
    # position and token of a 40-token prompt.
    assert 0 < err < 4 * 2.0 ** -11 * np.abs(a).max()
