"""LoRA adapters (refengine/lora.py) against transformers + peft, on tiny random models of two
families (Llama; Qwen3, whose q/k norms follow the adapted q/k projection). The adapters are
made here by peft with random, non-zero B (``init_lora_weights=False``): adapter "a" on every
attention and MLP projection with rsLoRA; adapter "b" on q/v/down of layer 1 only, with an
``alpha_pattern``. Each is checked alone, and in one step with a request on the other adapter
and one on the base model; the prefix cache keeps their blocks apart; bad adapters are refused."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import random_adapter

from refengine import LLM, LoRARequest, SamplingParams

FAMILIES = {"llama": ("LlamaConfig", "LlamaForCausalLM", {}),
            "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32))}
COMMON = dict(vocab_size=211, hidden_size=128, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = {"a": [5, 17, 42, 99, 3, 150, 7, 64, 33, 120, 8, 77, 19, 200, 45, 61, 90],
           "b": [9, 14, 88, 101, 6, 37, 140, 52, 11, 73, 166],
           None: [12, 44, 130, 7, 58, 91, 23, 176, 4, 65, 38, 102, 27]}
MAX_TOKENS = 4


def adapter_configs():
    from peft import LoraConfig

    return {"a": LoraConfig(r=4, lora_alpha=8, target_modules=ALL, use_rslora=True, init_lora_weights=False),
            "b": LoraConfig(r=2, lora_alpha=6, target_modules=["q_proj", "v_proj", "down_proj"],
                            layers_to_transform=[1], alpha_pattern={"down_proj": 3}, init_lora_weights=False)}


def hf_run(model, ids):
    """transformers' logits over ``ids`` and its greedy continuation (MAX_TOKENS tokens)."""
    out = list(ids)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].numpy()
        for _ in range(MAX_TOKENS):
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return logits, out[len(ids):]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(base dir, {adapter: LoRARequest}, {adapter or None: (prompt logits, greedy tokens)} from
    transformers + peft on that adapter's prompt)."""
    import transformers as tf
    from peft import get_peft_model

    torch.manual_seed(0)
    config_cls, model_cls, settings = FAMILIES[request.param]
    cfg = getattr(tf, config_cls)(**dict(COMMON, **settings))
    cfg._attn_implementation = "eager"
    base = getattr(tf, model_cls)(cfg).eval()
    path = tmp_path_factory.mktemp(f"lora-{request.param}")
    base.save_pretrained(path / "base", safe_serialization=True)
    refs = {None: hf_run(base, PROMPTS[None])}
    loras = {}
    for i, (name, lora_cfg) in enumerate(adapter_configs().items(), 1):
        torch.manual_seed(i)
        peft_model = get_peft_model(copy.deepcopy(base), lora_cfg).eval()
        peft_model.save_pretrained(path / name)
        refs[name] = hf_run(peft_model, PROMPTS[name])
        loras[name] = LoRARequest(name, i, str(path / name))
    return path / "base", loras, refs


@pytest.fixture(scope="module")
def engines(family):
    """One engine with enable_lora and one without, on the numba backend, shared by the tests."""
    base = family[0]
    return (LLM(str(base), enable_lora=True, num_kv_blocks=32, log_stats=False),
            LLM(str(base), num_kv_blocks=32, log_stats=False))


def assert_close(ours, want):
    np.testing.assert_allclose(ours, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_each_adapter_alone_matches_peft(family, engines, backend):
    base, loras, refs = family
    llm = engines[0] if backend == "numba" else LLM(str(base), enable_lora=True, attention_backend=backend,
                                                    num_kv_blocks=32, log_stats=False)
    for name in ("a", "b", None):
        logits = llm.prompt_logits(PROMPTS[name], lora_request=loras.get(name))
        assert_close(logits, refs[name][0])
        np.testing.assert_array_equal(logits.argmax(-1), refs[name][0].argmax(-1))
    for name in ("a", "b"):  # each adapter moves the logits well past the tolerance
        assert np.abs(llm.prompt_logits(PROMPTS[name]) - refs[name][0]).max() > 0.05


def test_adapters_and_base_in_one_step(family, engines):
    """Three requests, adapters a and b and none, prefilled in one step and decoded together:
    each one's greedy tokens and prompt log-probabilities are peft's, and the base request's
    are the same bits as in an engine without adapters."""
    base, loras, refs = family
    llm, plain = engines
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    engine = llm.llm_engine
    for name in ("a", "b", None):
        engine.add_request(f"r-{name}", PROMPTS[name], params, lora_request=loras.get(name))
    first = engine.step()  # all three prompts in the one step
    assert {o.request_id for o in first} == {"r-a", "r-b", "r-None"}
    outs = {o.request_id: o for o in first}
    prompt_lps = {o.request_id: o.prompt_logprobs for o in first}  # sent once, with the prefill
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step()})
    for name in ("a", "b", None):
        out = outs[f"r-{name}"]
        assert out.outputs[0].token_ids == refs[name][1], name
        ids = PROMPTS[name]
        want = torch.log_softmax(torch.tensor(refs[name][0]), -1).numpy()
        got = [entry[ids[p]].logprob for p, entry in enumerate(prompt_lps[f"r-{name}"]) if entry is not None]
        np.testing.assert_allclose(got, [want[p - 1, ids[p]] for p in range(1, len(ids))], rtol=1e-4, atol=1e-4)
    alone = plain.generate([PROMPTS[None]], params, use_tqdm=False)[0]
    assert alone.outputs[0].token_ids == outs["r-None"].outputs[0].token_ids
    assert ([e and {t: lp.logprob for t, lp in e.items()} for e in alone.prompt_logprobs]
            == [e and {t: lp.logprob for t, lp in e.items()} for e in prompt_lps["r-None"]])


def test_prefix_cache_keys_blocks_by_adapter(family, engines):
    """The same one-block prompt (block_size 16) under a, a again, b, the base, the base again:
    only the repeats hit."""
    base, loras, refs = family
    llm = engines[0]
    assert llm.reset_prefix_cache()
    params = SamplingParams(max_tokens=1, temperature=0.0)
    cached = [llm.generate([PROMPTS["a"]], params, use_tqdm=False, lora_request=lora)[0].num_cached_tokens
              for lora in (loras["a"], loras["a"], loras["b"], None, None)]
    assert cached == [0, 16, 0, 0, 16]


def test_int8_weights_with_an_adapter(family, engines):
    """The adapter on top of int8 weights: within int8's distance of the float32 run, and far
    from the int8 base (the product is added, not merged)."""
    base, loras, _ = family
    ids = PROMPTS["a"]
    int8 = LLM(str(base), enable_lora=True, quantization="int8", num_kv_blocks=32, log_stats=False)
    want = engines[0].prompt_logits(ids, lora_request=loras["a"])
    got = int8.prompt_logits(ids, lora_request=loras["a"])
    assert np.abs(got - want).max() < 0.05 < np.abs(int8.prompt_logits(ids) - got).max()


def test_bad_adapters_are_refused(family, engines, tmp_path):
    from refengine.lora import LoRAManager

    base, loras, _ = family
    llm, plain = engines
    engine = llm.llm_engine
    with pytest.raises(ValueError, match=r"rank r=4 is above max_lora_rank=3"):
        LoRAManager(engine.model, max_lora_rank=3).add(loras["a"])
    with pytest.raises(ValueError, match="has no adapter_config.json"):
        engine.add_request("x", [1, 2], lora_request=LoRARequest("none", 7, str(tmp_path)))
    dora = tmp_path / "dora"
    dora.mkdir()
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        (dora / f).write_bytes((Path(loras["b"].lora_path) / f).read_bytes())
    cfg = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps(dict(cfg, use_dora=True)))
    with pytest.raises(ValueError, match="use_dora=True: DoRA"):
        engine.add_request("x", [1, 2], lora_request=LoRARequest("dora", 8, str(dora)))
    with pytest.raises(ValueError, match="lora_int_id=2 is loaded as 'b'"):
        engine.add_request("y", [1, 2], lora_request=LoRARequest("other", 2, str(dora)))
    assert [r.lora_name for r in engine.list_loras()] == ["a", "b"]
    assert not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="needs an engine with enable_lora=True"):
        plain.llm_engine.add_request("x", [1, 2], lora_request=loras["b"])
    with pytest.raises(ValueError, match="lora_int_id=0 is invalid"):
        LoRARequest("z", 0, "/p")


def test_gguf_blocks_with_an_adapter(gguf_path, smollm2_dir, tmp_path):
    """The default model's Q4_1 GGUF file as stored, with a random adapter: its logits are the
    converted float32 directory's (the same weights, dequantized) with the same adapter."""
    lora = LoRARequest("random", 1, str(random_adapter(tmp_path / "random", smollm2_dir)))
    ids = [1, 504, 3458, 282, 4649, 314, 253, 1345, 28, 1978, 30, 378, 2817, 19, 2088, 314]
    # a small pool and context, no captured decode: the cheapest engines of the default model
    options = dict(enable_lora=True, num_kv_blocks=4, max_model_len=32, enforce_eager=True, log_stats=False)
    blocks, dense = LLM(str(gguf_path), **options), LLM(str(smollm2_dir), **options)
    got, want = blocks.prompt_logits(ids, lora_request=lora), dense.prompt_logits(ids, lora_request=lora)
    assert np.abs(got - want).max() <= 1e-4 * max(1.0, np.abs(want).max())
    assert np.abs(blocks.prompt_logits(ids) - got).max() > 0.1
