"""A whole tiny model generates through the CUDA kernels (host emulation) exactly as NumPy does."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tests.helpers import fake_cupy

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


def fake_cupy_for_the_model():
    """The stand-in CuPy of helpers.py (RawModule launches run the CPU emulator),
    widened to the array functions the model uses, so the whole ``device="cuda"`` code
    path runs here: everything but NVRTC compilation and cuBLAS."""
    import types

    cp = fake_cupy()
    cp.__getattr__ = lambda name: getattr(np, name)  # PEP 562: the rest of the array API
    cp.zeros = lambda shape, dtype=np.float32: np.zeros(shape, dtype).view(cp.ndarray)

    class Pool:
        def total_bytes(self):
            return 0

        def free_all_blocks(self):
            pass

    cp.get_default_memory_pool = Pool
    cp.cuda.runtime.memGetInfo = lambda: (1 << 30, 2 << 30)
    cp.cuda.Device = lambda: types.SimpleNamespace(id=0, synchronize=lambda: None)
    return cp


def test_tiny_model_on_the_cupy_code_path(tiny_llama_dir, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "cupy", fake_cupy_for_the_model())
    prompts = [list(range(3, 40)), [5, 9, 17]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in
            LLM(tiny_llama_dir, block_size=8, log_stats=False).generate(prompts, params, use_tqdm=False)]
    gpu = LLM(tiny_llama_dir, device="cuda", dtype="float32", block_size=8, max_num_batched_tokens=24,
              log_stats=False)
    engine = gpu.llm_engine
    assert engine.device == "cuda" and engine.attention_backend == "cuda"
    assert engine.model.ops.name == "cuda"  # RMSNorm, RoPE and SiLU-and-mul run as (emulated) kernels too
    # 1 GiB usable (2 GiB x 0.9 - 1 GiB in use) over 3 layers x 2 x 8 x 2 heads x 32 x 4 bytes per block
    assert engine.config.num_kv_blocks == int((2 * 0.9 - 1) * 2**30) // (3 * 2 * 8 * 2 * 32 * 4)
    got = [o.outputs[0].token_ids for o in gpu.generate(prompts, params, use_tqdm=False)]
    assert got == want
    half = LLM(tiny_llama_dir, device="cuda", dtype="float16", block_size=8, num_kv_blocks=32, log_stats=False)
    assert half.llm_engine.kv_cache.k[0].dtype == np.float16
    out = half.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [8, 8]


def test_dtype_rules(tiny_llama_dir):
    with pytest.raises(ValueError, match="dtype='float16' is not supported on the CPU"):
        LLM(tiny_llama_dir, dtype="float16", log_stats=False)
    with pytest.raises(ValueError, match="dtype='int8' is not one of"):
        LLM(tiny_llama_dir, dtype="int8", log_stats=False)
