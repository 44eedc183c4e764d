"""Turn a llama-architecture GGUF file into a Hugging Face style model directory.

The output directory holds what ``transformers`` (and :mod:`refengine.loader`) expect:

- ``model.safetensors``: every weight dequantized to float32, under HF Llama names
  (``model.layers.N.self_attn.q_proj.weight`` ...), each of the numpy/PyTorch shape
  ``[out_features, in_features]``;
- ``config.json`` and ``generation_config.json`` from the GGUF metadata;
- ``tokenizer.json`` (a byte-level BPE built with the ``tokenizers`` library from the
  GGUF vocabulary and merges) and ``tokenizer_config.json`` (special tokens and the chat
  template).

Shapes. GGUF lists a tensor's dimensions fastest-varying first (ggml's ``ne[0]`` is the
row length), the reverse of numpy. ``GGUFReader`` already hands back the data in numpy
order, so a GGUF ``[576, 1536]`` ffn_gate is the numpy ``[1536, 576]`` matrix that HF
calls ``gate_proj.weight`` ``[intermediate, hidden]``. We rely on the numpy order and check
every tensor against the shape the config implies.

The q/k permutation. llama.cpp applies rotary embeddings to *adjacent* pairs of a head's
dimensions ``(x0, x1), (x2, x3), ...`` (the original Meta layout), while HF Llama rotates
the two *halves* of a head ``(x_i, x_{i + d/2})`` (``rotate_half``). So when llama.cpp's
``convert_hf_to_gguf.py`` writes a HF checkpoint it reorders the output rows of
``q_proj`` and ``k_proj`` in its ``permute`` function::

    w.reshape(n_head, 2, head_dim // 2, n_in).swapaxes(1, 2).reshape(n_out, n_in)

i.e. within each head, row ``half * (d/2) + i`` moves to row ``2 * i + half``. We undo it
with the inverse reshape (``[n_head, head_dim // 2, 2, n_in]``, swap the middle axes);
``q`` uses the attention head count, ``k`` the KV head count (grouped-query attention).
``v``, ``o`` and the MLP are not permuted. The result equals the HF checkpoint row for
row, which is what makes HF's ``rotate_half`` rotary code correct on these weights.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import numpy as np

# GGUF per-layer tensor suffix -> HF Llama per-layer name.
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# llama.cpp token types (llama_token_type in llama.h / gguf.TokenType).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# HF special token name -> GGUF key stem ("tokenizer.ggml.<stem>_token_id").
_GGUF_SPECIAL_KEYS = {"bos": "bos", "eos": "eos", "unk": "unknown", "pad": "padding"}

# tokenizer.ggml.pre values whose pre-tokenizer we know how to rebuild. "smollm" is the
# GPT-2 byte-level regex after splitting every numeric character on its own (llama.cpp
# llama-vocab.cpp: the "\p{N}" expression before the GPT-2 one).
_PRE_TOKENIZERS = {"smollm": True, "gpt2": False, "default": False}  # -> split digits?


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write a HF style model directory for a llama-architecture GGUF file.

    Args:
        gguf_path: the ``.gguf`` file (any tensor type ``gguf.quants`` can dequantize:
            F32, F16, Q4_0/Q4_1/Q8_0, K-quants ...).
        out_dir: the directory to write; created if missing, files in it overwritten.

    Returns:
        ``Path(out_dir)``, holding ``model.safetensors`` (float32 tensors, HF names,
        shape ``[out_features, in_features]`` for linears and ``[hidden]`` for norms),
        ``config.json``, ``generation_config.json``, ``tokenizer.json`` and
        ``tokenizer_config.json``.

    Raises:
        FileNotFoundError: ``gguf_path`` does not exist.
        ValueError: the file is not a GGUF, its architecture is not ``llama``, a tensor is
            unknown or has an unexpected shape, or its tokenizer is not a byte-level BPE
            with a known pre-tokenizer.
    """
    import gguf  # imported here so `import refengine` stays light
    from safetensors.numpy import save_file

    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {str(gguf_path)!r}")
    try:
        reader = gguf.GGUFReader(gguf_path)
    except Exception as e:  # GGUFReader raises ValueError/struct errors on non-GGUF bytes
        raise ValueError(f"{str(gguf_path)!r} is not a readable GGUF file: {e}") from e

    meta = _read_metadata(reader)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(
            f"unsupported GGUF architecture {arch!r} in {str(gguf_path)!r}; only 'llama' is supported"
        )

    tensors = _read_tensors(reader)
    config = _hf_config(meta, has_lm_head="output.weight" in tensors)
    state_dict = _hf_state_dict(tensors, config)

    tokenizer = build_tokenizer(meta)

    # Each file is written under a temporary name and renamed into place, so a reader
    # (or an interrupted run) never sees a half-written model.safetensors.
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with _atomic(out_dir / "model.safetensors") as tmp:
        save_file(state_dict, str(tmp), metadata={"format": "pt"})
    with _atomic(out_dir / "tokenizer.json") as tmp:
        tokenizer.save(str(tmp))
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", _generation_config(config))
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(meta, config))
    return out_dir


def unpermute_rotary(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's ``permute`` of q/k projection rows (see the module docstring).

    Args:
        weight: ``[n_head * head_dim, n_in]`` q or k projection weight (any dtype), rows
            in llama.cpp's interleaved rotary order.
        n_head: heads in this projection (attention heads for q, KV heads for k).

    Returns:
        A new array of the same shape and dtype, rows in HF's half-split rotary order.

    Raises:
        ValueError: the row count is not a multiple of ``2 * n_head``.
    """
    n_out = weight.shape[0]
    if n_out % (2 * n_head):
        raise ValueError(f"{n_out} rows cannot be split into {n_head} heads of even size")
    head_dim = n_out // n_head
    return np.ascontiguousarray(
        weight.reshape(n_head, head_dim // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def build_tokenizer(meta: dict):
    """Build a ``tokenizers.Tokenizer`` (byte-level BPE) from GGUF tokenizer metadata.

    Args:
        meta: GGUF key -> value, with ``tokenizer.ggml.tokens`` (list[str], index = id),
            ``tokenizer.ggml.merges`` (list of ``"left right"``), optional
            ``tokenizer.ggml.token_type`` (list[int]) and ``tokenizer.ggml.pre``.

    Returns:
        The tokenizer: no normalizer; pre-tokenizer ``ByteLevel(add_prefix_space=False)``,
        preceded by ``Digits(individual_digits=True)`` for ``pre == "smollm"``; ByteLevel
        decoder and post-processor; control tokens registered as special added tokens
        (so ``<|im_start|>`` in text maps to its id) and user-defined ones as plain added
        tokens. This is the pipeline of SmolLM2's own ``tokenizer.json``.

    Raises:
        ValueError: ``tokenizer.ggml.model`` is not ``gpt2`` or the pre-tokenizer is unknown.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r}; only byte-level BPE 'gpt2'")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(
            f"unsupported GGUF pre-tokenizer {pre!r}; known: {sorted(_PRE_TOKENIZERS)}"
        )

    tokens = list(meta["tokenizer.ggml.tokens"])
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("GGUF vocabulary has duplicate tokens")
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if _PRE_TOKENIZERS[pre]:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)

    # Added tokens keep their vocabulary ids because each content is already in `vocab`.
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    added = [
        AddedToken(t, special=(ty == _TOKEN_TYPE_CONTROL), normalized=False)
        for t, ty in zip(tokens, types)
        if ty in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)
    ]
    tok.add_special_tokens([a for a in added if a.special])
    tok.add_tokens([a for a in added if not a.special])
    return tok


# --- metadata -------------------------------------------------------------------------


def _read_metadata(reader) -> dict:
    """GGUF key -> Python value (str, int, float, bool, or list of those)."""
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue  # header fields (version, counts), not model metadata
        meta[key] = field.contents()
    return meta


def _f32(x: float) -> float:
    """GGUF stores floats as float32: 1e-5 reads back 9.999999747e-06. Take the shortest
    decimal that round-trips through float32, which is what the HF config said."""
    return float(str(np.float32(x)))


def _hf_config(meta: dict, has_lm_head: bool) -> dict:
    """HF ``LlamaConfig`` fields from ``llama.*`` GGUF metadata."""

    def get(key, default=None):
        value = meta.get(f"llama.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks 'llama.{key}'")
        return value

    hidden = int(get("embedding_length"))
    n_head = int(get("attention.head_count"))
    n_kv = int(get("attention.head_count_kv", n_head))
    head_dim = int(get("attention.key_length", hidden // n_head))
    rope_dim = int(get("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"partial rotary (rope dim {rope_dim} != head_dim {head_dim}) unsupported")
    vocab = meta.get("llama.vocab_size") or len(meta["tokenizer.ggml.tokens"])

    rope_scaling = None
    scaling_type = meta.get("llama.rope.scaling.type", "none")
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": _f32(get("rope.scaling.factor"))}
    elif scaling_type != "none":
        raise ValueError(f"unsupported GGUF rope scaling type {scaling_type!r}")

    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    pad = meta.get("tokenizer.ggml.padding_token_id")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(get("context_length")),
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(get("rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "tie_word_embeddings": not has_lm_head,
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": None if eos is None else int(eos),
        "pad_token_id": None if pad is None else int(pad),
        "torch_dtype": "float32",
    }


def _generation_config(config: dict) -> dict:
    return {
        key: config[key]
        for key in ("bos_token_id", "eos_token_id", "pad_token_id")
        if config[key] is not None
    }


def _tokenizer_config(meta: dict, config: dict) -> dict:
    """``tokenizer_config.json`` as ``transformers`` writes it for a fast tokenizer."""
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    added_decoder = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": ty == _TOKEN_TYPE_CONTROL,
        }
        for i, (t, ty) in enumerate(zip(tokens, types))
        if ty in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)
    }

    def token(key):
        idx = meta.get(f"tokenizer.ggml.{_GGUF_SPECIAL_KEYS[key]}_token_id")
        return None if idx is None else tokens[int(idx)]

    out = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "added_tokens_decoder": added_decoder,
    }
    for key in ("bos", "eos", "unk", "pad"):
        if token(key) is not None:
            out[f"{key}_token"] = token(key)
    if "tokenizer.chat_template" in meta:
        out["chat_template"] = meta["tokenizer.chat_template"]
    return out


@contextlib.contextmanager
def _atomic(path: Path):
    """Yield a temporary sibling of ``path``; rename it onto ``path`` if the body succeeds.

    The file gets the mode a new file gets here (0644 under the usual umask): some writers
    (safetensors) create theirs 0600, which would hide the weights from other users.
    """
    tmp = path.with_name(path.name + ".tmp")
    try:
        yield tmp
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _write_json(path: Path, obj: dict) -> None:
    with _atomic(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# --- tensors --------------------------------------------------------------------------


def _read_tensors(reader) -> dict[str, np.ndarray]:
    """GGUF name -> float32 numpy array in numpy (HF) dimension order."""
    from gguf.quants import dequantize

    out = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims fastest first
        array = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        out[t.name] = array.reshape(shape)
    return out


def _hf_state_dict(tensors: dict[str, np.ndarray], config: dict) -> dict[str, np.ndarray]:
    """Rename GGUF tensors to HF, un-permute q/k, and check every shape."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    n_head, n_kv, head_dim = (
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["head_dim"],
    )
    expected = {
        "model.embed_tokens.weight": (config["vocab_size"], hidden),
        "lm_head.weight": (config["vocab_size"], hidden),
        "model.norm.weight": (hidden,),
    }
    per_layer = {
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (n_head * head_dim, hidden),
        "self_attn.k_proj.weight": (n_kv * head_dim, hidden),
        "self_attn.v_proj.weight": (n_kv * head_dim, hidden),
        "self_attn.o_proj.weight": (hidden, n_head * head_dim),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
    }

    state = {}
    for name, array in tensors.items():
        if name in _GLOBAL_NAMES:
            hf = _GLOBAL_NAMES[name]
            shape = expected[hf]
        else:
            parts = name.split(".", 2)  # "blk", "N", "attn_q.weight"
            if len(parts) != 3 or parts[0] != "blk" or parts[2] not in _LAYER_NAMES:
                raise ValueError(f"unknown GGUF tensor {name!r}")
            layer = int(parts[1])
            if not 0 <= layer < config["num_hidden_layers"]:
                raise ValueError(f"GGUF tensor {name!r} is past num_hidden_layers")
            suffix = _LAYER_NAMES[parts[2]]
            hf = f"model.layers.{layer}.{suffix}"
            shape = per_layer[suffix]
            if suffix == "self_attn.q_proj.weight":
                array = unpermute_rotary(array, n_head)
            elif suffix == "self_attn.k_proj.weight":
                array = unpermute_rotary(array, n_kv)
        if array.shape != shape:
            raise ValueError(f"GGUF tensor {name!r} has shape {array.shape}, expected {shape}")
        state[hf] = np.ascontiguousarray(array)

    missing = [
        f"model.layers.{i}.{s}" for i in range(config["num_hidden_layers"]) for s in per_layer
    ] + ["model.embed_tokens.weight", "model.norm.weight"]
    missing = [m for m in missing if m not in state]
    if missing:
        raise ValueError(f"GGUF file lacks tensors for {missing[:5]} ({len(missing)} in all)")
    return state
