"""Beam search within ``max_logprobs``, on a fake engine (no model).

Beam search asks for ``beam_width + number of EOS ids`` logprobs per beam, which gives the
same beams as transformers' ``2 * beam_width`` candidates over the full vocabulary, and
refuses up front a width that needs more than ``max_logprobs``.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest


class FakeLLM:
    """Enough of :class:`refengine.LLM` for :func:`refengine.beam_search.beam_search`: the
    next-token log-probabilities of a token list are a fixed pseudo-random function of it
    (vocabulary ``vocab``); ``generate`` refuses ``logprobs > max_logprobs`` as the engine does."""

    def __init__(self, vocab=40, eos=(2,), max_logprobs=20, max_model_len=100):
        self.vocab = vocab
        self.llm_engine = SimpleNamespace(eos_token_ids=set(eos), tokenizer=None,
                                          config=SimpleNamespace(max_model_len=max_model_len, max_logprobs=max_logprobs))
        self.calls = 0

    def logprobs(self, tokens: list[int]) -> np.ndarray:
        rng = np.random.default_rng(abs(hash(tuple(tokens))) % 2**32)
        x = rng.normal(0.0, 2.0, self.vocab)
        return x - np.log(np.exp(x - x.max()).sum()) - x.max()

    def generate(self, prompts, params, use_tqdm=False):
        if params.logprobs > self.llm_engine.config.max_logprobs:
            raise ValueError(f"logprobs={params.logprobs} is more than max_logprobs")
        self.calls += 1
        outs = []
        for p in prompts:
            lp = self.logprobs(p)
            top = np.argsort(-lp, kind="stable")[:params.logprobs]
            first = int(top[0])
            d = {first: float(lp[first])} | {int(t): float(lp[t]) for t in top}
            outs.append(SimpleNamespace(outputs=[SimpleNamespace(logprobs=[d])]))
        return outs


def reference_beams(llm: FakeLLM, prompt, width, max_tokens, eos, length_penalty=1.0):
    """transformers' rule (``_beam_search``) over the full vocabulary: the top
    ``max(2, 1 + len(eos)) * width`` of all beams' candidates, early_stopping=False."""
    k = max(2, 1 + len(eos)) * width
    live, finished = [(0.0, list(prompt))], []
    for step in range(1, max_tokens + 1):
        cands = [(cum + float(lp), toks, t) for cum, toks in live for t, lp in enumerate(llm.logprobs(toks))]
        cands.sort(key=lambda c: -c[0])
        live = []
        for rank, (cum, toks, t) in enumerate(cands[:k]):
            if step == max_tokens or t in eos:
                if rank < width:
                    finished.append((cum / step ** length_penalty, toks + [t]))
            elif len(live) < width:
                live.append((cum, toks + [t]))
        finished = sorted(finished, key=lambda f: -f[0])[:width]
        if step == max_tokens or not live:
            break
        if len(finished) == width and live[0][0] / step ** length_penalty <= finished[-1][0]:
            break
    return [toks for _, toks in finished]


@pytest.mark.parametrize("width, eos", [(11, (2,)), (6, (2, 3, 4)), (19, (2,)), (3, ())])
def test_beam_search_fits_max_logprobs_with_the_same_beams(width, eos):
    """Width 11 with one EOS id (22 candidates before) and 6 with three (Llama 3: 24)
    run within max_logprobs=20 and give transformers' beams over the full vocabulary."""
    from refengine.beam_search import BeamSearchParams, beam_search

    llm = FakeLLM(eos=eos)
    for prompt in ([5, 6, 7], [9]):
        [out] = beam_search(llm, [prompt], BeamSearchParams(beam_width=width, max_tokens=5, ignore_eos=not eos))
        assert [b.tokens for b in out.sequences] == reference_beams(llm, prompt, width, 5, set(eos))


@pytest.mark.parametrize("width, eos, needed", [(20, (2,), 21), (18, (2, 3, 4), 21)])
def test_beam_search_refuses_a_width_beyond_max_logprobs_up_front(width, eos, needed):
    from refengine.beam_search import BeamSearchParams, beam_search

    llm = FakeLLM(eos=eos)
    with pytest.raises(ValueError, match=rf"beam_width={width} needs logprobs={needed} .*max_logprobs=20"):
        beam_search(llm, [[5, 6]], BeamSearchParams(beam_width=width, max_tokens=4))
    assert llm.calls == 0  # refused before any step ran
