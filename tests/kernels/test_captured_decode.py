"""Captured decode steps (refengine.cpu.capture): a recording of each family's own forward, replayed bit for bit.

Every registered family, as a tiny random model that transformers builds (sliding windows of 8
tokens inside every context here, soft-caps, Gemma's scalings, q/k norms), decodes token by
token through its capture and through the forward on the same inputs: the logits must be the
same bits at every step, across numba thread changes (the step is recorded again) and a window
that starts sliding. The engine-level cases run the real files: SmolLM2's Q4_1 GGUF with Q8_0
activations and float32, float16 and int8 caches over the decode kernel's partition boundaries,
and requests that preempt one another.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")

from refengine import LLM, SamplingParams  # noqa: E402
from refengine.attention import paged_metadata  # noqa: E402
from refengine.cpu import capture as capture_module  # noqa: E402
from refengine.cpu.attention import DECODE_PARTITION, SERIAL_DECODE_MAX_TOKENS  # noqa: E402
from refengine.cpu.layer_ops import NumbaOps  # noqa: E402
from refengine.cpu.threads import use_threads  # noqa: E402
from refengine.models.registry import MODEL_REGISTRY  # noqa: E402

WINDOW = 8
COMMON = dict(vocab_size=211, hidden_size=64, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1,
              eos_token_id=2, tie_word_embeddings=False)
# architecture -> (transformers config class, the settings that differ from COMMON)
FAMILIES = {
    "LlamaForCausalLM": ("LlamaConfig", {}),
    "MistralForCausalLM": ("MistralConfig", dict(sliding_window=WINDOW)),
    "Qwen2ForCausalLM": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "Qwen3ForCausalLM": ("Qwen3Config", dict(tie_word_embeddings=True)),
    "Gemma2ForCausalLM": ("Gemma2Config", dict(sliding_window=WINDOW, query_pre_attn_scalar=16,
                                               attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    "Gemma3ForCausalLM": ("Gemma3TextConfig", dict(sliding_window=WINDOW, query_pre_attn_scalar=16, tie_word_embeddings=True,
                                                   layer_types=["sliding_attention", "full_attention",
                                                                "sliding_attention"])),
    "Olmo2ForCausalLM": ("Olmo2Config", {}),
    "Phi3ForCausalLM": ("Phi3Config", dict(sliding_window=WINDOW, pad_token_id=0)),
}


def test_every_registered_family_is_covered():
    assert set(FAMILIES) == set(MODEL_REGISTRY)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_dir(request, tmp_path_factory):
    """A tiny random model of the family saved by transformers (random norm weights)."""
    torch = pytest.importorskip("torch")
    import transformers as tf

    torch.manual_seed(0)
    config_cls, settings = FAMILIES[request.param]
    cfg = getattr(tf, config_cls)(**dict(COMMON, **settings))
    model = getattr(tf, request.param)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.5 + 0.2 * torch.randn_like(p))
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path, safe_serialization=True)
    return path


def _step(block_table: np.ndarray, position: int, block_size: int):
    """The metadata of one decode token at ``position`` of a sequence over ``block_table``."""
    return paged_metadata(np.array([1]), np.array([position + 1]), block_table[None, :], block_size)


def test_each_family_replays_its_forward_bit_for_bit(family_dir):
    """A 20-token prompt, then 30 greedy tokens decoded through the capture and through the
    forward on the same inputs: the same logits bits at every step, on one numba thread and on
    two (each change records the step again), with every sliding window inside the context."""
    llm = LLM(model=str(family_dir), max_model_len=128, enable_prefix_caching=False, num_threads=2)
    engine = llm.llm_engine
    model, kv, capture = engine.model, engine.kv_cache, engine.runner.decode_capture
    assert isinstance(capture, capture_module.DecodeCapture)
    bs = kv.block_size
    table = np.arange(-(-128 // bs), dtype=np.int32)
    prompt = np.random.default_rng(1).integers(3, 211, size=20)
    meta = paged_metadata(np.array([20]), np.array([20]), table[None, :], bs)
    logits = model.forward(prompt, np.arange(20), kv, meta, np.array([19]))
    token, recordings = int(np.argmax(logits[0])), 0
    for i, position in enumerate(range(20, 50)):
        use_threads(1, 1 + (i // 10) % 2)  # 1, 2, 1 threads over the steps
        ids, pos, meta = np.array([token]), np.array([position]), _step(table, position, bs)
        before = capture.tape
        captured = capture(ids, pos, meta)
        recordings += capture.tape is not before
        eager = model.forward(ids, pos, kv, meta, np.array([0]))
        np.testing.assert_array_equal(captured, eager)
        token = int(np.argmax(eager[0]))
    assert capture.declined is None
    assert recordings == 3  # the first step and each thread change: the window sliding needs none here


def test_a_window_that_starts_sliding_is_recorded_again(family_dir):
    """Contexts below, at and past a window larger than the prompt (8 -> 24 here: the sliding
    layers' partitions change when the window first cuts the context): the same bits, and a
    recording per change of the attention's work list."""
    if "Gemma3" not in family_dir.name:
        pytest.skip("one windowed family is enough")
    import json

    cfg = json.loads((family_dir / "config.json").read_text())
    cfg["sliding_window"] = 24
    (family_dir / "config.json").write_text(json.dumps(cfg))
    llm = LLM(model=str(family_dir), max_model_len=128, enable_prefix_caching=False, num_threads=1)
    engine = llm.llm_engine
    model, kv, capture = engine.model, engine.kv_cache, engine.runner.decode_capture
    bs = kv.block_size
    table = np.arange(-(-128 // bs), dtype=np.int32)
    meta = paged_metadata(np.array([16]), np.array([16]), table[None, :], bs)
    token = int(np.argmax(model.forward(np.arange(3, 19), np.arange(16), kv, meta, np.array([15]))[0]))
    tapes = set()
    for position in range(16, 40):
        ids, pos, meta = np.array([token]), np.array([position]), _step(table, position, bs)
        captured = capture(ids, pos, meta)
        tapes.add(id(capture.tape))
        eager = model.forward(ids, pos, kv, meta, np.array([0]))
        np.testing.assert_array_equal(captured, eager)
        token = int(np.argmax(eager[0]))
    assert len(tapes) == 2  # the window inside every context (till 24), then cutting it


def _greedy(llm: LLM, prompts: list[list[int]], n: int):
    """Token ids and every step's top-2 log-probabilities of greedy runs."""
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [sorted(step.items()) for step in o.outputs[0].logprobs]) for o in outs]


def _count_calls(monkeypatch) -> list[int]:
    calls = [0]
    step = capture_module.DecodeCapture.__call__

    def counted(self, *args):
        calls[0] += 1
        return step(self, *args)

    monkeypatch.setattr(capture_module.DecodeCapture, "__call__", counted)
    return calls


# Prompt lengths and greedy tokens of the engine-level runs: contexts 125-132 cross the KV block
# starting at 128 and the decode partition added at 129; contexts 253-260 the parallel decode
# kernel from 256, a block at 256 and a partition added at 257. The steps between two boundaries
# replay one recording, as the few here do; a longer run would repeat them.
BOUNDARY_PROMPTS, BOUNDARY_TOKENS = (124, 252), 8


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "float16", "int8"])
def test_captured_steps_give_the_forward_bits(gguf_path, kv_cache_dtype, monkeypatch):
    """SmolLM2's Q4_1 file with Q8_0 activations on two threads: a 124-token and a 252-token
    prompt, one after the other, each then 8 greedy tokens (contexts 125-132 and 253-260:
    partitions of 128 tokens added at 129 and 257, the parallel decode kernel from 256, new
    blocks at 128 and 256) give the same tokens and log-probabilities captured and eager.

    One engine runs both: captured, then with its runner's ``decode_capture`` set to None,
    which is what ``enforce_eager=True`` builds (checked on the tiny model in
    :func:`test_preempted_requests_resume_with_the_same_bits`); the same weights, pool and
    kernels, and a second engine would cost a load and a warm-up more."""
    assert DECODE_PARTITION == 128 and SERIAL_DECODE_MAX_TOKENS == 256  # the boundaries the runs cross
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 40000, n).tolist() for n in BOUNDARY_PROMPTS]
    llm = LLM(model=str(gguf_path), activation_dtype="q8_0", kv_cache_dtype=kv_cache_dtype, max_model_len=512,
              enable_prefix_caching=False, num_threads=2)
    runner = llm.llm_engine.runner
    runs = {}
    for eager in (False, True):
        if eager:
            runner.decode_capture = None
        assert (runner.decode_capture is None) == eager
        calls = _count_calls(monkeypatch)
        runs[eager] = [_greedy(llm, [prompt], BOUNDARY_TOKENS) for prompt in prompts]  # batch-1 steps: one at a time
        assert calls[0] == (0 if eager else len(prompts) * (BOUNDARY_TOKENS - 1))  # every step after the prompt's
    assert runs[False] == runs[True]


def test_preempted_requests_resume_with_the_same_bits(tiny_llama_tok_dir, monkeypatch):
    """Three requests in a pool too small for all of them: preemption by recompute, batch-1
    steps replayed from the capture whenever one sequence runs alone; the eager tokens and
    log-probabilities."""
    prompts = [list(range(3, 3 + n)) for n in (30, 21, 12)]
    kwargs = dict(max_model_len=72, enable_prefix_caching=False, num_kv_blocks=9, block_size=8, max_num_seqs=3)
    eager_llm = LLM(model=str(tiny_llama_tok_dir), enforce_eager=True, **kwargs)
    assert eager_llm.llm_engine.runner.decode_capture is None
    eager = _greedy(eager_llm, prompts, 40)
    llm = LLM(model=str(tiny_llama_tok_dir), **kwargs)
    calls = _count_calls(monkeypatch)
    assert _greedy(llm, prompts, 40) == eager
    assert llm.llm_engine.metrics.total_preemptions > 0 and calls[0] > 0


def test_bad_steps_raise_the_forward_errors_and_the_engine_serves_on(tiny_llama_tok_dir):
    llm = LLM(model=str(tiny_llama_tok_dir), max_model_len=64, enable_prefix_caching=False, num_kv_blocks=8,
              block_size=16)
    engine = llm.llm_engine
    capture = engine.runner.decode_capture
    ids, pos = np.array([5]), np.array([20])

    def meta(table, seq_len=21, q_lens=(1,)):
        return paged_metadata(np.array(q_lens), np.array([seq_len] * len(q_lens)), np.array([table] * len(q_lens),
                                                                                              np.int32), 16)

    capture(ids, pos, meta([0, 1]))  # recorded: the checks below run before a replay
    with pytest.raises(ValueError, match="block ids"):
        capture(ids, pos, meta([8, 0]))  # block 8 of a pool of 8 (the slot, in block 0, is fine)
    with pytest.raises(IndexError, match="RoPE"):
        capture(ids, np.array([10_000]), meta([0, 1]))
    with pytest.raises(ValueError, match="one sequence with one new token"):
        capture(ids, pos, meta([0, 1], q_lens=(1, 1)))
    with pytest.raises(ValueError, match="max_model_len"):
        capture(ids, np.array([128]), meta(list(range(9)), seq_len=129))  # the pool holds 128 tokens
    # the engine serves on after a failed step (the capture holds no state of a step)
    out = llm.generate([list(range(3, 20))], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_a_forward_the_tape_cannot_replay_runs_eagerly(tiny_llama_tok_dir):
    """A NumPy function other than a ufunc on an activation (here ``np.concatenate`` in the
    final logits) cannot be replayed: the capture declines, and its steps run the forward."""
    llm = LLM(model=str(tiny_llama_tok_dir), max_model_len=64, enable_prefix_caching=False)
    model = llm.llm_engine.model
    final = model.final_logits
    model.final_logits = lambda h: np.concatenate([final(h)])
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tokens = llm.generate([list(range(3, 20))], params, use_tqdm=False)[0].outputs[0].token_ids
    assert "concatenate" in llm.llm_engine.runner.decode_capture.declined
    eager = LLM(model=str(tiny_llama_tok_dir), max_model_len=64, enable_prefix_caching=False, enforce_eager=True)
    assert tokens == eager.generate([list(range(3, 20))], params, use_tqdm=False)[0].outputs[0].token_ids


def test_only_recording_backends_are_captured(tiny_llama_tok_dir):
    llm = LLM(model=str(tiny_llama_tok_dir), max_model_len=64, attention_backend="numpy")
    assert llm.llm_engine.runner.decode_capture is None


def test_bind_linear_checks_both_widths():
    """A float32 weight ``[in, out]``: an input of another width is refused, not read past."""
    w = np.zeros((8, 4), np.float32)
    ops = NumbaOps()
    with pytest.raises(ValueError, match="bind_linear"):
        ops.bind_linear(np.zeros((1, 9), np.float32), w, np.zeros((1, 4), np.float32))
    with pytest.raises(ValueError, match="bind_linear"):
        ops.bind_linear(np.zeros((1, 8), np.float32), w, np.zeros((1, 5), np.float32))
    x, out = np.ones((1, 8), np.float32), np.zeros((1, 4), np.float32)
    w[:, 2] = 0.5
    ops.bind_linear(x, w, out)()
    np.testing.assert_array_equal(out, [[0.0, 0.0, 4.0, 0.0]])
