"""Golden tests for the families beyond Llama: Gemma 2, Gemma 3, OLMo 2, Phi-3, and the
sliding windows of Mistral and Qwen2, on tiny random-weight models that transformers builds.

Every code path is switched on where transformers' defaults would leave it dormant: windows
shorter than the prompt, soft-caps small enough to bend the scores, head_dim 96 and 256,
random norm weights. Each case compares the whole prompt's logits (float32, eager) and a
greedy continuation; the sliding-window cases also run under chunked prefill with chunks
below, at and above the window, and token by token.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tests.helpers import assert_logits_match, hf_greedy

from refengine import LLM, SamplingParams

WINDOW = 8  # shorter than every prompt below

# family -> (config class, model class, the settings that differ from COMMON)
FAMILIES = {
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(head_dim=256, sliding_window=WINDOW, query_pre_attn_scalar=64, attn_logit_softcapping=2.0,
                    final_logit_softcapping=3.0, tie_word_embeddings=True)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(head_dim=256, sliding_window=WINDOW, query_pre_attn_scalar=64, num_hidden_layers=4,
                    tie_word_embeddings=True,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
                    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             dict(hidden_size=192, num_attention_heads=2, num_key_value_heads=1, sliding_window=WINDOW,
                  pad_token_id=0)),  # head_dim 96
    "phi3-longrope": ("Phi3Config", "Phi3ForCausalLM",
                      dict(hidden_size=192, num_attention_heads=2, num_key_value_heads=1, pad_token_id=0,
                           original_max_position_embeddings=32,
                           rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + i / 48 for i in range(48)],
                                         "long_factor": [1.0 + i / 6 for i in range(48)]})),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=WINDOW,
                                                      max_window_layers=1)),
}
# head_dim 32 where a family does not set its own: the smallest the CUDA kernels are compiled for
COMMON = dict(vocab_size=211, hidden_size=128, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False)
WINDOWED = ("gemma2", "gemma3", "phi3", "mistral", "qwen2")


def build(family: str, path, seed: int = 0):
    """Save a tiny random model of ``family`` to ``path``; return transformers' float32 model."""
    import transformers as tf

    torch.manual_seed(seed)
    config_cls, model_cls, settings = FAMILIES[family]
    cfg = getattr(tf, config_cls)(**dict(COMMON, **settings))
    cfg._attn_implementation = "eager"
    model = getattr(tf, model_cls)(cfg).eval()
    with torch.no_grad():  # random norms: Gemma's (1 + w) and the post-norms are exercised
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((0.0 if family.startswith("gemma") else 1.0) + 0.2 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, build(request.param, path)


def prompt(n: int, seed: int = 1) -> list[int]:
    return np.random.default_rng(seed).integers(3, 211, size=n).tolist()


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_family_matches_transformers(family, backend):
    name, path, ref = family
    ids = prompt(37)  # several windows long; past longrope's original context of 32 (its long factors)
    llm = LLM(model=path, device="cpu", block_size=8, attention_backend=backend, log_stats=False)
    assert_logits_match(llm.prompt_logits(ids), ref, ids)
    out = llm.generate([ids], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(ref, ids, 12)


@pytest.mark.parametrize("chunk", [WINDOW - 3, WINDOW, WINDOW + 5])
def test_window_under_chunked_prefill_and_batching(family, chunk):
    """Chunks below, at and above the window, batched with a second request: the same tokens
    as transformers, and the same as the engine alone."""
    name, path, ref = family
    if name not in WINDOWED:
        pytest.skip("no sliding window")
    ids, other = prompt(3 * WINDOW + 1), prompt(19, seed=2)
    llm = LLM(model=path, device="cpu", block_size=4, attention_backend="numba", enable_chunked_prefill=True,
              max_num_batched_tokens=chunk, log_stats=False)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = llm.generate([ids, other], params, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == hf_greedy(ref, ids, 8)
    assert outs[1].outputs[0].token_ids == hf_greedy(ref, other, 8)


def test_prefill_equals_token_by_token_decode(family):
    """A prompt three windows long: its logits from one prefill, from chunks below, at and
    above the window, and from a budget of one token per step (every row through the decode
    path), agree."""
    name, path, _ = family
    ids = prompt(3 * WINDOW)
    whole = LLM(model=path, device="cpu", block_size=4, log_stats=False).prompt_logits(ids)
    for backend in ("numpy", "numba"):
        for budget in (1, WINDOW - 3, WINDOW, WINDOW + 5):
            chunked = LLM(model=path, device="cpu", block_size=4, attention_backend=backend, log_stats=False,
                          enable_chunked_prefill=True, max_num_batched_tokens=budget).prompt_logits(ids)
            np.testing.assert_allclose(chunked, whole, rtol=1e-5, atol=1e-5 * np.abs(whole).max(),
                                       err_msg=f"{backend}, {budget} tokens per step")


def test_emulated_cuda_backend_gives_the_same_tokens(family):
    """The CUDA kernels (on the CPU emulator, float32) at this family's head size, window and caps."""
    name, path, ref = family
    ids = prompt(2 * WINDOW + 3)
    llm = LLM(model=path, device="cpu", block_size=8, attention_backend="cuda-emulated", log_stats=False)
    out = llm.generate([ids], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(ref, ids, 6)
