"""A step is atomic past the sampler (issue 11): a fault in the detokenizer, the stop rules
or the sampler undoes the step; a fault in the metrics leaves it fully applied. Either way,
stepping on gives exactly the outputs of a run without the fault, ``text ==
decode(token_ids)`` for every request, and every KV block is accounted for."""

from __future__ import annotations

import logging
from collections import Counter

import pytest

from refengine import SamplingParams
from refengine.core.engine import LLMEngine
from refengine.detokenizer import IncrementalDetokenizer
from refengine.metrics import EngineMetrics, RequestMetrics
from refengine.sampler import Sampler
from refengine.stop import StopChecker

# Seeded sampling, so a step that is redone must redraw the same tokens; one greedy request
# with a stop string, one with n=2.
REQUESTS = [
    ("a", "hello there", SamplingParams(max_tokens=12, temperature=0.9, seed=7, ignore_eos=True)),
    ("b", "abc", SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, stop=["zz", "YYY"])),
    ("c", "x", SamplingParams(max_tokens=8, temperature=1.2, seed=3, n=2, ignore_eos=True)),
]


def new_engine(model_dir) -> LLMEngine:
    # a pool of 7 blocks of 4 tokens, short of what the requests need at peak: some steps preempt
    return LLMEngine(model_dir, block_size=4, num_kv_blocks=7, max_num_batched_tokens=8, log_stats=False)


def blocks_accounted(engine: LLMEngine) -> bool:
    """Every block is either free (cached content or not) or held by unfinished sequences'
    block tables exactly as often as its reference count says (prefix caching shares blocks)."""
    bm = engine.block_manager
    held = Counter(b for req in engine.requests.values() for s in req.seqs if not s.is_finished
                   for b in s.block_table)
    free = list(bm.free_blocks) + list(bm.cached_free)
    return (all(bm.ref_counts[b] == (held[b] if b in held else 0) for b in range(bm.num_blocks))
            and len(free) == len(set(free)) and not set(free) & set(held)
            and sorted([*free, *held]) == list(range(bm.num_blocks)))


def run(engine: LLMEngine, steps_before: int = 0, fault=None) -> tuple[dict, int]:
    """Submit REQUESTS, step ``steps_before`` times, install ``fault`` (a callable that
    sets up one failure), then step to the end. Returns (request id -> final output, number
    of steps that raised)."""
    for rid, prompt, params in REQUESTS:
        engine.add_request(rid, prompt, params)
    done, raised = {}, 0
    for _ in range(steps_before):
        done.update({o.request_id: o for o in engine.step() if o.finished})
    if fault is not None:
        fault()
    while engine.has_unfinished_requests():
        try:
            outs = engine.step()
        except RuntimeError as e:
            assert str(e) == "injected fault"
            raised += 1
            assert blocks_accounted(engine)
            continue
        done.update({o.request_id: o for o in outs if o.finished})
        assert blocks_accounted(engine)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return done, raised


def fail_once(monkeypatch, cls, name: str, on_call: int):
    """Make ``cls.name`` raise RuntimeError("injected fault") on its ``on_call``-th call only."""
    real = getattr(cls, name)
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == on_call:
            raise RuntimeError("injected fault")
        return real(*args, **kwargs)

    return lambda: monkeypatch.setattr(cls, name, flaky)


@pytest.fixture(scope="module")
def reference(tiny_llama_tok_dir) -> dict:
    engine = new_engine(tiny_llama_tok_dir)
    done, raised = run(engine)
    assert raised == 0 and engine.metrics.total_preemptions > 0  # the pool is short: steps preempt
    return {rid: [(c.token_ids, c.text, c.finish_reason) for c in out.outputs] for rid, out in done.items()}


def check(engine: LLMEngine, done: dict, reference: dict) -> None:
    tok = engine.tokenizer
    assert {rid: [(c.token_ids, c.text, c.finish_reason) for c in out.outputs] for rid, out in done.items()} == reference
    for out in done.values():
        for c in out.outputs:
            if c.stop_reason is None:
                assert c.text == tok.decode(c.token_ids)
            else:  # cut before the stop string
                assert tok.decode(c.token_ids).startswith(c.text) and c.stop_reason in tok.decode(c.token_ids)


def test_reference_run_is_a_real_test(reference):
    """The scenario exercises what the faults hit: several samplers per step, a stop string, preemption."""
    assert sorted(reference) == ["a", "b", "c"] and len(reference["c"]) == 2
    assert all(len(ids) > 0 for outs in reference.values() for ids, _, _ in outs)
    assert reference["b"] == [([60, 60, 60], "", "stop")]  # greedy "YYY..." (Y is id 60) cut at the stop string


# (class, method, which call fails): each raises in the middle of a step, after some of the
# step's sequences were already handled.
UNDONE = [
    (IncrementalDetokenizer, "add_token", 1),
    (IncrementalDetokenizer, "add_token", 6),
    (IncrementalDetokenizer, "add_token", 20),
    (IncrementalDetokenizer, "flush", 1),
    (IncrementalDetokenizer, "truncate", 1),
    (StopChecker, "append_and_check", 2),
    (StopChecker, "append_and_check", 13),
    (Sampler, "__call__", 3),
]


@pytest.mark.parametrize("cls, name, on_call", UNDONE, ids=lambda x: getattr(x, "__name__", str(x)))
@pytest.mark.parametrize("steps_before", [0, 3])
def test_a_fault_after_sampling_undoes_the_step(tiny_llama_tok_dir, reference, monkeypatch, cls, name, on_call,
                                                steps_before):
    engine = new_engine(tiny_llama_tok_dir)
    done, raised = run(engine, steps_before, fail_once(monkeypatch, cls, name, on_call))
    assert raised == 1
    check(engine, done, reference)


@pytest.mark.parametrize("cls, name, on_call", [
    (EngineMetrics, "record_first_token", 1),
    (EngineMetrics, "record_token_latency", 4),
    (EngineMetrics, "record_finished", 1),
    (EngineMetrics, "record_step", 2),
    (RequestMetrics, "on_token", 5),
], ids=lambda x: getattr(x, "__name__", str(x)))
def test_a_fault_in_the_metrics_leaves_the_step_applied(tiny_llama_tok_dir, reference, monkeypatch, caplog, cls,
                                                        name, on_call):
    engine = new_engine(tiny_llama_tok_dir)
    with caplog.at_level(logging.ERROR, logger="refengine"):
        done, raised = run(engine, 0, fail_once(monkeypatch, cls, name, on_call))
    assert raised == 0  # the step's outputs were still returned
    assert [r.getMessage() for r in caplog.records] == [
        "recording the metrics of a step failed; the step's results stand"]
    check(engine, done, reference)
