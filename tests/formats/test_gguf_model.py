"""Running a GGUF file directly (``LLM(model="x.gguf")``): config, tokenizer and tensors from
the one file, the tensors kept in their stored block types.

The default model's float32 weights are exactly its Q4_1/Q8_0 blocks dequantized, so the
GGUF run as stored must give the float32 path's logits up to the products' summation
order, and the same greedy text.
"""

from __future__ import annotations

import numpy as np
import pytest

from refengine import LLM, SamplingParams
from refengine.core.engine import load_tokenizer
from refengine.quant import StackedWeight, is_quantized

PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes "
          "Gutenberg combined movable type with an oil-based ink and a wooden press.")
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


# Every engine here: one numba thread (the bits do not depend on the thread count: batch
# invariance; one thread spares each start the warm-up of the parallel kernels) and a
# context of 128 tokens (the longest sequence here is PROMPT plus 12 tokens, about 50; the
# warm-up's passes are bounded by it).
SMALL = dict(num_threads=1, max_model_len=128, log_stats=False)


@pytest.fixture(scope="module")
def float_llm(smollm2_dir):
    return LLM(model=smollm2_dir, block_size=16, **SMALL)


@pytest.fixture(scope="module")
def float_prompt_logits(float_llm) -> np.ndarray:
    """The float32 directory's logits for every row of PROMPT (each backend is compared with them)."""
    return float_llm.prompt_logits(float_llm.get_tokenizer().encode(PROMPT))


@pytest.fixture(scope="module")
def float_greedy(float_llm) -> list[list[int]]:
    """The float32 directory's 24 greedy tokens after each of PROMPTS."""
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in float_llm.generate(PROMPTS, sp, use_tqdm=False)]


@pytest.fixture(scope="module", params=["numba", "numpy"])
def gguf_llm(request, gguf_path):
    return LLM(model=gguf_path, attention_backend=request.param, block_size=16, **SMALL)


def test_dequantized_gguf_is_the_converted_directory(gguf_path, float_llm, float_prompt_logits):
    """``dtype="float32"`` dequantizes at load: the very weights ``convert-gguf`` writes."""
    llm = LLM(model=gguf_path, dtype="float32", block_size=16, **SMALL)
    ids = float_llm.get_tokenizer().encode(PROMPT)
    np.testing.assert_array_equal(llm.prompt_logits(ids), float_prompt_logits)


def test_weights_stay_in_their_stored_types(gguf_path):
    llm = LLM(model=gguf_path, attention_backend="numpy", **SMALL)
    model = llm.llm_engine.model
    assert is_quantized(model.embed) and model.embed.format == "Q8_0"
    assert model.lm_head is model.embed  # tied: the Q8_0 rows are read as they are
    layer = model.layers[0]
    for name in ("qkv", "o", "gate_up", "down"):
        w = getattr(layer, name)
        assert is_quantized(w) and not isinstance(w, StackedWeight) and w.format == "Q4_1", name
    total = sum(w.nbytes for lay in model.layers for w in vars(lay).values() if is_quantized(w)) + model.embed.nbytes
    assert total < 100e6  # the file is 98 MB; float32 would be 538 MB


def test_tokenizer_and_template_from_metadata(gguf_path, smollm2_dir, float_llm):
    """The tokenizer an engine of the GGUF file builds (``load_tokenizer``, which ``LLM``
    calls: no weights needed) against the converted directory's ``tokenizer.json``."""
    ours = load_tokenizer(gguf_path, float_llm.llm_engine.model_config.vocab_size)
    ref = float_llm.get_tokenizer()
    for text in (PROMPT, "12345 digits, emoji 🙂 and 中文", "<|im_start|>user\nhi<|im_end|>"):
        assert ours.encode(text) == ref.encode(text)
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    assert ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == \
        ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def test_logits_as_stored_match_float32(gguf_llm, float_llm, float_prompt_logits):
    ids = float_llm.get_tokenizer().encode(PROMPT)
    ours, ref = gguf_llm.prompt_logits(ids), float_prompt_logits
    assert np.abs(ours - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max())
    np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))


def test_greedy_text_as_stored_matches_float32(gguf_llm, float_greedy):
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in gguf_llm.generate(PROMPTS, sp, use_tqdm=False)]
    assert ours == float_greedy


def test_decode_rows_match_prefill_rows(gguf_llm):
    """A batch of decode steps (few rows, the fused kernels) and one prefill (many rows)
    score the same tokens alike."""
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    out = gguf_llm.generate([PROMPT], sp, use_tqdm=False)[0]
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    logits = gguf_llm.prompt_logits(ids)
    logz = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    n = len(out.prompt_token_ids)
    prefill = [logz[n - 1 + i, t] for i, t in enumerate(out.outputs[0].token_ids)]
    decoded = [lp[t] for lp, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]
    np.testing.assert_allclose(decoded, prefill, atol=1e-4)


def test_not_a_llama_gguf_is_refused(tmp_path):
    import gguf

    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        LLM(model=path)
