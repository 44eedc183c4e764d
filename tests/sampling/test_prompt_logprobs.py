"""``SamplingParams.prompt_logprobs`` (vLLM's semantics) and ``echo`` on ``/v1/completions``.

The reference is transformers' float32 ``log_softmax`` over the same prompt, computed here.
The engine's entries must not depend on how the prompt was run: chunk size, batch company,
``n``, prefix-cache hits of other requests, preemption and recompute. The tiny random Llama
covers the schedule (its logits spread widely, so a wrong row shows); SmolLM2 checks a real
tokenizer's prompt and the decoded tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from refengine import LLM, SamplingParams
from refengine.core.engine import LLMEngine
from refengine.core.sequence import Logprob

TOL = 1e-4  # against transformers (another implementation, other summation orders)
SAME = 1e-5  # the same engine run another way: only BLAS blocking differs


def hf_log_softmax(model_dir, prompts: list[list[int]]) -> list[np.ndarray]:
    """transformers' float32 log-softmax of each prompt's logits, ``[P, vocab]``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return [torch.log_softmax(model(torch.tensor([p])).logits[0].float(), dim=-1).numpy() for p in prompts]


def check_against(entries, prompt: list[int], ref: np.ndarray, k: int) -> None:
    """``entries`` (RequestOutput.prompt_logprobs) equal the reference log-softmax: the
    prompt token first, its rank, then the top k ids in order with their values."""
    assert len(entries) == len(prompt) and entries[0] is None
    for j in range(1, len(prompt)):
        row, tok = ref[j - 1], prompt[j]
        entry = entries[j]
        assert all(isinstance(v, Logprob) for v in entry.values())
        ids = list(entry)
        assert ids[0] == tok
        assert abs(entry[tok].logprob - row[tok]) < TOL, (j, entry[tok].logprob, row[tok])
        assert entry[tok].rank == int((row > row[tok]).sum()) + 1
        top = np.argsort(-row, kind="stable")[:k].tolist()
        rest = [t for t in ids[1:]]
        assert rest == [t for t in top if t != tok], (j, rest, top)  # the prompt token is not repeated
        for rank, t in enumerate(top, 1):
            assert abs(entry[t].logprob - row[t]) < TOL
            if t != tok:
                assert entry[t].rank == rank


def flat(entries) -> tuple[list, np.ndarray]:
    """``(ids and ranks per entry, logprobs)`` for comparing two runs."""
    keys = [None if e is None else [(t, lp.rank) for t, lp in e.items()] for e in entries]
    values = np.array([lp.logprob for e in entries[1:] for lp in e.values()])
    return keys, values


def assert_same(a, b) -> None:
    ka, va = flat(a)
    kb, vb = flat(b)
    assert ka == kb
    np.testing.assert_allclose(va, vb, rtol=0, atol=SAME)


@pytest.fixture(scope="module")
def tiny_prompts() -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(3, 211, n).tolist() for n in (45, 23, 61, 1, 2)]


@pytest.fixture(scope="module")
def tiny_ref(tiny_llama_dir, tiny_prompts) -> list[np.ndarray]:
    return hf_log_softmax(tiny_llama_dir, tiny_prompts)


def tiny_llm(tiny_llama_dir, **kw) -> LLM:
    return LLM(model=tiny_llama_dir, log_stats=False, **kw)


# --------------------------------------------------------------------------------------
# The engine
# --------------------------------------------------------------------------------------


# --- the arrays: row blocks, exactly the whole-array values --------------------------------

def whole_array_prompt_logprobs(logits, token_ids, k):
    """What the engine computed before row blocks: every step on the whole [r, V] array."""
    from refengine.sampler import log_softmax, sanitize_logits

    lp = log_softmax(sanitize_logits(logits))
    r = lp.shape[0]
    actual = lp[np.arange(r), token_ids]
    ranks = (lp > actual[:, None]).sum(axis=-1) + 1
    top = np.argpartition(-lp, k - 1, axis=-1)[:, :k]
    order = np.lexsort((top, -np.take_along_axis(lp, top, axis=-1)), axis=-1)
    top = np.take_along_axis(top, order, axis=-1)
    return actual, ranks, top, np.take_along_axis(lp, top, axis=-1)


def test_arrays_are_computed_in_row_blocks_with_bounded_memory(monkeypatch):
    """Scratch memory (numpy's allocations, which tracemalloc sees) is a few row blocks,
    not the ~4 [r, V] arrays (one int64) the whole-array computation took; every value,
    rank and top id equals the whole-array computation's."""
    import tracemalloc

    import refengine.sampler as sampler

    block = 256 * 1024
    monkeypatch.setattr(sampler, "PROMPT_LOGPROBS_BLOCK_BYTES", block)
    rng = np.random.default_rng(0)
    r, V, k = 200, 8192, 5  # 6.25 MiB of logits
    logits = (rng.standard_normal((r, V)) * 4).astype(np.float32)
    logits[3, 7] = np.nan  # counts as -inf
    logits[4, :] = np.float32(-np.inf)
    logits[4, 9] = 0.0
    token_ids = rng.integers(0, V, size=r)
    tracemalloc.start()
    try:
        got = sampler.prompt_logprobs_rows(logits, token_ids, k)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    results = r * (4 + 8 + k * (8 + 4))
    assert peak < 10 * block + results + 64 * 1024, peak  # measured about 7.5 blocks
    assert peak < logits.nbytes / 2
    want = whole_array_prompt_logprobs(logits, token_ids, k)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    assert got[1][4] == (1 if token_ids[4] == 9 else 2) and got[2][4, 0] == 9


def test_tiny_matches_transformers(tiny_llama_dir, tiny_prompts, tiny_ref):
    llm = tiny_llm(tiny_llama_dir)
    params = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=4)
    outs = llm.generate(tiny_prompts, params, use_tqdm=False)
    for out, prompt, ref in zip(outs, tiny_prompts, tiny_ref):
        check_against(out.prompt_logprobs, prompt, ref, k=4)
        assert all(lp.decoded_token is None for e in out.prompt_logprobs[1:] for lp in e.values())  # no tokenizer
    assert outs[3].prompt_logprobs == [None]  # a 1-token prompt: nothing predicts its token


def test_zero_means_only_the_prompt_token_and_none_means_none(tiny_llama_dir, tiny_prompts, tiny_ref):
    llm = tiny_llm(tiny_llama_dir)
    with_zero, without = llm.generate([tiny_prompts[1]] * 2, [SamplingParams(max_tokens=1, prompt_logprobs=0),
                                                            SamplingParams(max_tokens=1)], use_tqdm=False)
    assert without.prompt_logprobs is None
    entries = with_zero.prompt_logprobs
    assert [list(e) for e in entries[1:]] == [[t] for t in tiny_prompts[1][1:]]
    check_against(entries, tiny_prompts[1], tiny_ref[1], k=0)


def test_limits(tiny_llama_dir):
    engine = LLMEngine(tiny_llama_dir, log_stats=False, max_logprobs=5)
    with pytest.raises(ValueError, match=r"prompt_logprobs=6 is more than this engine's max_logprobs=5"):
        engine.add_request("a", [5, 6, 7], SamplingParams(prompt_logprobs=6))
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="SamplingParams.prompt_logprobs="):
            SamplingParams(prompt_logprobs=bad)
    assert not engine.has_unfinished_requests()


def test_chunks_batch_and_n_do_not_change_them(tiny_llama_dir, tiny_prompts, tiny_ref):
    params = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=3)
    alone = [tiny_llm(tiny_llama_dir, max_num_batched_tokens=512).generate([p], params, use_tqdm=False)[0]
             for p in tiny_prompts]
    chunked = tiny_llm(tiny_llama_dir, max_num_batched_tokens=7)
    plain = SamplingParams(max_tokens=4, temperature=0.0)
    # batched, chunks of 7 rows, beside requests that want none
    outs = chunked.generate(tiny_prompts + tiny_prompts[:2], [params] * len(tiny_prompts) + [plain] * 2,
                            use_tqdm=False)
    for a, b, prompt, ref in zip(alone, outs, tiny_prompts, tiny_ref):
        assert_same(a.prompt_logprobs, b.prompt_logprobs)
        check_against(b.prompt_logprobs, prompt, ref, k=3)
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert all(o.prompt_logprobs is None for o in outs[len(tiny_prompts):])
    # n = 3 completions share one list, filled once
    [out] = chunked.generate([tiny_prompts[2]], SamplingParams(n=3, max_tokens=2, prompt_logprobs=3, seed=1),
                             use_tqdm=False)
    assert_same(out.prompt_logprobs, alone[2].prompt_logprobs)


def test_lm_head_only_on_rows_that_need_it(tiny_llama_dir, tiny_prompts):
    llm = tiny_llm(tiny_llama_dir, max_num_batched_tokens=512)
    engine = llm.llm_engine
    rows = []
    forward = engine.model.forward

    def counting_forward(ids, positions, kv_cache, meta, logits_indices):
        rows.append((len(ids), len(logits_indices)))
        return forward(ids, positions, kv_cache, meta, logits_indices)

    engine.model.forward = counting_forward
    a, b = tiny_prompts[0], tiny_prompts[2]
    llm.generate([a, b], [SamplingParams(max_tokens=1, prompt_logprobs=2), SamplingParams(max_tokens=1)],
                 use_tqdm=False)
    # one step: both prompts; the LM head on a's rows 0 .. len(a) - 2, and each last row
    assert rows == [(len(a) + len(b), (len(a) - 1) + 2)]


def test_sent_once_in_the_output_where_the_prefill_completes(tiny_llama_dir, tiny_prompts, tiny_ref):
    engine = LLMEngine(tiny_llama_dir, log_stats=False, max_num_batched_tokens=8)
    prompt = tiny_prompts[2]
    engine.add_request("r", prompt, SamplingParams(max_tokens=5, temperature=0.0, prompt_logprobs=1))
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    assert len(outs) == 5  # one per token: chunked prefill steps report nothing
    assert outs[0].prompt_logprobs is not None and all(o.prompt_logprobs is None for o in outs[1:])
    check_against(outs[0].prompt_logprobs, prompt, tiny_ref[2], k=1)


def test_prefix_cache_hit_is_recomputed_not_read(tiny_llama_dir, tiny_prompts, tiny_ref):
    """The rule: a request owed prompt logprobs takes no prefix-cache hits (vLLM's), so its
    rows are computed; the blocks it fills are cached for the others."""
    llm = tiny_llm(tiny_llama_dir, enable_prefix_caching=True, block_size=16)
    prompt = tiny_prompts[2]  # 61 tokens: 3 full blocks
    plain = SamplingParams(max_tokens=2, temperature=0.0)
    first = llm.generate([prompt], plain, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert llm.generate([prompt], plain, use_tqdm=False)[0].num_cached_tokens == 48  # the cache works
    scored = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2),
                          use_tqdm=False)[0]
    assert scored.num_cached_tokens == 0
    check_against(scored.prompt_logprobs, prompt, tiny_ref[2], k=2)
    assert scored.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.generate([prompt], plain, use_tqdm=False)[0].num_cached_tokens == 48


@pytest.mark.parametrize("case", ["while decoding", "mid-prefill"])
def test_preemption_and_recompute_keep_each_entry_once(tiny_llama_dir, tiny_prompts, tiny_ref, case):
    if case == "while decoding":  # 12 blocks hold about two of these; preempted after their prefill
        order, max_tokens, engine_kw = [0, 2, 0, 1], [40] * 4, {"num_kv_blocks": 12}
    else:  # 5 blocks: the 61-token prompt, prefilled 15 tokens a step beside a decoding one, runs out at 60
        order, max_tokens, engine_kw = [1, 2], [50, 10], {"num_kv_blocks": 5, "max_model_len": 80}
    prompts, refs = [tiny_prompts[i] for i in order], [tiny_ref[i] for i in order]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, prompt_logprobs=2) for m in max_tokens]
    alone = [tiny_llm(tiny_llama_dir, max_num_batched_tokens=512).generate([p], q, use_tqdm=False)[0]
             for p, q in zip(prompts, params)]
    llm = tiny_llm(tiny_llama_dir, block_size=16, max_num_batched_tokens=16, **engine_kw)
    scheduler = llm.llm_engine.scheduler
    at_preemption = []  # (entries already there, prompt length)
    preempt = scheduler._preempt

    def recording_preempt(seq):
        at_preemption.append((len(seq.prompt_logprobs), seq.num_prompt_tokens))
        preempt(seq)

    scheduler._preempt = recording_preempt
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert at_preemption and llm.llm_engine.metrics.total_preemptions == len(at_preemption)
    if case == "mid-prefill":
        assert any(1 < done < n for done, n in at_preemption), at_preemption
    else:
        assert all(done == n for done, n in at_preemption), at_preemption
    for a, b, prompt, ref in zip(alone, outs, prompts, refs):
        check_against(b.prompt_logprobs, prompt, ref, k=2)
        assert_same(a.prompt_logprobs, b.prompt_logprobs)
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_with_speculative_decoding(tiny_llama_dir, tiny_prompts, tiny_ref):
    """The proposals' verification rows and the prompt rows share one LM-head call."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    llm = tiny_llm(tiny_llama_dir, speculative_config=spec, max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate(tiny_prompts[:3], params, use_tqdm=False)
    plain = tiny_llm(tiny_llama_dir).generate(tiny_prompts[:3], params, use_tqdm=False)
    for a, b, prompt, ref in zip(plain, outs, tiny_prompts, tiny_ref):
        check_against(b.prompt_logprobs, prompt, ref, k=2)
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_smollm2_matches_transformers(smollm2_dir):
    llm = LLM(model=smollm2_dir, max_num_batched_tokens=16, log_stats=False)
    tok = llm.get_tokenizer()
    text = "Question: What is the capital of France?\nAnswer: The capital of France is Paris."
    prompt = tok.encode(text)
    [ref] = hf_log_softmax(smollm2_dir, [prompt])
    [out] = llm.generate([text], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=5), use_tqdm=False)
    assert out.prompt_token_ids == prompt
    check_against(out.prompt_logprobs, prompt, ref, k=5)
    for e in out.prompt_logprobs[1:]:
        for t, lp in e.items():
            assert lp.decoded_token == tok.decode([t], skip_special_tokens=False)


# --------------------------------------------------------------------------------------
# The server: echo on /v1/completions
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tiny_llama_tok_dir):
    """The tiny Llama with its character tokenizer, served; ``offline`` is a second engine
    on the same weights for the expected values."""
    pytest.importorskip("fastapi")
    pytest.importorskip("openai")
    from tests.helpers import ServerThread, client

    from refengine.server.api import create_app

    engine = LLMEngine(tiny_llama_tok_dir, num_kv_blocks=128, log_stats=False)
    app = create_app(engine, served_model_name="tiny")
    with ServerThread(app) as url:
        yield client(url, key="unused"), LLM(model=tiny_llama_tok_dir, log_stats=False)


PROMPT = "Hello, world!"


def expected(offline: LLM, prompt, max_tokens: int, k: int):
    """The offline engine's prompt logprobs and greedy completion for ``prompt``."""
    [out] = offline.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=k,
                                                      prompt_logprobs=k), use_tqdm=False)
    return out


def test_echo_max_tokens_0_returns_the_prompt_scored(served):
    c, offline = served
    ref = expected(offline, PROMPT, 1, 2)
    resp = c.completions.create(model="tiny", prompt=PROMPT, echo=True, max_tokens=0, logprobs=2, temperature=0)
    [choice] = resp.choices
    assert choice.text == PROMPT and choice.finish_reason == "length"
    lp = choice.logprobs
    assert lp.tokens == list(PROMPT)  # one character per token
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == list(range(len(PROMPT)))
    for j in range(1, len(PROMPT)):
        entry = ref.prompt_logprobs[j]
        assert lp.token_logprobs[j] == pytest.approx(entry[ref.prompt_token_ids[j]].logprob, abs=SAME)
        assert set(lp.top_logprobs[j]) == {offline.get_tokenizer().decode([t], skip_special_tokens=False)
                                           for t in entry}
    assert resp.usage.prompt_tokens == len(PROMPT) and resp.usage.completion_tokens == 0


def test_echo_with_a_completion_puts_the_prompt_first(served):
    """lm-eval's loglikelihood request: echo, logprobs 1, max_tokens 1; and a longer one."""
    c, offline = served
    for max_tokens in (1, 4):
        ref = expected(offline, PROMPT, max_tokens, 1)
        plain = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=max_tokens, logprobs=1, temperature=0)
        resp = c.completions.create(model="tiny", prompt=PROMPT, echo=True, max_tokens=max_tokens, logprobs=1,
                                    temperature=0)
        [choice], [alone] = resp.choices, plain.choices
        assert choice.text == PROMPT + alone.text
        lp = choice.logprobs
        n = len(PROMPT)
        assert len(lp.tokens) == n + max_tokens and lp.token_logprobs[0] is None
        assert lp.tokens[n:] == alone.logprobs.tokens and lp.token_logprobs[n:] == alone.logprobs.token_logprobs
        assert lp.text_offset[n:] == [n + o for o in alone.logprobs.text_offset]
        np.testing.assert_allclose(lp.token_logprobs[1:n],
                                   [ref.prompt_logprobs[j][t].logprob for j, t in enumerate(ref.prompt_token_ids)
                                    if j], atol=SAME)
        assert choice.finish_reason == alone.finish_reason
        assert resp.usage.completion_tokens == max_tokens


def test_echo_without_logprobs_and_list_prompts(served):
    c, offline = served
    tok = offline.get_tokenizer()
    ids = tok.encode("abc def")
    resp = c.completions.create(model="tiny", prompt=[PROMPT, "xyz"], echo=True, max_tokens=2, temperature=0)
    plain = c.completions.create(model="tiny", prompt=[PROMPT, "xyz"], max_tokens=2, temperature=0)
    assert [ch.text for ch in resp.choices] == [PROMPT + plain.choices[0].text, "xyz" + plain.choices[1].text]
    assert all(ch.logprobs is None for ch in resp.choices)
    # token-id prompts echo their decoded text, with logprobs
    resp = c.completions.create(model="tiny", prompt=[ids, ids[:3]], echo=True, max_tokens=0, logprobs=0)
    assert [ch.text for ch in resp.choices] == ["abc def", "abc"]
    assert [len(ch.logprobs.tokens) for ch in resp.choices] == [7, 3]
    assert resp.choices[0].logprobs.token_logprobs[:3] == resp.choices[1].logprobs.token_logprobs


def test_echo_streamed_sends_the_prompt_in_the_first_chunk(served):
    c, _ = served
    whole = c.completions.create(model="tiny", prompt=PROMPT, echo=True, max_tokens=5, logprobs=1, temperature=0)
    chunks = list(c.completions.create(model="tiny", prompt=PROMPT, echo=True, max_tokens=5, logprobs=1,
                                       temperature=0, stream=True))
    texts = [ch.choices[0].text for ch in chunks if ch.choices]
    assert texts[0].startswith(PROMPT) and "".join(texts) == whole.choices[0].text
    tokens, token_lps, offsets = [], [], []
    for ch in chunks:
        if ch.choices and ch.choices[0].logprobs is not None:
            tokens += ch.choices[0].logprobs.tokens
            token_lps += ch.choices[0].logprobs.token_logprobs
            offsets += ch.choices[0].logprobs.text_offset
    assert tokens == whole.choices[0].logprobs.tokens
    assert token_lps == whole.choices[0].logprobs.token_logprobs
    assert offsets == whole.choices[0].logprobs.text_offset
    # max_tokens 0, streamed: one chunk, the prompt
    chunks = list(c.completions.create(model="tiny", prompt=PROMPT, echo=True, max_tokens=0, stream=True))
    assert [(ch.choices[0].text, ch.choices[0].finish_reason) for ch in chunks if ch.choices] == [(PROMPT, "length")]
