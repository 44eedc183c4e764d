"""Read a GGUF file as a model: its config, tokenizer and tensors, the tensors kept as stored.

A GGUF file (llama.cpp's format) holds everything a model directory holds: metadata
(the architecture's hyperparameters, the tokenizer's vocabulary and merges, the chat
template) and every tensor, most of them quantized in blocks. :class:`GGUFFile` turns it
into what the rest of refengine reads from a Hugging Face directory: the ``config.json``
fields (:attr:`GGUFFile.config`), a :class:`refengine.tokenizer.Tokenizer`, and the
tensors under HF names (:meth:`GGUFFile.weights`): matrices as
:class:`refengine.quant.gguf_blocks.GGUFWeight` (the stored blocks, dequantized on the fly
by the products) or, with ``dequantize=True``, as float32 arrays (what
:mod:`refengine.convert_gguf` writes to safetensors).

Shapes. GGUF lists a tensor's dimensions fastest-varying first (ggml's ``ne[0]`` is the
row length), the reverse of numpy. ``GGUFReader`` already hands back the data in numpy
order, so a GGUF ``[576, 1536]`` ffn_gate is the numpy ``[1536, 576]`` matrix that HF
calls ``gate_proj.weight`` ``[intermediate, hidden]``: one row per output, the row's
blocks along the input axis. We rely on the numpy order and check every tensor against
the shape the config implies.

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
Quantized blocks run along a row, so a row permutation moves whole rows of blocks:
the stored bytes are reordered, not requantized.
"""

from __future__ import annotations

import functools
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


def rotary_row_order(n_out: int, n_head: int) -> np.ndarray:
    """The row order :func:`unpermute_rotary` produces: row ``i`` of the result is row
    ``order[i]`` of llama.cpp's layout (int64 ``[n_out]``), for moving quantized rows."""
    return unpermute_rotary(np.arange(n_out).reshape(n_out, 1), n_head)[:, 0]


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


# --- metadata ---------------------------------------------------------------------------


def read_metadata(reader) -> dict:
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


def hf_config(meta: dict, has_lm_head: bool) -> dict:
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


def generation_config(config: dict) -> dict:
    """``generation_config.json``: the special token ids the config names."""
    return {
        key: config[key]
        for key in ("bos_token_id", "eos_token_id", "pad_token_id")
        if config[key] is not None
    }


def tokenizer_config(meta: dict, config: dict) -> dict:
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


# --- the file -------------------------------------------------------------------------


def is_gguf(path: str | os.PathLike) -> bool:
    """Whether ``path`` names a GGUF file (a file ending in ``.gguf``)."""
    return str(path).endswith(".gguf") and Path(path).is_file()


class GGUFFile:
    """One GGUF file, read lazily through ``gguf.GGUFReader`` (a memory map: opening is cheap).

    Args:
        path: the ``.gguf`` file.
    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is not a GGUF, or its architecture is not ``llama``.
    """

    def __init__(self, path: str | os.PathLike):
        import gguf  # imported here so `import refengine` stays light

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {str(self.path)!r}")
        try:
            self.reader = gguf.GGUFReader(self.path)
        except Exception as e:  # GGUFReader raises ValueError/struct errors on non-GGUF bytes
            raise ValueError(f"{str(self.path)!r} is not a readable GGUF file: {e}") from e
        self.meta = read_metadata(self.reader)
        arch = self.meta.get("general.architecture")
        if arch != "llama":
            raise ValueError(f"unsupported GGUF architecture {arch!r} in {str(self.path)!r}; "
                             f"only 'llama' is supported")
        self._tensors = {t.name: t for t in self.reader.tensors}
        self.config = hf_config(self.meta, has_lm_head="output.weight" in self._tensors)

    @property
    def generation_config(self) -> dict:
        """The ``generation_config.json`` fields (special token ids) of :attr:`config`."""
        return generation_config(self.config)

    def tokenizer(self):
        """The :class:`refengine.tokenizer.Tokenizer` the metadata describes (vocabulary,
        merges, special tokens, chat template)."""
        from refengine.tokenizer import Tokenizer

        return Tokenizer(build_tokenizer(self.meta), tokenizer_config(self.meta, self.config),
                         self.generation_config, config_source=f"{self.path} (tokenizer metadata)")

    def tensor_types(self) -> dict[str, str]:
        """GGUF tensor name -> its stored type name (``"Q4_1"``, ``"F32"`` ...)."""
        return {name: t.tensor_type.name for name, t in self._tensors.items()}

    def weights(self, dequantize: bool = False) -> dict:
        """Every tensor under its HF name, q/k rows unpermuted, shapes checked.

        Args:
            dequantize: float32 arrays for every tensor (today's ``convert-gguf`` output);
                else matrices stay as stored (:class:`refengine.quant.gguf_blocks.GGUFWeight`,
                F32 ones as float32 arrays) and vectors (norms) become float32 arrays.
        Returns:
            HF name -> ``[out, in]`` matrix or ``[n]`` vector.
        Raises:
            ValueError: an unknown tensor, one past the layer count, a wrong shape, or a
                missing one; the message names it.
        """
        from gguf.quants import dequantize as gguf_dequantize

        out = {}
        for name, t in self._tensors.items():
            hf, shape, n_head = self._hf_name(name)
            stored = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims fastest first
            if stored != shape:
                raise ValueError(f"GGUF tensor {name!r} has shape {stored}, expected {shape}")
            if dequantize or len(shape) == 1 or t.tensor_type.name == "F32":
                array = gguf_dequantize(t.data, t.tensor_type).astype(np.float32, copy=False).reshape(shape)
                if n_head:
                    array = unpermute_rotary(array, n_head)
                out[hf] = np.array(array, dtype=np.float32, order="C")  # a copy, never a view of the map
            else:
                from refengine.quant.gguf_blocks import GGUFWeight

                weight = GGUFWeight.from_raw(t.tensor_type, t.data, shape)
                out[hf] = weight.take_rows(rotary_row_order(shape[0], n_head)) if n_head else weight
        cfg = self.config
        missing = [f"model.layers.{i}.{s}" for i in range(cfg["num_hidden_layers"]) for s in _LAYER_NAMES.values()]
        missing = [m for m in missing + ["model.embed_tokens.weight", "model.norm.weight"] if m not in out]
        if missing:
            raise ValueError(f"GGUF file lacks tensors for {missing[:5]} ({len(missing)} in all)")
        return out

    def _hf_name(self, name: str) -> tuple[str, tuple[int, ...], int]:
        """GGUF tensor name -> (HF name, the shape the config implies, heads to unpermute or 0)."""
        c = self.config
        hidden, inter, head_dim = c["hidden_size"], c["intermediate_size"], c["head_dim"]
        n_head, n_kv = c["num_attention_heads"], c["num_key_value_heads"]
        if name in _GLOBAL_NAMES:
            hf = _GLOBAL_NAMES[name]
            return hf, ((hidden,) if hf == "model.norm.weight" else (c["vocab_size"], hidden)), 0
        parts = name.split(".", 2)  # "blk", "N", "attn_q.weight"
        if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit() or parts[2] not in _LAYER_NAMES:
            raise ValueError(f"unknown GGUF tensor {name!r}")
        layer = int(parts[1])
        if not 0 <= layer < c["num_hidden_layers"]:
            raise ValueError(f"GGUF tensor {name!r} is past num_hidden_layers")
        suffix = _LAYER_NAMES[parts[2]]
        shape = {
            "input_layernorm.weight": (hidden,),
            "post_attention_layernorm.weight": (hidden,),
            "self_attn.q_proj.weight": (n_head * head_dim, hidden),
            "self_attn.k_proj.weight": (n_kv * head_dim, hidden),
            "self_attn.v_proj.weight": (n_kv * head_dim, hidden),
            "self_attn.o_proj.weight": (hidden, n_head * head_dim),
            "mlp.gate_proj.weight": (inter, hidden),
            "mlp.up_proj.weight": (inter, hidden),
            "mlp.down_proj.weight": (hidden, inter),
        }[suffix]
        heads = {"self_attn.q_proj.weight": n_head, "self_attn.k_proj.weight": n_kv}.get(suffix, 0)
        return f"model.layers.{layer}.{suffix}", shape, heads


@functools.lru_cache(maxsize=4)
def _open_cached(path: str, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(path)


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """:class:`GGUFFile` of ``path``, shared while the file is unchanged (the engine reads
    the config, the tokenizer and the tensors at different moments of its start) and until
    :func:`close_gguf_files`."""
    st = Path(path).stat()
    return _open_cached(str(Path(path).resolve()), st.st_mtime_ns, st.st_size)


def close_gguf_files() -> None:
    """Drop the files :func:`open_gguf` shares, and so their memory maps: an engine calls it
    once its weights are loaded (the weights hold copies of the blocks, not views of the map)."""
    _open_cached.cache_clear()
