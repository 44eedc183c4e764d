"""Load a Hugging Face model directory's safetensors into arrays, strictly.

Every tensor the architecture expects must be present with the shape ``config.json``
implies, and every tensor in the checkpoint must be used: a mismatch is an error naming
the tensor. bfloat16 checkpoints load through ``ml_dtypes`` (importing it teaches NumPy,
and so ``safetensors.numpy``, the ``bfloat16`` type).
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes  # noqa: F401  (registers numpy's bfloat16 for safetensors)
import numpy as np
from safetensors import safe_open

from refengine.config import ModelConfig


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for ``cfg`` (names as in ``modeling_llama.py`` / ``modeling_qwen3.py``)."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q_out, kv_out = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q_out, h),
            p + "self_attn.k_proj.weight": (kv_out, h),
            p + "self_attn.v_proj.weight": (kv_out, h),
            p + "self_attn.o_proj.weight": (h, q_out),
            p + "mlp.gate_proj.weight": (cfg.intermediate_size, h),
            p + "mlp.up_proj.weight": (cfg.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, cfg.intermediate_size),
        })
        if cfg.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q_out,), p + "self_attn.k_proj.bias": (kv_out,),
                           p + "self_attn.v_proj.bias": (kv_out,)})
        if cfg.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of ``model_dir``: one file, or the shards an index names.

    Raises:
        FileNotFoundError: no ``model.safetensors`` nor ``model.safetensors.index.json``,
            or a shard the index names is missing.
    """
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [model_dir / s for s in shards]
        for path in files:
            if not path.is_file():
                raise FileNotFoundError(f"shard {str(path)!r} named in {index.name} is missing")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {str(model_dir)!r}")


def load_weights(model_dir: str | Path, cfg: ModelConfig, dtype=np.float32) -> dict[str, np.ndarray]:
    """Read every tensor of the checkpoint, check it against ``cfg``, cast to ``dtype``.

    A tied checkpoint that also ships ``lm_head.weight`` is accepted (transformers ties
    it to the embedding; so do we, and the extra tensor is dropped), and so are the
    ``rotary_emb.inv_freq`` buffers of older Llama checkpoints (derived, so dropped).

    Returns:
        HF name -> array of ``dtype`` (float32 on the CPU).
    Raises:
        FileNotFoundError: no checkpoint files.
        ValueError: a file is unreadable (e.g. truncated), a tensor is missing, unused,
            or has the wrong shape; the message names it.
    """
    model_dir = Path(model_dir)
    want = expected_shapes(cfg)
    weights: dict[str, np.ndarray] = {}
    for path in checkpoint_files(model_dir):
        try:
            with safe_open(str(path), framework="numpy") as f:
                for name in f.keys():
                    weights[name] = f.get_tensor(name)
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise ValueError(f"cannot read {str(path)!r}: {e} (truncated or corrupt safetensors file?)") from e
    if cfg.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    # Older Llama checkpoints ship RoPE buffers; they are derived from config.json, so drop them.
    for name in [n for n in weights if n.endswith(("rotary_emb.inv_freq", "rotary_emb.cos_cached",
                                                   "rotary_emb.sin_cached"))]:
        del weights[name]
    missing = [n for n in want if n not in weights]
    if missing:
        raise ValueError(f"checkpoint in {str(model_dir)!r} is missing {len(missing)} tensor(s), e.g. {missing[:3]}")
    unused = [n for n in weights if n not in want]
    if unused:
        raise ValueError(f"checkpoint in {str(model_dir)!r} has {len(unused)} unused tensor(s), e.g. {unused[:3]}")
    for name, shape in want.items():
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(weights[name].shape)}, config.json implies {shape}")
    return {name: np.ascontiguousarray(w.astype(dtype, copy=False)) for name, w in weights.items()}
