"""The sampler: exact penalty numbers, exact candidate sets, empirical distributions,
per-request seeding, edge values, and golden checks against transformers' processors."""

from __future__ import annotations


import numpy as np
import pytest

from refengine.sampler import (
                               NO_TOKEN,
                               SAMPLE,
                               Sampler,
                               TokenUniforms,
                               apply_min_p,
                               apply_presence_frequency_penalties,
                               apply_repetition_penalty,
                               apply_temperature,
                               apply_top_k_top_p,
                               log_softmax,
                               sample_rows,
                               )
from refengine.sampling_params import SamplingParams
from tests.helpers import FakeSeq

NEG_INF = -np.inf


class FixedUniform:
    """A TokenUniforms stub whose values are given in advance (to test inverse-CDF exactly);
    records the (position, purpose) of each call."""

    def __init__(self, *us):
        self.us = list(us)
        self.calls = []

    def __call__(self, position, purpose=SAMPLE):
        self.calls.append((position, purpose))
        return self.us.pop(0)


def survivors(row) -> set[int]:
    return set(np.flatnonzero(np.isfinite(row)).tolist())


P4 = np.array([0.5, 0.3, 0.15, 0.05])
LOGITS_P4 = np.log(P4).astype(np.float32)[None, :]  # softmax(LOGITS_P4) == P4


# --- penalties: exact numbers ----------------------------------------------------------------

def test_repetition_penalty_hf_rule_exact():
    logits = np.array([[2.0, -1.0, 0.5, -3.0, 0.0]], dtype=np.float32)
    seen = np.array([[True, True, False, True, True]])
    out = apply_repetition_penalty(logits, seen, np.array([2.0]))
    # positive divided, negative multiplied, zero stays zero, unseen untouched
    np.testing.assert_array_equal(out, [[1.0, -2.0, 0.5, -6.0, 0.0]])
    # a penalty < 1 rewards: positive grows, negative shrinks toward 0
    out = apply_repetition_penalty(logits, seen, np.array([0.5]))
    np.testing.assert_array_equal(out, [[4.0, -0.5, 0.5, -1.5, 0.0]])


def test_presence_frequency_penalties_exact():
    logits = np.array([[2.0, -1.0, 0.5, -3.0, 0.0]], dtype=np.float32)
    counts = np.array([[0, 1, 0, 2, 0]])
    out = apply_presence_frequency_penalties(logits, counts, np.array([0.5]), np.array([0.25]))
    # token 1: -1 - 0.25*1 - 0.5 ; token 3: -3 - 0.25*2 - 0.5
    np.testing.assert_array_equal(out, [[2.0, -1.75, 0.5, -4.0, 0.0]])


def test_sampler_penalties_use_prompt_for_repetition_and_output_only_for_presence():
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, presence_penalty=0.5,
                            frequency_penalty=0.25)
    seq = FakeSeq(params, prompt=[0, 1], output=[1, 3, 3])
    logits = np.array([[2.0, -1.0, 0.5, -3.0, 0.0]], dtype=np.float32)
    out = Sampler().process_logits(logits, [seq])
    # repetition over {0, 1, 3} (prompt + output, once each), then output counts {1: 1, 3: 2}
    np.testing.assert_array_equal(out, [[1.0, -2.75, 0.5, -7.0, 0.0]])
    assert logits[0, 0] == 2.0  # the caller's logits are not modified


def test_greedy_argmax_sees_penalties():
    logits = np.array([[3.0, 2.0, 1.0]], dtype=np.float32)
    seq = FakeSeq(SamplingParams(temperature=0.0, repetition_penalty=2.0), prompt=[0])
    assert Sampler()(logits, [seq]).token_ids.tolist() == [1]  # 3/2 = 1.5 < 2
    seq = FakeSeq(SamplingParams(temperature=0.0, frequency_penalty=1.0), output=[0, 0])
    assert Sampler()(logits, [seq]).token_ids.tolist() == [1]  # 3 - 2 = 1 < 2


def test_penalties_ignore_out_of_vocab_history():
    seq = FakeSeq(SamplingParams(repetition_penalty=2.0, presence_penalty=1.0), prompt=[5, 100], output=[7, -1])
    out = Sampler().process_logits(np.zeros((1, 4), np.float32), [seq])
    np.testing.assert_array_equal(out, np.zeros((1, 4)))


# --- filters: exact candidate sets -------------------------------------------------------------

@pytest.mark.parametrize("k, expected", [(1, {1}), (2, {1, 3}), (3, {1, 2, 3}), (5, {0, 1, 2, 3, 4}),
                                         (10**9, {0, 1, 2, 3, 4}), (0, {0, 1, 2, 3, 4}), (-1, {0, 1, 2, 3, 4})])
def test_top_k_sets(k, expected):
    logits = np.array([[1.0, 4.0, 2.0, 3.0, 0.0]], dtype=np.float32)
    out = apply_top_k_top_p(logits, np.array([k]), np.array([1.0]))
    assert survivors(out[0]) == expected
    np.testing.assert_array_equal(out[0, sorted(expected)], logits[0, sorted(expected)])


def test_top_k_keeps_ties_with_kth_value_like_hf():
    logits = np.array([[1.0, 3.0, 3.0, 3.0, 0.0]], dtype=np.float32)
    assert survivors(apply_top_k_top_p(logits, np.array([2]), np.array([1.0]))[0]) == {1, 2, 3}


# P4 = [0.5, 0.3, 0.15, 0.05]: cumulative 0.5, 0.8, 0.95, 1.0 (boundaries avoided on purpose).
@pytest.mark.parametrize("p, expected", [(1e-12, {0}), (0.4, {0}), (0.6, {0, 1}), (0.79, {0, 1}),
                                         (0.81, {0, 1, 2}), (0.96, {0, 1, 2, 3}),
                                         (1 - 1e-12, {0, 1, 2, 3}), (1.0, {0, 1, 2, 3})])
def test_top_p_sets(p, expected):
    out = apply_top_k_top_p(LOGITS_P4, np.array([0]), np.array([p]))
    assert survivors(out[0]) == expected


def test_top_p_applies_after_top_k_on_the_renormalised_set():
    # top-2 of P4 renormalised: [0.625, 0.375]; p=0.6 keeps only token 0 (0.5 alone would not
    # reach 0.6 on the full distribution, so the order matters).
    out = apply_top_k_top_p(LOGITS_P4, np.array([2]), np.array([0.6]))
    assert survivors(out[0]) == {0}


@pytest.mark.parametrize("m, expected", [(0.0, {0, 1, 2, 3}), (0.05, {0, 1, 2, 3}), (0.25, {0, 1, 2}),
                                         (0.4, {0, 1}), (0.7, {0}), (1.0, {0})])
def test_min_p_sets(m, expected):
    # threshold = m * 0.5; P4 / 0.5 = [1, 0.6, 0.3, 0.1]
    assert survivors(apply_min_p(LOGITS_P4, np.array([m]))[0]) == expected


def test_min_p_one_keeps_all_ties_of_the_top():
    logits = np.log(np.array([[0.4, 0.4, 0.2]])).astype(np.float32)
    assert survivors(apply_min_p(logits, np.array([1.0]))[0]) == {0, 1}


def test_rows_of_a_batch_are_filtered_independently():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, 50)).astype(np.float32) * 3
    params = [SamplingParams(top_k=3), SamplingParams(top_p=0.5), SamplingParams(min_p=0.2, temperature=0.5),
              SamplingParams(temperature=0.0, repetition_penalty=1.5), SamplingParams(top_k=7, top_p=0.9, min_p=0.1)]
    seqs = [FakeSeq(p, prompt=[1, 2, 3], output=[4]) for p in params]
    batch = Sampler().process_logits(logits, seqs)
    for i, s in enumerate(seqs):
        np.testing.assert_array_equal(batch[i], Sampler().process_logits(logits[i:i + 1], [s])[0])


# --- drawing --------------------------------------------------------------------------------------

def test_inverse_cdf_draw_exact():
    # CDF of P4: 0.5, 0.8, 0.95, 1.0
    for u, expected in [(0.0, 0), (0.49, 0), (0.51, 1), (0.79, 1), (0.81, 2), (0.96, 3), (0.999999, 3)]:
        assert sample_rows(LOGITS_P4.copy(), [u]).tolist() == [expected]
    # masked tokens are never drawn, even at u = 0 or u -> 1
    logits = np.array([[NEG_INF, 1.0, 2.0, NEG_INF]], dtype=np.float32)
    assert sample_rows(logits, [0.0]).tolist() == [1]
    assert sample_rows(logits, [1 - 2**-53]).tolist() == [2]


def _empirical(params: SamplingParams, logits_row: np.ndarray, n: int = 20000, seed: int = 1234):
    seqs = [FakeSeq(params, seed=seed + i) for i in range(n)]  # n seeds: n independent uniforms
    tokens = Sampler()(np.repeat(logits_row[None, :], n, axis=0), seqs).token_ids
    return np.bincount(tokens, minlength=logits_row.shape[0]) / n


@pytest.mark.parametrize("params, expected", [
    (SamplingParams(temperature=1.0), P4),
    (SamplingParams(temperature=0.5), P4**2 / (P4**2).sum()),  # softmax(l / 0.5) ∝ p^2
    (SamplingParams(temperature=2.0), np.sqrt(P4) / np.sqrt(P4).sum()),
    (SamplingParams(top_k=2), np.array([0.625, 0.375, 0, 0])),
    (SamplingParams(top_p=0.9), np.array([0.5, 0.3, 0.15, 0]) / 0.95),
    (SamplingParams(min_p=0.25), np.array([0.5, 0.3, 0.15, 0]) / 0.95),
])
def test_empirical_frequencies_match_the_distribution(params, expected):
    n = 20000
    freq = _empirical(params, LOGITS_P4[0], n)
    # 5 binomial standard deviations per token (sqrt(p(1-p)/n) <= 0.0036); exact zeros stay zero.
    tol = 5 * np.sqrt(expected * (1 - expected) / n)
    assert np.all(np.abs(freq - expected) <= tol), (freq, expected)
    assert np.all(freq[expected == 0] == 0)


def test_seed_reproducible_across_batch_position_and_companions():
    rng = np.random.default_rng(0)
    steps, V = 30, 64
    logits = rng.normal(size=(steps, V)).astype(np.float32) * 2
    target = SamplingParams(seed=7, top_p=0.95, top_k=40)

    alone = FakeSeq(target, seed=target.seed)
    ref = []
    for t in range(steps):
        ref.append(int(Sampler()(logits[t][None], [alone]).token_ids[0]))
        alone.output_token_ids.append(ref[-1])  # the next token's position

    seqs = [FakeSeq(SamplingParams(), seed=123), FakeSeq(SamplingParams(temperature=0.0)),
            FakeSeq(SamplingParams(seed=7, temperature=0.3), seed=7),  # same seed, other params
            FakeSeq(target, seed=target.seed), FakeSeq(SamplingParams(min_p=0.3), seed=1)]
    got = []
    for t in range(steps):
        batch_logits = rng.normal(size=(5, V)).astype(np.float32)
        batch_logits[3] = logits[t]
        tokens = Sampler()(batch_logits, seqs).token_ids
        got.append(int(tokens[3]))
        for s, tok in zip(seqs, tokens):
            s.output_token_ids.append(int(tok))
    assert got == ref
    assert len(set(ref)) > 3  # it really sampled


def test_one_uniform_per_sampled_token_keyed_by_its_position_and_none_for_greedy():
    stub = FixedUniform(0.3, 0.9)
    Sampler()(LOGITS_P4, [FakeSeq(SamplingParams(top_k=3), output=[1, 2, 3], uniforms=stub)])
    assert stub.calls == [(3, SAMPLE)]  # output position 3: the fourth output token
    # The token at a position is a function of (seed, index, position) alone: nothing is
    # consumed, so recomputing it (a preemption, a failed step redone) gives it again.
    uniforms = TokenUniforms(5)
    first = [Sampler()(LOGITS_P4, [FakeSeq(output=[0] * i, uniforms=uniforms)]).token_ids[0] for i in range(4)]
    again = [Sampler()(LOGITS_P4, [FakeSeq(output=[0] * i, uniforms=uniforms)]).token_ids[0] for i in range(4)]
    us = [TokenUniforms(5)(i) for i in range(4)]
    assert first == again == [int(np.searchsorted(np.cumsum(P4), u, side="right")) for u in us]
    # greedy rows never draw
    stub = FixedUniform()
    tok = Sampler()(LOGITS_P4, [FakeSeq(SamplingParams(temperature=0.0), uniforms=stub)]).token_ids
    assert tok.tolist() == [0] and stub.calls == []


def test_token_uniforms_are_philox_keyed_by_seed_index_position_and_purpose():
    """TokenUniforms(seed, index)(position, purpose) is the first output of a fresh
    numpy Philox at key (seed, index), counter (position, purpose, 0, 0), as a float in
    [0, 1); a pure function of its key and counter, whatever was drawn before."""
    for seed, index, position, purpose in [(0, 0, 0, 0), (2**64 - 1, 3, 17, 2), (7, 1, 2**40, 1)]:
        fresh = np.random.Generator(np.random.Philox(key=np.array([seed, index], np.uint64),
                                                     counter=np.array([position, purpose, 0, 0], np.uint64)))
        u = TokenUniforms(seed, index)
        assert u(position, purpose) == fresh.random()
        u(position + 1, purpose)
        assert u(position, purpose) == u(position, purpose) == TokenUniforms(seed, index)(position, purpose)
    u = TokenUniforms(9)
    values = [u(pos, purpose) for pos in range(3) for purpose in range(4)]
    values += [TokenUniforms(9, 1)(0), TokenUniforms(10)(0)]
    assert len(set(values)) == len(values) and all(0.0 <= v < 1.0 for v in values)
    # uniform: 20000 positions, every decile within 5 binomial standard deviations
    deciles = np.bincount((np.array([u(pos) for pos in range(20000)]) * 10).astype(int), minlength=10)
    assert np.all(np.abs(deciles - 2000) <= 5 * np.sqrt(20000 * 0.1 * 0.9)), deciles
    for bad in [(-1, 0), (2**64, 0), (0, -1)]:
        with pytest.raises(ValueError, match="TokenUniforms needs 0 <= seed < 2"):
            TokenUniforms(*bad)


def test_greedy_ties_go_to_lowest_id():
    logits = np.array([[1.0, 5.0, 5.0, 5.0]], dtype=np.float32)
    assert Sampler()(logits, [FakeSeq(SamplingParams(temperature=0.0))]).token_ids.tolist() == [1]


# --- edges: never an exception, always a candidate ------------------------------------------------

@pytest.mark.parametrize("params", [
    SamplingParams(top_p=1e-12),
    SamplingParams(top_k=1),
    SamplingParams(min_p=1.0),
    SamplingParams(temperature=1e-6),
    SamplingParams(temperature=1e-6, top_p=1e-12, top_k=1, min_p=1.0),
])
def test_extreme_filters_leave_exactly_the_argmax(params):
    logits = np.array([[0.0, 10.0, 9.9999, NEG_INF, -5.0]], dtype=np.float32)
    for seed in range(20):
        assert Sampler()(logits, [FakeSeq(params, seed=seed)]).token_ids.tolist() == [1]


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(top_p=1 - 1e-12), SamplingParams(top_k=10**9),
                                    SamplingParams(temperature=1e-6), SamplingParams(temperature=0.0),
                                    SamplingParams(min_p=1.0, top_p=1e-9), SamplingParams(repetition_penalty=1e-3)])
@pytest.mark.parametrize("row", [
    [NEG_INF, NEG_INF, 3.0, NEG_INF],            # one finite candidate
    [NEG_INF] * 4,                               # nothing finite: NO_TOKEN, no error
    [np.nan, 1.0, np.nan, 0.5],                  # NaN counts as -inf
    [1.0, np.inf, 2.0, 0.0],                     # +inf is the largest float32
    [3e38, -3e38, 3e38, 0.0],                    # extremes of float32 (tiny temperature overflows)
])
def test_odd_logits_never_raise(params, row):
    logits = np.array([row], dtype=np.float32)
    seq = FakeSeq(params, prompt=[0, 1, 2, 3], output=[2], seed=3)
    with np.errstate(all="raise"):  # no floating-point warning escapes either
        tok = int(Sampler()(logits, [seq]).token_ids[0])
    finite = np.nan_to_num(logits[0], nan=-np.inf, posinf=3.4e38, neginf=-np.inf)
    if np.isfinite(finite).any():
        assert tok >= 0 and np.isfinite(finite[tok]), (row, tok)
    else:
        assert tok == NO_TOKEN  # never a token the logits exclude


def test_tiny_temperature_is_near_greedy_without_overflow():
    logits = np.array([[1000.0, 999.0, -1000.0]], dtype=np.float32)
    p = SamplingParams(temperature=1e-6)
    assert {int(Sampler()(logits, [FakeSeq(p, seed=s)]).token_ids[0]) for s in range(50)} == {0}
    out = apply_temperature(np.array([[1e33, -1e33]], np.float32), np.array([1e-6]))
    assert np.isfinite(out[0, 0]) and out[0, 1] == NEG_INF


def test_empty_batch_and_shape_errors():
    out = Sampler()(np.zeros((0, 8), np.float32), [])
    assert out.token_ids.shape == (0,) and out.logprobs is None
    with pytest.raises(ValueError, match="B == len\\(seqs\\)"):
        Sampler()(np.zeros((2, 8), np.float32), [FakeSeq()])


# --- min_tokens ------------------------------------------------------------------------------------

def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    logits = np.array([[0.0, 1.0, 9.0, 8.0, 2.0]], dtype=np.float32)  # EOS=2 most likely, stop id 3 next
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3])
    sampler = Sampler(eos_token_id=2)
    assert sampler(logits, [FakeSeq(p, output=[1])]).token_ids.tolist() == [4]
    assert sampler(logits, [FakeSeq(p, output=[1, 1])]).token_ids.tolist() == [2]  # reached
    p_ign = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3], ignore_eos=True)
    assert sampler(logits, [FakeSeq(p_ign, output=[])]).token_ids.tolist() == [2]  # EOS allowed
    assert Sampler(eos_token_id=[2, 3])(logits, [FakeSeq(SamplingParams(temperature=0.0, min_tokens=1))]).token_ids.tolist() == [4]


# --- logprobs ---------------------------------------------------------------------------------------

def test_logprobs_are_raw_and_include_sampled_and_top_n():
    logits = np.repeat(LOGITS_P4, 3, axis=0)
    seqs = [FakeSeq(SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=5.0), prompt=[0]),
            FakeSeq(SamplingParams(logprobs=0, temperature=0.7), uniforms=FixedUniform(0.99)),
            FakeSeq(SamplingParams(temperature=0.0))]
    out = Sampler()(logits, seqs)
    lp = np.log(P4)
    # row 0: the penalty moves the argmax to token 1, but logprobs stay those of the raw logits
    assert out.token_ids[0] == 1
    assert list(out.logprobs[0]) == [1, 0]  # sampled first, then the top 2 (1 already there)
    assert out.logprobs[0] == pytest.approx({1: lp[1], 0: lp[0]}, abs=1e-6)
    # row 1: u = 0.99 under temperature 0.7 draws the last token; logprobs=0 -> only it
    assert out.token_ids[1] == 3
    assert out.logprobs[1] == pytest.approx({3: lp[3]}, abs=1e-6)
    assert out.logprobs[2] is None
    assert Sampler()(logits, [FakeSeq(), FakeSeq(), FakeSeq()]).logprobs is None


def test_logprobs_top_n_larger_than_vocab_and_ties():
    logits = np.array([[1.0, 2.0, 2.0, 0.0]], dtype=np.float32)
    out = Sampler()(logits, [FakeSeq(SamplingParams(temperature=0.0, logprobs=10))])
    assert list(out.logprobs[0]) == [1, 2, 0, 3]
    np.testing.assert_allclose(list(out.logprobs[0].values()), log_softmax(logits)[0, [1, 2, 0, 3]])


# --- golden: transformers' logits processors -----------------------------------------------------------

torch = pytest.importorskip("torch")
lp_mod = pytest.importorskip("transformers.generation.logits_process")


def _assert_same_processing(ours: np.ndarray, theirs, rtol=1e-6):
    theirs = theirs.detach().numpy()
    np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(theirs))
    np.testing.assert_allclose(ours[np.isfinite(ours)], theirs[np.isfinite(theirs)], rtol=rtol, atol=0)


@pytest.fixture(scope="module")
def golden_batch():
    rng = np.random.default_rng(42)
    logits = (rng.standard_normal((4, 1000)) * 3).astype(np.float32)
    history = rng.integers(0, 1000, size=(4, 40))
    return logits, history


@pytest.mark.parametrize("penalty", [0.7, 1.3, 2.0])
def test_golden_repetition_penalty(golden_batch, penalty):
    logits, history = golden_batch
    theirs = lp_mod.RepetitionPenaltyLogitsProcessor(penalty)(torch.from_numpy(history), torch.from_numpy(logits.copy()))
    seen = np.zeros_like(logits, dtype=bool)
    np.put_along_axis(seen, history, True, axis=1)
    _assert_same_processing(apply_repetition_penalty(logits, seen, np.full(4, penalty)), theirs, rtol=0)


@pytest.mark.parametrize("t", [0.3, 0.7, 1.5])
def test_golden_temperature(golden_batch, t):
    logits, history = golden_batch
    theirs = lp_mod.TemperatureLogitsWarper(t)(torch.from_numpy(history), torch.from_numpy(logits))
    _assert_same_processing(apply_temperature(logits, np.full(4, t)), theirs)


@pytest.mark.parametrize("k", [1, 5, 50, 999, 1000, 5000])
def test_golden_top_k(golden_batch, k):
    logits, history = golden_batch
    theirs = lp_mod.TopKLogitsWarper(k)(torch.from_numpy(history), torch.from_numpy(logits))
    _assert_same_processing(apply_top_k_top_p(logits, np.full(4, k), np.ones(4)), theirs, rtol=0)


@pytest.mark.parametrize("p", [1e-6, 0.1, 0.5, 0.9, 0.999])
def test_golden_top_p(golden_batch, p):
    logits, history = golden_batch
    theirs = lp_mod.TopPLogitsWarper(p)(torch.from_numpy(history), torch.from_numpy(logits))
    _assert_same_processing(apply_top_k_top_p(logits, np.zeros(4, np.int64), np.full(4, p)), theirs, rtol=0)


@pytest.mark.parametrize("m", [0.01, 0.1, 0.5, 1.0])
def test_golden_min_p(golden_batch, m):
    logits, history = golden_batch
    theirs = lp_mod.MinPLogitsWarper(m)(torch.from_numpy(history), torch.from_numpy(logits))
    _assert_same_processing(apply_min_p(logits, np.full(4, m)), theirs, rtol=0)


@pytest.mark.parametrize("rep, t, k, p, m", [(1.2, 0.8, 50, 0.9, 0.05), (0.9, 1.3, 200, 0.95, 0.0),
                                              (1.0, 0.5, 0, 0.7, 0.2), (1.5, 1.0, 10, 1.0, 0.0)])
def test_golden_full_chain_matches_hf_processor_list(golden_batch, rep, t, k, p, m):
    """Our whole pipeline == HF's processors chained in the same order on the same logits."""
    logits, history = golden_batch
    procs = [lp_mod.RepetitionPenaltyLogitsProcessor(rep), lp_mod.TemperatureLogitsWarper(t)]
    if k > 0:
        procs.append(lp_mod.TopKLogitsWarper(k))
    if p < 1.0:
        procs.append(lp_mod.TopPLogitsWarper(p))
    if m > 0:
        procs.append(lp_mod.MinPLogitsWarper(m))
    theirs = lp_mod.LogitsProcessorList(procs)(torch.from_numpy(history), torch.from_numpy(logits.copy()))
    params = SamplingParams(repetition_penalty=rep, temperature=t, top_k=k, top_p=p, min_p=m)
    seqs = [FakeSeq(params, prompt=h[:25], output=h[25:]) for h in history]
    _assert_same_processing(Sampler().process_logits(logits, seqs), theirs)


def test_works_on_real_sequences_and_n_completions_differ():
    from refengine.core.sequence import Sequence

    logits = np.zeros((1, 1000), np.float32)  # uniform: two streams agree by chance 1/1000 per step

    def run(index, seed=11):
        seq = Sequence("r", None, [1, 2, 3], SamplingParams(n=2, seed=seed), index=index)
        for _ in range(5):
            seq.output_token_ids.append(int(Sampler()(logits, [seq]).token_ids[0]))
        return seq.output_token_ids

    assert run(0) == run(0)  # the same seed and index: the same tokens
    assert run(0) != run(1)  # completion 1 has its own key (seed, 1)
    assert run(0, seed=None) != run(0, seed=None)  # unseeded: a fresh seed per sequence

