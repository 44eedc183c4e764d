"""Sliding-window attention and attention-logit soft-capping in the NumPy twin, against the
dense float64 reference of ``helpers.py`` (a query at ``p`` sees ``p - W < key <= p``).

The other backends test themselves against the twin with the same batches
(``test_cpu_kernels.py``, ``test_cuda_kernels.py``); the model-level checks (prefill against
token-by-token decode over three windows, chunk sizes around the window) live with the
models that use windows (``test_tiny_models.py``).
"""

from __future__ import annotations

import numpy as np
import pytest
from tests.helpers import BLOCK_SIZE, dense_reference, make_case, numpy_twin

from refengine.attention.numpy_ref import K_TILE, NumpyAttention, flash_prefill


def written_case(rng, seqs, num_heads, num_kv_heads, head_dim):
    """A float32 batch whose new keys and values are already in the cache."""
    case = make_case(rng, seqs, num_heads, num_kv_heads, head_dim, BLOCK_SIZE, np.float32)
    NumpyAttention().write_kv(case.k_cache, case.v_cache, case.k_new, case.v_new, case.meta)
    return case


def window_batch(window: int):
    """Prompts shorter than, equal to and longer than the window; chunks that start inside
    and past it; decode rows at and past its edge; a context several key tiles long."""
    W = window
    return [(max(1, W - 1), max(1, W - 1)), (W, W), (W + 1, W + 1), (3 * W, 3 * W), (3 * W, W // 2 + 1), (2 * W + 5, 7),
            (W, 1), (W + 1, 1), (3 * W + 2, 1), (1, 1), (K_TILE * 2 + 3 * W, W + 3)]


@pytest.mark.parametrize("window", [1, 5, BLOCK_SIZE, 37])
@pytest.mark.parametrize("group", [1, 4])
def test_sliding_window_matches_dense(window, group):
    rng = np.random.default_rng(window * 10 + group)
    case = written_case(rng, window_batch(window), 2 * group, 2, 32)
    want = dense_reference(case, sliding_window=window)
    np.testing.assert_allclose(numpy_twin(case, sliding_window=window), want, rtol=2e-5, atol=2e-5)


def test_window_at_least_the_context_is_plain_causal():
    rng = np.random.default_rng(3)
    case = written_case(rng, [(40, 40), (40, 9), (40, 1)], 4, 2, 16)
    np.testing.assert_array_equal(numpy_twin(case, sliding_window=40), numpy_twin(case))
    assert not np.allclose(numpy_twin(case, sliding_window=39), numpy_twin(case))


@pytest.mark.parametrize("cap", [0.5, 20.0])
@pytest.mark.parametrize("window", [None, 7])
def test_soft_cap_matches_dense(cap, window):
    rng = np.random.default_rng(int(cap * 10))
    case = written_case(rng, window_batch(7), 4, 2, 32)
    case.q *= 8  # scores of several units: the cap bends them
    want = dense_reference(case, sliding_window=window, logits_soft_cap=cap)
    got = numpy_twin(case, sliding_window=window, logits_soft_cap=cap)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    assert not np.allclose(got, numpy_twin(case, sliding_window=window), atol=1e-3)


def test_rows_whose_window_starts_past_a_key_tile():
    """Small key tiles: later rows of a query tile find whole key tiles before their window
    (their running max stays -inf there); they must neither turn NaN nor see those keys."""
    rng = np.random.default_rng(5)
    q_len, W = 64, 3
    q = rng.standard_normal((q_len, 2, 16)).astype(np.float32)
    k = rng.standard_normal((q_len, 1, 16)).astype(np.float32)
    v = rng.standard_normal((q_len, 1, 16)).astype(np.float32)
    got = flash_prefill(q, k, v, 0.25, q_tile=32, k_tile=4, sliding_window=W)
    for p in (0, 2, 3, 31, 32, 63):
        keys = np.arange(max(0, p - W + 1), p + 1)
        s = q[p] @ k[keys, 0].T * 0.25  # [heads, keys]
        w = np.exp(s - s.max(axis=1, keepdims=True))
        np.testing.assert_allclose(got[p], (w / w.sum(axis=1, keepdims=True)) @ v[keys, 0], rtol=2e-5, atol=2e-6)
