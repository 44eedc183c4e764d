"""Golden tests on tiny random-weight models that transformers builds, one per supported shape.

Each case builds a model with transformers, saves it as a model directory, loads it
into refengine and compares full prompt logits (float32, eager attention) and a greedy
continuation.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from tests.helpers import assert_logits_match, hf_greedy

from refengine import LLM, SamplingParams

CASES = {
    # name: (architecture, heads, kv heads, tied, rope_scaling, checkpoint dtype)
    "llama-9-3-tied": ("llama", 9, 3, True, None, torch.float32),
    "llama-14-2-untied-linear": ("llama", 14, 2, False, {"rope_type": "linear", "factor": 4.0}, torch.float32),
    "llama-8-1-llama3": ("llama", 8, 1, False, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                         torch.float32),
    "llama-4-4-bf16": ("llama", 4, 4, True, None, torch.bfloat16),
    "mistral-8-1": ("mistral", 8, 1, False, None, torch.float16),
    "qwen2-14-2-bias": ("qwen2", 14, 2, True, None, torch.float32),
    "qwen3-9-3-qknorm": ("qwen3", 9, 3, False, {"rope_type": "linear", "factor": 2.0}, torch.float32),
}


def build(kind, heads, kv_heads, tied, rope_scaling, dtype, path, seed=0, max_shard_size=None):
    import transformers as tf

    torch.manual_seed(seed)
    # transformers wants hidden_size % heads == 0; Qwen3 also gets a head_dim != hidden / heads
    common = dict(vocab_size=211, hidden_size=16 * heads, intermediate_size=80, num_hidden_layers=3,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=32 if kind == "qwen3" else 16,
                  max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
                  tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2)
    if rope_scaling is not None:
        common["rope_scaling"] = dict(rope_scaling)
    cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM), "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
           "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM), "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM)}[kind]
    if kind == "mistral":
        common["sliding_window"] = None
    cfg = cls[0](**common)
    cfg._attn_implementation = "eager"
    model = cls[1](cfg).eval()
    with torch.no_grad():  # random norms and biases, so those code paths are exercised
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    model.to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    model = model.float()  # reference in float32 from the same (rounded) weights
    return model


@pytest.mark.parametrize("backend", ["numpy", "numba"])
@pytest.mark.parametrize("case", list(CASES))
def test_tiny_model_matches_transformers(case, backend, tmp_path):
    if backend == "numba":
        pytest.importorskip("numba")
    ref = build(*CASES[case], tmp_path)
    rng = np.random.default_rng(1)
    ids = rng.integers(3, 211, size=37).tolist()
    llm = LLM(model=tmp_path, device="cpu", block_size=8, attention_backend=backend, log_stats=False)
    assert_logits_match(llm.prompt_logits(ids), ref, ids)
    out = llm.generate([ids], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(ref, ids, 12)


def test_sharded_checkpoint(tmp_path):
    ref = build("llama", 4, 2, False, None, torch.float32, tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ids = list(range(3, 30))
    assert_logits_match(LLM(model=tmp_path, log_stats=False).prompt_logits(ids), ref, ids)


def test_tied_checkpoint_that_also_ships_lm_head(tmp_path):
    ref = build("llama", 4, 2, True, None, torch.float32, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    assert "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ids = list(range(3, 20))
    assert_logits_match(LLM(model=tmp_path, log_stats=False).prompt_logits(ids), ref, ids)


# --- strict loading: each a clear error --------------------------------------------------

def test_missing_model_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(model=tmp_path / "nope", log_stats=False)


def test_unknown_architecture(tmp_path):
    build("llama", 4, 2, True, None, torch.float32, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'.*LlamaForCausalLM"):
        LLM(model=tmp_path, log_stats=False)


def test_unsupported_rope_type(tmp_path):
    build("llama", 4, 2, True, None, torch.float32, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_scaling"] = {"rope_type": "xpos", "factor": 4.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported rope scaling type 'xpos'"):
        LLM(model=tmp_path, log_stats=False)


def test_truncated_safetensors(tmp_path):
    build("llama", 4, 2, True, None, torch.float32, tmp_path)
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ValueError, match="cannot read .*model.safetensors"):
        LLM(model=tmp_path, log_stats=False)


def test_missing_unused_and_misshapen_tensors(tmp_path):
    build("llama", 4, 2, False, None, torch.float32, tmp_path)
    path = tmp_path / "model.safetensors"
    good = load_file(path)

    bad = dict(good)
    del bad["model.layers.1.mlp.up_proj.weight"]
    save_file(bad, path)
    with pytest.raises(ValueError, match="missing 1 tensor.*model.layers.1.mlp.up_proj.weight"):
        LLM(model=tmp_path, log_stats=False)

    bad = dict(good, **{"model.layers.0.extra.weight": np.zeros(3, np.float32)})
    save_file(bad, path)
    with pytest.raises(ValueError, match="unused tensor.*model.layers.0.extra.weight"):
        LLM(model=tmp_path, log_stats=False)

    bad = dict(good, **{"model.norm.weight": np.ones(47, np.float32)})
    save_file(bad, path)
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(47,\), config.json implies \(64,\)"):
        LLM(model=tmp_path, log_stats=False)
