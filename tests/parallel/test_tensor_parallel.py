"""Tensor parallelism (refengine/parallel/): the split plan, the shards, and TP = 2 against TP = 1.

TP = 2 runs two MPI worker processes (``mpiexec``, from the ``mpich`` wheel); on this
2-core machine each is pinned to one core. The end-to-end tests compare logits and greedy
continuations with the single-process engine on the same model.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest

from refengine import LLM, SamplingParams
from refengine.core import executor
from refengine.core.executor import WorkerError, cpu_shares
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

    llm = LLM(model=str(tiny_llama_dir), num_kv_blocks=32, tensor_parallel_size=2)
    try:
        os.kill(llm.llm_engine.runner.workers[1]["pid"], signal.SIGKILL)
        with pytest.raises(WorkerError, match="worker"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()


# --- start-up: nothing a neighbour on the machine can use --------------------------------

KEY = b"a neighbour must never see this!"  # the driver's authkey in these tests (32 bytes)

NEIGHBOUR_THEN_MPIEXEC = """#!{python}
# Stands in for mpiexec: a neighbour's three connections reach the driver's port first, then
# the real launcher starts the workers.
import pickle, socket, struct, subprocess, sys
from multiprocessing.connection import Client

host, port = sys.argv[-2].rsplit(":", 1)
address = (host, int(port))


class Touch:
    def __reduce__(self):  # loading this pickle creates a file
        return open, ({touched!r}, "w")


silent = socket.create_connection(address)  # connects, then says nothing
stranger = socket.create_connection(address)  # no key: a pickle where the HMAC answer goes
payload = pickle.dumps(Touch())
stranger.sendall(struct.pack("!i", len(payload)) + payload)
insider = Client(address, authkey={key!r})  # holds the key, and sends a pickle where the rank goes
insider.send(Touch())
sys.exit(subprocess.call([{mpiexec!r}, *sys.argv[1:]]))
"""


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (from each ``/proc/PID/stat``'s parent field)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # ended meanwhile
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        todo += children.get(found[-1], [])
    return found


class Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def tp2_behind_a_neighbour(tiny_llama_dir, tmp_path_factory):
    """The tiny model at TP = 2, started through :data:`NEIGHBOUR_THEN_MPIEXEC` with the key
    :data:`KEY`: ``(llm, path the neighbour's pickle would create, the driver's warnings)``."""
    if not HAVE_MPI:
        pytest.skip("mpi4py/mpich not installed (pip install 'refengine[distributed]')")
    tmp = tmp_path_factory.mktemp("neighbour")
    touched, launcher = tmp / "unpickled", tmp / "mpiexec"
    launcher.write_text(NEIGHBOUR_THEN_MPIEXEC.format(python=sys.executable, touched=str(touched), key=KEY,
                                                      mpiexec=executor.mpiexec()))
    launcher.chmod(0o755)
    warnings = Warnings()
    logging.getLogger(executor.__name__).addHandler(warnings)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(executor, "secrets", types.SimpleNamespace(token_bytes=lambda n: KEY))
        mp.setattr(executor, "mpiexec", lambda: str(launcher))
        mp.setattr(executor, "HANDSHAKE_TIMEOUT_S", 1)  # what the silent peer costs
        try:
            llm = LLM(model=str(tiny_llama_dir), num_kv_blocks=32, tensor_parallel_size=2)
        finally:
            logging.getLogger(executor.__name__).removeHandler(warnings)
    yield llm, touched, warnings.messages
    llm.llm_engine.shutdown()


def test_the_key_is_on_no_command_line_nor_in_any_environment(tp2_behind_a_neighbour):
    """While the workers run, no process of the launch (launcher, mpiexec, MPICH's proxy, the
    ranks) has the key on its command line (any local user can read ``/proc/PID/cmdline``)
    or in its environment (MPICH sends the environment over its control socket); the key
    file whose path the launch carries is gone."""
    llm, _, _ = tp2_behind_a_neighbour
    runner = llm.llm_engine.runner
    pids = descendants(runner._launcher.pid)
    assert {w["pid"] for w in runner.workers} <= set(pids)  # the ranks are among those read
    for pid in pids:
        for part in ("cmdline", "environ"):
            text = Path(f"/proc/{pid}/{part}").read_bytes()
            assert KEY not in text and KEY.hex().encode() not in text, (pid, part)
    key_file = Path(f"/proc/{runner._launcher.pid}/cmdline").read_bytes().split(b"\0")[-2].decode()
    assert "refengine-tp-key-" in key_file and not Path(key_file).exists()


def test_peers_that_do_not_prove_the_key_are_dropped_and_nothing_is_unpickled(tp2_behind_a_neighbour):
    """A silent peer, one that sends a pickle instead of the HMAC answer, and one that holds
    the key but sends a pickle as its rank all reach the driver before the workers: each is
    dropped (the last because the rank is read as bytes, never unpickled), the pickle's
    ``open(path, "w")`` never runs, and the two real workers start."""
    llm, touched, warnings = tp2_behind_a_neighbour
    assert not touched.exists()
    assert [w["rank"] for w in llm.llm_engine.runner.workers] == [0, 1]
    assert len(warnings) == 3, warnings
    assert "(TimeoutError: no answer in 1 s)" in warnings[0]
    assert "(AuthenticationError: digest received was wrong)" in warnings[1]
    assert "OSError: bad message length" in warnings[2]  # a pickle is longer than a rank's 8 digits
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


@pytest.mark.parametrize("script, timeout_s, message", [
    ("exit 3", 60, "mpiexec exited with code 3 before the tensor-parallel workers connected"),
    ("exec sleep 60", 1, "tensor-parallel workers did not connect in 1 s"),
])
def test_a_launch_that_fails_or_never_connects_raises_worker_error(tiny_llama_dir, tmp_path, monkeypatch,
                                                                   script, timeout_s, message):
    """A launcher that exits at once (seen at once, not at the deadline), or one that runs but
    starts no worker (``STARTUP_TIMEOUT_S`` applies): ``LLM(...)`` raises WorkerError within
    seconds, not a hang; the launcher is gone and so is the key file."""
    launcher = tmp_path / "mpiexec"
    launcher.write_text(f'#!/bin/sh\necho $$ > "{tmp_path}/pid"\nprintf "%s\\n" "$@" > "{tmp_path}/args"\n{script}\n')
    launcher.chmod(0o755)
    monkeypatch.setattr(executor, "mpiexec", lambda: str(launcher))
    monkeypatch.setattr(executor, "STARTUP_TIMEOUT_S", timeout_s)
    start = time.monotonic()
    with pytest.raises(WorkerError, match=message):
        LLM(model=str(tiny_llama_dir), num_kv_blocks=32, tensor_parallel_size=2)
    assert time.monotonic() - start < 10
    assert not Path(f"/proc/{(tmp_path / 'pid').read_text().strip()}").exists()  # killed and reaped
    key_file = (tmp_path / "args").read_text().split("\n")[-2]
    assert "refengine-tp-key-" in key_file and not Path(key_file).exists()


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
