"""Beam search against transformers' ``generate(num_beams=...)`` on the real model.

Same token ids for every returned beam, in the same order, and scores
(``sequences_scores``: cumulative log-probability over ``len ** length_penalty``) within
1e-4, for beam widths 2 and 4 with several length penalties and each ``early_stopping``
mode. Chat prompts with short answers make beams end at EOS inside ``max_tokens``; plain
prompts run to the length limit.

Each beam's cumulative log-probability is also checked, within 1e-4, against a float64
transformers forward pass over the beam (the exact value up to float64 rounding), not
against transformers' beam search: its float32 step-by-step decoding drifts by about 1e-4
over 12 tokens (one beam measured at -11.552368 against an exact -11.552476; ours
-11.552493), so ``length_penalty=0`` (score = cumulative log-probability) is not among the
cases compared with transformers' scores.
"""

from __future__ import annotations

import copy

import pytest
import torch

from refengine import LLM, BeamSearchParams

MAX_TOKENS = 12
BLOCK_SIZE = 4
CHAT = ["What is the capital of France? Answer in one word.", "Name one primary color.", "Say hello."]
PLAIN = ["The capital of France is", "Once upon a time, there was a"]


@pytest.fixture(scope="module")
def prompts(smollm2_dir) -> list[list[int]]:
    from refengine.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(smollm2_dir)
    return ([tok.apply_chat_template([{"role": "user", "content": c}], tokenize=True) for c in CHAT]
            + [tok.encode(p) for p in PLAIN])


@pytest.fixture(scope="module")
def hf_model(smollm2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def hf_model64(smollm2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float64, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def exact_logprob(hf_model64):
    """``exact_logprob(prompt, generated)``: the sum of the generated tokens' log-probabilities
    in a float64 forward; computed once per beam (the configurations return many of the same
    beams). The prompt's forward is run once and its KV cache shared by the prompt's beams:
    a beam's forward then covers only its own tokens (the same values up to float64 rounding)."""
    known: dict[tuple[tuple[int, ...], tuple[int, ...]], float] = {}
    prefills: dict[tuple[int, ...], tuple[object, torch.Tensor]] = {}

    def logprob(prompt: list[int], generated: list[int]) -> float:
        key = (tuple(prompt), tuple(generated))
        if key not in known:
            with torch.no_grad():
                if key[0] not in prefills:
                    out = hf_model64(torch.tensor([prompt]), use_cache=True)
                    prefills[key[0]] = (out.cache, torch.log_softmax(out.logits[0, -1], dim=-1))
                cache, first = prefills[key[0]]
                total = first[generated[0]]
                if len(generated) > 1:  # the rest, after the prompt's cached keys and values
                    logits = hf_model64(torch.tensor([generated[:-1]]), cache=copy.deepcopy(cache),
                                        use_cache=True).logits[0]
                    lp = torch.log_softmax(logits, dim=-1)
                    total = total + lp[torch.arange(len(generated) - 1), torch.tensor(generated[1:])].sum()
            known[key] = float(total)
        return known[key]

    return logprob


def hf_beams(model, prompts, width, length_penalty, early_stopping):
    """transformers' beams for each prompt: ``[[(generated ids up to and with EOS, score)]]``,
    best first. One ``generate`` for all prompts, left-padded with an attention mask (its
    own batching: half the time of one call per prompt, the same ids, scores within 3e-6)."""
    n = max(map(len, prompts))
    ids = torch.tensor([[2] * (n - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (n - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, num_beams=width, num_return_sequences=width, do_sample=False,
                             max_new_tokens=MAX_TOKENS, length_penalty=length_penalty, early_stopping=early_stopping,
                             output_scores=True, return_dict_in_generate=True, pad_token_id=2, eos_token_id=2)
    beams = [[] for _ in prompts]
    for row, (seq, score) in enumerate(zip(out.sequences, out.sequences_scores)):
        gen = seq[n:].tolist()
        if 2 in gen:  # finished beams are padded after their EOS
            gen = gen[:gen.index(2) + 1]
        beams[row // width].append((gen, float(score)))
    return beams


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    """The engine, on one thread: the beams do not depend on the thread count (batch
    invariance), and one thread spares its start the warm-up of the parallel kernels (most of
    its CPU time). Small blocks: each step's request of a beam recomputes the tokens after
    its parent's last full block, so most of the search's compute is up to ``block_size - 1``
    tokens per beam per step; the beams are the same at any block size (batch invariance)."""
    return LLM(model=smollm2_dir, device="cpu", block_size=BLOCK_SIZE, log_stats=False, num_threads=1)


CONFIGS = [  # (beam width, length_penalty, early_stopping)
    (2, 1.0, False),
    (4, 1.0, False),
    (4, 2.0, True),
    (2, 0.5, "never"),
    (4, 1.0, "never"),
]


@pytest.mark.parametrize("width, length_penalty, early_stopping", CONFIGS)
def test_beams_equal_transformers(llm, hf_model, exact_logprob, prompts, width, length_penalty, early_stopping):
    params = BeamSearchParams(beam_width=width, max_tokens=MAX_TOKENS, length_penalty=length_penalty,
                              early_stopping=early_stopping)
    outs = llm.beam_search(prompts, params)
    assert len(outs) == len(prompts)
    reasons = set()
    refs = hf_beams(hf_model, prompts, width, length_penalty, early_stopping)
    for ids, out, ref in zip(prompts, outs, refs):
        got = out.sequences
        assert [b.output_token_ids for b in got] == [r[0] for r in ref]
        for b, (_, score) in zip(got, ref):
            n = len(b.output_token_ids)
            assert abs(b.score - score) <= 1e-4
            assert abs(b.cum_logprob - exact_logprob(ids, b.output_token_ids)) <= 1e-4
            assert b.tokens[:len(ids)] == ids and b.num_prompt_tokens == len(ids)
            assert b.score == pytest.approx(b.cum_logprob / n ** length_penalty)
            assert b.finish_reason == ("stop" if b.output_token_ids[-1] == 2 else "length")
            assert b.output_text == llm.get_tokenizer().decode(b.output_token_ids)
            reasons.add(b.finish_reason)
    assert reasons == {"stop", "length"}  # both ends are exercised
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and engine.block_manager.usage == 0.0


def test_beams_share_their_prefix_through_the_cache(llm, smollm2_dir, prompts):
    """Each step's request of a beam reuses its parent's full blocks: a step computes at
    most ``block_size`` tokens per beam after the first; without caching, the same beams
    at a far higher cost. With caching: the module's engine, its prefix cache emptied first
    (a fresh engine's state)."""
    params = BeamSearchParams(beam_width=2, max_tokens=6)
    assert llm.llm_engine.block_manager.enable_prefix_caching and llm.reset_prefix_cache()
    results = {}
    for caching in (True, False):
        engine = llm if caching else LLM(model=smollm2_dir, device="cpu", block_size=BLOCK_SIZE, log_stats=False,
                                         num_threads=1, enable_prefix_caching=False)
        computed = engine.llm_engine.metrics.total_prompt_tokens
        outs = engine.beam_search(prompts[3:], params)  # plain prompts: no early EOS
        results[caching] = ([[b.tokens for b in o.sequences] for o in outs],
                            engine.llm_engine.metrics.total_prompt_tokens - computed)
    assert results[True][0] == results[False][0]
    prompt_len = sum(len(p) for p in prompts[3:])
    # the first step computes the prompts; each later step at most block_size tokens per live beam
    assert results[True][1] <= prompt_len + 5 * 2 * 2 * BLOCK_SIZE
    assert results[False][1] > prompt_len * 2 * 5  # every step recomputes every beam


def test_beam_search_params_are_checked():
    with pytest.raises(ValueError, match="beam_width=0"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens=0"):
        BeamSearchParams(beam_width=2, max_tokens=0)
    with pytest.raises(ValueError, match="early_stopping='always'"):
        BeamSearchParams(beam_width=2, max_tokens=4, early_stopping="always")
