"""Speculative decoding without a model: the config, the n-gram proposer, the acceptance
rule, and the scheduler's side (speculative slots, rollback, stops inside an accepted run).

Statistical tests: each chi-square test below is at significance 1e-3 (a correct sampler
fails one with probability 0.001), with fixed seeds, so a run is deterministic: these tests
either always pass or always fail for given code.
"""

from __future__ import annotations

import numpy as np
import pytest

from refengine.config import SchedulerConfig
from refengine.core.block_manager import BlockManager
from refengine.core.scheduler import Scheduler
from refengine.core.sequence import Sequence
from refengine.sampling_params import SamplingParams
from refengine.spec_decode import SpeculativeConfig, propose_ngram, rejection_sample, verify_tokens
from refengine.sampler import NO_TOKEN
from refengine.spec_decode.decoder import SpecDecoder
from refengine.spec_decode.draft_model import Proposal
from refengine.spec_decode.rejection import draw
from refengine.stop import StopChecker

ALPHA = 1e-3  # significance of every chi-square test in this file


def chi2_sf(stat: float, df: int) -> float:
    """P(X >= stat) for X ~ chi-square(df): the regularised upper incomplete gamma Q(df/2, stat/2)."""
    import torch

    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def chi2_goodness_of_fit(counts: np.ndarray, probs: np.ndarray) -> float:
    """p-value of ``counts`` against ``probs``; cells with probability 0 must be empty."""
    assert counts[probs == 0].sum() == 0, "a token with target probability 0 was emitted"
    keep = probs > 0
    n = counts.sum()
    expected = n * probs[keep]
    stat = float(((counts[keep] - expected) ** 2 / expected).sum())
    return chi2_sf(stat, int(keep.sum()) - 1)


def test_chi2_helper_is_right():
    # known quantiles: chi2(1) 3.841 -> 0.05, chi2(5) 20.515 -> 0.001
    assert chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, rel=1e-9)
    assert chi2_sf(20.515005652432873, 5) == pytest.approx(0.001, rel=1e-9)


# --- config ------------------------------------------------------------------------------

def test_config_defaults_and_names():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (c.prompt_lookup_max, c.prompt_lookup_min, c.disable_by_batch_size) == (5, 5, None)  # vLLM's defaults
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4})
    assert (c.prompt_lookup_max, c.prompt_lookup_min) == (4, 4)
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2})
    assert (c.prompt_lookup_max, c.prompt_lookup_min) == (2, 2)
    c = SpeculativeConfig.from_dict({"model": "some/dir", "num_speculative_tokens": 5, "disable_by_batch_size": 4})
    assert (c.method, c.model, c.num_speculative_tokens, c.disable_by_batch_size) == ("draft_model", "some/dir", 5, 4)


@pytest.mark.parametrize("value, message", [
    ([1], r"=\[1\] is invalid: must be a dict"),
    ({"method": "ngram", "num_speculative_tokens": 3, "k": 1}, r"unknown key\(s\) 'k'"),
    ({"method": "eagle", "num_speculative_tokens": 3}, r"\['method'\]='eagle' is invalid: must be one of 'ngram'"),
    ({"num_speculative_tokens": 3}, r"\['method'\]=None is invalid"),
    ({"method": "ngram"}, r"needs 'num_speculative_tokens'"),
    ({"method": "ngram", "num_speculative_tokens": 0},
     r"\['num_speculative_tokens'\]=0 is invalid: must be an integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": True}, r"\['num_speculative_tokens'\]=True is invalid"),
    ({"method": "ngram", "num_speculative_tokens": 3.0}, r"\['num_speculative_tokens'\]=3.0 is invalid"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 3},
     r"\['prompt_lookup_min'\]=3 is invalid: must be <= prompt_lookup_max=2"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 0}, r"\['prompt_lookup_min'\]=0"),
    ({"method": "ngram", "num_speculative_tokens": 3, "model": "x"}, r"\['model'\] is for method 'draft_model'"),
    ({"method": "draft_model", "num_speculative_tokens": 3}, r"\['model'\]=None is invalid"),
    ({"method": "draft_model", "model": "", "num_speculative_tokens": 3}, r"\['model'\]='' is invalid"),
    ({"method": "draft_model", "model": "x", "num_speculative_tokens": 3, "prompt_lookup_max": 2},
     r"\['prompt_lookup_max'\] is for method 'ngram'"),
    ({"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 0},
     r"\['disable_by_batch_size'\]=0 is invalid: must be an integer >= 1"),
])
def test_config_refuses(value, message):
    with pytest.raises(ValueError, match=r"^speculative_config" + "(.*)" + message):
        SpeculativeConfig.from_dict(value)


# --- n-gram proposer ---------------------------------------------------------------------

@pytest.mark.parametrize("tokens, lo, hi, k, expected", [
    ([1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3], 1, 3, 2, [8, 1]),  # last 3-gram: most recent earlier occurrence
    ([1, 2, 3, 9, 1, 2], 1, 3, 3, [3, 9, 1]),  # 3-gram [9,1,2] not earlier; 2-gram [1,2] at 0
    ([5, 1, 2, 7, 3, 2], 1, 3, 2, [7, 3]),  # only the 1-gram [2] occurs earlier
    ([5, 1, 2, 7, 3, 2], 2, 3, 2, []),  # ... which min_n=2 does not try
    ([4, 4, 4, 4], 1, 2, 3, [4]),  # the most recent occurrence ends one before the end
    ([1, 2, 3, 4], 1, 3, 2, []),  # nothing repeats
    ([1, 2, 1, 2], 1, 3, 0, []),  # k = 0
    ([7], 1, 3, 2, []),  # too short to repeat
    ([1, 2, 3, 1, 2, 3, 1, 2], 2, 5, 5, [3, 1, 2]),  # 5-gram [1,2,3,1,2] at 0: x[5:10], cut at the end
])
def test_propose_ngram(tokens, lo, hi, k, expected):
    assert propose_ngram(tokens, lo, hi, k) == expected


# --- the acceptance rule -------------------------------------------------------------------

def test_verify_tokens():
    assert verify_tokens([5, 6, 7, 8], [5, 6, 7]) == ([5, 6, 7, 8], 3)  # all accepted + bonus
    assert verify_tokens([5, 6, 7, 8], [5, 9, 7]) == ([5, 6], 1)  # the target's token where they differ
    assert verify_tokens([5, 6], [4]) == ([5], 0)
    assert verify_tokens([3], []) == ([3], 0)


def test_rejection_sample_refuses_bad_shapes():
    with pytest.raises(ValueError, match=r"target_probs and draft_probs must be \[k, V\] and accept_u, residual_u k"):
        rejection_sample(np.full((3, 4), 0.25), [1, 2], None, [0.5, 0.5], [0.5, 0.5])
    with pytest.raises(ValueError, match=r"got \(2, 4\), None, 1 and 2"):
        rejection_sample(np.full((2, 4), 0.25), [1, 2], None, [0.5], [0.5, 0.5])


def test_rejection_sample_uses_each_positions_own_uniforms():
    """The accept test at position j reads accept_u[j] only, the residual residual_u[j]."""
    p = np.array([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    q = np.array([[0.25, 0.75, 0.0], [0.0, 0.0, 1.0]])
    # position 0: p/q(1) = 2/3; u 0.6 accepts; position 1: p/q(2) = 0.5, u 0.7 rejects; the
    # residual max(0, p_1 - q_1) = (0.2, 0.3, 0) at u 0.5 (0.5 * 0.5 = 0.25 > 0.2) is token 1
    assert rejection_sample(p, [1, 2], q, [0.6, 0.7], [0.99, 0.5]) == ([1, 1], 1)
    assert rejection_sample(p, [1, 2], q, [0.6, 0.4], [0.99, 0.5]) == ([1, 2], 2)  # the caller adds the bonus
    # a rejection at position 0: residual (0.25, 0, 0) is token 0 at any u
    assert rejection_sample(p, [1, 2], q, [0.7, 0.0], [0.99, 0.0]) == ([0], 0)


def _normalise(x) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x / x.sum()


# (target p_0, p_1, p_2; draft q_0, q_1 or None for a deterministic proposer; fixed proposals)
P0 = _normalise([0.30, 0.25, 0.20, 0.15, 0.10, 0.0])  # token 5 impossible for the target
P1 = _normalise([0.05, 0.05, 0.50, 0.10, 0.10, 0.20])
P2 = _normalise([0.10, 0.20, 0.30, 0.40, 0.0, 0.0])
Q0 = _normalise([0.05, 0.40, 0.05, 0.20, 0.10, 0.20])  # proposes token 5, which the target never emits
Q1 = _normalise([0.30, 0.30, 0.10, 0.10, 0.10, 0.10])
CASES = {
    "draft distributions": (np.stack([P0, P1, P2]), np.stack([Q0, Q1]), None),
    "draft equals target": (np.stack([P0, P1, P2]), np.stack([P0, P1]), None),
    "deterministic proposals": (np.stack([P0, P1, P2]), None, [1, 2]),
    "deterministic, target-impossible": (np.stack([P0, P1, P2]), None, [5, 4]),
}


@pytest.mark.parametrize("case, matching", [(c, False) for c in CASES] + [
    (c, True) for c in CASES if CASES[c][1] is None])
def test_rejection_sampler_emits_the_target_distribution(case, matching):
    """~1e5 verifications of k=2 proposals: the first emitted token follows p_0, the second
    (when the first was accepted) p_1, and the acceptance rate at position 0 is
    sum_x min(p_0, q_0) (Leviathan et al. 2023, §3.1). ``matching``: deterministic
    proposals verified by :func:`verify_tokens` against the inverse-CDF token of each p_j at
    a uniform (what n-gram speculation does), the same law as rejection with a one-hot q."""
    target, draft_probs, fixed = CASES[case]
    n, V = 100_000, target.shape[1]
    gen = np.random.default_rng(1234)
    if draft_probs is None:
        drafts = np.tile(fixed, (n, 1))
    else:  # the proposer's own draws
        draft_gen = np.random.default_rng(99)
        drafts = np.stack([draft_gen.choice(V, size=n, p=draft_probs[j]) for j in range(2)], axis=1)
    first, second = np.zeros(V, dtype=np.int64), np.zeros(V, dtype=np.int64)
    accepted0 = 0
    for proposals, us in zip(drafts.tolist(), gen.random((n, 5))):
        if matching:
            tokens, num_accepted = verify_tokens([draw(target[j], us[j]) for j in range(3)], proposals)
        else:
            tokens, num_accepted = rejection_sample(target[:2], proposals, draft_probs, us[:2], us[2:4])
            if num_accepted == 2:
                tokens.append(draw(target[2], us[4]))  # the bonus, the caller's
        assert len(tokens) == num_accepted + 1 and tokens[:num_accepted] == proposals[:num_accepted]
        first[tokens[0]] += 1
        if len(tokens) >= 2:
            second[tokens[1]] += 1
        accepted0 += num_accepted >= 1
    q0 = draft_probs[0] if draft_probs is not None else np.eye(V)[fixed[0]]
    beta = np.minimum(target[0], q0).sum()
    assert chi2_goodness_of_fit(first, target[0]) > ALPHA
    if beta > 0:
        assert chi2_goodness_of_fit(second, target[1]) > ALPHA
    else:  # a proposal the target cannot emit is always rejected
        assert second.sum() == 0
    # binomial count: within 5 standard deviations (a correct sampler fails this with p < 1e-6)
    assert abs(accepted0 - n * beta) <= 5 * np.sqrt(n * beta * (1 - beta)) + 1e-9, (accepted0, n * beta)
    if case == "draft equals target":
        assert accepted0 == n  # p/q = 1: every proposal is accepted


# --- the scheduler's side ------------------------------------------------------------------

class StubSpeculator:
    """Wants ``k`` speculative tokens for every decoding sequence, off above ``disable`` running."""

    def __init__(self, k: int, disable: int | None = None):
        self.k, self.disable, self.calls = k, disable, []

    def num_spec_tokens(self, seq, num_running):
        self.calls.append((seq.request_id, num_running))
        return 0 if self.disable is not None and num_running > self.disable else self.k


def make_seq(name: str, prompt_len: int, **params) -> Sequence:
    return Sequence(name, None, list(range(10, 10 + prompt_len)), SamplingParams(**{"max_tokens": 100, **params}))


def make_sched(k=3, num_blocks=100, block_size=4, budget=64, disable=None, stop_checker=None) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, enable_chunked_prefill=True,
                          max_model_len=1000)
    return Scheduler(cfg, BlockManager(num_blocks, block_size), stop_checker, speculator=StubSpeculator(k, disable))


def prefill(sched: Scheduler, *seqs: Sequence) -> None:
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert out.spec == {}  # prefills never speculate
    sched.postprocess(out.scheduled, [(s, 7, None) for s, n in out.scheduled])


def test_decoding_sequences_get_speculative_slots():
    sched = make_sched(k=3, block_size=4)
    a, b = make_seq("a", 6), make_seq("b", 3)
    prefill(sched, a, b)
    out = sched.schedule()
    assert [(s.request_id, n) for s, n in out.scheduled] == [("a", 4), ("b", 4)] and out.spec == {a: 3, b: 3}
    # a: positions 6 (its last token) .. 9 -> 3 blocks of 4; b: positions 3 .. 6 -> 2 blocks
    assert (len(a.block_table), len(b.block_table)) == (3, 2)
    assert sched.speculator.calls == [("a", 2), ("b", 2)]


def test_speculative_tokens_fit_the_budget_and_the_free_blocks_without_preempting():
    sched = make_sched(k=5, budget=6)
    a, b = make_seq("a", 3), make_seq("b", 3)
    prefill(sched, a, b)
    out = sched.schedule()
    # every running sequence gets its decode token first; proposals take what is left
    assert out.spec == {a: 4} and [(s.request_id, n) for s, n in out.scheduled] == [("a", 5), ("b", 1)]
    sched = make_sched(k=5, num_blocks=3, block_size=4)
    a = make_seq("a", 7)
    prefill(sched, a)  # 7 + 1 tokens in 2 blocks, 1 block free
    out = sched.schedule()
    assert out.spec == {a: 4} and out.preempted == []  # positions 7 .. 11 fill the last free block
    assert sched.block_manager.num_free_blocks == 0


def test_disable_by_batch_size():
    sched = make_sched(k=2, disable=1)
    a, b = make_seq("a", 3), make_seq("b", 3)
    prefill(sched, a, b)
    out = sched.schedule()
    assert out.spec == {} and [n for _, n in out.scheduled] == [1, 1]


def test_rejected_slots_roll_back():
    """k=5 from position 7: accepting 1 advances num_computed_tokens by 2 (the last token
    and the accepted proposal); the blocks past the new length go back to the pool."""
    sched = make_sched(k=5, num_blocks=10, block_size=4, stop_checker=StopChecker([2], 1000))
    a = make_seq("a", 7)
    prefill(sched, a)
    assert (len(a), a.num_computed_tokens, len(a.block_table)) == (8, 7, 2)
    out = sched.schedule()
    assert out.spec == {a: 5} and len(a.block_table) == 4  # positions 7 .. 12
    sched.postprocess(out.scheduled, [(a, [40, 41], None)], num_rejected={a: 4})
    assert a.output_token_ids == [7, 40, 41] and a.num_computed_tokens == 9 and len(a) == 10
    assert len(a.block_table) == 3 and sched.block_manager.num_free_blocks == 7  # 10 tokens: 3 blocks
    out = sched.schedule()  # the next verify starts at position 9, the last emitted token
    assert out.scheduled == [(a, 6)] and a.num_computed_tokens == 9


@pytest.mark.parametrize("params, tokens, emitted, reason", [
    ({"max_tokens": 3}, [40, 41, 42, 43], [7, 40, 41], ("length", None)),
    ({"stop_token_ids": [41]}, [40, 41, 42, 43], [7, 40, 41], ("stop", 41)),
    ({}, [40, 2, 42, 43], [7, 40, 2], ("stop", None)),  # EOS
    ({"stop_token_ids": [41], "min_tokens": 4}, [40, 41, 42, 41], [7, 40, 41, 42, 41], ("stop", 41)),
])
def test_a_stop_inside_an_accepted_run_ends_the_sequence_there(params, tokens, emitted, reason):
    sched = make_sched(k=3, stop_checker=StopChecker([2], 1000))
    a = make_seq("a", 5, **params)
    prefill(sched, a)
    out = sched.schedule()
    lps = [{t: -0.5} for t in tokens]
    [(seq, decision)] = sched.postprocess(out.scheduled, [(a, tokens, lps)], num_rejected={a: 0})
    assert a.output_token_ids == emitted and (a.finish_reason, a.stop_reason) == reason
    assert a.logprobs == lps[:len(emitted) - 1]  # nothing after the stop is kept
    assert a.is_finished and sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_no_token_inside_an_accepted_run_ends_the_sequence_with_error():
    """The verifier's NO_TOKEN (a row its masks left empty) appends nothing and no logprobs."""
    sched = make_sched(k=3, stop_checker=StopChecker([2], 1000))
    a = make_seq("a", 5)
    prefill(sched, a)
    out = sched.schedule()
    sched.postprocess(out.scheduled, [(a, [40, NO_TOKEN], [{40: -0.5}, None])], num_rejected={a: 2})
    assert a.output_token_ids == [7, 40] and (a.finish_reason, a.stop_reason) == ("error", None)
    assert a.logprobs == [{40: -0.5}] and a.is_finished
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


@pytest.mark.parametrize("greedy, draft_probs", [(True, False), (False, False), (False, True)])
def test_verification_stops_at_a_row_without_a_token(greedy, draft_probs):
    """Row 1 of 3 is -inf everywhere: proposal 1 is accepted (row 0 puts all its mass on
    it), then NO_TOKEN, whatever was proposed after (token 0 would once have matched)."""
    x = np.full((3, 4), -np.inf, dtype=np.float32)
    x[0, 2] = x[2, 0] = 0.0
    seq = Sequence("s", None, [1], SamplingParams(temperature=0.0 if greedy else 1.0, seed=0))
    q = np.zeros((2, 4))
    q[0, 2] = q[1, 0] = 1.0
    tokens, accepted = SpecDecoder._verify(seq, x, Proposal([2, 0], q if draft_probs else None))
    assert (tokens, accepted) == ([2, NO_TOKEN], 1)
