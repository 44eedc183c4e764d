"""A whole tiny model generates through the CUDA kernels (host emulation) exactly as NumPy does."""

from __future__ import annotations

import numpy as np
import torch

from refengine import LLM, SamplingParams


def test_tiny_model_through_emulated_kernels(tiny_llama_dir):
    prompts = [list(range(3, 40)), [5, 9, 17], list(range(50, 67))]  # 37, 3 and 17 tokens: block edges at 8
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    kw = dict(block_size=8, max_num_batched_tokens=24, log_stats=False)  # chunked prefill mixed with decodes
    numpy_llm = LLM(tiny_llama_dir, attention_backend="numpy", **kw)
    emu_llm = LLM(tiny_llama_dir, attention_backend="cuda-emulated", **kw)
    want = [o.outputs[0].token_ids for o in numpy_llm.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in emu_llm.generate(prompts, params, use_tqdm=False)]
    assert got == want

    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32, attn_implementation="eager")
    ref.generation_config.eos_token_id = None
    with torch.no_grad():
        for ids, tokens in zip(prompts, got):
            out = ref.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, pad_token_id=0)
            assert out[0, len(ids):].tolist() == tokens

    ids = prompts[0]
    np.testing.assert_allclose(emu_llm.prompt_logits(ids), numpy_llm.prompt_logits(ids), rtol=1e-5, atol=1e-5)
