"""Batch-invariant logits on the CPU (``batch_invariant``, on by default with the numba backend).

A sequence's log-probabilities must be the same bits whatever else is in its step (alone,
or among 200 other requests: steps of more than ``BLAS_MIN_ROWS`` rows, where BLAS would
take over; among 24 at 7 tokens a step), however its prompt is chunked (7 and 512 tokens a step), whether its prefix
came from the prefix cache or was computed, and on 1 or 2 threads. Checked on the tiny
Llama and on a tiny Gemma 3 (sliding windows shorter than the prompt, so key tiles start
inside the context), with ``batch_invariant=False`` as the control that the crowd does
change the bits when BLAS is allowed.

The module takes a minute: 12 engine runs per model, 4 of them among a crowd of 200
requests, which must be large enough for steps beyond ``BLAS_MIN_ROWS`` rows.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from tests.models.test_tiny_families import build

from refengine import LLM, SamplingParams
from refengine.cpu.layer_ops import BLAS_MIN_ROWS

PROMPT_LEN = 45  # several chunks of 7; not a multiple of the block size
MAX_TOKENS = 6
CROWD = 200
#: The crowd at 7 tokens a step, where no step holds more than 7 rows whatever the crowd's
#: size: 24 others give the target the same company as 200 (other prompts' chunks and
#: decodes, before and after its own), in an eighth of the steps.
CHUNKED_CROWD = 24


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model_dir(request, tiny_llama_dir, tmp_path_factory):
    if request.param == "llama":
        return tiny_llama_dir
    path = tmp_path_factory.mktemp("tiny-gemma3")
    build("gemma3", path)
    return path


def _target(seed: int = 7) -> list[int]:
    return np.random.default_rng(seed).integers(3, 211, size=PROMPT_LEN).tolist()


def _crowd(n: int = CROWD) -> list[list[int]]:
    rng = np.random.default_rng(11)
    return [rng.integers(3, 211, size=int(rng.integers(1, 24))).tolist() for _ in range(n)]


def _exact(entry: dict) -> list:
    """``{token: logprob or Logprob}`` -> sorted ``(token, float32 bit pattern)``."""
    return sorted((t, np.float32(getattr(lp, "logprob", lp)).view(np.uint32).item()) for t, lp in entry.items())


def _bits(output, prompt_logprobs: bool) -> list:
    """Every float the request returned, as exact bit patterns (and the token ids)."""
    c = output.outputs[0]
    got = [tuple(c.token_ids)] + [_exact(step) for step in c.logprobs]
    if prompt_logprobs:
        got += [_exact(entry) for entry in output.prompt_logprobs[1:]]
    return got


@functools.cache
def _run(model_dir, *, crowd: bool, budget: int, threads: int, cached: bool, batch_invariant: bool | None = None):
    """The target's bits from one engine: alone or after/among the crowd, ``budget`` tokens
    a step; ``cached``: the target's prompt was served before, so its full blocks come
    from the prefix cache (then no prompt logprobs, which never take cache hits).

    A run is deterministic and a crowd run serves up to 201 requests, so a configuration that two
    tests use (``test_cold_and_cached_prefix_agree`` takes two of the first test's) runs
    once (``functools.cache``)."""
    llm = LLM(model=str(model_dir), num_threads=threads, max_num_batched_tokens=budget, max_num_seqs=256,
              enable_prefix_caching=True, batch_invariant=batch_invariant)
    target = _target()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=5, ignore_eos=True,
                            prompt_logprobs=None if cached else 5)
    if cached:
        llm.generate([target], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    others = _crowd(CROWD if budget >= BLAS_MIN_ROWS else CHUNKED_CROWD) if crowd else []
    at = len(others) // 2
    prompts = others[:at] + [target] + others[at:]
    plain = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, [params if i == at else plain for i in range(len(prompts))], use_tqdm=False)
    out = outs[at]
    assert out.prompt_token_ids == target
    if cached:
        assert out.num_cached_tokens > 0
    return _bits(out, prompt_logprobs=not cached)


@pytest.mark.parametrize("cached", [False, True], ids=["cold", "prefix-cache"])
def test_logprobs_are_the_same_bits_in_any_batch_chunking_and_thread_count(model_dir, cached):
    want = _run(model_dir, crowd=False, budget=512, threads=1, cached=cached)
    for crowd, budget, threads in [(False, 7, 2), (True, 512, 2), (True, 7, 1), (True, 512, 1), (False, 512, 2)]:
        got = _run(model_dir, crowd=crowd, budget=budget, threads=threads, cached=cached)
        assert got == want, f"crowd={crowd} budget={budget} threads={threads} cached={cached}"


def test_cold_and_cached_prefix_agree(model_dir):
    cold = _run(model_dir, crowd=False, budget=7, threads=2, cached=False)
    cached = _run(model_dir, crowd=True, budget=512, threads=2, cached=True)
    assert cached == cold[:1 + MAX_TOKENS]  # the generated tokens and their logprobs


def test_steps_of_the_crowd_are_larger_than_the_blas_switch(tiny_llama_dir):
    """The crowd makes steps where BLAS would take over: with ``batch_invariant=False`` the
    target's bits change (the control: the invariant runs above do exercise the switch)."""
    assert CROWD + 1 > BLAS_MIN_ROWS
    alone = _run(tiny_llama_dir, crowd=False, budget=512, threads=2, cached=False, batch_invariant=False)
    crowd = _run(tiny_llama_dir, crowd=True, budget=512, threads=2, cached=False, batch_invariant=False)
    assert alone[0] == crowd[0]  # the same tokens ...
    assert alone != crowd  # ... from logprobs that differ in their last bits


def test_batch_invariant_needs_the_numba_backend(tiny_llama_dir):
    with pytest.raises(ValueError, match=r"batch_invariant=True needs attention_backend in \('numba',\)"):
        LLM(model=str(tiny_llama_dir), attention_backend="numpy", batch_invariant=True)
    llm = LLM(model=str(tiny_llama_dir), attention_backend="numpy")
    assert llm.llm_engine.config.batch_invariant is False
    assert LLM(model=str(tiny_llama_dir)).llm_engine.config.batch_invariant is True


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_cuda_decode_split_is_fixed_per_sequence_not_per_batch(dtype):
    """The CUDA decode kernel (run by the emulator) splits a context into partitions by the
    sequence's own length: a short sequence's output is the same bits alone (one partition,
    written directly) and beside a long one (a grid several partitions deep, merged by the
    reduce kernel, which keeps a lone partition's output as it is)."""
    from tests.helpers import make_case

    from refengine.attention import paged_metadata
    from refengine.attention.cuda import EmulatedCudaAttention

    backend = EmulatedCudaAttention(decode_partition_size=64)
    short = [(n, 1) for n in (1, 17, 40, 63, 64)]  # one partition each
    case = make_case(np.random.default_rng(3), short + [(300, 1)], num_heads=8, num_kv_heads=2, head_dim=128,
                     block_size=16, dtype=dtype)
    backend.write_kv(case.k_cache, case.v_cache, case.k_new, case.v_new, case.meta)
    batch = backend.forward(case.q, case.k_cache, case.v_cache, case.meta, case.scale)  # 5 partitions deep
    m, n = case.meta, len(short)
    alone_meta = paged_metadata(case.q_lens[:n], np.asarray(m.seq_lens)[:n], np.asarray(m.block_tables)[:n], 16)
    alone = backend.forward(case.q[:n], case.k_cache, case.v_cache, alone_meta, case.scale)  # 1 partition deep
    np.testing.assert_array_equal(alone.view(np.uint8), batch[:n].view(np.uint8))
    assert np.isfinite(batch.astype(np.float32)).all()
