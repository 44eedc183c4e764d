"""A seeded sampled request's tokens do not depend on its batch companions (issue 23), with
speculative decoding too.

Every uniform is keyed by (seed, completion index, output position) (refengine.sampler.
TokenUniforms) and n-gram proposals are verified by matching them against the token the
plain sampler draws at each position (refengine/spec_decode/rejection.py), so the tokens of a
seeded request are the same whatever the load does to its proposals: how many the step's
token budget leaves room for, ``disable_by_batch_size``, chunked prefill, prefix-cache hits,
preemption and recompute, and with speculation off. The logits must be the same bits as
well: the default CPU backend (numba) is batch-invariant (EngineArgs.batch_invariant).

The tiny random Llama at temperature 1 with top-k 5 is close to uniform over five tokens,
so proposals are both accepted and rejected; each test checks that the load really changed
the proposals it verified.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from refengine import LLM, SamplingParams
from refengine.spec_decode import SpecDecoder

_rng = np.random.default_rng(23)
TARGET = _rng.integers(3, 211, size=12).tolist() * 2  # repeats itself: n-gram matches from the start
TARGET_N2 = _rng.integers(3, 211, size=9).tolist() * 2
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, top_k=5, seed=1234, max_tokens=40, ignore_eos=True)
SEEDED_N2 = dataclasses.replace(SEEDED, n=2, seed=99, max_tokens=30)
# ~200 companions of lengths 2-80 (a third share the target's first two blocks, so the target
# gets prefix-cache hits under load), greedy and sampled, seeded and not, 1-30 tokens each
OTHERS = [(TARGET[:8] if i % 3 == 0 else []) + _rng.integers(3, 211, size=int(_rng.integers(2, 72))).tolist()
          for i in range(200)]
OTHER_PARAMS = [SamplingParams(temperature=float(_rng.choice([0.0, 0.8, 1.0])), top_k=int(_rng.choice([0, 20])),
                               max_tokens=int(_rng.integers(1, 31)), seed=i if i % 2 else None, ignore_eos=True)
                for i in range(200)]
# one setting for every run: chunked prefill on a small budget (so the running decodes leave
# the target few or no proposal slots), the prefix cache, speculation off above 64 running
OPTIONS = dict(block_size=4, max_num_batched_tokens=32, enable_prefix_caching=True, log_stats=False)


def ngram(k: int = 3) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
            "disable_by_batch_size": 64}


def generate(model, prompts, params, spec: dict | None, monkeypatch, **options):
    """The outputs, and per prompt in TARGET / TARGET_N2 the ``(output position, proposals)``
    of every verify step (a completion's own list per sequence index)."""
    proposals: dict[tuple[int, int], list] = {}
    real = SpecDecoder.propose

    def recording(self, spec_tokens, preempted):
        out = real(self, spec_tokens, preempted)
        for seq, p in out.items():
            for which, prompt in enumerate((TARGET, TARGET_N2)):
                if seq.prompt_token_ids == prompt:
                    proposals.setdefault((which, seq.index), []).append((seq.num_output_tokens, p.token_ids))
        return out

    monkeypatch.setattr(SpecDecoder, "propose", recording)
    llm = LLM(model, speculative_config=spec, **{**OPTIONS, **options})
    outs = llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.undo()
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return outs, proposals, engine.metrics


def tokens(out) -> list[list[int]]:
    return [c.token_ids for c in out.outputs]


def accepted_and_rejected(verifies, output: list[int]) -> tuple[int, int]:
    """Proposals accepted and rejected in ``verifies`` (each ``(position, proposals)``):
    accepted are the leading ones the final output agrees with."""
    acc = rej = 0
    for pos, props in verifies:
        a = 0
        while a < len(props) and output[pos + a] == props[a]:
            a += 1
        acc, rej = acc + a, rej + len(props) - a
    return acc, rej


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    """The two seeded requests among the 200 companions, n-gram speculation on."""
    with pytest.MonkeyPatch.context() as mp:
        prompts = OTHERS[:100] + [TARGET] + OTHERS[100:150] + [TARGET_N2] + OTHERS[150:]
        params = OTHER_PARAMS[:100] + [SEEDED] + OTHER_PARAMS[100:150] + [SEEDED_N2] + OTHER_PARAMS[150:]
        outs, proposals, metrics = generate(str(tiny_llama_dir), prompts, params, ngram(), mp)
    return outs[100], outs[151], proposals, metrics


def test_seeded_ngram_request_alone_and_among_200_others(tiny_llama_dir, loaded, monkeypatch):
    target, _, loaded_props, metrics = loaded
    [alone], alone_props, _ = generate(str(tiny_llama_dir), [TARGET], [SEEDED], ngram(), monkeypatch)
    assert tokens(target) == tokens(alone)
    # the load changed what was verified: other steps, other numbers of proposals
    assert loaded_props[0, 0] != alone_props[0, 0]
    assert sum(len(p) for _, p in loaded_props[0, 0]) < sum(len(p) for _, p in alone_props[0, 0])
    for props in (alone_props[0, 0], loaded_props[0, 0]):
        acc, rej = accepted_and_rejected(props, tokens(alone)[0])
        assert acc > 0 and rej > 0  # both sides of the verification ran
    assert target.num_cached_tokens == 8 and alone.num_cached_tokens == 0  # a prefix-cache hit under load
    assert metrics.spec_totals["num_drafts"] > 0 and len(set(tokens(alone)[0])) > 5  # really sampled


@pytest.mark.parametrize("k", [1, 3, 5])
def test_the_same_tokens_with_and_without_speculation(tiny_llama_dir, loaded, monkeypatch, k):
    plain, _, _ = generate(str(tiny_llama_dir), [TARGET, TARGET_N2], [SEEDED, SEEDED_N2], None, monkeypatch)
    outs, props, _ = generate(str(tiny_llama_dir), [TARGET, TARGET_N2], [SEEDED, SEEDED_N2], ngram(k), monkeypatch)
    assert [tokens(o) for o in outs] == [tokens(o) for o in plain] == [tokens(loaded[0]), tokens(loaded[1])]
    assert max(len(p) for _, p in props[0, 0]) == k


def test_seeded_n2_request_alone_and_among_200_others(tiny_llama_dir, loaded, monkeypatch):
    _, target, loaded_props, _ = loaded
    [alone], alone_props, _ = generate(str(tiny_llama_dir), [TARGET_N2], [SEEDED_N2], ngram(), monkeypatch)
    [plain], _, _ = generate(str(tiny_llama_dir), [TARGET_N2], [SEEDED_N2], None, monkeypatch)
    assert tokens(target) == tokens(alone) == tokens(plain)
    assert tokens(alone)[0] != tokens(alone)[1]  # each completion its own key (seed, index)
    assert any(loaded_props[1, i] != alone_props[1, i] for i in (0, 1))


def test_preemption_and_recompute_keep_the_tokens(tiny_llama_dir, loaded, monkeypatch):
    """A KV pool of 40 blocks of 4 tokens for 40 requests: preempted sequences recompute
    their prompt and outputs, and draw at each position what they drew before."""
    prompts = OTHERS[:20] + [TARGET, TARGET_N2] + OTHERS[20:38]
    params = OTHER_PARAMS[:20] + [SEEDED, SEEDED_N2] + OTHER_PARAMS[20:38]
    outs, _, metrics = generate(str(tiny_llama_dir), prompts, params, ngram(), monkeypatch,
                                num_kv_blocks=40, max_model_len=128)
    assert metrics.total_preemptions > 0
    assert tokens(outs[20]) == tokens(loaded[0]) and tokens(outs[21]) == tokens(loaded[1])
