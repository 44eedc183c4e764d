"""Tensor parallelism (refengine/parallel/): the split plan, the shards, and TP = 2 against TP = 1.

TP = 2 runs two MPI worker processes (``mpiexec``, from the ``mpich`` wheel); on this
2-core machine each is pinned to one core. The end-to-end tests compare logits and greedy
continuations with the single-process engine on the same model.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import numpy as np
import pytest

from refengine import LLM, SamplingParams
from refengine.core.executor import cpu_shares
from refengine.engine_args import EngineArgs
from refengine.models.hf_config import read_model_config
from refengine.parallel import plan_partitions, shard_checkpoint
from refengine.quant.gguf_blocks import GGUFWeight
from refengine.quant.int8 import Int8Weight

from tests.helpers import save_tiny_llama

HAVE_MPI = importlib.util.find_spec("mpi4py") is not None
needs_mpi = pytest.mark.skipif(not HAVE_MPI, reason="mpi4py/mpich not installed (pip install 'refengine[distributed]')")


def smollm2_like(**kw):
    """SmolLM2-135M's head and feature counts (9 query heads, 3 KV heads, 1536 features)."""
    from refengine.config import ModelConfig

    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    base = dict(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0, rope_scaling=None,
                tie_word_embeddings=True)
    base.update(kw)
    return ModelConfig(**{k: v for k, v in base.items() if k in fields})


# --- the plan --------------------------------------------------------------------------------

def test_plan_splits_kv_heads_unevenly_when_they_do_not_divide():
    """SmolLM2 at TP = 2: 3 KV heads give 1 and 2 (with 3 and 6 query heads); the MLP's 1536
    features split at 768 (a multiple of 256: down_proj's blocks stay whole); the vocabulary halves."""
    p0, p1 = plan_partitions(smollm2_like(), 2)
    assert (p0.kv_heads, p1.kv_heads) == (range(0, 1), range(1, 3))
    assert (p0.q_heads, p1.q_heads) == (range(0, 3), range(3, 9))
    assert (p0.ffn, p1.ffn) == (range(0, 768), range(768, 1536))
    assert (p0.vocab, p1.vocab) == (range(0, 24576), range(24576, 49152))
    local = p1.local_config(smollm2_like())
    assert (local.num_attention_heads, local.num_key_value_heads, local.intermediate_size, local.head_dim) == (6, 2, 768, 64)


def test_plan_replicates_kv_heads_when_fewer_than_workers():
    """4 query heads, 1 KV head over 2 and 4 workers: the KV head on every worker, the query
    heads shared out equally (vLLM's rule)."""
    cfg = smollm2_like(num_attention_heads=4, num_key_value_heads=1)
    assert [(p.q_heads, p.kv_heads) for p in plan_partitions(cfg, 2)] == [(range(0, 2), range(0, 1)),
                                                                         (range(2, 4), range(0, 1))]
    cfg = smollm2_like(num_attention_heads=8, num_key_value_heads=2)
    assert [p.kv_heads for p in plan_partitions(cfg, 4)] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]


@pytest.mark.parametrize("heads, kv, n, match", [
    (9, 3, 10, "more than the model's 9 attention heads"),
    (6, 2, 3, "multiple of the KV heads"),
    (6, 1, 4, "divide the attention heads"),
])
def test_plan_refuses_splits_that_do_not_fit(heads, kv, n, match):
    with pytest.raises(ValueError, match=match):
        plan_partitions(smollm2_like(num_attention_heads=heads, num_key_value_heads=kv), n)


def test_cpu_shares_pin_each_worker_to_its_own_cores():
    assert cpu_shares(2, [0, 1]) == [[0], [1]]
    assert cpu_shares(2, [0, 1, 2, 3, 4]) == [[0, 1], [2, 3]]
    assert cpu_shares(3, [0, 1]) == [None, None, None]  # fewer cores than workers: no pinning


# --- the shards ---------------------------------------------------------------------------

def test_shards_put_back_together_are_the_checkpoint():
    """Every worker's share of a random checkpoint: row splits (q/k/v, gate/up, embedding)
    concatenate back to the tensor, column splits (o_proj, down_proj) likewise on the input axis."""
    cfg = smollm2_like(num_hidden_layers=1, vocab_size=101, hidden_size=64, intermediate_size=96,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    rng = np.random.default_rng(0)
    from refengine.models.llama import LlamaForCausalLM

    full = {name: rng.standard_normal(shape).astype(np.float32)
            for name, shape in LlamaForCausalLM.checkpoint_shapes(cfg).items()}
    parts = plan_partitions(cfg, 2)
    shards = [shard_checkpoint(dict(full), cfg, p) for p in parts]
    L = "model.layers.0."
    for name in ("model.embed_tokens.weight", L + "self_attn.q_proj.weight", L + "self_attn.k_proj.weight",
                 L + "self_attn.v_proj.weight", L + "mlp.gate_proj.weight", L + "mlp.up_proj.weight"):
        np.testing.assert_array_equal(np.concatenate([s[name] for s in shards]), full[name], err_msg=name)
    for name in (L + "self_attn.o_proj.weight", L + "mlp.down_proj.weight"):
        np.testing.assert_array_equal(np.concatenate([s[name] for s in shards], axis=1), full[name], err_msg=name)
    for name in ("model.norm.weight", L + "input_layernorm.weight"):
        assert all(s[name] is full[name] for s in shards)  # replicated, not copied
    assert shards[1][L + "self_attn.q_proj.weight"].shape == (2 * 16, 64)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q6_K"])
def test_gguf_columns_cut_on_block_bounds_are_the_dequantized_columns(qtype):
    """``take_columns`` keeps the stored blocks: its dequantization is the ``gguf`` package's
    dequantization of the whole row, sliced (bit for bit); a cut inside a block is refused."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize

    from tests.quant.test_gguf_blocks import random_raw

    raw = random_raw(qtype, 7, 1024, np.random.default_rng(1))
    weight = GGUFWeight.from_raw(qtype, raw, (7, 1024))
    block = weight.block_size
    whole = dequantize(raw, T[qtype]).reshape(7, 1024)
    cut = weight.take_columns(2 * block, 3 * block)
    assert cut.format == qtype and cut.shape == (7, block)
    np.testing.assert_array_equal(cut.dequantize(), whole[:, 2 * block:3 * block])
    with pytest.raises(ValueError, match="do not fall on"):
        weight.take_columns(1, block + 1)


def test_int8_columns_keep_the_row_scales():
    w = np.random.default_rng(2).standard_normal((5, 48)).astype(np.float32)
    q = Int8Weight.quantize(w)
    np.testing.assert_array_equal(q.take_columns(16, 40).dequantize(), q.dequantize()[:, 16:40])


# --- the engine ------------------------------------------------------------------------------

def test_engine_refuses_what_tensor_parallelism_cannot_run(tiny_llama_dir):
    """Named errors before any worker starts: more workers than heads, and a draft model."""
    with pytest.raises(ValueError, match="tensor_parallel_size=5 is more than the model's 4 attention heads"):
        LLM(model=str(tiny_llama_dir), tensor_parallel_size=5)
    args = EngineArgs.from_kwargs(str(tiny_llama_dir), tensor_parallel_size=2,
                                  speculative_config={"method": "draft_model", "model": str(tiny_llama_dir),
                                                      "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="does not run a draft model"):
        args.create_engine_config(*args.model_config())


@pytest.fixture(scope="module")
def tiny_one_kv_head_dir(tmp_path_factory):
    """A tiny random Llama with 4 query heads and 1 KV head (fewer KV heads than TP = 2
    workers), and an lm_head of its own (not tied)."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-1kv"), seed=3, num_hidden_layers=2,
                           num_key_value_heads=1, tie_word_embeddings=False)


@needs_mpi
def test_one_kv_head_replicated_on_two_workers_gives_the_same_logits(tiny_one_kv_head_dir):
    ids = list(np.random.default_rng(4).integers(3, 211, size=40))
    one = LLM(model=str(tiny_one_kv_head_dir), num_kv_blocks=32)
    ref = one.prompt_logits(ids)
    two = LLM(model=str(tiny_one_kv_head_dir), num_kv_blocks=32, tensor_parallel_size=2)
    try:
        assert [w["kv_heads"] for w in two.llm_engine.runner.workers] == [range(0, 1), range(0, 1)]
        got = two.prompt_logits(ids)
    finally:
        two.llm_engine.shutdown()
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5)


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
           "List three prime numbers:", "The quick brown fox", "Water boils at"]
GREEDY = SamplingParams(max_tokens=20, temperature=0.0)


@pytest.fixture(scope="module")
def smollm2_tp1(smollm2_dir):
    return LLM(model=str(smollm2_dir), num_kv_blocks=256)


@pytest.fixture(scope="module")
def smollm2_tp2(smollm2_dir):
    """The default model at TP = 2 with a 10-block pool (preemption) and a 24-token budget
    (chunked prefill)."""
    if not HAVE_MPI:
        pytest.skip("mpi4py/mpich not installed (pip install 'refengine[distributed]')")
    llm = LLM(model=str(smollm2_dir), tensor_parallel_size=2, num_kv_blocks=10, block_size=16,
              max_num_batched_tokens=24)
    yield llm
    llm.llm_engine.shutdown()


def test_default_model_logits_at_tp2_match_tp1(smollm2_tp1, smollm2_tp2):
    """Every prompt position's logits (chunks of 24 at TP = 2, one pass at TP = 1) within 1e-5
    of the logits' scale: the shares' partial sums are the only rounding that differs."""
    ids = smollm2_tp1.llm_engine.tokenizer.encode(" ".join(PROMPTS), add_special_tokens=True)[:100]
    ref, got = smollm2_tp1.prompt_logits(ids), smollm2_tp2.prompt_logits(ids)
    assert got.shape == ref.shape == (len(ids), 49152)
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err < 1e-5, err
    assert (got.argmax(-1) == ref.argmax(-1)).all()


def test_default_model_greedy_at_tp2_under_batching_chunking_and_preemption(smollm2_tp1, smollm2_tp2):
    """Six prompts at once through a pool that holds about two of them: the same greedy text
    as TP = 1 running them one by one, with preemptions, and no block left taken."""
    ref = [smollm2_tp1.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    outs = smollm2_tp2.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    engine = smollm2_tp2.llm_engine
    assert engine.metrics.total_preemptions > 0
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks


@needs_mpi
def test_q4_1_gguf_as_stored_at_tp2_matches_tp1(gguf_path):
    """The default model's own Q4_1 file: every share keeps its stored blocks (o_proj and
    down_proj cut on block bounds, none dequantized) and the logits match TP = 1 on the same file."""
    ids = list(range(1000, 1060))
    one = LLM(model=str(gguf_path), num_kv_blocks=64)
    ref = one.prompt_logits(ids)
    whole = {name: getattr(getattr(one.llm_engine.model.layers[0], name), "format", "float")
             for name in ("qkv", "o", "gate_up", "down")}
    two = LLM(model=str(gguf_path), num_kv_blocks=64, tensor_parallel_size=2)
    try:
        assert [w["layer0_formats"] for w in two.llm_engine.runner.workers] == [whole, whole]
        assert "float" not in whole.values()
        got = two.prompt_logits(ids)
    finally:
        two.llm_engine.shutdown()
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-5
    assert (got.argmax(-1) == ref.argmax(-1)).all()


def test_a_worker_that_dies_is_reported_not_waited_for(tiny_llama_dir):
    """Killing a worker mid-service: the next step raises WorkerError naming it, within seconds."""
    if not HAVE_MPI:
        pytest.skip("mpi4py/mpich not installed")
    import os
    import signal

    from refengine.core.executor import WorkerError

    llm = LLM(model=str(tiny_llama_dir), num_kv_blocks=32, tensor_parallel_size=2)
    try:
        os.kill(llm.llm_engine.runner.workers[1]["pid"], signal.SIGKILL)
        with pytest.raises(WorkerError, match="worker"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()


def test_nccl_communicator_on_a_gpu():
    """NCCL's all-reduce and all-gather (one rank per GPU); where there is no GPU, skipped."""
    try:
        import cupy

        gpus = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # no CuPy, no driver
        pytest.skip(f"no GPU here ({type(e).__name__}): the NCCL path runs where one is present")
    if gpus < 1:
        pytest.skip("no GPU here: the NCCL path runs where one is present")
    from cupy.cuda import nccl

    from refengine.parallel.communicator import NcclCommunicator

    comm = NcclCommunicator(0, 1, nccl.get_unique_id(), widths=[5])
    x = cupy.arange(10, dtype=cupy.float32).reshape(2, 5)
    np.testing.assert_array_equal(cupy.asnumpy(comm.all_reduce(x.copy())), cupy.asnumpy(x))
    np.testing.assert_array_equal(cupy.asnumpy(comm.all_gather(x)), cupy.asnumpy(x))
    comm.close()


def test_model_config_read_for_smollm2_matches_the_plan_fixture(smollm2_dir):
    """The plan's fixture config has the real model's counts (so the unit tests above test the real split)."""
    mc = read_model_config(smollm2_dir)
    real = plan_partitions(mc, 2)
    assert [(p.q_heads, p.kv_heads, p.ffn, p.vocab) for p in real] == \
        [(p.q_heads, p.kv_heads, p.ffn, p.vocab) for p in plan_partitions(smollm2_like(), 2)]
