"""Captured one-row decode steps (refengine.ops.numba_decode): the same bits as the forward.

A captured step replays the kernels the forward runs, bound to fixed buffers, so every
logit must be the same bits as with ``enforce_eager=True`` (the forward every step): across
the attention's partition boundaries and its serial/parallel switch, with float32, float16
and int8 caches, GGUF weights with Q8_0 activations and float32 weights, on one thread or two.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")

from refengine import LLM, SamplingParams  # noqa: E402
from refengine.attention import paged_metadata  # noqa: E402
from refengine.attention.numba_cpu import DECODE_PARTITION, SERIAL_DECODE_MAX_TOKENS  # noqa: E402
from refengine.ops import numba_decode  # noqa: E402
from refengine.ops.numba_ops import NumbaOps  # noqa: E402


def _greedy(llm: LLM, prompt: list[int], n: int):
    """Token ids and every step's top-2 log-probabilities of a greedy run."""
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    return out.token_ids, [sorted(step.items()) for step in out.logprobs]


def _count_calls(monkeypatch) -> list[int]:
    calls = [0]
    step = numba_decode.DecodeCapture.__call__

    def counted(self, *args):
        calls[0] += 1
        return step(self, *args)

    monkeypatch.setattr(numba_decode.DecodeCapture, "__call__", counted)
    return calls


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "float16", "int8"])
def test_captured_steps_give_the_forward_bits(gguf_path, kv_cache_dtype, monkeypatch):
    """SmolLM2's Q4_1 file with Q8_0 activations: a 120-token prompt then 150 greedy tokens
    (contexts 121-270: partitions of 128 tokens added at 129 and 257, the parallel decode
    kernel from 256) give the same tokens and log-probabilities captured and eager."""
    assert DECODE_PARTITION == 128 and SERIAL_DECODE_MAX_TOKENS == 256  # the boundaries the run crosses
    prompt = np.random.default_rng(0).integers(100, 40000, 120).tolist()
    runs = {}
    for eager in (True, False):
        llm = LLM(model=str(gguf_path), activation_dtype="q8_0", kv_cache_dtype=kv_cache_dtype, max_model_len=512,
                  enable_prefix_caching=False, enforce_eager=eager, num_threads=2)
        runner = llm.llm_engine.runner
        assert (runner.decode_capture is None) == eager
        calls = _count_calls(monkeypatch)
        runs[eager] = _greedy(llm, prompt, 150)
        assert calls[0] == (0 if eager else 149)  # every step after the prompt's
    assert runs[False] == runs[True]


def test_float32_weights_and_thread_changes(tiny_llama_tok_dir, monkeypatch):
    """A float32 checkpoint (the products' dot kernel bound), with numba's thread count
    changed between requests (the calls rebound for it): the eager bits on one thread and on two."""
    import numba

    from refengine import model_runner
    from refengine.runtime.threads import use_threads

    prompt = list(range(3, 40))
    eager = LLM(model=str(tiny_llama_tok_dir), max_model_len=200, enable_prefix_caching=False, enforce_eager=True)
    llm = LLM(model=str(tiny_llama_tok_dir), max_model_len=200, enable_prefix_caching=False)
    capture = llm.llm_engine.runner.decode_capture
    assert capture is not None
    calls = _count_calls(monkeypatch)
    for threads in (1, 2, 1):  # each step's count, set where the runner would adapt it
        monkeypatch.setattr(model_runner, "adapt_threads", lambda **kw: use_threads(1, threads))
        assert _greedy(llm, prompt, 30) == _greedy(eager, prompt, 30)
        assert capture._threads == numba.get_num_threads() == min(threads, numba.config.NUMBA_NUM_THREADS)
    assert calls[0] == 3 * 29


def test_bad_steps_raise_and_other_models_run_the_forward(tiny_llama_tok_dir):
    llm = LLM(model=str(tiny_llama_tok_dir), max_model_len=64, enable_prefix_caching=False, num_kv_blocks=8,
              block_size=16)
    engine = llm.llm_engine
    capture = engine.runner.decode_capture
    ids, pos = np.array([5]), np.array([20])

    def meta(table, seq_len=21, q_lens=(1,)):
        return paged_metadata(np.array(q_lens), np.array([seq_len] * len(q_lens)), np.array([table] * len(q_lens),
                                                                                              np.int32), 16)

    with pytest.raises(ValueError, match="block table"):
        capture(ids, pos, meta([8, 0]))  # block 8 of a pool of 8 (the slot, in block 0, is fine)
    with pytest.raises(IndexError, match="RoPE"):
        capture(ids, np.array([10_000]), meta([0, 1]))
    with pytest.raises(ValueError, match="one sequence with one new token"):
        capture(ids, pos, meta([0, 1], q_lens=(1, 1)))
    with pytest.raises(ValueError, match="max_model_len"):
        capture(ids, np.array([128]), meta(list(range(9)), seq_len=129))  # the pool holds 128 tokens
    # the engine serves on after a failed step (the capture holds no state of a step)
    out = llm.generate([list(range(3, 20))], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    # a family whose decoder layer differs, or a sliding window: no capture
    model = engine.model
    model.layers[0].attention_options = {"sliding_window": 8}
    try:
        assert numba_decode.DecodeCapture.for_model(model, engine.kv_cache) is None
    finally:
        model.layers[0].attention_options = {}
    assert numba_decode.DecodeCapture.for_model(model, engine.kv_cache) is not None


def test_bind_linear_checks_both_widths():
    """A float32 weight ``[in, out]``: an input of another width is refused, not read past."""
    w = np.zeros((8, 4), np.float32)
    ops = NumbaOps()
    with pytest.raises(ValueError, match="bind_linear"):
        ops.bind_linear(np.zeros((1, 9), np.float32), w, np.zeros((1, 4), np.float32))
    with pytest.raises(ValueError, match="bind_linear"):
        ops.bind_linear(np.zeros((1, 8), np.float32), w, np.zeros((1, 5), np.float32))
    x, out = np.ones((1, 8), np.float32), np.zeros((1, 4), np.float32)
    w[:, 2] = 0.5
    ops.bind_linear(x, w, out)()
    np.testing.assert_array_equal(out, [[0.0, 0.0, 4.0, 0.0]])
