"""The output never depends on the schedule (greedy).

Every run here is compared token for token with transformers' greedy output for the
same prompt alone: batch company, chunk size, block size, preemption and aborts of
other requests must not change a single token. transformers loads the converted model
directory (tests/formats/test_convert.py checks that it equals transformers' own GGUF load).

Every test runs with prefix caching off and on (the ``caching`` fixture): with it on, the
module-wide engine also serves later tests from blocks cached by earlier ones.
``test_prefix_reuse_at_every_alignment`` checks the reuse itself: which prompt reuses how
many tokens, and that the output still equals transformers'.

Two models (the ``model`` parameter): SmolLM2 (``smollm2``), and for some of a property's
cases a tiny random Llama (``tiny``) with the same kernels, whose runs cost next to
nothing. Every property keeps at least one SmolLM2 case; each tiny case says why it is
one. The tiny model's weights are drawn wide (``initializer_range=0.2``), so its greedy
continuation changes token at almost every step (17 to 20 distinct tokens of 20 for its
prompts), with top-2 margins of at least 3e-3 in logits up to about 9, hundreds of times
what float32 rounding moves them: a key or value read from the wrong slot, a lost chunk
or a stale block changes its tokens as surely as SmolLM2's, and rounding cannot.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from tests.helpers import save_tiny_llama, shared_models

from refengine import LLM, SamplingParams

TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age "
        "of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season "
        "of Light, it was the season of Darkness, it was the spring of hope, it was the winter of despair.")
MAX_TOKENS = 20
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@dataclass
class Model:
    """A model directory, its prompts (by name, the same names and lengths for both models)
    and transformers' greedy continuation of each."""

    path: Path
    prompts: dict[str, list[int]]
    reference: dict[str, list[int]]


@pytest.fixture(scope="module", autouse=True)
def _shared_models():
    """The module's engines differ in their schedule only: those of one model share it, and
    none warms up (:func:`tests.helpers.shared_models`), which changes no output."""
    with shared_models(max_models=3):
        yield


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from refengine.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> dict[str, list[int]]:
    ids = tokenizer.encode(TEXT)
    assert len(ids) > 60
    return {
        "short": tokenizer.encode("The capital of France is"),
        "p31": ids[:31], "p32": ids[:32], "p33": ids[:33],
        "long": ids[:61],
        "question": tokenizer.encode("Question: what is two plus two? Answer:"),
    }


def hf_reference(path, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    """transformers' greedy continuation of each prompt, alone (float32, eager)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None
    ref = {}
    with torch.no_grad():
        for name, ids in prompts.items():
            out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=2)
            ref[name] = out[0, len(ids):].tolist()
    return ref


@pytest.fixture(scope="module")
def reference(smollm2_dir, prompts) -> dict[str, list[int]]:
    return hf_reference(smollm2_dir, prompts)


@pytest.fixture(scope="module")
def smollm2(smollm2_dir, prompts, reference) -> Model:
    return Model(smollm2_dir, prompts, reference)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Model:
    """The tiny random Llama (vocab 211, 3 layers, 4/2 heads, head_dim 32) with wide weights
    (see the module docstring) and a context of 4096 (as ``test_chunk_sizes`` asks); its
    prompts are random ids, ``p31``-``p33`` prefixes of ``long`` as SmolLM2's are."""
    path = save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-wide"), initializer_range=0.2,
                           max_position_embeddings=4096)
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 211, size=61).tolist()
    prompts = {"short": rng.integers(3, 211, size=5).tolist(), "p31": ids[:31], "p32": ids[:32], "p33": ids[:33],
               "long": ids, "question": rng.integers(3, 211, size=11).tolist()}
    return Model(path, prompts, hf_reference(path, prompts))


@pytest.fixture(scope="module")
def model(request) -> Model:
    """``smollm2`` or ``tiny``, by the test's ``model`` parameter (indirect)."""
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module", params=[False, True], ids=["no-prefix-cache", "prefix-cache"])
def caching(request) -> bool:
    return request.param


def make_llm(path, caching: bool, **kw) -> LLM:
    kw.setdefault("log_stats", False)
    return LLM(model=path, device="cpu", enable_prefix_caching=caching, **kw)


def check(outputs, names, reference):
    for out, name in zip(outputs, names):
        assert out.outputs[0].token_ids == reference[name], name
        assert out.outputs[0].finish_reason == "length"


def assert_idle(llm: LLM):
    engine = llm.llm_engine
    bm = engine.block_manager
    assert not engine.has_unfinished_requests()
    assert bm.num_free_blocks == bm.num_blocks and bm.usage == 0.0
    assert bm.ref_counts == [0] * bm.num_blocks


@pytest.fixture(scope="module")
def llm16(caching):
    """The module-wide engine of each model (block size 16), made when first asked for."""
    engines = {}

    def get(model: Model) -> LLM:
        if model.path not in engines:
            engines[model.path] = make_llm(model.path, caching, block_size=16)
        return engines[model.path]
    return get


# 2 and 20 copies on the tiny model: SmolLM2 keeps 1 (alone) and 7 (company in every step);
# 2- and 20-row steps run the same kernels on either model.
@pytest.mark.parametrize("model, copies", [("smollm2", 1), ("tiny", 2), ("smollm2", 7), ("tiny", 20)],
                         indirect=["model"])
def test_batch_company(llm16, model, copies):
    llm = llm16(model)
    outs = llm.generate([model.prompts["p33"]] * copies, GREEDY, use_tqdm=False)
    check(outs, ["p33"] * copies, model.reference)
    assert_idle(llm)


def test_mixed_lengths_together(llm16, smollm2):
    llm = llm16(smollm2)
    names = list(smollm2.prompts) * 2
    outs = llm.generate([smollm2.prompts[n] for n in names], GREEDY, use_tqdm=False)
    check(outs, names, smollm2.reference)
    assert_idle(llm)


# numba on the tiny model: every other SmolLM2 test of this module runs the numba backend
# (the default); NumPy's only case here is SmolLM2's.
@pytest.mark.parametrize("backend, model", [("numpy", "smollm2"), ("numba", "tiny")], indirect=["model"])
def test_mixed_lengths_together_with_backend(caching, model, backend):
    """The numba CPU kernels (attention and layer ops) under the same schedule test."""
    llm = make_llm(model.path, caching, block_size=16, max_num_batched_tokens=48, attention_backend=backend)
    names = list(model.prompts) * 2
    outs = llm.generate([model.prompts[n] for n in names], GREEDY, use_tqdm=False)
    check(outs, names, model.reference)
    assert_idle(llm)


# SmolLM2 keeps a chunk of 17 tokens: chunks that end inside blocks, in steps that mix
# prefill chunks and decodes. The tiny model runs the same kernels on the others: 1 (every
# token its own step, the decodes one a step too), 5, 16 (block-aligned) and 4096 (whole
# prompts, as SmolLM2 prefills them in the other tests).
@pytest.mark.parametrize("chunk, model", [(1, "tiny"), (5, "tiny"), (16, "tiny"), (17, "smollm2"),
                                          (4096, "tiny")], indirect=["model"])
def test_chunk_sizes(caching, model, chunk):
    llm = make_llm(model.path, caching, block_size=16, max_num_batched_tokens=chunk, max_model_len=4096)
    names = ["long", "short", "p31"]
    outs = llm.generate([model.prompts[n] for n in names], GREEDY, use_tqdm=False)
    check(outs, names, model.reference)
    assert_idle(llm)


# Block sizes 16 and 32 on the tiny model: SmolLM2 keeps 8, the size with the most block
# boundaries inside these prompts and their continuations (and runs block size 16 in every
# other test of this module).
@pytest.mark.parametrize("block_size, model", [(8, "smollm2"), (16, "tiny"), (32, "tiny")], indirect=["model"])
def test_block_sizes(caching, model, block_size):
    llm = make_llm(model.path, caching, block_size=block_size, max_num_batched_tokens=40)
    names = ["p31", "p32", "p33", "long"]  # cross block boundaries in prefill and decode
    outs = llm.generate([model.prompts[n] for n in names], GREEDY, use_tqdm=False)
    check(outs, names, model.reference)
    assert_idle(llm)


def test_preemption_by_recompute(smollm2_dir, caching, prompts, reference):
    # Each request needs ceil((len + 20) / 16) blocks (4 to 6 here); 10 blocks hold about two.
    llm = make_llm(smollm2_dir, caching, block_size=16, num_kv_blocks=10)
    names = ["p31", "p32", "p33", "short", "question", "p31"]
    outs = llm.generate([prompts[n] for n in names], GREEDY, use_tqdm=False)
    check(outs, names, reference)
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outs)
    metrics = llm.llm_engine.metrics
    assert metrics.total_preemptions > 0
    # with caching, the second "p31" and the preempted sequences reuse cached blocks
    assert (metrics.total_prefix_cache_hits > 0) == caching
    assert_idle(llm)


def run_until(engine, cond, limit=500):
    outs = {}
    for _ in range(limit):
        for o in engine.step():
            outs[o.request_id] = o
        if cond():
            return outs
    raise AssertionError("condition never reached")


def test_abort_during_prefill_and_decode(smollm2_dir, caching, prompts, reference):
    llm = make_llm(smollm2_dir, caching, block_size=16, max_num_batched_tokens=8)
    engine = llm.llm_engine
    engine.add_request("keep-a", prompts["p33"], GREEDY)
    engine.add_request("in-prefill", prompts["long"], GREEDY)
    engine.add_request("keep-b", prompts["short"], GREEDY)
    engine.add_request("in-decode", prompts["question"], GREEDY)
    seqs = {rid: engine.requests[rid].seqs[0] for rid in engine.requests}
    # abort "in-prefill" once part of its 61-token prompt is in the cache
    run_until(engine, lambda: 0 < seqs["in-prefill"].num_computed_tokens < len(prompts["long"]))
    engine.abort("in-prefill")
    assert seqs["in-prefill"].block_table == [] and seqs["in-prefill"].finish_reason == "abort"
    run_until(engine, lambda: seqs["in-decode"].num_output_tokens >= 3)
    engine.abort("in-decode")
    assert seqs["in-decode"].block_table == []
    finished = run_until(engine, lambda: not engine.has_unfinished_requests())
    assert set(finished) >= {"keep-a", "keep-b"}
    assert finished["keep-a"].outputs[0].token_ids == reference["p33"]
    assert finished["keep-b"].outputs[0].token_ids == reference["short"]
    assert_idle(llm)


def test_chunked_prefill_off_prefills_whole_prompts(smollm2_dir, caching, prompts, reference):
    llm = make_llm(smollm2_dir, caching, block_size=16, enable_chunked_prefill=False, max_model_len=256,
                   max_num_batched_tokens=256)
    names = ["long", "p32", "short"]
    outs = llm.generate([prompts[n] for n in names], GREEDY, use_tqdm=False)
    check(outs, names, reference)
    assert_idle(llm)


def test_prefix_reuse_at_every_alignment(smollm2_dir, prompts, reference):
    """Prompts sent one after another to a fresh engine (block size 16): the tokens each
    reuses, and its output, which must still be transformers' greedy output."""
    llm = make_llm(smollm2_dir, True, block_size=16)
    p33_then_output = prompts["p33"] + reference["p33"][:16]  # 49 tokens: block 2 holds generated tokens
    steps = [  # (prompt, expected num_cached_tokens, expected output)
        ("long", prompts["long"], 0, reference["long"]),
        ("the same prompt twice", prompts["long"], 48, reference["long"]),  # (61 - 1) // 16 blocks
        ("a prefix of an earlier prompt", prompts["p33"], 32, reference["p33"]),
        ("a whole number of blocks", prompts["p32"], 16, reference["p32"]),  # the last block is recomputed
        ("a whole number of blocks, again", prompts["p32"], 16, reference["p32"]),
        ("31 tokens", prompts["p31"], 16, reference["p31"]),
        ("nothing shared", prompts["short"], 0, reference["short"]),
        ("prompt + generated tokens", p33_then_output, 48, reference["p33"][16:]),
    ]
    for what, prompt, cached, expected in steps:
        params = SamplingParams(max_tokens=len(expected), temperature=0.0, ignore_eos=True)
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        assert out.num_cached_tokens == cached, what
        assert out.outputs[0].token_ids == expected, what
        assert_idle(llm)
    assert llm.llm_engine.metrics.total_prefix_cache_hits == sum(c for _, _, c, _ in steps)
    assert llm.reset_prefix_cache() is True
    out = llm.generate([prompts["long"]], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == reference["long"]
