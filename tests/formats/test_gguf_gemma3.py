"""Gemma 3 270M from its Q4_K_M GGUF (``weights/gemma-3-270m-q4_k_m.gguf``, fetched by
``python weights/fetch_gemma3.py``): refengine.formats.gguf_file's config, tokenizer and weights
against what ``transformers`` builds from the same file.

The references, all loaded from the one file: ``AutoConfig`` (a ``Gemma3TextConfig``),
``AutoTokenizer`` (transformers' GGUF Gemma converter), and ``AutoModelForCausalLM``
(``Gemma3ForCausalLM``, float32), each loaded once for the session (``conftest.py``) and shared
with ``tests/models/test_golden_gemma3.py``. No forward pass: that is the model class's test.
The tests skip when the file is absent.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from refengine.formats.gguf_file import GGUFFile, _gemma3_config


slow = pytest.mark.slow
TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading and trailing spaces  ",
    "multiple     inner spaces\t\ttabs\n\n\nnewlines\r\n",
    "  \n  \n",
    " ",
    "",
    "你好，世界！今天天气很好。",
    "Привет, мир! Ωmega café naïve façade ß",
    "ＡＢＣ full width, \u200b zero width, \ufeff BOM",
    "family: 👨\u200d👩\u200d👧\u200d👦, flag: 🏳\ufe0f\u200d🌈, thumbs: 👍🏽",
    "def add(a, b):\n    return a + b  # sum\n\n\tif x != y: pass\n",
    "<table><tr><td>html</td></tr></table>",
    "12345 3.14159 -0 1e10 1,000,000 ٣٤٥",
    "don't won't it's I'm we've they'll",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text after a literal bos",
    "<unused5> [multimodal] <mask> <eos>",
    "\x00\x01 control \x7f characters",
    "x" * 60,
]

# Gemma 3's chat template (google/gemma-3-4b-it tokenizer_config.json). The GGUF stores none
# (no tokenizer.chat_template key), so both sides get it from here to compare the rendering.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n"
)

CONVERSATION = [
    {"role": "system", "content": "You answer in one short sentence."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "  Paris is the capital of France.  "},
    {"role": "user", "content": "And of Italy? 🇮🇹"},
]


# --- fixtures -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf(gemma3_gguf) -> GGUFFile:
    return GGUFFile(gemma3_gguf)


@pytest.fixture(scope="module")
def tok(gguf):
    return gguf.tokenizer()


@pytest.fixture(scope="module")
def hf_state_dict(hf_gemma3):
    """transformers' Gemma3ForCausalLM loaded from the GGUF in float32 (conftest.py), as numpy arrays."""
    assert type(hf_gemma3).__name__ == "Gemma3ForCausalLM"
    return {k: v.detach().numpy() for k, v in hf_gemma3.state_dict().items()}


# --- config -------------------------------------------------------------------------------

# config.json fields that equal the transformers attribute of the same name.
SAME_FIELDS = [
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window", "layer_types",
    "query_pre_attn_scalar", "final_logit_softcapping", "attn_logit_softcapping", "hidden_activation",
    "tie_word_embeddings", "attention_bias", "bos_token_id", "eos_token_id", "pad_token_id", "model_type",
]


@slow
def test_config_fields_equal_transformers(gguf, hf_gemma3_config):
    ours = gguf.config
    assert type(hf_gemma3_config).__name__ == "Gemma3TextConfig"
    assert ours["architectures"] == ["Gemma3ForCausalLM"]  # transformers leaves it None; its class is this
    for key in SAME_FIELDS:
        assert ours[key] == getattr(hf_gemma3_config, key), key
    # Same float32 (GGUF stores float32; we write its shortest decimal, 1e-06).
    assert np.float32(ours["rms_norm_eps"]) == np.float32(hf_gemma3_config.rms_norm_eps)
    assert ours["rms_norm_eps"] == 1e-6
    # transformers 5 keeps the two RoPE bases in rope_parameters, by layer type.
    rope = hf_gemma3_config.rope_parameters
    assert ours["rope_theta"] == rope["full_attention"]["rope_theta"] == 1_000_000.0
    assert ours["rope_local_base_freq"] == rope["sliding_attention"]["rope_theta"] == 10_000.0
    assert ours["rope_scaling"] is None
    assert rope["full_attention"]["rope_type"] == rope["sliding_attention"]["rope_type"] == "default"
    assert ours["sliding_window_pattern"] == hf_gemma3_config._sliding_window_pattern == 6
    assert ours["layer_types"].count("full_attention") == 3


@slow
def test_transformers_reads_our_config_as_its_own(gguf, hf_gemma3_config):
    """Our config.json, read by transformers (the Hub spelling: rope_theta,
    rope_local_base_freq, sliding_window_pattern), gives the config it builds from the GGUF."""
    transformers = pytest.importorskip("transformers")
    mine = transformers.Gemma3TextConfig(**{k: v for k, v in gguf.config.items() if k != "model_type"})
    theirs = hf_gemma3_config.to_dict()
    for key in SAME_FIELDS + ["rope_parameters"]:
        assert mine.to_dict()[key] == theirs[key], key
    assert np.float32(mine.rms_norm_eps) == np.float32(hf_gemma3_config.rms_norm_eps)


@slow
def test_generation_config_stops_at_end_of_turn(gguf, tok):
    assert gguf.generation_config == {"bos_token_id": 2, "eos_token_id": [1, 106], "pad_token_id": 0}
    assert tok.convert_ids_to_tokens(106) == "<end_of_turn>"
    assert tok.eos_token_ids == {1, 106}


def _meta(**extra):
    """Metadata of a small Gemma 3 file, for the config builder's optional keys."""
    meta = {"general.architecture": "gemma3", "tokenizer.ggml.tokens": ["<pad>", "<eos>", "<bos>"],
            "gemma3.embedding_length": 64, "gemma3.block_count": 4, "gemma3.attention.head_count": 4,
            "gemma3.attention.head_count_kv": 2, "gemma3.attention.key_length": 32,
            "gemma3.attention.value_length": 32, "gemma3.feed_forward_length": 96,
            "gemma3.context_length": 256, "gemma3.attention.layer_norm_rms_epsilon": 1e-6,
            "gemma3.rope.freq_base": 1e6, "gemma3.attention.sliding_window": 16}
    meta.update(extra)
    return meta


def test_config_optional_keys():
    c = _gemma3_config(_meta(), has_lm_head=False)
    assert c["layer_types"] == ["sliding_attention"] * 4 and c["sliding_window_pattern"] == 6
    assert c["query_pre_attn_scalar"] == 32 and c["vocab_size"] == 3 and c["tie_word_embeddings"]
    c = _gemma3_config(_meta(**{"gemma3.attention.sliding_window_pattern": [True, False, True, False],
                                "gemma3.rope.freq_base_swa": 5e4, "gemma3.rope.scaling.type": "linear",
                                "gemma3.rope.scaling.factor": 8.0}), has_lm_head=True)
    assert c["layer_types"] == ["sliding_attention", "full_attention"] * 2 and "sliding_window_pattern" not in c
    assert c["rope_local_base_freq"] == 5e4 and c["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}
    assert not c["tie_word_embeddings"]
    c = _gemma3_config(_meta(**{"gemma3.attention.sliding_window_pattern": 2}), has_lm_head=False)
    assert c["layer_types"] == ["sliding_attention", "full_attention"] * 2
    c = _gemma3_config(_meta(**{"gemma3.attention.sliding_window": 0}), has_lm_head=False)
    assert c["sliding_window"] is None and c["layer_types"] == ["full_attention"] * 4
    # llama.cpp's 27B rule: 62 layers -> hidden / heads, not head_dim
    assert _gemma3_config(_meta(**{"gemma3.block_count": 62}), has_lm_head=False)["query_pre_attn_scalar"] == 16
    with pytest.raises(ValueError, match="sliding_window_pattern has 3 entries for 4 layers"):
        _gemma3_config(_meta(**{"gemma3.attention.sliding_window_pattern": [True] * 3}), has_lm_head=False)
    with pytest.raises(ValueError, match="unsupported GGUF rope scaling type 'yarn'"):
        _gemma3_config(_meta(**{"gemma3.rope.scaling.type": "yarn"}), has_lm_head=False)
    with pytest.raises(ValueError, match="lacks 'gemma3.feed_forward_length'"):
        _gemma3_config({k: v for k, v in _meta().items() if k != "gemma3.feed_forward_length"}, has_lm_head=False)


# --- tokenizer ----------------------------------------------------------------------------


@slow
def test_tokenizer_pipeline_is_transformers(tok, hf_tok):
    """The whole tokenizers pipeline, serialized: vocabulary, the 514,906 rebuilt merges,
    normalizer, pre-tokenizer, decoder, post-processor and added tokens.

    ``tok`` wraps ``build_tokenizer(gguf.meta)`` (``GGUFFile.tokenizer``), the pipeline
    ``convert_gguf`` saves too, so it is not rebuilt here."""
    ours = json.loads(tok._tok.to_str())
    theirs = json.loads(hf_tok.backend_tokenizer.to_str())
    assert len(ours["model"]["merges"]) == len(theirs["model"]["merges"]) > 500_000
    for key in theirs:
        assert ours[key] == theirs[key], key


@slow
@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("special", [False, True], ids=["plain", "special"])
def test_encode_equals_transformers(tok, hf_tok, text, special):
    ids = tok.encode(text, add_special_tokens=special)
    assert ids == hf_tok(text, add_special_tokens=special)["input_ids"]
    assert (ids[:1] == [2]) == (special or text.startswith("<bos>"))


@slow
@pytest.mark.parametrize("text", TEXTS)
def test_decode_equals_transformers_and_round_trips(tok, hf_tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    for skip in (False, True):
        assert tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(ids, skip_special_tokens=skip)


@slow
def test_special_tokens(tok, hf_tok):
    assert tok.add_bos_token and not tok.add_eos_token
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (2, 1, 0, 3)
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.pad_token_id, hf_tok.unk_token_id) == (2, 1, 0, 3)
    assert tok.vocab_size == len(hf_tok) == 262_144
    assert tok.encode("<start_of_turn><end_of_turn>") == [105, 106]
    assert set(hf_tok.all_special_ids) <= set(tok.all_special_ids)


@slow
def test_file_has_no_chat_template(gguf, tok, hf_tok):
    """This GGUF carries no tokenizer.chat_template: neither side invents one."""
    assert "tokenizer.chat_template" not in gguf.meta
    assert tok.chat_template is None and hf_tok.chat_template is None
    with pytest.raises(ValueError, match="no chat_template"):
        tok.apply_chat_template(CONVERSATION[1:2])


@slow
def test_chat_template_renders_as_transformers(gguf, tok, hf_tok):
    """With Gemma 3's template in the metadata, the rendering (bos_token variable, trim,
    roles) and its ids equal transformers' apply_chat_template with that template.

    The tokenizer is built as ``GGUFFile.tokenizer`` builds it, from metadata that adds the
    template (``tokenizer_config``), around the shared ``tok``'s pipeline: the template key
    plays no part in ``build_tokenizer``, so the vocabulary and merges are not rebuilt."""
    from refengine.formats.gguf_file import tokenizer_config
    from refengine.tokenizer import Tokenizer

    meta = {**gguf.meta, "tokenizer.chat_template": GEMMA3_CHAT_TEMPLATE}
    tok = Tokenizer(tok._tok, tokenizer_config(meta, gguf.config), gguf.generation_config)
    for messages in (CONVERSATION, CONVERSATION[1:]):
        text = tok.apply_chat_template(messages, add_generation_prompt=True)
        expected = hf_tok.apply_chat_template(messages, chat_template=GEMMA3_CHAT_TEMPLATE,
                                              add_generation_prompt=True, tokenize=False)
        assert text == expected
        assert text.startswith("<bos><start_of_turn>user\n") and text.endswith("<start_of_turn>model\n")
        assert tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True) == \
            hf_tok.encode(expected, add_special_tokens=False)


# --- weights ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dequantized(gguf):
    return gguf.weights(dequantize=True)


@slow
def test_weights_equal_transformers_state_dict(dequantized, hf_state_dict):
    hf = dict(hf_state_dict)
    np.testing.assert_array_equal(hf.pop("lm_head.weight"), hf["model.embed_tokens.weight"])  # tied
    assert sorted(dequantized) == sorted(hf)
    assert len(dequantized) == 2 + 18 * 13
    for name, theirs in hf.items():
        ours = dequantized[name]
        assert ours.dtype == np.float32 and ours.shape == theirs.shape, name
        np.testing.assert_array_equal(ours, theirs, err_msg=name)


@slow
def test_norms_offset_and_no_qk_permutation(gguf, dequantized):
    """Guard against no-ops: the stored norms are ours + 1; q/k rows are as stored."""
    from gguf.quants import dequantize

    raw = {t.name: t for t in gguf.reader.tensors}

    def stored(name):
        t = raw[name]
        return dequantize(t.data, t.tensor_type).reshape(tuple(int(d) for d in reversed(t.shape)))

    for gguf_name, hf_name in [("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"),
                               ("blk.3.ffn_norm.weight", "model.layers.3.pre_feedforward_layernorm.weight"),
                               ("blk.5.post_ffw_norm.weight", "model.layers.5.post_feedforward_layernorm.weight"),
                               ("blk.7.attn_q_norm.weight", "model.layers.7.self_attn.q_norm.weight"),
                               ("output_norm.weight", "model.norm.weight")]:
        np.testing.assert_array_equal(dequantized[hf_name], stored(gguf_name) - np.float32(1), err_msg=hf_name)
    for gguf_name, hf_name in [("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
                               ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight")]:
        np.testing.assert_array_equal(dequantized[hf_name], stored(gguf_name), err_msg=hf_name)


@slow
def test_weights_as_stored_keep_their_blocks(gguf, dequantized):
    """The quantized path: matrices stay GGUFWeight in the file's block types and decode to
    exactly the dequantized path's arrays; norms come as the same float32 arrays."""
    from refengine.quant.gguf_blocks import GGUFWeight

    weights = gguf.weights()
    assert sorted(weights) == sorted(dequantized)
    types = gguf.tensor_types()
    assert weights["model.embed_tokens.weight"].format == types["token_embd.weight"] == "Q8_0"
    formats = set()
    for name, w in weights.items():
        if name.endswith("norm.weight"):
            assert isinstance(w, np.ndarray) and w.dtype == np.float32, name
            np.testing.assert_array_equal(w, dequantized[name], err_msg=name)
        else:
            assert isinstance(w, GGUFWeight), name
            formats.add(w.format)
            if name.startswith(("model.layers.0.", "model.layers.17.")):
                np.testing.assert_array_equal(w.dequantize(), dequantized[name], err_msg=name)
    assert formats == {"Q8_0", "Q5_0", "Q4_K", "Q6_K"}


@slow
def test_convert_gguf_writes_a_directory_transformers_reads(gemma3_gguf, dequantized, tok, tmp_path):
    """``refengine convert-gguf`` on Gemma 3: the float32 weights are the dequantized ones,
    and transformers reads the directory's config and tokenizer as the GGUF's."""
    transformers = pytest.importorskip("transformers")
    from safetensors.numpy import load_file

    from refengine.formats.convert_gguf import convert_gguf

    out = convert_gguf(gemma3_gguf, tmp_path / "gemma3")
    saved = load_file(str(out / "model.safetensors"))
    assert sorted(saved) == sorted(dequantized)
    for name, w in saved.items():
        np.testing.assert_array_equal(w, dequantized[name], err_msg=name)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [1, 106]
    config = transformers.AutoConfig.from_pretrained(out)
    assert type(config).__name__ == "Gemma3TextConfig" and config.layer_types.count("full_attention") == 3
    hf = transformers.AutoTokenizer.from_pretrained(out)
    assert len(hf) == 262_144  # no added token got a new id
    for text in TEXTS:
        assert hf(text)["input_ids"] == tok.encode(text, add_special_tokens=True), text
