"""refengine.formats.convert_gguf: GGUF -> HF model directory.

The real-model tests convert the SmolLM2 GGUF afresh into a temporary directory and compare
every tensor with what ``transformers`` itself dequantizes from the same file, which proves
the renaming, the shapes and the q/k un-permutation.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from refengine.formats.convert_gguf import convert_gguf, unpermute_rotary

# --- no weights needed ------------------------------------------------------------------


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The forward reordering llama.cpp's convert_hf_to_gguf.py applies to q/k rows:
    within each head, the two halves are interleaved (row h*d + half*d/2 + i -> h*d + 2i + half)."""
    n_out = w.shape[0]
    d = n_out // n_head
    out = np.empty_like(w)
    for h in range(n_head):
        for half in range(2):
            for i in range(d // 2):
                out[h * d + 2 * i + half] = w[h * d + half * d // 2 + i]
    return out


def test_unpermute_inverts_llama_cpp_permute():
    rng = np.random.default_rng(0)
    for n_head, head_dim in [(1, 4), (3, 64), (9, 64), (2, 6)]:
        w = rng.standard_normal((n_head * head_dim, 5)).astype(np.float32)
        np.testing.assert_array_equal(unpermute_rotary(llama_cpp_permute(w, n_head), n_head), w)
    # one head of 4: llama.cpp row order is [r0, r2, r1, r3]
    rows = np.arange(4, dtype=np.float32)[:, None]
    np.testing.assert_array_equal(unpermute_rotary(rows, 1)[:, 0], [0, 2, 1, 3])


def test_unpermute_makes_interleaved_rope_equal_hf_rotate_half():
    """Why the permutation exists: interleaved-pair RoPE on llama.cpp's rows is HF's
    rotate_half RoPE on HF's rows, up to the same row reordering."""
    rng = np.random.default_rng(1)
    n_head, d, n_in, pos, theta = 3, 8, 16, 5, 10000.0
    w_hf = rng.standard_normal((n_head * d, n_in))
    x = rng.standard_normal(n_in)
    angle = pos * theta ** (-np.arange(0, d, 2) / d)  # [d/2]
    cos, sin = np.cos(angle), np.sin(angle)

    q = (w_hf @ x).reshape(n_head, d)  # HF: rotate (q[i], q[i + d/2])
    a, b = q[:, : d // 2], q[:, d // 2 :]
    hf = np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=1)

    q = (llama_cpp_permute(w_hf, n_head) @ x).reshape(n_head, d)  # llama.cpp: (q[2i], q[2i+1])
    a, b = q[:, 0::2], q[:, 1::2]
    interleaved = np.stack([a * cos - b * sin, b * cos + a * sin], axis=2).reshape(-1, 1)

    np.testing.assert_allclose(unpermute_rotary(interleaved, n_head).reshape(n_head, d), hf, atol=1e-12)


def test_unpermute_rejects_odd_head_size():
    with pytest.raises(ValueError, match="cannot be split into 2 heads"):
        unpermute_rotary(np.zeros((6, 3)), 2)


def test_missing_gguf_names_the_path(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        convert_gguf(missing, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"definitely not a gguf file" * 10)
    with pytest.raises(ValueError, match="not a readable GGUF"):
        convert_gguf(bad, tmp_path / "out")


def test_non_llama_architecture_is_named(tmp_path):
    import gguf

    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        convert_gguf(path, tmp_path / "out")


def test_written_files_get_the_usual_mode(tmp_path):
    """safetensors creates its file 0600; the converter's files get what a new file gets (0644
    under umask 022), so model.safetensors is as readable as the JSON files beside it."""
    from safetensors.numpy import save_file

    from refengine.formats.convert_gguf import _atomic, _write_json

    with _atomic(tmp_path / "model.safetensors") as tmp:
        save_file({"w": np.zeros(2, np.float32)}, str(tmp))
    _write_json(tmp_path / "config.json", {})
    (tmp_path / "plain").write_text("")
    want = (tmp_path / "plain").stat().st_mode & 0o777
    assert {f.name: f.stat().st_mode & 0o777 for f in tmp_path.iterdir()} == {
        "model.safetensors": want, "config.json": want, "plain": want}


# --- the real SmolLM2 GGUF ----------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_reader(gguf_path):
    import gguf

    return gguf.GGUFReader(gguf_path)


@pytest.fixture(scope="module")
def converted(gguf_path, tmp_path_factory):
    return convert_gguf(gguf_path, tmp_path_factory.mktemp("smollm2"))


@pytest.fixture(scope="module")
def hf_gguf_state_dict(gguf_path):
    """transformers' own dequantization of the same GGUF (float32), as numpy arrays."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    return {k: v.numpy() for k, v in model.state_dict().items()}


def test_weights_equal_transformers_gguf_load(converted, hf_gguf_state_dict):
    from safetensors.numpy import load_file

    ours = load_file(str(converted / "model.safetensors"))
    # Tied embeddings: transformers shows lm_head.weight as the same tensor as embed_tokens.
    hf = dict(hf_gguf_state_dict)
    np.testing.assert_array_equal(hf.pop("lm_head.weight"), hf["model.embed_tokens.weight"])
    assert sorted(ours) == sorted(hf)
    assert len(ours) == 2 + 30 * 9
    for name, theirs in hf.items():
        assert ours[name].dtype == np.float32, name
        assert ours[name].shape == theirs.shape, name
        np.testing.assert_allclose(ours[name], theirs, rtol=0, atol=1e-6, err_msg=name)


def test_qk_rows_are_actually_unpermuted(converted, gguf_reader):
    """Guard against a no-op: the raw GGUF q/k rows differ from ours, v rows do not."""
    from gguf.quants import dequantize
    from safetensors.numpy import load_file

    raw = {t.name: t for t in gguf_reader.tensors if t.name.startswith("blk.0.")}
    ours = load_file(str(converted / "model.safetensors"))
    for suffix, hf_name, n_head in [("attn_q", "q_proj", 9), ("attn_k", "k_proj", 3), ("attn_v", "v_proj", None)]:
        t = raw[f"blk.0.{suffix}.weight"]
        w = dequantize(t.data, t.tensor_type)
        mine = ours[f"model.layers.0.self_attn.{hf_name}.weight"]
        if n_head is None:
            np.testing.assert_array_equal(mine, w)
        else:
            assert not np.array_equal(mine, w)
            np.testing.assert_array_equal(mine, unpermute_rotary(w, n_head))


def test_config_json(converted):
    config = json.loads((converted / "config.json").read_text())
    expected = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": 30,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        "rope_scaling": None,
    }
    assert {k: config.get(k) for k in expected} == expected
    assert json.loads((converted / "generation_config.json").read_text()) == {
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
    }


def test_tokenizer_config_json(converted, gguf_reader):
    template = gguf_reader.fields["tokenizer.chat_template"].contents()
    config = json.loads((converted / "tokenizer_config.json").read_text())
    assert config["chat_template"] == template
    assert config["chat_template"].startswith("{% for message in messages %}")
    assert config["bos_token"] == "<|im_start|>"
    assert config["eos_token"] == "<|im_end|>"
    assert config["pad_token"] == "<|im_end|>"
    assert config["unk_token"] == "<|endoftext|>"
    assert config["add_bos_token"] is False  # the GGUF says so; the ChatML template has no BOS
    assert config["model_max_length"] == 8192
    assert sorted(int(i) for i in config["added_tokens_decoder"]) == list(range(17))


def test_converted_dir_matches_committed_weights_dir(converted, smollm2_dir):
    """weights/SmolLM2-135M-Instruct (what the other tests use) is today's converter output."""
    for name in ("config.json", "generation_config.json", "tokenizer_config.json", "tokenizer.json"):
        assert (converted / name).read_text() == (smollm2_dir / name).read_text(), name
    assert (converted / "model.safetensors").stat().st_size == (smollm2_dir / "model.safetensors").stat().st_size
    assert len({f.stat().st_mode & 0o777 for f in converted.iterdir()}) == 1  # model.safetensors as readable
