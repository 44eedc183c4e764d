"""Gemma 3 270M (the second real model) against transformers, both reading the same Q4_K_M
GGUF file: refengine runs its blocks as stored, transformers dequantizes them to float32
(eager attention; ``conftest.py``'s ``hf_gemma3``).

Four prompts: the issue's "The capital of France is", a code prompt, a chat-templated one
(Gemma 3's published template: the file carries none) and one of about 1,000 tokens, longer
than the 512-token window of five layers in six. Logits must match within the golden
tolerance and greedy continuations must be identical: alone, batched together, under chunked
prefill with chunks below, at and above the window, and under preemption.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tests.helpers import assert_logits_close
from tests.formats.test_gguf_gemma3 import GEMMA3_CHAT_TEMPLATE

from refengine import LLM, SamplingParams

WINDOW = 512
NEW_TOKENS = 10
LONG_TEXT = " ".join(f"Fact {i}: the number {i} squared is {i * i}." for i in range(60))


@pytest.fixture(scope="module")
def prompts(hf_tok) -> dict[str, list[int]]:
    chat = hf_tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                      chat_template=GEMMA3_CHAT_TEMPLATE, add_generation_prompt=True, tokenize=False)
    out = {"france": hf_tok.encode("The capital of France is"),
           "code": hf_tok.encode("def fibonacci(n):\n    "),
           "chat": hf_tok.encode(chat, add_special_tokens=False),
           "long": hf_tok.encode(LONG_TEXT)}
    assert len(out["long"]) > WINDOW + 100 and out["chat"][0] == hf_tok.bos_token_id
    return out


@pytest.fixture(scope="module")
def hf_run(hf_gemma3, prompts) -> dict[str, tuple[np.ndarray, list[int]]]:
    """transformers' logits for every row of each prompt (``[len(ids), vocab]`` float32) and
    its NEW_TOKENS greedy tokens after it.

    One forward over the prompt gives every row's logits and fills a KV cache; each further
    token is one forward of the last token over that cache. That is the reference of a full
    forward per token (the last row of each): the prompt's forward is the same one (its
    logits are bitwise those of a forward without a cache), and each cached step's query sees
    the same keys, the sliding layers keeping their last ``WINDOW - 1`` (transformers'
    ``DynamicSlidingWindowLayer``). Only the products' shapes differ, one row against many,
    so a step's logits differ by float32 rounding alone: by at most 8e-5 on logits of up to
    41, far inside the golden tolerance (1e-4 of the largest logit), with the same 40 greedy
    tokens and the top two logits of every step at least 0.2 apart.
    """
    import transformers

    out = {}
    with torch.no_grad():
        for name, ids in prompts.items():
            cache = transformers.DynamicCache(config=hf_gemma3.config)
            logits = hf_gemma3(torch.tensor([ids]), cache=cache).logits[0]
            tokens = [int(logits[-1].argmax())]
            for _ in range(NEW_TOKENS - 1):
                step = hf_gemma3(torch.tensor([tokens[-1:]]), cache=cache).logits[0, -1]
                tokens.append(int(step.argmax()))
            assert cache.get_seq_length() == len(ids) + NEW_TOKENS - 1, "the steps did not extend the cache"
            out[name] = (logits.numpy(), tokens)
    return out


@pytest.fixture(scope="module")
def reference(hf_run) -> dict[str, list[int]]:
    """transformers' greedy tokens after each prompt."""
    return {name: tokens for name, (_, tokens) in hf_run.items()}


@pytest.fixture(scope="module", autouse=True)
def _one_tokenizer():
    """The module's five engines share the tokenizer the first one loads from the GGUF.

    ``load_tokenizer`` builds it from the metadata (the 262,144-token vocabulary and the
    514,906 merges rebuilt from it), about half of each engine's start; the tokenizer holds no
    per-engine state, so later engines get the same object the real loader built for the file.
    """
    import refengine.core.engine as engine

    load = engine.load_tokenizer
    loaded: dict[tuple, object] = {}

    def load_once(model_dir, vocab_size):
        key = (str(model_dir), vocab_size)
        if key not in loaded:
            loaded[key] = load(model_dir, vocab_size)
        return loaded[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine, "load_tokenizer", load_once)
        yield


@pytest.fixture(scope="module")
def llm(gemma3_gguf) -> LLM:
    return LLM(model=str(gemma3_gguf), log_stats=False)


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_france_continues_as_transformers_says(llm, hf_tok, prompts, reference):
    text = hf_tok.decode(reference["france"])
    assert text.startswith(" the capital of the country of France. It is the largest"[:len(text)])
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == prompts["france"]
    assert out.outputs[0].token_ids == reference["france"]


@pytest.mark.parametrize("name", ["france", "code", "long"])
def test_prompt_logits_match_transformers(llm, hf_run, prompts, name):
    assert_logits_close(llm.prompt_logits(prompts[name]), hf_run[name][0])


def test_greedy_alone_and_batched(llm, prompts, reference):
    names = list(prompts)
    for name in names:
        assert greedy(llm, [prompts[name]]) == [reference[name]], name
    assert greedy(llm, [prompts[n] for n in names]) == [reference[n] for n in names]


@pytest.mark.parametrize("chunk", [WINDOW // 2, WINDOW, WINDOW + 188])
def test_long_prompt_under_chunked_prefill(gemma3_gguf, prompts, reference, chunk):
    """The long prompt and the chat one under a token budget below, at and above the window.
    On one thread (the serial kernels), so the start warms one thread count, not two."""
    llm = LLM(model=str(gemma3_gguf), enable_chunked_prefill=True, max_num_batched_tokens=chunk, log_stats=False,
              num_threads=1)
    assert greedy(llm, [prompts["long"], prompts["chat"]]) == [reference["long"], reference["chat"]]


def test_greedy_under_preemption(gemma3_gguf, prompts, reference):
    """Blocks of 4 tokens, 10 in the pool: the three short prompts are admitted together and
    outgrow the pool while decoding, so some are preempted and recomputed."""
    names = ["chat", "code", "france"]
    llm = LLM(model=str(gemma3_gguf), block_size=4, num_kv_blocks=10, log_stats=False, num_threads=1)
    assert greedy(llm, [prompts[n] for n in names]) == [reference[n] for n in names]
    assert llm.llm_engine.metrics.total_preemptions > 0
