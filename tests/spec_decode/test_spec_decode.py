"""Speculative decoding through the engine (issue 15).

- Greedy: with speculation on (n-gram and draft model, k = 1, 3, 5) the output is token for
  token the output with it off, under batching, chunked prefill and preemption (tiny
  models for the whole matrix; the real model on the schedule-invariance prompts).
- The target as its own draft accepts every proposal: mean acceptance length exactly k + 1.
- Temperature > 0: token frequencies with and without speculation agree (two-sample
  chi-square tests at significance 1e-3 each, fixed seeds, so deterministic).
- Stop ids, stop strings and max_tokens inside an accepted run: exactly the output without
  speculation; streamed deltas add up to the same text.
- Seeds reproduce; disable_by_batch_size; logprobs; an atomic step; options and flags.
"""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest
from click.testing import CliRunner

from refengine import LLM, SamplingParams
from refengine.cli import main
from refengine.core.engine import LLMEngine
from refengine.engine_args import EngineArgs
from refengine.stop import StopChecker
from tests.core.test_scheduler_invariance import GREEDY, prompts, tokenizer  # noqa: F401 (fixtures)
from tests.helpers import shared_models
from tests.spec_decode.test_spec_decode_unit import chi2_sf

ALPHA = 1e-3  # significance of each chi-square test


@pytest.fixture(scope="module", autouse=True)
def _shared_models():
    """Engines of one target model that differ in their schedule or speculation only share
    the loaded target, and none warms up (:func:`tests.helpers.shared_models`), which
    changes no output."""
    with shared_models():
        yield


def save_llama(path, seed: int, **config) -> str:
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    cfg = dict(vocab_size=211, hidden_size=128, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
               tie_word_embeddings=True)
    cfg.update(config)
    tf.LlamaForCausalLM(tf.LlamaConfig(**cfg)).save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.fixture(scope="module")
def tiny_draft_dir(tiny_llama_dir, tmp_path_factory) -> str:
    """tiny_llama_dir with noise added to every weight (std 0.01 against the weights' 0.02):
    a draft that agrees with the target often but not always, so verification both
    accepts and rejects."""
    from safetensors.numpy import load_file, save_file

    path = tmp_path_factory.mktemp("tiny-draft")
    (path / "config.json").write_bytes((tiny_llama_dir / "config.json").read_bytes())
    rng = np.random.default_rng(1)
    weights = load_file(tiny_llama_dir / "model.safetensors")
    save_file({k: (v + rng.normal(0.0, 0.01, v.shape)).astype(v.dtype) for k, v in weights.items()},
              path / "model.safetensors")
    return str(path)


def ngram(k: int) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def draft(model: str, k: int) -> dict:
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k}


def assert_idle(llm: LLM) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def token_ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


# --- greedy: the same tokens, whatever the schedule ------------------------------------------

_rng = np.random.default_rng(0)
# The tiny random model mostly repeats one token; the last three prompts make it switch to
# another (found by search), where proposals are rejected and rejected slots roll back.
TINY_PROMPTS = [_rng.integers(3, 211, size=n).tolist() for n in (5, 17, 33)] + [
    [5, 6, 7, 8] * 3, [9, 154, 7, 8], [130, 107, 8], [108, 145, 167, 49, 22, 14, 123, 57, 44]]
TINY_GREEDY = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
# every scenario: engine options; batching runs each prompt twice in one batch
SCENARIOS = {
    "batching": dict(block_size=4),
    "chunked prefill": dict(block_size=4, max_num_batched_tokens=7),
    "preemption": dict(block_size=4, num_kv_blocks=20, max_model_len=64),
}


@pytest.fixture(scope="module")
def tiny_reference(tiny_llama_dir) -> list[list[int]]:
    return token_ids(LLM(tiny_llama_dir, log_stats=False).generate(TINY_PROMPTS, TINY_GREEDY, use_tqdm=False))


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_output_is_unchanged_tiny(tiny_llama_dir, tiny_draft_dir, tiny_reference, method, k, scenario):
    spec = ngram(k) if method == "ngram" else draft(tiny_draft_dir, k)
    llm = LLM(tiny_llama_dir, log_stats=False, speculative_config=spec, **SCENARIOS[scenario])
    copies = 2 if scenario == "batching" else 1
    outs = llm.generate(TINY_PROMPTS * copies, TINY_GREEDY, use_tqdm=False)
    assert token_ids(outs) == tiny_reference * copies
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    totals = llm.llm_engine.metrics.spec_totals
    assert 0 < totals["num_accepted_tokens"] < totals["num_draft_tokens"]  # both paths of the verification ran
    if scenario == "preemption":
        assert llm.llm_engine.metrics.total_preemptions > 0
    assert_idle(llm)


@pytest.fixture(scope="module")
def real_reference(smollm2_dir, prompts) -> dict[str, list[int]]:  # noqa: F811
    outs = LLM(smollm2_dir, log_stats=False).generate(list(prompts.values()), GREEDY, use_tqdm=False)
    return dict(zip(prompts, token_ids(outs)))


# the real model (slow): each k once, each scenario once, and the draft-model path
REAL_CASES = [
    pytest.param("ngram", 1, dict(block_size=16, num_kv_blocks=10), id="ngram-k1-preemption"),
    pytest.param("ngram", 3, dict(block_size=16, max_num_batched_tokens=17, max_model_len=4096),
                 id="ngram-k3-chunked-prefill"),
    pytest.param("ngram", 5, dict(block_size=16), id="ngram-k5-batching"),  # all prompts in one batch
    pytest.param("draft_model", 3, dict(block_size=16), id="draft-k3-batching"),  # the model as its own draft
]


@pytest.mark.parametrize("method, k, options", REAL_CASES)
def test_greedy_output_is_unchanged_real_model(smollm2_dir, prompts, real_reference, method, k, options):  # noqa: F811
    spec = ngram(k) if method == "ngram" else draft(smollm2_dir, k)
    llm = LLM(smollm2_dir, log_stats=False, speculative_config=spec, **options)
    outs = llm.generate(list(prompts.values()), GREEDY, use_tqdm=False)
    assert dict(zip(prompts, token_ids(outs))) == real_reference
    assert llm.llm_engine.metrics.spec_totals["num_accepted_tokens"] > 0
    if "num_kv_blocks" in options:
        assert llm.llm_engine.metrics.total_preemptions > 0
    assert_idle(llm)


# --- the target as its own draft --------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 3, 5])
def test_the_target_as_its_own_draft_accepts_everything(tiny_llama_dir, tiny_reference, k):
    # 1 + 4 (k + 1) tokens: the first from the prefill, then four verifies of k proposals each
    params = dataclasses.replace(TINY_GREEDY, max_tokens=1 + 4 * (k + 1))
    llm = LLM(tiny_llama_dir, log_stats=False, speculative_config=draft(tiny_llama_dir, k))
    outs = llm.generate(TINY_PROMPTS, params, use_tqdm=False)
    assert token_ids(outs) == [r[:params.max_tokens] for r in tiny_reference]
    metrics = llm.llm_engine.metrics
    stats = metrics.stats_since_last_log()
    drafts = 4 * len(TINY_PROMPTS)
    assert (stats["spec_decode_num_drafts"], stats["spec_decode_num_draft_tokens"],
            stats["spec_decode_num_accepted_tokens"]) == (drafts, k * drafts, k * drafts)
    assert stats["spec_decode_acceptance_rate"] == 1.0 and stats["spec_decode_mean_acceptance_length"] == k + 1
    assert stats["spec_decode_acceptance_rate_per_pos"] == [1.0] * k
    line = metrics.format_log_line(stats)
    assert f"Spec decode: acceptance rate 100.0%, mean acceptance length {k + 1}.00" in line
    text = metrics.exposition()
    assert f"refengine:spec_decode_num_drafts_total {float(drafts)}" in text
    assert f"refengine:spec_decode_num_accepted_tokens_total {float(k * drafts)}" in text
    assert f'refengine:spec_decode_num_accepted_tokens_per_pos_total{{position="{k - 1}"}} {float(drafts)}' in text
    # one step emits k + 1 tokens; generation tokens count each of them
    assert metrics.total_generation_tokens == len(TINY_PROMPTS) * params.max_tokens
    assert_idle(llm)


def test_the_target_as_its_own_draft_accepts_everything_after_preemption(tiny_llama_dir, tiny_reference):
    """A preempted sequence's draft K/V are gone with its blocks: the draft starts again
    from its prompt (DraftModelProposer.forget), so every proposal is still accepted."""
    llm = LLM(tiny_llama_dir, log_stats=False, speculative_config=draft(tiny_llama_dir, 3),
              **SCENARIOS["preemption"])
    outs = llm.generate(TINY_PROMPTS, TINY_GREEDY, use_tqdm=False)
    assert token_ids(outs) == tiny_reference
    metrics = llm.llm_engine.metrics
    assert metrics.total_preemptions > 0
    assert metrics.spec_totals["num_accepted_tokens"] == metrics.spec_totals["num_draft_tokens"] > 0
    assert_idle(llm)


@pytest.mark.parametrize("scenario", ["batching", "preemption"])
def test_draft_proposals_are_the_drafts_own_greedy_continuations(tiny_llama_dir, tiny_draft_dir, monkeypatch,
                                                                 scenario):
    """After rejections (its K/V past the accepted tokens dropped) and preemptions, the
    draft's k proposals are exactly the draft model's own greedy continuation of the
    sequence, as a separate engine running the draft alone computes it."""
    from refengine.spec_decode import DraftModelProposer

    records = []
    real = DraftModelProposer.propose

    def recording(self, items):
        proposals = real(self, items)
        records.extend((seq.prompt_token_ids + seq.output_token_ids, p.token_ids)
                       for (seq, _), p in zip(items, proposals))
        return proposals

    monkeypatch.setattr(DraftModelProposer, "propose", recording)
    llm = LLM(tiny_llama_dir, log_stats=False, speculative_config=draft(tiny_draft_dir, 3), **SCENARIOS[scenario])
    llm.generate(TINY_PROMPTS, TINY_GREEDY, use_tqdm=False)
    totals = llm.llm_engine.metrics.spec_totals
    assert 0 < totals["num_accepted_tokens"] < totals["num_draft_tokens"]
    assert scenario != "preemption" or llm.llm_engine.metrics.total_preemptions > 0
    monkeypatch.undo()
    alone = LLM(tiny_draft_dir, log_stats=False).generate(
        [context for context, _ in records],
        [dataclasses.replace(TINY_GREEDY, max_tokens=len(p)) for _, p in records], use_tqdm=False)
    assert [p for _, p in records] == token_ids(alone)


# --- temperature > 0: the same distribution ----------------------------------------------------

@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory) -> tuple[str, str]:
    """A target and a draft over 16 tokens whose next-token distributions are neither flat
    nor one-hot (entropy about 1-2 nats), so acceptances and rejections both happen often."""
    cfg = dict(vocab_size=16, hidden_size=64, intermediate_size=64, num_hidden_layers=2, max_position_embeddings=64,
               initializer_range=0.2)
    return (save_llama(tmp_path_factory.mktemp("v16-target"), seed=0, **cfg),
            save_llama(tmp_path_factory.mktemp("v16-draft"), seed=1, **cfg))


DIST_PROMPT = [3, 4, 5, 6, 3, 4, 5, 7, 8, 9]
DIST_PARAMS = {
    "temperature 1": SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True),
    "processed": SamplingParams(temperature=0.8, top_k=8, top_p=0.9, min_p=0.05, repetition_penalty=1.3,
                                presence_penalty=0.5, frequency_penalty=0.3, max_tokens=4, ignore_eos=True),
}
NUM_SAMPLES = 1500


def sample_outputs(model: str, params: SamplingParams, spec: dict | None, seed0: int) -> np.ndarray:
    """``[NUM_SAMPLES, 4]`` output tokens, request i seeded ``seed0 + i``."""
    llm = LLM(model, log_stats=False, speculative_config=spec, max_num_seqs=256)
    batch = [dataclasses.replace(params, seed=seed0 + i) for i in range(NUM_SAMPLES)]
    outs = llm.generate([DIST_PROMPT] * NUM_SAMPLES, batch, use_tqdm=False)
    if spec is not None:
        totals = llm.llm_engine.metrics.spec_totals
        assert 0 < totals["num_accepted_tokens"] < totals["num_draft_tokens"]
    return np.array(token_ids(outs))


def two_sample_p_value(a: np.ndarray, b: np.ndarray, vocab: int) -> float:
    """Chi-square test of homogeneity of two samples of token ids."""
    table = np.stack([np.bincount(a, minlength=vocab), np.bincount(b, minlength=vocab)]).astype(np.float64)
    table = table[:, table.sum(axis=0) > 0]
    expected = table.sum(axis=1, keepdims=True) * table.sum(axis=0, keepdims=True) / table.sum()
    return chi2_sf(float(((table - expected) ** 2 / expected).sum()), table.shape[1] - 1)


@pytest.fixture(scope="module")
def plain_samples(small_vocab_pair) -> dict:
    """Samples without speculation, per DIST_PARAMS entry (computed when first asked for)."""
    cache = {}

    def get(name: str) -> np.ndarray:
        if name not in cache:
            cache[name] = sample_outputs(small_vocab_pair[0], DIST_PARAMS[name], None, seed0=0)
        return cache[name]
    return get


@pytest.mark.parametrize("params", DIST_PARAMS)
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_sampled_tokens_follow_the_same_distribution(small_vocab_pair, plain_samples, method, params):
    """Output positions 1-3 (position 0 comes from the prefill, never speculated): each
    position's token frequencies, 1500 requests with and 1500 without speculation (other
    seeds), pass a chi-square test of homogeneity at significance 1e-3."""
    target, draft_dir = small_vocab_pair
    spec = ngram(3) if method == "ngram" else draft(draft_dir, 3)
    off = plain_samples(params)
    on = sample_outputs(target, DIST_PARAMS[params], spec, seed0=10_000)
    for pos in (1, 2, 3):
        assert two_sample_p_value(off[:, pos], on[:, pos], 16) > ALPHA, pos


# --- stop rules inside an accepted run -----------------------------------------------------------

K_STOP = 5
STOP_PROMPT = "speculative"


@pytest.fixture(scope="module")
def stop_setup(tiny_llama_tok_dir):
    """The greedy continuation of STOP_PROMPT without speculation, and where its token first
    changes (``c``): with the model as its own draft (all accepted, k = 5) a verify emits
    outputs 1-6, 7-12, 13-18 ..., and ``c`` must fall inside one of those runs."""
    ref = LLM(tiny_llama_tok_dir, log_stats=False).generate(
        [STOP_PROMPT], SamplingParams(max_tokens=25, temperature=0.0, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    ids = ref.token_ids
    c = next(i for i in range(1, len(ids)) if ids[i] != ids[0])
    # c and c + 1 (the stop strings below) must not end a run: tokens after them are dropped
    assert c % (K_STOP + 1) not in (0, K_STOP), "the first change must fall inside an accepted run"
    return ids, c


def spec_and_plain(model, params: list[SamplingParams]):
    """Generate with and without speculation (the model as its own draft, k = 5)."""
    plain = LLM(model, log_stats=False).generate([STOP_PROMPT] * len(params), params, use_tqdm=False)
    llm = LLM(model, log_stats=False, speculative_config=draft(model, K_STOP))
    spec = llm.generate([STOP_PROMPT] * len(params), params, use_tqdm=False)
    assert llm.llm_engine.metrics.spec_totals["num_accepted_tokens"] > 0
    assert_idle(llm)
    return plain, spec


def summary(out):
    c = out.outputs[0]
    return c.token_ids, c.text, c.finish_reason, c.stop_reason


def test_stop_ids_and_strings_inside_an_accepted_run(tiny_llama_tok_dir, stop_setup):
    ids, c = stop_setup
    tok = LLMEngine(tiny_llama_tok_dir, log_stats=False).tokenizer
    pair = tok.decode(ids[c - 1:c + 1])
    params = [SamplingParams(max_tokens=25, temperature=0.0, ignore_eos=True, **kw) for kw in (
        dict(stop_token_ids=[ids[c]]),
        dict(stop=[pair]),
        dict(stop=[pair], include_stop_str_in_output=True),
        dict(stop=["never", pair[1] * 2]),  # completes one token later, still inside the run
    )]
    plain, spec = spec_and_plain(tiny_llama_tok_dir, params)
    assert [summary(o) for o in spec] == [summary(o) for o in plain]
    assert summary(spec[0]) == (ids[:c + 1], tok.decode(ids[:c]), "stop", ids[c])  # a stop id's text is left out
    assert summary(spec[1]) == (ids[:c + 1], tok.decode(ids[:c - 1]), "stop", pair)
    assert summary(spec[2])[1] == tok.decode(ids[:c + 1])
    assert summary(spec[3])[0] == ids[:c + 2]


def test_max_tokens_inside_a_run(tiny_llama_tok_dir, stop_setup):
    ids, _ = stop_setup
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in range(1, 15)]
    plain, spec = spec_and_plain(tiny_llama_tok_dir, params)
    assert [summary(o) for o in spec] == [summary(o) for o in plain]
    assert [o.outputs[0].token_ids for o in spec] == [ids[:m] for m in range(1, 15)]


def test_streamed_deltas_add_up_to_the_same_text(tiny_llama_tok_dir, stop_setup):
    ids, c = stop_setup
    engine = LLMEngine(tiny_llama_tok_dir, log_stats=False, speculative_config=draft(tiny_llama_tok_dir, K_STOP))
    tok = engine.tokenizer
    params = SamplingParams(max_tokens=25, temperature=0.0, ignore_eos=True, stop=[tok.decode(ids[c - 1:c + 1])])
    engine.add_request("r", STOP_PROMPT, params)
    deltas, delta_ids, final = [], [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.outputs[0].delta_text)
            delta_ids += out.outputs[0].delta_token_ids
            final = out
    assert final.finished and "".join(deltas) == final.outputs[0].text == tok.decode(ids[:c - 1])
    assert delta_ids == final.outputs[0].token_ids == ids[:c + 1]
    assert len(deltas) < len(delta_ids)  # several tokens per step: the speculation happened


# --- seeds, batch size, logprobs, atomic steps ---------------------------------------------------

def test_seeded_requests_reproduce(tiny_llama_dir, tiny_draft_dir):
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=11, ignore_eos=True)
    others = [SamplingParams(max_tokens=10, temperature=0.7, seed=s, ignore_eos=True) for s in (1, 2)]

    def run(prompts, ps):
        llm = LLM(tiny_llama_dir, log_stats=False, speculative_config=draft(tiny_draft_dir, 3))
        return token_ids(llm.generate(prompts, ps, use_tqdm=False))

    alone = run([TINY_PROMPTS[1]], [params])
    assert run([TINY_PROMPTS[1]], [params]) == alone
    assert run([TINY_PROMPTS[0], TINY_PROMPTS[1], TINY_PROMPTS[3]], [others[0], params, others[1]])[1] == alone[0]


@pytest.mark.parametrize("limit, speculates", [(2, False), (3, True)])
def test_disable_by_batch_size(tiny_llama_dir, tiny_reference, limit, speculates):
    spec = {**ngram(3), "disable_by_batch_size": limit}
    llm = LLM(tiny_llama_dir, log_stats=False, speculative_config=spec)
    outs = llm.generate(TINY_PROMPTS[3:6], TINY_GREEDY, use_tqdm=False)  # three requests, finishing together
    assert token_ids(outs) == tiny_reference[3:6]
    assert (llm.llm_engine.metrics.spec_totals["num_drafts"] > 0) == speculates


def test_logprobs_match_plain_decoding(tiny_llama_dir, tiny_reference):
    params = dataclasses.replace(TINY_GREEDY, max_tokens=16, logprobs=3)
    plain = LLM(tiny_llama_dir, log_stats=False).generate(TINY_PROMPTS, params, use_tqdm=False)
    spec = LLM(tiny_llama_dir, log_stats=False, speculative_config=draft(tiny_llama_dir, 3)).generate(
        TINY_PROMPTS, params, use_tqdm=False)
    for a, b in zip(plain, spec):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert list(la) == list(lb)  # the sampled token, then the top 3, in order
            # the verify pass sums a 4-row batch in another order than a 1-row decode (float32)
            assert np.allclose(list(la.values()), list(lb.values()), atol=1e-4, rtol=0)


def test_a_failed_speculative_step_is_redone_exactly(tiny_llama_tok_dir, tiny_draft_dir, monkeypatch):
    """A fault in the stop rules in the middle of a verified run undoes the step, the draft
    model's random draws included: the outputs equal a run without the fault."""
    requests = [("a", "hello there", SamplingParams(max_tokens=14, temperature=0.9, seed=7, ignore_eos=True)),
                ("b", "abc", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)),
                ("c", "x", SamplingParams(max_tokens=10, temperature=1.2, seed=3, n=2, ignore_eos=True))]

    def run(fail_on: int | None):
        engine = LLMEngine(tiny_llama_tok_dir, log_stats=False, block_size=4, num_kv_blocks=12,
                           speculative_config=draft(tiny_draft_dir, 3))
        for rid, prompt, params in requests:
            engine.add_request(rid, prompt, params)
        real, calls = StopChecker.append_and_check, {"n": 0}

        def flaky(self, seq, token):
            calls["n"] += 1
            if calls["n"] == fail_on:
                raise RuntimeError("injected fault")
            return real(self, seq, token)

        monkeypatch.setattr(StopChecker, "append_and_check", flaky)
        done, raised = {}, 0
        while engine.has_unfinished_requests():
            try:
                outs = engine.step()
            except RuntimeError:
                raised += 1
                continue
            done.update({o.request_id: [(c.token_ids, c.text) for c in o.outputs] for o in outs if o.finished})
        monkeypatch.undo()
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        return done, raised, engine.metrics.spec_totals

    reference, raised, totals = run(None)
    assert raised == 0 and 0 < totals["num_accepted_tokens"] < totals["num_draft_tokens"]
    for fail_on in (9, 20):  # calls in steps that verify several tokens
        done, raised, _ = run(fail_on)
        assert raised == 1 and done == reference


# --- the option and the flag -------------------------------------------------------------------

def test_engine_option_and_resolved_config(tiny_llama_dir, tiny_draft_dir):
    engine = LLMEngine(tiny_llama_dir, log_stats=False, speculative_config=draft(tiny_draft_dir, 2))
    cfg = engine.config
    assert cfg.speculative_config.method == "draft_model" and cfg.speculative_config.num_speculative_tokens == 2
    assert cfg.summary()["speculative_config"]["model"] == str(tiny_draft_dir)
    # one pool size for both caches: the draft's blocks are counted in the memory budget
    assert cfg.draft_bytes_per_block == cfg.bytes_per_block == 2 * 3 * 16 * 2 * 32 * 4  # a copy's shapes
    assert cfg.num_kv_blocks == 2 * 1024**3 // (cfg.bytes_per_block + cfg.draft_bytes_per_block)
    assert engine.spec_decoder.draft.kv_cache.num_blocks == cfg.num_kv_blocks


def test_a_draft_with_another_vocabulary_is_refused_before_loading(tiny_llama_dir, small_vocab_pair, monkeypatch):
    monkeypatch.setattr("refengine.core.engine.load_model", lambda *a, **k: pytest.fail("loaded the weights"))
    with pytest.raises(ValueError, match=r"has vocab_size=16 but the target model has 211: a draft model must "
                                         r"share the target's vocabulary"):
        LLMEngine(tiny_llama_dir, speculative_config=draft(small_vocab_pair[1], 2))
    with pytest.raises(ValueError, match=r"speculative_config\['num_speculative_tokens'\]=0 is invalid"):
        EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 0})


def test_cli_flag(tiny_llama_tok_dir):
    spec = json.dumps(ngram(3))
    res = CliRunner().invoke(main, ["generate", "--model", str(tiny_llama_tok_dir), "--speculative-config", spec,
                                    "--max-tokens", "8", "--ignore-eos", "--json", "abc"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout.splitlines()[0])["text"] == "Y" * 8
    for value, message in [("{nope", r"Error: .*--speculative-config.*is not valid JSON"),
                           ("[1]", r"Error: .*--speculative-config.*is not a JSON object"),
                           ('{"method": "ngram"}', r"Error: --speculative-config needs 'num_speculative_tokens'")]:
        res = CliRunner().invoke(main, ["generate", "--model", str(tiny_llama_tok_dir), "--speculative-config",
                                        value, "hi"])
        lines = res.stderr.splitlines()
        assert res.exit_code == 2 and len(lines) == 1 and re.match(message, lines[0]), res.output


def test_bench_reports_the_acceptance(tiny_llama_tok_dir, tmp_path):
    from refengine.bench.scenarios import run_simple
    from tests.bench.test_bench import bench_engine_kwargs, fake_ctx

    lines = []
    kwargs = bench_engine_kwargs(model=str(tiny_llama_tok_dir), speculative_config=ngram(3), log_stats=False)
    report = run_simple(fake_ctx(tmp_path, engine_kwargs=kwargs, plot_path=None, echo=lines.append), "throughput")
    spec = json.loads((tmp_path / "r.json").read_text())["speculative_decoding"]
    assert spec == report["speculative_decoding"] and spec["num_drafts"] > 0
    assert spec["acceptance_rate"] == spec["num_accepted_tokens"] / spec["num_draft_tokens"]
    assert spec["mean_acceptance_length"] == 1 + spec["num_accepted_tokens"] / spec["num_drafts"]
    assert any(line.startswith("speculative decoding:") and "acceptance rate:" in line for line in lines)
