"""Golden tests on the real model: refengine against transformers loading the same GGUF.

transformers dequantizes the Q4_1 GGUF itself and undoes llama.cpp's q/k permutation on
its own, so agreement here checks our converter and our forward pass together.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from refengine import LLM, SamplingParams

PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes "
          "Gutenberg combined movable type with an oil-based ink and a wooden press.")


@pytest.fixture(scope="module")
def hf_model(gguf_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32,
                                                 attn_implementation="eager")
    model.eval()
    return model


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    return LLM(model=smollm2_dir, device="cpu", block_size=16, log_stats=False)


def hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def test_prompt_logits_match_transformers(llm, hf_model):
    ids = llm.get_tokenizer().encode(PROMPT)
    assert len(ids) >= 20
    ours = llm.prompt_logits(ids)
    ref = hf_logits(hf_model, ids)
    assert ours.shape == ref.shape == (len(ids), 49152)
    assert np.abs(ours - ref).max() <= 1e-3
    np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))


def test_greedy_continuation_matches_transformers(llm, hf_model):
    ids = llm.get_tokenizer().encode("The capital of France is")
    hf_model.generation_config.eos_token_id = None  # a pure 40-token greedy run, as ignore_eos
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False, pad_token_id=2)
    ref = ref[0, len(ids):].tolist()
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == ref
    assert len(ref) == 40
    assert out.outputs[0].finish_reason == "length"
    assert out.outputs[0].text.startswith(" Paris")


def test_generation_stops_at_eos(llm):
    out = llm.generate("The capital of France is", SamplingParams(max_tokens=100, temperature=0.0),
                       use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason is None
    assert c.token_ids[-1] == 2 and 2 not in c.token_ids[:-1]
    assert "<|im_end|>" not in c.text
