#!/usr/bin/env python
"""GPU check of refengine's CUDA kernels: correctness on the device, then speed.

For a machine with an NVIDIA GPU (written for an H200) and CuPy. Installs nothing; runs
in a few minutes:

  (a) correctness: the CUDA kernels (``CudaAttention``) against the NumPy twin on random
      paged batches (decode, chunked prefill, mixed; GQA; head_dim 64/128; float16,
      bfloat16, float32 storage), then the per-layer options (sliding window, logit soft
      cap) at head_dim 64/96/128/256, ``reshape_and_cache`` bit for bit, the layer kernels
      (rotary embedding at head_dim 64/96/256), the quantized-weight products (int8 and
      int4 GEMV / GEMM, ``cuda/quant_matmul.cu``), and the tensor-core layouts on the hardware
      (one MMA; one ``ldmatrix`` /
      ``ldmatrix.trans`` with ``cp.async`` zero fill, bit for bit against the PTX figures
      as ``ldmatrix_expected`` writes them out; the CPU emulator is tested against the same);
  (b) speed:
      * flash prefill TFLOP/s (causal; FLOPs = 2 * 2 * b * h * s^2 * d / 2) at head_dim 64
        and 128, seq 1k-8k, batch filling the chip, beside
        ``torch.nn.functional.scaled_dot_product_attention`` on the same (contiguous)
        inputs when torch with CUDA is importable;
      * paged decode achieved bandwidth (K+V bytes read / time) at batch 1-128 and
        context 1k-32k, 32 query heads, 8 KV heads, head_dim 128, beside the device's
        measured device-to-device copy bandwidth ((read + write bytes) / time), at the
        default partition size (512) and the best of 128/256/512/1024;
      * quantized-weight products (int8, int4) at 4096x4096: weight bytes read per second
        at 1-9 rows (GEMV), TFLOP/s at 512 (the SIMT GEMM);
      * end to end: SmolLM2 greedy on the GPU (float32) against the CPU, and offline
        throughput in bfloat16;
  each printed as a short table under (b).

Usage:  python benchmarks/gpu_check.py [--quick] [--skip-bench | --skip-correctness] [--budget-s S]
                                     [--performance-md docs/PERFORMANCE.md]
Exit status: 0 all checks passed, 1 a correctness check failed, 2 no CuPy/CUDA device.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from refengine.attention import paged_metadata  # noqa: E402

TIME_BUDGET_S = 120.0  # seconds of flash-prefill and paged-decode points, from their start

# (seq_len, q_len) per sequence: block edges (block size 16), chunked prefill, and
# decode rows long enough to span several Flash-Decoding partitions.
CORRECTNESS_BATCHES = {
    "decode": [(1, 1), (15, 1), (16, 1), (17, 1), (700, 1), (2000, 1)],
    "prefill": [(300, 300), (64, 64), (33, 33)],
    "mixed": [(1, 1), (300, 40), (17, 17), (1000, 1), (48, 16)],
}
# The per-layer options, (sliding_window, logits_soft_cap), at these head dims (96: Phi-3;
# 256: Gemma 2/3), 8 query heads over 2 KV heads, on these batches: windows shorter than a
# partition and several; chunks starting past the window; a prompt spanning several tiles.
OPTION_CASES = ((None, None), (64, None), (200, 1.0), (None, 2.0))
OPTION_HEAD_DIMS = (64, 96, 128, 256)
OPTION_BATCHES = {
    "decode": [(1, 1), (17, 1), (700, 1), (2000, 1)],
    "mixed": [(300, 40), (1000, 1), (48, 16), (130, 130)],
}


def require_cupy():
    """Return the cupy module, or None when CuPy or a CUDA device is missing."""
    try:
        import cupy as cp

        if cp.cuda.runtime.getDeviceCount() < 1:
            return None
        return cp
    except Exception:  # ImportError, or CUDA driver errors
        return None


# --------------------------------------------------------------------------------------
# Random paged batches
# --------------------------------------------------------------------------------------

def random_paged_batch(rng, seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, shuffle=True):
    """Host arrays for a batch: ``seqs`` = [(seq_len, q_len)]. The cache is filled with
    random values everywhere (the slots a sequence owns are all written)."""
    seq_lens = np.array([s for s, _ in seqs], np.int32)
    q_lens = np.array([q for _, q in seqs], np.int32)
    blocks_per_seq = [-(-int(s) // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 1
    physical = rng.permutation(num_blocks) if shuffle else np.arange(num_blocks)
    block_tables = np.full((len(seqs), max(blocks_per_seq)), -1, np.int32)
    start = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = physical[start:start + n]
        start += n
    meta = paged_metadata(q_lens, seq_lens, block_tables, block_size)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = rng.standard_normal(shape, dtype=np.float32).astype(dtype)
    v_cache = rng.standard_normal(shape, dtype=np.float32).astype(dtype)
    q = rng.standard_normal((int(q_lens.sum()), num_heads, head_dim), dtype=np.float32).astype(dtype)
    return q, k_cache, v_cache, meta


# --------------------------------------------------------------------------------------
# (a) correctness
# --------------------------------------------------------------------------------------

def check_correctness(cp, quick: bool) -> list[tuple[str, bool, str]]:
    import ml_dtypes

    from refengine.attention.cuda import CudaAttention
    from refengine.attention.numpy_ref import NumpyAttention

    rng = np.random.default_rng(0)
    results = []
    dtypes = [("f16", np.float16, 2e-3), ("bf16", ml_dtypes.bfloat16, 1e-2), ("f32", np.float32, 5e-5)]
    batches = CORRECTNESS_BATCHES
    groups = [(8, 8), (32, 8)] if quick else [(8, 8), (24, 8), (28, 4), (32, 4)]
    # (decode partition size, prefill kernel): 64-token partitions force the merge kernel;
    # "simt" checks the non-tensor-core prefill kernel on 16-bit storage too.
    for partition, prefill_kernel in ((512, "auto"), (64, "auto"), (512, "simt")):
        backend = CudaAttention(decode_partition_size=partition, prefill_kernel=prefill_kernel)
        ref = NumpyAttention()
        for tag, dtype, tol in dtypes:
            for head_dim in (64, 128):
                for num_heads, num_kv_heads in groups:
                    for kind, seqs in batches.items():
                        if partition == 64 and kind != "decode":
                            continue
                        if prefill_kernel == "simt" and (kind == "decode" or tag == "f32"):
                            continue
                        name = (f"{kind:7s} {tag:4s} hd{head_dim} h{num_heads}/kv{num_kv_heads} "
                                f"part{partition} {prefill_kernel}")
                        batch = random_paged_batch(rng, seqs, num_heads, num_kv_heads, head_dim, 16, dtype)
                        results.append(compare_with_twin(cp, backend, ref, name, batch, tol))
                for head_dim in OPTION_HEAD_DIMS:
                    for window, cap in OPTION_CASES:
                        for kind, seqs in OPTION_BATCHES.items():
                            if (partition == 64 and kind != "decode") or (
                                    prefill_kernel == "simt" and (kind == "decode" or tag == "f32")):
                                continue
                            name = (f"{kind:7s} {tag:4s} hd{head_dim} h8/kv2 window {window} cap {cap} "
                                    f"part{partition} {prefill_kernel}")
                            batch = random_paged_batch(rng, seqs, 8, 2, head_dim, 16, dtype)
                            results.append(compare_with_twin(cp, backend, ref, name, batch, tol,
                                                             sliding_window=window, logits_soft_cap=cap))
    results += check_mma_layout(cp, rng)
    results += check_layers(cp, rng)
    results += check_kv_quant(cp, rng, dtypes, quick)
    results += check_quant_matmul(cp, rng)
    # reshape_and_cache: a copy, so bit-exact.
    backend = CudaAttention()
    for tag, dtype, _ in dtypes:
        q, kc, vc, meta = random_paged_batch(rng, [(40, 40), (70, 9)], 8, 4, 128, 16, dtype)
        k = rng.standard_normal((meta.num_tokens, 4, 128), dtype=np.float32).astype(dtype)
        v = rng.standard_normal((meta.num_tokens, 4, 128), dtype=np.float32).astype(dtype)
        try:
            dk, dv, dkc, dvc = (cp.asarray(x) for x in (k, v, kc, vc))
        except Exception as exc:
            results.append((f"reshape_and_cache {tag}", True, f"skipped: {exc}"))
            continue
        backend.write_kv(dkc, dvc, dk, dv, meta)
        NumpyAttention().write_kv(kc, vc, k, v, meta)
        ok = cp.asnumpy(dkc).tobytes() == kc.tobytes() and cp.asnumpy(dvc).tobytes() == vc.tobytes()
        results.append((f"reshape_and_cache {tag}", ok, "bit-exact" if ok else "MISMATCH"))
    return results


def check_kv_quant(cp, rng, dtypes, quick: bool = False) -> list[tuple[str, bool, str]]:
    """Quantized KV caches (int8, fp8_e4m3, fp8_e5m2) on the device against the NumPy twin:
    the cache write bit for bit (codes and int8 scales), every fp8 code decoded bit for bit
    (one key whose value row holds the 256 codes: the output is that row times the scale),
    and prefill / decode attention over the written cache within the output dtype's rounding
    (``quick``: head_dim 64 only)."""
    from refengine.attention import AttentionMetadata
    from refengine.attention.cuda import CudaAttention
    from refengine.attention.kv_cache import FP8Scale
    from refengine.attention.numpy_ref import NumpyAttention, fp8_to_float

    results = []
    backend, twin = CudaAttention(decode_partition_size=64), NumpyAttention()
    for fmt in ("fp8_e4m3", "fp8_e5m2"):
        kc = np.zeros((2, 16, 1, 256), np.uint8)
        vc = kc.copy()
        vc[0, 0, 0] = np.arange(256, dtype=np.uint8)
        meta = AttentionMetadata(np.array([0, 1], np.int32), np.array([1], np.int32), np.array([[0]], np.int32),
                                 np.array([], np.int32), 1, 1)
        out = cp.asnumpy(backend.forward(cp.asarray(np.ones((1, 1, 256), np.float32)), cp.asarray(kc), cp.asarray(vc), meta,
                                         1.0, k_scale=FP8Scale(fmt, 1.0), v_scale=FP8Scale(fmt, 2.0)))[0, 0]
        want = fp8_to_float(np.arange(256, dtype=np.uint8), fmt) * np.float32(2.0)
        # exact values, NaNs in the same places; -0.0 reads as 0.0 (the kernel adds it to a 0.0 sum)
        ok = bool(np.array_equal(out, want, equal_nan=True))
        results.append((f"kv {fmt} decode all 256 codes", ok, "exact" if ok else "MISMATCH"))
    for kv_dtype in ("int8", "fp8_e4m3", "fp8_e5m2"):
        for tag, dtype, _ in dtypes:
            for head_dim in (64,) if quick else (64, 128):
                for kind, seqs in (("prefill", [(70, 70), (100, 33), (16, 1)]), ("decode", [(1, 1), (130, 1),
                                                                                          (300, 1)])):
                    name = f"kv {kv_dtype:8s} {kind:7s} {tag:4s} hd{head_dim} h8/kv2"
                    q, kc, vc, meta = random_paged_batch(rng, seqs, 8, 2, head_dim, 16, dtype)
                    if kv_dtype == "int8":
                        kc, vc = np.zeros((2, *kc.shape), np.int8)
                        ks, vs = np.zeros((2, *kc.shape[:3]), np.float32)
                        scales = lambda c: {"k_scale": c[2], "v_scale": c[3]}  # noqa: E731
                        host = [kc, vc, ks, vs]
                    else:
                        kc, vc = np.zeros((2, *kc.shape), np.uint8)
                        fixed = {"k_scale": FP8Scale(kv_dtype, 0.5), "v_scale": FP8Scale(kv_dtype, 2.0)}
                        scales = lambda c: fixed  # noqa: E731
                        host = [kc, vc]
                    # every context token comes through write_kv (one prefill writes the whole cache)
                    full = paged_metadata(meta.seq_lens, meta.seq_lens, meta.block_tables, 16)
                    k = (rng.standard_normal((full.num_tokens, 2, head_dim), dtype=np.float32) * 3).astype(dtype)
                    v = rng.standard_normal((full.num_tokens, 2, head_dim), dtype=np.float32).astype(dtype)
                    try:
                        dev = [cp.asarray(x) for x in host]
                        dq, dk, dv = cp.asarray(q), cp.asarray(k), cp.asarray(v)
                    except Exception as exc:  # e.g. a CuPy without bfloat16 support
                        results.append((name, True, f"skipped: {type(exc).__name__}: {exc}"))
                        continue
                    backend.write_kv(dev[0], dev[1], dk, dv, full, **scales(dev))
                    twin.write_kv(host[0], host[1], k.astype(np.float32), v.astype(np.float32), full, **scales(host))
                    same = all(cp.asnumpy(d).tobytes() == h.tobytes() for d, h in zip(dev, host))
                    scale = 1.0 / math.sqrt(head_dim)
                    out = cp.asnumpy(backend.forward(dq, dev[0], dev[1], meta, scale, **scales(dev))).astype(np.float32)
                    want = twin.forward(q.astype(np.float32), host[0], host[1], meta, scale, **scales(host))
                    tol = {"f32": 2e-5}.get(tag, 1e-2 if tag == "bf16" else 2e-3)  # the output's rounding
                    err = float(np.abs(out - want).max())
                    ok = same and bool(np.isfinite(out).all()) and np.allclose(out, want, rtol=tol, atol=tol)
                    results.append((name, ok, f"write {'bit-exact' if same else 'MISMATCH'}, max |err| {err:.2e}"))
    return results


def compare_with_twin(cp, backend, ref, name: str, batch: tuple, tol: float, **options) -> tuple[str, bool, str]:
    """One ``CudaAttention.forward`` on the device against the NumPy twin (float32 on the
    same values); ``batch`` from :func:`random_paged_batch`, ``options`` the per-layer
    keywords. Returns ``(name, passed, detail)``; a dtype CuPy cannot hold is a skip."""
    q, kc, vc, meta = batch
    try:
        dq, dk, dv = cp.asarray(q), cp.asarray(kc), cp.asarray(vc)
    except Exception as exc:  # e.g. a CuPy without bfloat16 support
        return name, True, f"skipped: {type(exc).__name__}: {exc}"
    scale = 1.0 / math.sqrt(q.shape[-1])
    out = cp.asnumpy(backend.forward(dq, dk, dv, meta, scale, **options)).astype(np.float32)
    expected = ref.forward(q.astype(np.float32), kc.astype(np.float32), vc.astype(np.float32), meta, scale,
                           **options)
    err = float(np.abs(out - expected).max())
    ok = bool(np.isfinite(out).all()) and np.allclose(out, expected, rtol=tol, atol=tol)
    return name, ok, f"max |err| {err:.2e} (tol {tol:.0e})"


def ldmatrix_expected(m: np.ndarray) -> np.ndarray:
    """What ``ldmatrix_check_f16`` must write, from the PTX ISA's ldmatrix fragment figures
    (§9.7.14.5.15), written out here on their own: lane l = 4g + t receives, in register i,
    elements (g, 2t) and (g, 2t + 1) of matrix i, or with .trans (2t, g) and (2t + 1, g);
    the low 16 bits hold the first. Then 128 zero words (cp.async's zero fill).

    Args:
        m: ``[4, 8, 8]`` float16 (four 8x8 matrices, row-major).
    Returns:
        ``[384]`` uint32: ``plain[32 lanes][4 regs]``, ``trans[32][4]``, then 128 zeros.
    """
    bits = m.view(np.uint16).astype(np.uint32)
    plain = np.zeros((32, 4), np.uint32)
    trans = np.zeros((32, 4), np.uint32)
    for lane in range(32):
        g, t = divmod(lane, 4)
        for i in range(4):
            plain[lane, i] = bits[i, g, 2 * t] | bits[i, g, 2 * t + 1] << 16
            trans[lane, i] = bits[i, 2 * t, g] | bits[i, 2 * t + 1, g] << 16
    return np.concatenate([plain.ravel(), trans.ravel(), np.zeros(32 * 4, np.uint32)])


def check_mma_layout(cp, rng) -> list[tuple[str, bool, str]]:
    """One real tensor-core MMA with fragments built from the PTX layout (cuda/mma_check.cu):
    confirms on hardware the register layout that flash_prefill_mma and the emulator assume."""
    import ml_dtypes

    from refengine.kernels.build import SELF_TEST_SOURCES, cupy_kernels
    from refengine.kernels.plans import Launch

    kernels = cupy_kernels(SELF_TEST_SOURCES)  # the self-tests are not in the production module
    results = []
    for tag, dtype in (("f16", np.float16), ("bf16", ml_dtypes.bfloat16)):
        a = rng.standard_normal((16, 16), dtype=np.float32).astype(dtype)
        b = rng.standard_normal((16, 8), dtype=np.float32).astype(dtype)
        try:
            da, db = cp.asarray(a), cp.asarray(b)
        except Exception as exc:
            results.append((f"mma fragment layout {tag}", True, f"skipped: {exc}"))
            continue
        dd = cp.full((16, 8), np.nan, dtype=np.float32) if hasattr(cp, "full") else cp.empty((16, 8), np.float32)
        kernels.launch(Launch(f"mma_check_{tag}", (1, 1, 1), (32, 1, 1), 0, (da, db, dd)))
        got = cp.asnumpy(dd).astype(np.float64)
        expected = a.astype(np.float64) @ b.astype(np.float64)
        ok = bool(np.allclose(got, expected, rtol=1e-5, atol=1e-5))
        results.append((f"mma fragment layout {tag}", ok, f"max |err| {np.abs(got - expected).max():.2e}"))

    # ldmatrix / ldmatrix.trans and cp.async zero fill (cuda/mma_check.cu), bit for bit.
    m = rng.standard_normal((4, 8, 8), dtype=np.float32).astype(np.float16)
    dout = cp.asarray(np.zeros(32 * 4 * 3, dtype=np.uint32))
    kernels.launch(Launch("ldmatrix_check_f16", (1, 1, 1), (32, 1, 1), 32 * 24 * 2, (cp.asarray(m), dout)))
    wrong = int((cp.asnumpy(dout) != ldmatrix_expected(m)).sum())
    results.append(("ldmatrix + cp.async layout", wrong == 0, "bit-exact" if not wrong else f"{wrong} words differ"))
    return results


def check_layers(cp, rng) -> list[tuple[str, bool, str]]:
    """rms_norm, silu_and_mul, gelu_tanh_and_mul, rotary_embedding (head_dim 64, 96, 256) on
    the GPU against float64 NumPy."""
    from refengine.ops.cuda import CudaLayerOps

    ops = CudaLayerOps()
    results = []
    for tag, dtype, tol in (("f16", np.float16, 2e-3), ("f32", np.float32, 2e-5)):
        x = rng.standard_normal((33, 576), dtype=np.float32).astype(dtype)
        w = rng.standard_normal(576, dtype=np.float32).astype(dtype)
        xd = x.astype(np.float64)
        expected = xd / np.sqrt((xd ** 2).mean(1, keepdims=True) + 1e-5) * w
        got = cp.asnumpy(ops.rms_norm(cp.asarray(x), cp.asarray(w), 1e-5)).astype(np.float64)
        results.append((f"rms_norm {tag}", bool(np.allclose(got, expected, rtol=tol, atol=tol)),
                        f"max |err| {np.abs(got - expected).max():.2e}"))
        g = rng.standard_normal((33, 2 * 1536), dtype=np.float32).astype(dtype)
        gd = g.astype(np.float64)
        expected = gd[:, :1536] / (1 + np.exp(-gd[:, :1536])) * gd[:, 1536:]
        got = cp.asnumpy(ops.silu_and_mul(cp.asarray(g))).astype(np.float64)
        results.append((f"silu_and_mul {tag}", bool(np.allclose(got, expected, rtol=tol, atol=tol)),
                        f"max |err| {np.abs(got - expected).max():.2e}"))
        gate, up = gd[:, :1536], gd[:, 1536:]
        expected = 0.5 * gate * (1 + np.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate ** 3))) * up
        got = cp.asnumpy(ops.gelu_tanh_and_mul(cp.asarray(g))).astype(np.float64)
        results.append((f"gelu_tanh_and_mul {tag}", bool(np.allclose(got, expected, rtol=tol, atol=tol)),
                        f"max |err| {np.abs(got - expected).max():.2e}"))
        for head_dim in (64, 96, 256):
            half, positions = head_dim // 2, rng.integers(0, 8192, 33).astype(np.int32)
            inv_freq = 1.0 / (10000.0 ** (np.arange(0, head_dim, 2) / head_dim))
            angles = np.arange(8192)[:, None] * inv_freq[None]
            cos_sin = np.concatenate([np.cos(angles), np.sin(angles)], 1).astype(np.float32)
            q = rng.standard_normal((33, 9, head_dim), dtype=np.float32).astype(dtype)
            k = rng.standard_normal((33, 3, head_dim), dtype=np.float32).astype(dtype)
            dq, dk = cp.asarray(q), cp.asarray(k)
            ops.rotary_embedding(positions, dq, dk, cp.asarray(cos_sin))
            c = cos_sin[positions, :half][:, None].astype(np.float64)
            s = cos_sin[positions, half:][:, None].astype(np.float64)
            qd = q.astype(np.float64)
            expected = np.concatenate([qd[..., :half] * c - qd[..., half:] * s,
                                       qd[..., half:] * c + qd[..., :half] * s], -1)
            got = cp.asnumpy(dq).astype(np.float64)
            ok = bool(np.allclose(got, expected, rtol=tol, atol=tol))
            results.append((f"rotary_embedding {tag} hd{head_dim}", ok, f"max |err| {np.abs(got - expected).max():.2e}"))
    return results


# (out, in, group_size): SmolLM2's K (576) on the 16-byte loads, and odd sizes (out not a
# multiple of the 4 / 64 channels per block, K not a multiple of the group) on the byte path
QUANT_SHAPES = ((200, 576, 64), (37, 50, 20))
QUANT_ROWS = (1, 8, 9, 33)  # the GEMV, its last row count, the tiled GEMM, a tile and a row


def check_quant_matmul(cp, rng) -> list[tuple[str, bool, str]]:
    """The quantized-weight products (cuda/quant_matmul.cu, through ``CudaLayerOps.linear``:
    int8, int4 with an act-order permutation) on the GPU against the float64 product of the
    dequantized weights, within the float32 accumulation bound ``(K + 2) 2^-24 |x| @ |w'|.T``
    (tests/kernels/test_cuda_quant.py derives it); the NumPy twin (``reference_linear``) is held to the same."""
    import ml_dtypes

    from refengine.ops.cuda import CudaLayerOps
    from refengine.quant import reference_linear
    from refengine.quant.int4 import Int4Weight
    from refengine.quant.int8 import Int8Weight

    ops = CudaLayerOps()
    results = []
    for out_f, in_f, gs in QUANT_SHAPES:
        n_groups = -(-in_f // gs)
        weights = {
            "int8": Int8Weight.quantize(rng.standard_normal((out_f, in_f), dtype=np.float32)),
            "int4": Int4Weight.from_values(rng.integers(0, 16, (out_f, in_f)),
                                           rng.uniform(0.01, 0.1, (out_f, n_groups)).astype(np.float32),
                                           rng.integers(0, 17, (out_f, n_groups)), gs, rng.permutation(in_f)),
        }
        for fmt, w in weights.items():
            w_deq = w.dequantize().astype(np.float64)
            for tag, dtype in (("f16", np.float16), ("bf16", ml_dtypes.bfloat16), ("f32", np.float32)):
                for rows in QUANT_ROWS:
                    x = rng.standard_normal((rows, in_f), dtype=np.float32).astype(dtype)
                    name = f"{fmt} linear {tag} {rows}x{in_f} @ {out_f}x{in_f}" + (f" g{gs}" if fmt == "int4" else "")
                    try:
                        dx = cp.asarray(x)
                    except Exception as exc:  # a CuPy without bfloat16 arrays
                        results.append((name, True, f"skipped: {exc}"))
                        continue
                    exact = x.astype(np.float64) @ w_deq.T
                    limit = (in_f + 2) * 2.0 ** -24 * (np.abs(x.astype(np.float64)) @ np.abs(w_deq).T)
                    got = cp.asnumpy(ops.linear(dx, w)).astype(np.float64)
                    twin = reference_linear(x, w).astype(np.float64)
                    err = np.abs(got - exact)
                    ok = bool(np.isfinite(got).all() and (err <= limit).all()
                              and (np.abs(twin - exact) <= limit).all())
                    results.append((name, ok, f"max |err| {err.max():.2e} (bound {limit.max():.2e})"))
    return results


# --------------------------------------------------------------------------------------
# (b) microbenchmarks
# --------------------------------------------------------------------------------------

def time_gpu(cp, fn, warmup=2, iters=5) -> float:
    """Median seconds per call of ``fn`` measured with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
    return float(np.median(times))


def copy_bandwidth(cp, nbytes=2 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read + bytes written."""
    src = cp.empty(nbytes, dtype=cp.uint8)
    dst = cp.empty_like(src)
    seconds = time_gpu(cp, lambda: cp.cuda.runtime.memcpy(dst.data.ptr, src.data.ptr, nbytes,
                                                          cp.cuda.runtime.memcpyDeviceToDevice))
    del src, dst
    return 2 * nbytes / seconds / 1e9


def bench_quant_matmul(cp, deadline: float, shape=(4096, 4096), rows=(1, 8, 9, 512)) -> list[dict]:
    """Quantized-weight products (``cuda/quant_matmul.cu`` through ``CudaLayerOps.linear``)
    of float16 rows by an ``[out, in]`` int8 and int4 (group 128) weight: microseconds,
    weight bytes read per second (the decode figure of merit: the GEMV reads each weight
    byte once) and TFLOP/s (2 * rows * out * in)."""
    from refengine.ops.cuda import CudaLayerOps
    from refengine.quant.int4 import Int4Weight
    from refengine.quant.int8 import Int8Weight

    rng = np.random.default_rng(0)
    out_f, in_f = shape
    gs = min(128, in_f)
    n_groups = -(-in_f // gs)
    ops = CudaLayerOps()
    weights = {"int8": Int8Weight(rng.integers(-127, 128, shape, dtype=np.int8), np.ones(out_f, np.float32)),
               "int4": Int4Weight(rng.integers(0, 256, (out_f, in_f // 2), dtype=np.uint8),
                                  np.ones((out_f, n_groups), np.float32), np.full((out_f, n_groups), 8, np.uint8), gs)}
    results = []
    for fmt, w in weights.items():
        ops.place_quantized(w)  # the copy to the device is not timed
        for n in rows:
            if time.time() > deadline:
                return results
            x = cp.asarray(rng.standard_normal((n, in_f), dtype=np.float32).astype(np.float16))
            seconds = time_gpu(cp, lambda: ops.linear(x, w))
            results.append({"format": fmt, "rows": n, "shape": shape, "us": seconds * 1e6,
                            "gbps": w.nbytes / seconds / 1e9, "tflops": 2 * n * out_f * in_f / seconds / 1e12})
    return results


def bench_prefill(cp, quick: bool, deadline: float, head_dims=(64, 128), seqs=None,
                  tokens_per_batch=16384) -> list[dict]:
    from refengine.attention.cuda import CudaAttention

    try:
        import torch

        torch_ok = torch.cuda.is_available()
    except Exception:
        torch_ok = False
    backends = {"mma": CudaAttention(prefill_kernel="mma"), "simt": CudaAttention(prefill_kernel="simt")}
    rows = []
    if seqs is None:
        seqs = (1024, 4096) if quick else (1024, 2048, 4096, 8192)
    num_heads, num_kv_heads, block_size = 32, 8, 16
    for head_dim in head_dims:
        for seq in seqs:
            if time.time() > deadline:
                break
            batch = max(1, tokens_per_batch // seq)
            rng = np.random.default_rng(seq)
            q, kc, vc, meta = random_paged_batch(rng, [(seq, seq)] * batch, num_heads, num_kv_heads, head_dim,
                                                 block_size, np.float16, shuffle=True)
            dq, dk, dv = cp.asarray(q), cp.asarray(kc), cp.asarray(vc)
            scale = 1.0 / math.sqrt(head_dim)
            flops = 4.0 * batch * num_heads * seq * seq * head_dim / 2  # causal: half the square
            row = {"head_dim": head_dim, "seq": seq, "batch": batch, "sdpa_tflops": float("nan")}
            for kernel, backend in backends.items():
                seconds = time_gpu(cp, lambda: backend.forward(dq, dk, dv, meta, scale))
                row[f"{kernel}_tflops"] = flops / seconds / 1e12
                row[f"{kernel}_ms"] = seconds * 1e3
            if torch_ok:
                row["sdpa_tflops"] = flops / time_sdpa(torch, batch, seq, num_heads, num_kv_heads, head_dim) / 1e12
            rows.append(row)
            del dq, dk, dv
    return rows


def time_sdpa(torch, batch, seq, num_heads, num_kv_heads, head_dim) -> float:
    """Seconds per causal SDPA call on contiguous [b, h, s, d] float16 tensors."""
    import torch.nn.functional as F

    q = torch.randn(batch, num_heads, seq, head_dim, device="cuda", dtype=torch.float16)
    k = torch.randn(batch, num_kv_heads, seq, head_dim, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    try:
        call = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
        call()
    except TypeError:  # torch without enable_gqa: expand the KV heads (not timed)
        group = num_heads // num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        call = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    for _ in range(2):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return float(np.median(times))


def bench_decode(cp, quick: bool, deadline: float, batches=None, contexts=None) -> list[dict]:
    from refengine.attention.cuda import CudaAttention

    # The default partition size, and a sweep of others: the best one depends on how many
    # blocks (sequences x KV heads x partitions) it takes to keep every SM's loads in flight.
    partitions = (512, 128, 256, 1024)
    backends = {p: CudaAttention(decode_partition_size=p) for p in partitions}
    num_heads, num_kv_heads, head_dim, block_size = 32, 8, 128, 16
    itemsize = 2
    rows = []
    if batches is None:
        batches = (1, 32, 128) if quick else (1, 8, 32, 128)
    if contexts is None:
        contexts = (1024, 8192, 32768) if quick else (1024, 4096, 16384, 32768)
    for batch in batches:
        for ctx in contexts:
            if time.time() > deadline:
                break
            kv_bytes = 2 * batch * ctx * num_kv_heads * head_dim * itemsize
            if kv_bytes > 24 << 30:
                continue
            blocks_per_seq = ctx // block_size
            num_blocks = batch * blocks_per_seq
            rng = np.random.default_rng(batch + ctx)
            block_tables = rng.permutation(num_blocks).astype(np.int32).reshape(batch, blocks_per_seq)
            meta = paged_metadata(np.ones(batch, np.int32), np.full(batch, ctx, np.int32), block_tables, block_size)
            shape = (num_blocks, block_size, num_kv_heads, head_dim)
            k_cache = cp.random.standard_normal(shape, dtype=cp.float32).astype(cp.float16)
            v_cache = cp.random.standard_normal(shape, dtype=cp.float32).astype(cp.float16)
            q = cp.random.standard_normal((batch, num_heads, head_dim), dtype=cp.float32).astype(cp.float16)
            scale = 1.0 / math.sqrt(head_dim)
            times = {p: time_gpu(cp, lambda b=b: b.forward(q, k_cache, v_cache, meta, scale))
                     for p, b in backends.items()}
            best = min(times, key=times.get)
            rows.append({"batch": batch, "ctx": ctx, "us": times[512] * 1e6, "gbps": kv_bytes / times[512] / 1e9,
                         "best_partition": best, "best_gbps": kv_bytes / times[best] / 1e9})
            del k_cache, v_cache, q
            cp.get_default_memory_pool().free_all_blocks()
    return rows


# --------------------------------------------------------------------------------------
# End to end: the real model on the GPU against the CPU run, then offline throughput
# --------------------------------------------------------------------------------------

def smollm2_shaped_stand_in(path: Path) -> str:
    """A random-weight Llama with SmolLM2-135M's exact shapes, built by transformers.

    The real weights (538 MB of float32) are more than a device call can carry, so on a
    bare GPU machine the end-to-end figures run on this stand-in: same layers, heads,
    vocabulary and sizes, hence the same work per token.
    """
    import torch
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2)
    tf.LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return str(path)


def end_to_end_smollm2() -> str:
    """SmolLM2 through ``LLM(device="cuda")``, then offline throughput.

    With the real weights (``weights/SmolLM2-135M-Instruct``): greedy tokens of float32 on
    the GPU equal to the CPU run's. Without them: a SmolLM2-shaped random model, whose
    prompt logits on the GPU (float32) must match the CPU's (random weights give near-tied
    logits, so greedy tokens are not a fair check there). Then bfloat16 offline throughput
    (64 requests, 128-token prompts, 128 output tokens, EOS ignored).
    """
    import tempfile

    try:
        from refengine import LLM, SamplingParams

        root = Path(__file__).resolve().parents[1]
        model = root / "weights" / "SmolLM2-135M-Instruct"
        real = (model / "model.safetensors").is_file()
        tmp = tempfile.TemporaryDirectory()
        if not real:
            model = smollm2_shaped_stand_in(Path(tmp.name))
        model = str(model)
        cpu_llm = LLM(model=model, device="cpu", log_stats=False)
        gpu32 = LLM(model=model, device="cuda", dtype="float32", log_stats=False)
        if real:
            prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
            greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
            cpu = [o.outputs[0].token_ids for o in cpu_llm.generate(prompts, greedy, use_tqdm=False)]
            gpu = [o.outputs[0].token_ids for o in gpu32.generate(prompts, greedy, use_tqdm=False)]
            check = f"SmolLM2 greedy float32 GPU == CPU: {'ok' if gpu == cpu else 'FAIL'}"
        else:
            ids = list(range(100, 400))
            want, got = cpu_llm.prompt_logits(ids), gpu32.prompt_logits(ids)
            err = float(np.abs(got - want).max() / np.abs(want).max())
            check = (f"stand-in (weights not on this machine) prompt logits float32 GPU vs CPU: "
                     f"max error {err:.1e} of max|logit| {'ok' if err < 1e-3 else 'FAIL'}")
        del cpu_llm, gpu32
        llm = LLM(model=model, device="cuda", dtype="bfloat16", log_stats=False)
        ids = list(range(1000, 1128))
        params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
        llm.generate([ids] * 4, params, use_tqdm=False)  # warm-up: kernel compilation
        t0 = time.perf_counter()
        outs = llm.generate([ids] * 64, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        return (f"{check}; bfloat16 offline throughput {n_out / dt:.0f} output tok/s, "
                f"{(n_out + 64 * len(ids)) / dt:.0f} total tok/s (64 requests, 128 in / 128 out)")
    except Exception as exc:  # report, don't hide the kernel tables above
        return f"FAILED: {type(exc).__name__}: {exc}"


# --------------------------------------------------------------------------------------

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    skip = parser.add_mutually_exclusive_group()
    skip.add_argument("--skip-bench", action="store_true", help="correctness only")
    skip.add_argument("--skip-correctness", action="store_true", help="speed only")
    parser.add_argument("--budget-s", type=float, default=TIME_BUDGET_S,
                        help="seconds after the benchmarks start past which no new flash-prefill or paged-decode "
                             "point starts (default %(default)s)")
    parser.add_argument("--performance-md", default=None,
                        help="write the speed tables as a section of this Markdown file (docs/PERFORMANCE.md)")
    args = parser.parse_args(argv)
    if args.budget_s < 0:
        parser.error(f"--budget-s {args.budget_s} must be at least 0")
    if args.performance_md and args.skip_bench:
        parser.error("--performance-md writes the speed tables: it cannot go with --skip-bench")

    cp = require_cupy()
    if cp is None:
        print("gpu_check: CuPy with a CUDA device is required (pip install 'refengine[cuda]' on a GPU machine)")
        return 2
    started = time.time()
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    device = (f"{props['name'].decode()}, {props['multiProcessorCount']} SMs, "
              f"{props['totalGlobalMem'] / 2**30:.0f} GiB, CUDA runtime {cp.cuda.runtime.runtimeGetVersion()}, "
              f"CuPy {cp.__version__}")
    print(f"device: {device}")

    failed, correctness = [], "not run (--skip-correctness)"
    if not args.skip_correctness:
        print("\n(a) correctness: CUDA kernels vs NumPy twin")
        results = check_correctness(cp, args.quick)
        failed = [r for r in results if not r[1]]
        for name, ok, detail in results:
            print(f"  {'ok  ' if ok else 'FAIL'} {name}  {detail}")
        correctness = f"{len(results) - len(failed)}/{len(results)} passed"
        print(f"  {correctness}  ({time.time() - started:.0f} s)")

    if not args.skip_bench:
        from refengine.kernels.build import cupy_kernels

        compile_s = cupy_kernels().compile()  # NVRTC on a fresh machine: no timed point pays for it
        print(f"\nkernel module compiled (NVRTC or CuPy's cache) in {compile_s:.1f} s")
        deadline = time.time() + args.budget_s
        copy_gbps = copy_bandwidth(cp)
        prefill = bench_prefill(cp, args.quick, deadline)
        decode = bench_decode(cp, args.quick, deadline)
        quant = bench_quant_matmul(cp, time.time() + 30)  # a few short points, after the budget if need be
        tables = speed_tables(prefill, decode, quant, copy_gbps)
        for caption, (headers, rows) in tables:
            print(f"\n(b) {caption}")
            print("  " + " ".join(f"{h:>12}" for h in headers))
            for row in rows:
                print("  " + " ".join(f"{v:>12}" for v in row))
        e2e = end_to_end_smollm2()
        print(f"\nend to end: {e2e}")
        if args.performance_md:
            from refengine.bench.report import write_performance

            body = [f"GPU: {device}. Correctness in this run (CUDA kernels against the NumPy twin): "
                    f"{correctness}. The kernel module compiled in {compile_s:.1f} s (NVRTC, or CuPy's disk "
                    "cache), before any timed point.",
                    *(item for caption, table in tables for item in (caption + ":", table)),
                    f"End to end: {e2e}."]
            write_performance(args.performance_md, f"gpu-check ({props['name'].decode()})", body)
            print(f"wrote the section to {args.performance_md}")
    print(f"\ntotal {time.time() - started:.0f} s")
    return 1 if failed else 0


def speed_tables(prefill: list[dict], decode: list[dict], quant: list[dict], copy_gbps: float) -> list:
    """The benchmark rows as ``[(caption, (headers, rows))]``, cells already formatted."""
    return [
        ("flash prefill, causal, float16, 32 query heads / 8 KV heads, paged (block 16); "
         "FLOPs = 2 * 2 * b * h * s^2 * d / 2",
         (["head_dim", "seq", "batch", "mma ms", "mma TFLOP/s", "simt TFLOP/s", "torch SDPA TFLOP/s"],
          [[r["head_dim"], r["seq"], r["batch"], f"{r['mma_ms']:.2f}", f"{r['mma_tflops']:.1f}",
            f"{r['simt_tflops']:.1f}", f"{r['sdpa_tflops']:.1f}"] for r in prefill])),
        (f"paged decode, float16 KV, 32 query heads / 8 KV heads, head_dim 128, partition 512 and the best "
         f"of 128-1024; GB/s = K+V bytes read / time; device-to-device copy {copy_gbps:.0f} GB/s (read + write)",
         (["batch", "context", "us", "GB/s", "% of copy", "best partition", "best GB/s"],
          [[r["batch"], r["ctx"], f"{r['us']:.1f}", f"{r['gbps']:.0f}", f"{100 * r['gbps'] / copy_gbps:.0f}%",
            r["best_partition"], f"{r['best_gbps']:.0f}"] for r in decode])),
        ("quantized-weight products (cuda/quant_matmul.cu), float16 rows; GB/s = weight bytes read / time",
         (["format", "rows", "out x in", "us", "GB/s", "TFLOP/s"],
          [[r["format"], r["rows"], f"{r['shape'][0]}x{r['shape'][1]}", f"{r['us']:.1f}", f"{r['gbps']:.0f}",
            f"{r['tflops']:.2f}"] for r in quant])),
    ]


if __name__ == "__main__":
    sys.exit(main())
