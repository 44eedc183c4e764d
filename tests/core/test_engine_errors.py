"""Bad input gets a clear error; the engine keeps serving the others and leaks no KV block."""

from __future__ import annotations

import pytest

from refengine import LLM, SamplingParams
from refengine.core.engine import LLMEngine

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


@pytest.fixture
def engine(tiny_llama_dir) -> LLMEngine:
    return LLMEngine(tiny_llama_dir, block_size=4, num_kv_blocks=12, max_model_len=40, log_stats=False)


def all_free(engine: LLMEngine) -> bool:
    return engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def drain(engine: LLMEngine) -> dict:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


@pytest.mark.parametrize("prompt, message", [
    ([], "the prompt is empty"),
    (list(range(3, 43)), "the prompt has 40 tokens but max_model_len is 40"),
    ([5, 211], r"prompt token id 211 is outside the vocabulary \[0, 211\)"),
    ([5, -1], r"prompt token id -1 is outside the vocabulary"),
])
def test_bad_prompts_are_refused_and_others_keep_going(engine, prompt, message):
    engine.add_request("good", [5, 6, 7], GREEDY)
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, GREEDY)
    assert "bad" not in engine.requests
    done = drain(engine)
    assert list(done) == ["good"] and len(done["good"].outputs[0].token_ids) == 5
    assert all_free(engine)


def test_prompt_needing_more_blocks_than_the_pool(tiny_llama_dir):
    engine = LLMEngine(tiny_llama_dir, block_size=4, num_kv_blocks=12, log_stats=False)
    assert engine.config.max_model_len == 48  # capped by the pool: 12 blocks x 4 tokens
    with pytest.raises(ValueError, match="max_model_len is 48"):
        engine.add_request("big", list(range(3, 51)), GREEDY)
    with pytest.raises(ValueError, match=r"max_model_len=100 needs 25 KV blocks but the pool holds 12"):
        LLMEngine(tiny_llama_dir, block_size=4, num_kv_blocks=12, max_model_len=100, log_stats=False)


def test_duplicate_request_id(engine):
    engine.add_request("x", [5, 6], GREEDY)
    with pytest.raises(ValueError, match="request_id 'x' is already in use"):
        engine.add_request("x", [5, 6], GREEDY)
    drain(engine)
    assert all_free(engine)


def test_string_prompt_without_tokenizer(engine):
    with pytest.raises(ValueError, match="no tokenizer.json: pass prompts as token ids"):
        engine.add_request("s", "hello", GREEDY)


def test_generation_reaching_max_model_len_finishes_with_length(engine):
    engine.add_request("long", list(range(3, 38)), SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
    out = drain(engine)["long"]
    assert out.outputs[0].finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 40
    assert all_free(engine)


def test_generate_with_a_bad_prompt_queues_nothing(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, block_size=4, num_kv_blocks=12, max_model_len=40, log_stats=False)
    with pytest.raises(ValueError, match="the prompt is empty"):
        llm.generate([[5, 6], []], GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests() and all_free(llm.llm_engine)
    with pytest.raises(ValueError, match="got 1 sampling_params for 2 prompts"):
        llm.generate([[5], [6]], [GREEDY], use_tqdm=False)
    outs = llm.generate([[5, 6], [7]], GREEDY, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 5]


def test_max_tokens_zero_and_one(engine):
    with pytest.raises(ValueError, match=r"SamplingParams.max_tokens=0 is invalid: must be None or an integer >= 1"):
        SamplingParams(max_tokens=0)
    engine.add_request("one", [5, 6], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    out = drain(engine)["one"]
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"


def test_bad_engine_options(tiny_llama_dir):
    with pytest.raises(ValueError, match="block_size=0 is invalid"):
        LLMEngine(tiny_llama_dir, block_size=0, log_stats=False)
    with pytest.raises(ValueError, match="device='tpu' is not one of"):
        LLMEngine(tiny_llama_dir, device="tpu", log_stats=False)
    with pytest.raises(ValueError, match="attention_backend='flash' is not one of"):
        LLMEngine(tiny_llama_dir, attention_backend="flash", log_stats=False)
    with pytest.raises(ValueError, match="max_num_batched_tokens=16 must be >= max_model_len=40"):
        LLMEngine(tiny_llama_dir, enable_chunked_prefill=False, max_num_batched_tokens=16, max_model_len=40,
                  num_kv_blocks=12, block_size=4, log_stats=False)


@pytest.mark.parametrize("prompt, message", [
    ([1.7, 3], r"prompt token ids must be integers, got 1.7 \(float\)"),
    ([True, 3], r"prompt token ids must be integers, got True"),
    (["a"], r"prompt token ids must be integers, got 'a'"),
    (None, r"a prompt must be a string or a list of token ids, got NoneType"),
])
def test_prompts_that_are_not_token_ids(engine, prompt, message):
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, GREEDY)
    assert all_free(engine) and not engine.has_unfinished_requests()


def test_numpy_token_ids_are_accepted(tiny_llama_dir):
    import numpy as np

    llm = LLM(tiny_llama_dir, block_size=4, num_kv_blocks=12, max_model_len=40, log_stats=False)
    a = llm.generate(np.array([5, 6, 7]), GREEDY, use_tqdm=False)
    b = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids


def test_stop_strings_need_a_tokenizer(engine):
    with pytest.raises(ValueError, match=r"stop strings \['x'\] need a tokenizer"):
        engine.add_request("s", [5, 6], SamplingParams(max_tokens=3, stop=["x"]))


def test_an_exception_inside_a_step_leaves_the_engine_consistent(engine, monkeypatch):
    engine.add_request("a", [5, 6, 7], GREEDY)
    engine.add_request("b", [8, 9], GREEDY)
    engine.step()
    calls = {"n": 0}
    real = engine.sampler.__class__.__call__

    def flaky(self, logits, seqs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("sampler failed once")
        return real(self, logits, seqs)

    monkeypatch.setattr(engine.sampler.__class__, "__call__", flaky)
    with pytest.raises(RuntimeError, match="sampler failed once"):
        engine.step()
    done = drain(engine)  # the failed step is redone, nothing is skipped or duplicated
    assert sorted(done) == ["a", "b"] and all(len(o.outputs[0].token_ids) == 5 for o in done.values())
    assert all_free(engine)


def test_delta_token_ids_and_abort_metrics(engine):
    engine.add_request("a", [5, 6, 7], GREEDY)
    seen = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen += out.outputs[0].delta_token_ids
            final = out
    assert seen == final.outputs[0].token_ids and len(seen) == 5
    engine.add_request("b", [5, 6], GREEDY)
    engine.step()
    engine.abort("b")
    assert 'refengine:request_success_total{finished_reason="abort"} 1.0' in engine.metrics.exposition()
    assert all_free(engine)


def test_rope_buffers_of_older_checkpoints_are_ignored(tiny_llama_dir, tmp_path):
    import shutil

    import numpy as np
    from safetensors.numpy import load_file, save_file

    for f in tiny_llama_dir.iterdir():
        shutil.copy(f, tmp_path / f.name)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(16, np.float32)
    save_file(tensors, tmp_path / "model.safetensors")
    ids = [5, 6, 7, 8]
    want = LLM(tiny_llama_dir, log_stats=False).prompt_logits(ids)
    np.testing.assert_array_equal(LLM(tmp_path, log_stats=False).prompt_logits(ids), want)


def test_sliding_window_no_longer_caps_max_model_len(tiny_llama_dir, tmp_path):
    """Sliding-window attention exists: a Mistral window of 64 leaves the context at the model's own."""
    import json
    import shutil

    for f in tiny_llama_dir.iterdir():
        shutil.copy(f, tmp_path / f.name)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=64)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    engine = LLMEngine(tmp_path, max_model_len=128, log_stats=False)
    assert engine.config.max_model_len == 128
    assert engine.config.model_config.layer_window(0) == 64
