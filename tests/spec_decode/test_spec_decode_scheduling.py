"""The scheduler's side of speculative decoding, on stub and tiny models.

1. Speculative slots come after every running sequence's decode token: proposals never
   take a later sequence's budget or block, nor preempt it.
2. The draft model's catch-up pass keeps to ``max_num_batched_tokens`` and sizes the
   thread pools for its own batch; the GPU KV pool leaves room for the draft's weights,
   activations and KV (the arithmetic, no GPU).
3. A stop inside accepted speculative tokens: ``num_computed_tokens`` never passes the
   sequence's end and only full blocks are hashed into the prefix cache.
"""

from __future__ import annotations

import pytest

from refengine.config import SchedulerConfig
from refengine.core.block_manager import BlockManager, hash_block_tokens
from refengine.core.scheduler import Scheduler
from refengine.core.sequence import Sequence
from refengine.sampling_params import SamplingParams
from refengine.stop import StopChecker
from tests.spec_decode.test_spec_decode_unit import StubSpeculator, make_seq, prefill


def make_sched(k=3, num_blocks=100, block_size=4, budget=64, stop_checker=None, caching=False) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, enable_chunked_prefill=True,
                          max_model_len=1000)
    return Scheduler(cfg, BlockManager(num_blocks, block_size, enable_prefix_caching=caching), stop_checker,
                     speculator=StubSpeculator(k))


# --- 1. proposals from what is left ----------------------------------------------------------

def test_proposals_never_take_the_block_a_later_sequence_needs():
    """a (4 tokens) and b (5 tokens) decode from a pool of 4 blocks of 4 with 2 free. b's
    next token (position 4) needs a new block; a's 5 proposals would want both free
    blocks (they took them, and b was preempted). b gets its block, a's proposals fit the
    one left (positions 4 .. 7), b's 3 fit the block it has; no one is preempted."""
    sched = make_sched(k=5, num_blocks=4, block_size=4)
    a, b = make_seq("a", 3), make_seq("b", 4)
    prefill(sched, a, b)
    assert (len(a), len(b), sched.block_manager.num_free_blocks) == (4, 5, 2)
    out = sched.schedule()
    assert out.preempted == [] and sched.running == [a, b]
    assert [(s.request_id, n) for s, n in out.scheduled] == [("a", 5), ("b", 4)] and out.spec == {a: 4, b: 3}
    assert (len(a.block_table), len(b.block_table), sched.block_manager.num_free_blocks) == (2, 2, 0)


def test_no_proposals_in_a_step_that_preempts():
    """The pool is short (b preempts itself for its decode block): the block b gave back
    is not spent on a's proposals; b is re-admitted next step and both decode."""
    sched = make_sched(k=3, num_blocks=3, block_size=4)
    a, b = make_seq("a", 4), make_seq("b", 4)
    prefill(sched, a, b)
    out = sched.schedule()
    assert out.preempted == [b] and out.spec == {} and out.scheduled == [(a, 1)]


def test_proposals_use_the_budget_left_after_every_decode_token():
    sched = make_sched(k=5, budget=3)
    seqs = [make_seq(name, 1) for name in "abc"]
    prefill(sched, *seqs)
    out = sched.schedule()
    assert out.spec == {} and [n for _, n in out.scheduled] == [1, 1, 1]  # nothing left to propose with
    sched = make_sched(k=5, budget=5)
    seqs = [make_seq(name, 1) for name in "abc"]
    prefill(sched, *seqs)
    out = sched.schedule()
    assert out.spec == {seqs[0]: 2} and [n for _, n in out.scheduled] == [3, 1, 1]  # oldest first


# --- 2. the draft model's catch-up pass; the GPU pool with a draft ------------------------------

def test_the_draft_catch_up_keeps_to_the_token_budget(tiny_llama_dir, monkeypatch):
    """Three 40-token prompts with max_num_batched_tokens=16: the target prefills in
    chunks of at most 16, and so must the draft's catch-up on the same prompts (it ran
    all 120 tokens in one pass). The tiny model as its own draft accepts every proposal,
    so the output is the output without speculation. Each draft pass sizes the thread
    pools for its own batch (adapt_threads, as the target's runner does)."""
    from refengine import LLM

    prompts = [[(7 * i + j) % 200 + 3 for j in range(40)] for i in range(3)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in LLM(tiny_llama_dir, log_stats=False).generate(
        prompts, params, use_tqdm=False)]
    llm = LLM(tiny_llama_dir, log_stats=False, max_num_batched_tokens=16,
              speculative_config={"method": "draft_model", "model": str(tiny_llama_dir), "num_speculative_tokens": 3})
    draft = llm.llm_engine.spec_decoder.draft
    rows, pools = [], []
    forward = draft.model.forward

    def recording(ids, *args, **kwargs):
        rows.append(int(ids.shape[0]))
        return forward(ids, *args, **kwargs)

    monkeypatch.setattr(draft.model, "forward", recording)
    from refengine.cpu import engine_hooks  # the draft's ops size its pools (LayerOps.begin_step)

    real_adapt, real_once, in_draft = engine_hooks.adapt_threads, draft._forward_once, []

    def draft_forward(chunks):
        in_draft.append(True)
        try:
            return real_once(chunks)
        finally:
            in_draft.clear()

    def adapt(**kw):  # the draft's forwards only, not the target's steps
        if in_draft:
            pools.append(kw)
        return real_adapt(**kw)

    monkeypatch.setattr(draft, "_forward_once", draft_forward)
    monkeypatch.setattr(engine_hooks, "adapt_threads", adapt)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert sum(rows) >= 3 * 40 and max(rows) <= 16
    assert len(pools) == len(rows) and all(set(kw) == {"blas_step", "library_blas"} for kw in pools)


def test_gpu_kv_pool_leaves_room_for_the_draft():
    """The pool is what ``utilization`` of the GPU leaves after the weights (target and
    draft, both loaded when memory is read) and the larger activation peak; each block
    costs the target's and the draft's bytes together."""
    from refengine.core.model_runner import gpu_kv_pool_blocks

    gib = 2**30
    # 80 GiB, 10 GiB held (weights of both), peak 2 GiB, 0.9: 72 - 10 - 2 = 60 GiB for KV
    assert gpu_kv_pool_blocks(total_bytes=80 * gib, free_bytes=70 * gib, activation_peak_bytes=2 * gib,
                              bytes_per_block=3 * 2**20, draft_bytes_per_block=2**20,
                              utilization=0.9) == 60 * gib // (4 * 2**20) == 15360
    assert gpu_kv_pool_blocks(80 * gib, 70 * gib, 2 * gib, 3 * 2**20, 0, 0.9) == 60 * gib // (3 * 2**20)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.1 .*8.00 GiB.*and its draft model"):
        gpu_kv_pool_blocks(80 * gib, 72 * gib, 0, 3 * 2**20, 2**20, 0.1)


def test_profile_activation_peak_counts_only_scratch_bytes():
    """The activation peak of a profile pass is what the pool grew by, less the scratch
    cache that pass held (its own bytes: the target's, or the draft's; its KV dtype),
    never below 0; the larger of the two passes sizes the pool."""
    from refengine.core.model_runner import activation_peak

    assert activation_peak(held_before=100, held_after=100 + 500 + 64, scratch_bytes=64) == 500
    assert activation_peak(held_before=100, held_after=120, scratch_bytes=64) == 0


# --- 3. a stop inside an accepted run ----------------------------------------------------------

@pytest.mark.parametrize("params, tokens", [
    ({"stop_token_ids": [40]}, [40, 41, 42, 43]),  # stop id at the first emitted token
    ({}, [2, 41, 42, 43]),  # EOS there
])
def test_a_stop_inside_accepted_proposals_hashes_only_full_blocks(params, tokens):
    """Prompt of 4 (one block), the first output makes 5 tokens; 3 proposals all accepted
    (positions 4 .. 7 computed), but the stop ends the sequence at 6 tokens: it has
    computed 6, not 8, and only block 0 (positions 0 .. 3) is registered, under the hash of
    its own 4 tokens (block 1 holds 2 tokens: never hashed)."""
    sched = make_sched(k=3, block_size=4, stop_checker=StopChecker([2], 1000), caching=True)
    a = make_seq("a", 4, **params)
    prefill(sched, a)
    out = sched.schedule()
    assert out.spec == {a: 3}
    bm = sched.block_manager
    [(_, decision)] = sched.postprocess(out.scheduled, [(a, tokens, None)], num_rejected={a: 0})
    assert decision is not None and a.output_token_ids == [7, tokens[0]] and len(a) == 6
    assert a.num_computed_tokens <= len(a)
    assert len(a.block_hashes) == 1 and list(bm.cached) == [hash_block_tokens(None, a.prompt_token_ids)]
    assert bm.num_free_blocks == bm.num_blocks


def test_num_computed_tokens_never_passes_the_end_in_a_real_run(tiny_llama_dir):
    """The tiny model as its own draft (every proposal accepted; k=5), prefix caching on.
    Greedy, this prompt gives 44 four times, then 49: with stop id 49 the stop is the 4th
    of the first verify's 5 accepted proposals. The output is the output without
    speculation, no sequence ever counts more computed tokens than it has, and every
    registered block's hash is that of a full block of the request's tokens."""
    from refengine import LLM

    prompt = [108, 145, 167, 49, 22, 14, 123, 57, 44]
    free_run = LLM(tiny_llama_dir, log_stats=False).generate(
        [prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    stop = next(t for t in free_run.token_ids if t != free_run.token_ids[0])
    at = free_run.token_ids.index(stop)
    assert at >= 2 and (at - 1) % 6 != 5  # inside the accepted proposals, not the bonus token
    params = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop])
    plain = LLM(tiny_llama_dir, log_stats=False).generate([prompt], params, use_tqdm=False)[0].outputs[0]
    llm = LLM(tiny_llama_dir, log_stats=False, enable_prefix_caching=True, block_size=4,
              speculative_config={"method": "draft_model", "model": str(tiny_llama_dir), "num_speculative_tokens": 5})
    engine = llm.llm_engine
    seen = []
    original = engine.scheduler.postprocess

    def checked(scheduled, sampled, num_rejected=None):
        results = original(scheduled, sampled, num_rejected)
        seen.extend((len(s), s.num_computed_tokens) for s, _ in scheduled)
        return results

    engine.scheduler.postprocess = checked
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == plain.token_ids and out.finish_reason == "stop" and out.token_ids[-1] == stop
    assert engine.metrics.spec_totals["num_accepted_tokens"] > 0
    assert seen and all(computed <= length for length, computed in seen)
    tokens = prompt + out.token_ids
    full, parent = [], None
    for i in range(len(tokens) // 4):
        parent = hash_block_tokens(parent, tokens[4 * i:4 * i + 4])
        full.append(parent)
    assert engine.block_manager.cached and set(engine.block_manager.cached) <= set(full)
