"""The engine-side defects of the code review (issue 24), each pinned by a test.

1. Speculative slots come after every running sequence's decode token: proposals never
   take a later sequence's budget or block, nor preempt it.
2. The draft model's catch-up pass keeps to ``max_num_batched_tokens`` and sizes the
   thread pools for its own batch; the GPU KV pool leaves room for the draft's weights,
   activations and KV (the arithmetic, no GPU).
3. A stop inside accepted speculative tokens: ``num_computed_tokens`` never passes the
   sequence's end and only full blocks are hashed into the prefix cache.
4. Beam search asks for ``beam_width + number of EOS ids`` logprobs per beam (the same
   beams as transformers' ``2 * beam_width`` candidates) and refuses up front a width
   that needs more than ``max_logprobs``.
5. The thread count honours cgroup CPU quotas (v2 ``cpu.max``, v1 ``cfs_quota_us``).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from refengine.config import SchedulerConfig
from refengine.kv_cache import BlockManager, hash_block_tokens
from refengine.sampling_params import SamplingParams
from refengine.scheduler import Scheduler
from refengine.sequence import Sequence
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
    from refengine.spec_decode import draft_model

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
    real_adapt = draft_model.adapt_threads
    monkeypatch.setattr(draft_model, "adapt_threads",
                        lambda **kw: pools.append(kw) or real_adapt(**kw))
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert sum(rows) >= 3 * 40 and max(rows) <= 16
    assert len(pools) == len(rows) and all(set(kw) == {"blas_step", "library_blas"} for kw in pools)


def test_gpu_kv_pool_leaves_room_for_the_draft():
    """The pool is what ``utilization`` of the GPU leaves after the weights (target and
    draft, both loaded when memory is read) and the larger activation peak; each block
    costs the target's and the draft's bytes together."""
    from refengine.model_runner import gpu_kv_pool_blocks

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
    from refengine.model_runner import activation_peak

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


# --- 4. beam search within max_logprobs --------------------------------------------------------

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


# --- 5. cgroup CPU quotas ----------------------------------------------------------------------

def write_cgroup(root, files: dict[str, str]):
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.mark.parametrize("proc, files, quota", [
    ("0::/\n", {"cpu.max": "200000 100000\n"}, 2.0),  # cgroup v2, namespace root
    ("0::/\n", {"cpu.max": "150000 100000\n"}, 1.5),
    ("0::/\n", {"cpu.max": "max 100000\n"}, None),  # no limit
    ("0::/job/step\n", {"job/cpu.max": "300000 100000\n", "job/step/cpu.max": "max 100000\n"}, 3.0),  # a parent's
    ("0::/job\n", {"cpu.max": "100000 100000\n", "job/cpu.max": "400000 100000\n"}, 1.0),  # the tightest
    ("4:cpu,cpuacct:/docker/abc\n1:memory:/docker/abc\n",
     {"cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "50000\n", "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n"},
     0.5),  # cgroup v1
    ("4:cpu,cpuacct:/\n", {"cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"},
     None),
    ("0::/\n", {}, None),  # no controller files
])
def test_cgroup_cpu_quota(tmp_path, proc, files, quota):
    from refengine.runtime.threads import cgroup_cpu_quota

    write_cgroup(tmp_path / "cg", files)
    (tmp_path / "self_cgroup").write_text(proc)
    got = cgroup_cpu_quota(str(tmp_path / "cg"), str(tmp_path / "self_cgroup"))
    assert got == (None if quota is None else pytest.approx(quota))


@pytest.mark.parametrize("affinity, quota, cores", [(64, 2.0, 2), (64, 1.5, 2), (64, 0.5, 1), (4, 8.0, 4),
                                                    (64, None, 64)])
def test_usable_cores_is_the_affinity_capped_by_the_quota(monkeypatch, affinity, quota, cores):
    from refengine.runtime import threads

    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(range(affinity)))
    monkeypatch.setattr(threads, "cgroup_cpu_quota", lambda *a, **k: quota)
    assert threads.usable_cores() == cores == min(affinity, math.ceil(quota) if quota else affinity)


def test_a_two_cpu_container_starts_two_threads(monkeypatch, tmp_path):
    """A container limited to 2 CPUs on a 64-core host: configure_threads sizes the pools to 2."""
    from refengine.runtime import threads

    write_cgroup(tmp_path / "cg", {"cpu.max": "200000 100000\n"})
    (tmp_path / "self_cgroup").write_text("0::/\n")
    monkeypatch.setattr(threads, "CGROUP_ROOT", str(tmp_path / "cg"))
    monkeypatch.setattr(threads, "PROC_SELF_CGROUP", str(tmp_path / "self_cgroup"))
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setattr(threads, "_set_pools", lambda *a: None)
    for name in ("_requested", "_adaptive", "_current", "_last_sample", "_library_blas"):
        monkeypatch.setattr(threads, name, getattr(threads, name))  # restored after the test
    assert threads.configure_threads(None) == 2 and threads.max_threads() == 2


# --- 6. the load test's own helpers ------------------------------------------------------------

def _load_test_module():
    import importlib.util
    import pathlib
    import sys

    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "load_test.py"
    spec = importlib.util.spec_from_file_location("load_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["load_test"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_load_test_reads_metrics_and_memory():
    import os

    lt = _load_test_module()
    text = ("# HELP refengine:kv_cache_usage_perc x\n# TYPE refengine:kv_cache_usage_perc gauge\n"
            "refengine:kv_cache_usage_perc 0.25\nrefengine:num_requests_running_total 3.0\n"
            'refengine:num_requests_running{model_name="m"} 2.0\n')
    assert lt.metric_value(text, "refengine:kv_cache_usage_perc") == 0.25
    assert lt.metric_value(text, "refengine:num_requests_running") == 2.0  # not the _total one
    assert lt.metric_value(text, "refengine:num_requests_waiting") is None
    with open(f"/proc/{os.getpid()}/status") as f:
        own = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    assert lt.tree_rss_bytes(os.getpid()) >= own > 0


def test_load_test_refuses_bad_options():
    lt = _load_test_module()
    with pytest.raises(SystemExit):
        lt.main(["--duration", "0"])
