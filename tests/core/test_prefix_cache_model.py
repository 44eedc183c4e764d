"""Prefix caching on the real model: a shared system prompt, and a two-turn chat.

Outputs are compared with transformers' greedy output (shared prefix) or with the same
engine run without caching (chat); the cache must only save work.
"""

from __future__ import annotations

import pytest
import torch
from tests.helpers import shared_models

from refengine import LLM, SamplingParams
from refengine.cli import chat_turn

PREFIX_TEXT = ("You are a helpful assistant for a library. The library opens at nine in the morning and "
               "closes at six in the evening on weekdays; on Saturdays it closes at one. Members may borrow "
               "up to ten books at a time for three weeks, renewable twice unless another member has "
               "reserved the book. Late returns cost twenty cents a day per book. The reading room on the "
               "second floor is silent; group study rooms on the third floor can be booked for two hours. "
               "Printing costs ten cents a page in black and white and fifty cents in colour. The archive "
               "in the basement holds local newspapers since 1850 and can be visited by appointment. "
               "Children's story time is every Wednesday at four. Lost cards are replaced for two dollars. "
               "Wi-Fi is free; the password is printed on the back of every member card. The café next to "
               "the entrance sells tea, coffee and sandwiches until half past five, and food is not allowed "
               "beyond the lobby. Lockers for bags are on the ground floor and take a one-dollar coin that "
               "is returned. Volunteers teach basic computer skills on Monday and Thursday afternoons, and "
               "a book club meets on the last Friday of every month. Donations of books in good condition "
               "are welcome at the front desk during opening hours. Answer briefly.")
MAX_TOKENS = 8


@pytest.fixture(scope="module", autouse=True)
def _one_model():
    """The three engines differ in prefix caching only: they share the loaded model and skip
    the warm-up (:func:`tests.helpers.shared_models`), which changes no output."""
    with shared_models():
        yield


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from refengine.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def shared_prefix_prompts(tokenizer) -> list[list[int]]:
    prefix = tokenizer.encode(PREFIX_TEXT)
    assert len(prefix) >= 256
    prefix = prefix[:256]
    questions = ["When does it open on Saturday?", "How much is a late book?", "Where is the archive kept?",
                 "Can I print in colour here?", "Is there anything for kids?", "I lost my card, what now?",
                 "How long can I keep a book?", "Where can our group study?"]
    suffixes = [tokenizer.encode(" Question: " + q + " Answer in one short sentence. Answer: the answer is that")[:16]
                for q in questions]
    assert all(len(s) == 16 for s in suffixes) and len({tuple(s) for s in suffixes}) == 8
    return [prefix + s for s in suffixes]


@pytest.fixture(scope="module")
def shared_prefix_reference(smollm2_dir, shared_prefix_prompts) -> list[list[int]]:
    """transformers' greedy tokens after each prompt. Its KV cache of the shared 256 tokens
    is computed once and a copy continues each prompt (transformers' own prompt reuse,
    ``generate(cache=copy.deepcopy(prefix_cache))``), so the reference costs one
    prefix, not eight."""
    import copy

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32, attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None
    prefix = shared_prefix_prompts[0][:256]
    assert all(ids[:256] == prefix for ids in shared_prefix_prompts)
    with torch.no_grad():
        prefix_cache = model(torch.tensor([prefix]), use_cache=True).cache
        return [model.generate(torch.tensor([ids]), cache=copy.deepcopy(prefix_cache),
                               max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=2)[0, len(ids):].tolist()
                for ids in shared_prefix_prompts]


def test_shared_256_token_prefix(smollm2_dir, shared_prefix_prompts, shared_prefix_reference):
    llm = LLM(model=smollm2_dir, device="cpu", block_size=16, log_stats=False)
    engine = llm.llm_engine
    computed: dict[str, int] = {}  # prompt tokens each request runs through the model
    execute = engine.runner.execute

    def counting_execute(scheduled, **kw):
        for seq, n in scheduled:
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                computed[seq.request_id] = computed.get(seq.request_id, 0) + n
        return execute(scheduled, **kw)

    engine.runner.execute = counting_execute
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    # the first request fills the cache; the other seven arrive together after it
    outs = llm.generate(shared_prefix_prompts[:1], params, use_tqdm=False)
    outs += llm.generate(shared_prefix_prompts[1:], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == shared_prefix_reference
    assert outs[0].num_cached_tokens == 0 and computed[outs[0].request_id] == 272
    for o in outs[1:]:
        assert o.num_cached_tokens == 256
        assert computed[o.request_id] == 16 <= 32
    m = engine.metrics
    assert m.total_prefix_cache_queries == 8 * 272 and m.total_prefix_cache_hits == 7 * 256
    assert m.stats_since_last_log()["prefix_cache_hit_rate"] == pytest.approx(100 * 7 * 256 / (8 * 272))
    assert f'refengine:prefix_cache_hits_total {7 * 256}.0' in m.exposition()
    bm = engine.block_manager
    assert bm.usage == 0.0 and bm.ref_counts == [0] * bm.num_blocks


def test_chat_second_turn_computes_only_the_new_tokens(smollm2_dir, tokenizer):
    params = SamplingParams(max_tokens=32, temperature=0.0)
    answers = {}
    for caching in (True, False):
        engine = LLM(model=smollm2_dir, device="cpu", block_size=16, log_stats=False,
                     enable_prefix_caching=caching).llm_engine
        history = [{"role": "user", "content": "What is the capital of France?"}]
        first = chat_turn(engine, tokenizer, history, "chat-0", params)
        history += [{"role": "assistant", "content": first.outputs[0].text},
                    {"role": "user", "content": "And of Italy?"}]
        before = engine.metrics.total_prompt_tokens
        second = chat_turn(engine, tokenizer, history, "chat-1", params)
        answers[caching] = (first.outputs[0].token_ids, second.outputs[0].token_ids)
        if not caching:
            assert second.num_cached_tokens == 0
            continue
        assert first.outputs[0].finish_reason == "stop"
        # turn 1's prompt and answer, up to its last token (sampled, never computed), are
        # the start of turn 2's prompt, and their full blocks are still cached
        done = first.prompt_token_ids + first.outputs[0].token_ids[:-1]
        prompt2 = second.prompt_token_ids
        assert prompt2[:len(done)] == done
        assert second.num_cached_tokens == len(done) // 16 * 16 > 0
        new = engine.metrics.total_prompt_tokens - before
        assert new == len(prompt2) - second.num_cached_tokens
        assert new < len(prompt2) - len(done) + 16  # the new turn, plus the unfinished block of the last
    assert answers[True] == answers[False]
