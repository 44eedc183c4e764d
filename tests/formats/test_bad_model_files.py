"""A broken model directory fails at load, before the weights are read or the KV pool is
allocated, with an error that names the file and the key (issue 11)."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest

from refengine.core.engine import LLMEngine


@pytest.fixture
def model_dir(tiny_llama_tok_dir, tmp_path) -> Path:
    """A fresh copy of the tiny Llama with its word-level tokenizer (weights linked, small
    files copied), so every model file is present and can be broken one at a time."""
    for f in tiny_llama_tok_dir.iterdir():
        if f.is_symlink():
            os.symlink(os.readlink(f), tmp_path / f.name)
        else:
            (tmp_path / f.name).write_bytes(f.read_bytes())
    return tmp_path


def edit_config(**changes):
    def edit(cfg: dict) -> dict:
        for key, value in changes.items():
            if value is DELETE:
                del cfg[key]
            else:
                cfg[key] = value
        return cfg
    return edit


DELETE = object()

# (what is done to config.json, a pattern the message must match after the file's path)
BAD_CONFIGS = [
    (edit_config(hidden_size=DELETE), r"required key 'hidden_size' is missing \(an integer >= 1\)"),
    (edit_config(vocab_size=DELETE), r"required key 'vocab_size' is missing"),
    (edit_config(num_hidden_layers=0), r"'num_hidden_layers' must be an integer >= 1, got 0"),
    (edit_config(hidden_size=-5), r"'hidden_size' must be an integer >= 1, got -5"),
    (edit_config(intermediate_size=1.5), r"'intermediate_size' must be an integer >= 1, got 1.5"),
    (edit_config(vocab_size="211"), r"'vocab_size' must be an integer >= 1, got '211'"),
    (edit_config(num_attention_heads=True), r"'num_attention_heads' must be an integer >= 1, got True"),
    (edit_config(max_position_embeddings=0), r"'max_position_embeddings' must be an integer >= 1, got 0"),
    (edit_config(num_key_value_heads=3),
     r"'num_attention_heads' \(4\) must be a multiple of 'num_key_value_heads' \(3\)"),
    (edit_config(num_key_value_heads=8),
     r"'num_attention_heads' \(4\) must be a multiple of 'num_key_value_heads' \(8\)"),
    (edit_config(hidden_size=130, head_dim=DELETE),
     r"'hidden_size' \(130\) must be a multiple of 'num_attention_heads' \(4\) when 'head_dim' is not given"),
    (edit_config(head_dim=31), r"the head size \(31\) must be even"),
    (edit_config(rms_norm_eps=float("nan")), r"'rms_norm_eps' must be a finite number > 0, got nan"),
    (edit_config(rms_norm_eps=-1e-5), r"'rms_norm_eps' must be a finite number > 0"),
    (edit_config(rope_theta=0), r"'rope_theta' must be a finite number > 0, got 0"),
    (edit_config(rope_theta=float("inf")), r"'rope_theta' must be a finite number > 0, got inf"),
    (edit_config(tie_word_embeddings="yes"), r"'tie_word_embeddings' must be true or false, got 'yes'"),
    (edit_config(architectures="LlamaForCausalLM"), r"'architectures' must be a non-empty list of class names"),
    (edit_config(architectures=DELETE), r"'architectures' must be a non-empty list of class names, got None"),
    (edit_config(eos_token_id=-1), r"'eos_token_id' must be a token id \(integer >= 0\) or a list of them"),
    (edit_config(eos_token_id=[2, "x"]), r"'eos_token_id' must be a token id"),
    (edit_config(rope_scaling=[]), r"'rope_scaling' must be a JSON object or null, got \[\]"),
    (edit_config(rope_scaling={"rope_type": "linear"}), r"rope_scaling: required key 'factor' is missing"),
    (edit_config(rope_scaling={"rope_type": "linear", "factor": 0}), r"rope_scaling: 'factor' must be a finite"),
    (edit_config(rope_scaling={"rope_type": "llama3", "factor": 8, "low_freq_factor": 4, "high_freq_factor": 1,
                               "original_max_position_embeddings": 64}),
     r"rope_scaling: 'high_freq_factor' \(1\) must be greater than 'low_freq_factor' \(4\)"),
    (edit_config(eos_token_id=500), r"'eos_token_id' 500 is outside the vocabulary \[0, 211\)"),
]


@pytest.mark.parametrize("edit, message", BAD_CONFIGS, ids=lambda x: x if isinstance(x, str) else "")
def test_broken_config_json(model_dir, nothing_allocated, edit, message):
    path = model_dir / "config.json"
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    with pytest.raises(ValueError) as e:
        LLMEngine(model_dir, log_stats=False)
    assert re.search(re.escape(str(path)) + r": " + message, str(e.value)), str(e.value)


# (file, content, pattern after the file's path)
BAD_FILES = [
    ("config.json", "{", r": invalid JSON at line 1 column 2: Expecting property name"),
    ("config.json", "[1, 2]", r": must hold a JSON object \(\{\.\.\.\}\), got a JSON array"),
    ("config.json", '"llama"', r": must hold a JSON object .*got a JSON string"),
    ("config.json", b"\xff\xfe{}", r": not UTF-8 text \(byte 0: invalid start byte\)"),
    ("config.json", "{}", r": required key 'vocab_size' is missing"),
    ("tokenizer.json", "{}", r": not a tokenizer file that the tokenizers library can read: .*Model"),
    ("tokenizer.json", "not json", r": not a tokenizer file that the tokenizers library can read"),
    ("tokenizer_config.json", "{", r": invalid JSON at line 1 column 2"),
    ("tokenizer_config.json", "[]", r": must hold a JSON object"),
    ("tokenizer_config.json", '{"eos_token": "<nope>"}', r": eos_token '<nope>' is not in the vocabulary"),
    ("tokenizer_config.json", '{"eos_token": 2}', r": 'eos_token' must be a string, got 2"),
    ("tokenizer_config.json", '{"chat_template": 7}', r": 'chat_template' must be a string or a list"),
    ("generation_config.json", "", r": invalid JSON at line 1 column 1: Expecting value"),
    ("generation_config.json", "[2]", r": must hold a JSON object .*got a JSON array"),
    ("generation_config.json", '{"eos_token_id": "2"}', r": 'eos_token_id' must be a token id"),
    ("generation_config.json", '{"eos_token_id": [2, -1]}', r": 'eos_token_id' must be a token id"),
    ("generation_config.json", '{"eos_token_id": 9999}', r": 'eos_token_id' 9999 is outside the vocabulary"),
    ("generation_config.json", '{"bos_token_id": true}', r": 'bos_token_id' must be a token id"),
]


@pytest.mark.parametrize("name, content, message", BAD_FILES, ids=lambda x: x if isinstance(x, str) else "")
def test_broken_model_files(model_dir, nothing_allocated, name, content, message):
    path = model_dir / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    with pytest.raises(ValueError) as e:
        LLMEngine(model_dir, log_stats=False)
    assert re.search(re.escape(str(path)) + message, str(e.value)), str(e.value)


def test_a_tokenizer_bigger_than_the_vocabulary(model_dir, nothing_allocated):
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["vocab_size"] = 90  # the tokenizer has 100 tokens
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"tokenizer.json has 100 tokens but config.json's 'vocab_size' is 90"):
        LLMEngine(model_dir, log_stats=False)


@pytest.mark.parametrize("remove, error, message", [
    ("config.json", FileNotFoundError, r"config.json' not found: a model directory needs a config.json"),
    ("model.safetensors", FileNotFoundError, r"no model.safetensors or model.safetensors.index.json"),
])
def test_missing_model_files(model_dir, remove, error, message):
    (model_dir / remove).unlink()
    with pytest.raises(error, match=message):
        LLMEngine(model_dir, log_stats=False)


def test_broken_shard_index(model_dir):
    (model_dir / "model.safetensors").unlink()
    (model_dir / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(ValueError, match=r"model.safetensors.index.json: 'weight_map' must be an object"):
        LLMEngine(model_dir, log_stats=False)


def test_the_intact_copy_loads_and_runs(model_dir):
    """The fixture itself is sound: what fails above fails for the edit alone."""
    engine = LLMEngine(model_dir, log_stats=False, block_size=4, num_kv_blocks=8)
    assert engine.eos_token_ids == {2} and engine.tokenizer.vocab_size == 100
    assert engine.tokenizer.decode(engine.tokenizer.encode("héllo €1")) == "héllo €1"
    engine.add_request("a", "hello", None)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_free_blocks == 8
    assert not math.isnan(engine.model_config.rms_norm_eps)
