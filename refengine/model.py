"""The Llama-family forward pass over a flat batch of tokens from many sequences.

One code path for NumPy (CPU) and CuPy (GPU): every array op goes through ``self.xp``.
Covers Llama, Mistral, Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm).

Per layer, as in transformers ``models/llama/modeling_llama.py`` (``LlamaDecoderLayer``)::

    x = rms_norm(h)                         # input_layernorm
    q, k, v = x @ W_qkv  (+ bias)           # one fused projection
    q, k = rms_norm(q), rms_norm(k)         # Qwen3 only, per head
    q, k = rope(q, k, positions)
    cache[slot_mapping] = k, v              # write first ...
    o = attention(q, cache, meta)           # ... then read through the block tables
    h = h + o @ W_o
    h = h + down(silu(gate(x')) * up(x'))   # x' = rms_norm(h), post_attention_layernorm

Linear weights are stored transposed (``[in, out]``) and q/k/v and gate/up are fused,
so each layer does four matrix products.

Numerics: weights and the KV cache are in ``dtype`` (float32 on the CPU; float16 or
bfloat16 on a GPU); activations, norms, RoPE and softmax stay float32 and each matrix
product casts its input to the weight dtype (cuBLAS accumulates in float32).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from refengine.attention import AttentionBackend, AttentionMetadata
from refengine.config import ModelConfig
from refengine.kv_cache import KVCache
from refengine.layers import RotaryEmbedding
from refengine.loader import load_weights
from refengine.ops import LayerOps
from refengine.ops.numpy_ops import NumpyOps


class Layer:
    """One decoder layer's weights (``[in, out]`` layout, fused where noted)."""

    def __init__(self, w: dict, i: int, cfg: ModelConfig, xp, dtype):
        p = f"model.layers.{i}."

        def t(name):  # HF stores [out, in]
            return w.pop(p + name).T

        f32 = np.float32  # small vectors (norms, biases) stay float32
        self.input_norm = xp.asarray(w.pop(p + "input_layernorm.weight"), dtype=f32)
        self.post_norm = xp.asarray(w.pop(p + "post_attention_layernorm.weight"), dtype=f32)
        qkv = np.concatenate([t("self_attn.q_proj.weight"), t("self_attn.k_proj.weight"),
                              t("self_attn.v_proj.weight")], axis=1)
        self.qkv = xp.asarray(np.ascontiguousarray(qkv), dtype=dtype)
        self.qkv_bias = None
        if cfg.attention_bias:
            bias = np.concatenate([w.pop(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
            self.qkv_bias = xp.asarray(bias, dtype=f32)
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            self.q_norm = xp.asarray(w.pop(p + "self_attn.q_norm.weight"), dtype=f32)
            self.k_norm = xp.asarray(w.pop(p + "self_attn.k_norm.weight"), dtype=f32)
        self.o = xp.asarray(np.ascontiguousarray(t("self_attn.o_proj.weight")), dtype=dtype)
        gate_up = np.concatenate([t("mlp.gate_proj.weight"), t("mlp.up_proj.weight")], axis=1)
        self.gate_up = xp.asarray(np.ascontiguousarray(gate_up), dtype=dtype)
        self.down = xp.asarray(np.ascontiguousarray(t("mlp.down_proj.weight")), dtype=dtype)


class LlamaModel:
    """Weights plus the forward pass.

    Args:
        model_dir: a Hugging Face model directory (config.json + safetensors).
        attention: the attention backend (see :mod:`refengine.attention`).
        xp: ``numpy`` or ``cupy``.
        dtype: weight and KV cache dtype (float32 on the CPU; float16/bfloat16 on a GPU).
    Raises:
        FileNotFoundError, ValueError: from :class:`ModelConfig` and :func:`load_weights`.
    """

    def __init__(self, model_dir: str | Path, attention: AttentionBackend, ops: LayerOps | None = None, xp=np,
                 dtype=np.float32):
        self.config = cfg = ModelConfig.from_model_dir(model_dir)
        self.xp, self.dtype, self.attention = xp, dtype, attention
        self.ops = ops if ops is not None else NumpyOps(xp)
        w = load_weights(model_dir, cfg, dtype=np.float32)  # cast to `dtype` on upload
        self.embed = xp.asarray(w.pop("model.embed_tokens.weight"), dtype=dtype)  # [V, H]
        self.layers = [Layer(w, i, cfg, xp, dtype) for i in range(cfg.num_hidden_layers)]
        self.norm = xp.asarray(w.pop("model.norm.weight"), dtype=np.float32)
        if cfg.tie_word_embeddings:
            self.lm_head = self.embed.T  # a view: tied weights are one array
        else:
            self.lm_head = xp.asarray(np.ascontiguousarray(w.pop("lm_head.weight").T), dtype=dtype)
        assert not w, f"unconsumed weights: {list(w)[:3]}"
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                    cfg.rope_scaling, xp=xp)
        self.scale = 1.0 / math.sqrt(cfg.head_dim)

    def forward(self, input_ids, positions, kv_cache: KVCache, meta: AttentionMetadata, logits_indices):
        """Run the model over a flat batch; write its K/V into the cache; return logits.

        Args:
            input_ids: ``[T]`` int token ids of every sequence's new tokens, concatenated.
            positions: ``[T]`` int64 NumPy (host) array, the position of each token in its sequence.
            kv_cache: the paged cache (written at ``meta.slot_mapping``).
            meta: the attention metadata of this batch.
            logits_indices: ``[S]`` int rows of the flat batch whose logits are wanted
                (the last token of each sequence that samples, or every row).
        Returns:
            ``[S, vocab_size]`` float32 logits.
        """
        xp, cfg = self.xp, self.config
        n_q, n_kv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q_size, kv_size = n_q * hd, n_kv * hd
        T = input_ids.shape[0]
        f32 = xp.float32
        eps = cfg.rms_norm_eps

        ops = self.ops
        linear, norm, act = ops.linear, ops.rms_norm, ops.silu_and_mul
        positions = ops.device_positions(positions)
        self.attention.prepare(meta)

        h = self.embed[input_ids].astype(f32)
        for li, layer in enumerate(self.layers):
            x = norm(h, layer.input_norm, eps)
            qkv = linear(x, layer.qkv)
            if layer.qkv_bias is not None:
                qkv += layer.qkv_bias
            q = qkv[:, :q_size].reshape(T, n_q, hd)
            k = qkv[:, q_size:q_size + kv_size].reshape(T, n_kv, hd)
            v = qkv[:, q_size + kv_size:].reshape(T, n_kv, hd)
            if layer.q_norm is not None:
                q = norm(q, layer.q_norm, eps)
                k = norm(k, layer.k_norm, eps)
            q, k = ops.rope(q, k, positions, self.rope)
            kc, vc = kv_cache.k[li], kv_cache.v[li]
            self.attention.write_kv(kc, vc, k.astype(kc.dtype, copy=False), v.astype(kc.dtype, copy=False), meta)
            o = self.attention.forward(q.astype(kc.dtype, copy=False), kc, vc, meta, self.scale)
            h = h + linear(o.reshape(T, q_size), layer.o)
            x = norm(h, layer.post_norm, eps)
            h = h + linear(act(linear(x, layer.gate_up)), layer.down)
        h = norm(h[logits_indices], self.norm, eps)
        return linear(h, self.lm_head)
